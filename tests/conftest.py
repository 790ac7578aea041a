"""Shared fixtures. Tests that need Ray share one local instance per session (2 logical CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Built-in datasets go to a per-session cache, never the user's ~/.cache."""
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    os.environ["RAYDIFF_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", address="local")
    yield ray
    ray.shutdown()


def run_cli(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """Run `python -m <module> args...` as a user would, in a fresh process and a clean environment."""
    full_env = dict(os.environ, RAY_ADDRESS="local")  # a fresh Ray, never someone else's cluster
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT, stdin=subprocess.DEVNULL)
