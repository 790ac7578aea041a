"""Decisions made for the nodes a run trains on, on Ray's fake multi-node autoscaler: a head that runs no workers
(CPU: 0, as cluster/aws.yaml, cluster/gcp.yaml and the KubeRay configs have it) and a worker type that the
autoscaler starts, as local raylets, when a job asks for one. The fake nodes dial the GCS at the address the
provider's config names (a free port; 6379 where none is named, so a machine running Ray there skipped the test); the
test stops only the processes it started (the head's process group, which the fake nodes join)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from conftest import free_port, run_cli

pytestmark = pytest.mark.ray

WORKER_STORE = 200 * 10 ** 6


@pytest.fixture
def autoscaling_cluster(tmp_path):
    port = free_port()
    gcs = f"127.0.0.1:{port}"
    config = {
        "cluster_name": "raydiff-fake", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 1,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs},
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "ray.worker.cpu": {"resources": {"CPU": 2, "object_store_memory": WORKER_STORE}, "node_config": {},
                               "min_workers": 0, "max_workers": 1},
        },
        "head_node_type": "ray.head.default",
        **{key: [] for key in ("initialization_commands", "setup_commands", "head_setup_commands",
                               "worker_setup_commands", "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files")},
        "file_mounts": {}, "file_mounts_sync_continuously": False,
    }
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    # Token auth stays on, with a token of the test's own: the head, its fake nodes and every client present it (a
    # fresh machine has no ~/.ray/auth_token, and a user's is not the test's to use).
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    temp_dir = tempfile.mkdtemp(prefix="rdf-", dir="/tmp")  # Ray's socket paths must stay under 108 bytes
    # RAY_ADDRESS: its processes, the fake nodes' too, look up this cluster, never another (docs/training.md#which-ray).
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_ADDRESS=gcs, **auth)
    head = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--port", str(port), "--num-cpus", "0",
         f"--autoscaling-config={tmp_path / 'cluster.yaml'}", "--temp-dir", temp_dir, "--block",
         "--disable-usage-stats",
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(free_port()),
         "--dashboard-agent-listen-port", str(free_port())],
        stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        start_new_session=True)
    try:
        deadline = time.time() + 120
        while "Ray runtime started" not in (tmp_path / "head.log").read_text():
            assert time.time() < deadline and head.poll() is None, (tmp_path / "head.log").read_text()[-3000:]
            time.sleep(0.5)
        yield {"RAY_ADDRESS": gcs, **auth}
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the fake worker nodes are in the head's process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                head.wait(timeout=3)  # Ray's graceful stop takes longer than that: the SIGKILL ends it
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_run_decides_for_the_worker_nodes_an_autoscaler_adds(autoscaling_cluster, tmp_path):
    """With only the 0-CPU head alive, the run asks the autoscaler for a worker, waits for it, and decides from its
    object store: the built-in digits go to memory, as on one machine (deciding from the head, they went to stream
    mode: no node with a CPU, so an object store of 0)."""
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path / 'runs'}",
                   "--set", "train.total_steps=10", "--set", "train.sample_every=0", "--set", "scaling.num_workers=1",
                   env=autoscaling_cluster)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "the cluster has no node that can run a worker yet (its head runs none): asked the autoscaler for " \
           "{'CPU': 1}" in output
    assert "a worker node joined after " in output and f"{WORKER_STORE / 2 ** 20:,.0f} MB object store" in output
    assert (f"data.cache auto: memory, from the decoded dataset (0.11 MB) and the smallest worker node's object "
            f"store ({WORKER_STORE / 2 ** 20:,.0f} MB)") in output


def test_the_first_worker_node_is_asked_for_again_at_every_look_while_the_run_waits(monkeypatch):
    """A request replaces the cluster's standing one, and Ray Data's autoscaling coordinator (started by any earlier
    job, for the cluster's life) sends its own every 20 s, empty when idle: asked once, the run's request could be
    gone before the autoscaler read it, and the run waited scaling.node_wait_s for a node never launched."""
    import ray.autoscaler.sdk

    from raydiff.cluster import nodes

    standing: list[dict] = []
    looks, launched = 0, False

    def worker_nodes(use_gpu):  # the autoscaler launches a node once it has read a standing request for one
        nonlocal looks, launched
        looks += 1
        if looks == 2:
            standing.clear()  # the coordinator's empty request, just after the run's
        launched = launched or (looks >= 4 and bool(standing))
        return [{"Resources": {"GPU": 1, "CPU": 8}}] if launched else []

    monkeypatch.setattr(ray.autoscaler.sdk, "request_resources", lambda bundles: standing.__setitem__(slice(None),
                                                                                                       bundles))
    monkeypatch.setattr(nodes, "worker_nodes", worker_nodes)
    monkeypatch.setattr(nodes, "POLL_S", 0.0)
    said = nodes.wait_for_worker_node(True, timeout_s=30)
    assert said.startswith("a worker node joined after ") and standing == []  # withdrawn once the node is there
