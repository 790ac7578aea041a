"""Shared fixtures. Tests marked `ray` share one local Ray cluster per session (2 logical CPUs)."""

from __future__ import annotations

import os
import socket
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_cluster_address: str | None = None  # set while the session's cluster runs; run_cli joins it


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One local Ray cluster (a head with 2 CPUs, like this machine) for every test that needs Ray: joining it
    saves each CLI run the start of a Ray instance of its own. Stopped by the session: only what it started."""
    global _cluster_address
    from ray.cluster_utils import Cluster

    os.environ["RAYDIFF_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    # With the dashboard: Ray Train's placement-group cleaner (which Tune sweeps rely on) uses the state API.
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": True,
                                                      "dashboard_host": "127.0.0.1", "dashboard_port": free_port()})
    _cluster_address = c.address
    yield c
    _cluster_address = None
    c.shutdown()


@pytest.fixture(autouse=True)
def _ray_tests_join_the_cluster(request):
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("cluster")


@pytest.fixture(scope="session")
def ray_session(cluster):
    """This process as a driver of the session's cluster (for tests that call Ray directly)."""
    import ray

    ray.init(address=cluster.address, logging_level="ERROR")
    yield ray
    ray.shutdown()


def run_cli(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """Run `python -m <module> args...` as a user would, in a fresh process. Ray tests join the session's
    cluster; other tests get `local` (a fresh Ray if they start one), never someone else's cluster."""
    full_env = dict(os.environ, RAY_ADDRESS=_cluster_address or "local")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT, stdin=subprocess.DEVNULL)
