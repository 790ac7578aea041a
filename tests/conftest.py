"""Shared fixtures. Tests that need Ray share one local instance per session (2 logical CPUs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Ray Train's controller collects each worker's reports when it polls them (every 2 s by default). Tests
# checkpoint every few steps, so the end of every test run would wait on that queue; every Ray process the
# tests start (local instances, test clusters, CLI runs) inherits this.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")


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
