"""The nodes a run trains on, as the driver sees them when it decides (`data.cache: auto`, the stream buffer,
`scaling.num_workers: auto`).

On an autoscaling cluster (the cluster launcher's and KubeRay's configs in `cluster/`) the head runs no workers
(`CPU: 0`) and the worker nodes come when a job asks for them. Deciding from the nodes alive at start would see
the head only: no object store to hold the data (so stream mode, for any dataset) and no GPU (so one CPU
worker). The driver therefore asks the autoscaler for one worker's resources and waits, with a message and a
bound (`scaling.node_wait_s`), for the first node that can run a worker, and decides from the nodes that can:
the GPU nodes when the run trains on GPUs, else the CPU nodes.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from raydiff.cluster.errors import NoWorkerNode

POLL_S = 1.0


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


def this_node() -> dict[str, float]:
    """The resources Ray counts on the node this process runs on (its CPUs: a container's CPU limit, not the
    host's cores); empty where the node is not found."""
    node_id = ray.get_runtime_context().get_node_id()
    return next((n["Resources"] for n in alive_nodes() if n["NodeID"] == node_id), {})


def _runs_workers(node: dict[str, Any], use_gpu: bool | str) -> bool:
    resources = node["Resources"]
    if use_gpu is True:
        return resources.get("GPU", 0) > 0
    return resources.get("CPU", 0) > 0 or resources.get("GPU", 0) > 0


def worker_nodes(use_gpu: bool | str) -> list[dict[str, Any]]:
    """The alive nodes the run's workers can run on: with GPUs (`use_gpu` true, or auto on a cluster that has
    them), else with CPUs."""
    nodes = [n for n in alive_nodes() if _runs_workers(n, use_gpu)]
    if use_gpu == "auto" and any(n["Resources"].get("GPU", 0) > 0 for n in nodes):
        nodes = [n for n in nodes if n["Resources"].get("GPU", 0) > 0]
    return nodes


def smallest_object_store(use_gpu: bool | str = "auto") -> int:
    """Bytes of object store on the smallest node the run's workers can run on (0 when there is none)."""
    sizes = [n["Resources"].get("object_store_memory", 0) for n in worker_nodes(use_gpu)]
    return int(min(sizes)) if sizes else 0


def _describe(node: dict[str, Any]) -> str:
    r = node["Resources"]
    return (f"{r.get('CPU', 0):g} CPU, {r.get('GPU', 0):g} GPU, "
            f"{r.get('object_store_memory', 0) / 2 ** 20:,.0f} MB object store")


def wait_for_worker_node(use_gpu: bool | str, timeout_s: float) -> str | None:
    """Return at once when a node can run a worker; else ask the autoscaler for one worker's resources and wait
    for such a node, at most `timeout_s`. Returns a note for the start line (None when nothing was waited for);
    raises NoWorkerNode on the timeout."""
    if worker_nodes(use_gpu):
        return None
    from ray.autoscaler.sdk import request_resources

    bundle = {"GPU": 1} if use_gpu is True else {"CPU": 1}
    print(f"[raydiff] the cluster has no node that can run a worker yet (its head runs none): asked the autoscaler "
          f"for {bundle} and waiting up to {timeout_s:g} s (scaling.node_wait_s) for the first node, to decide "
          f"for the nodes the run will train on", flush=True)
    started = time.monotonic()
    try:
        while not worker_nodes(use_gpu):
            if time.monotonic() - started > timeout_s:
                raise NoWorkerNode(f"no node that can run a worker ({bundle}) joined the cluster within {timeout_s:g} "
                                   f"s (scaling.node_wait_s): look at the autoscaler (ray status) and its node types, "
                                   f"or raise scaling.node_wait_s")
            # Asked again at every look: a request replaces the cluster's standing one, and Ray Data's autoscaling
            # coordinator (started by any earlier job) sends its own, empty when idle, every 20 s.
            request_resources(bundles=[bundle])
            time.sleep(POLL_S)
    finally:
        request_resources(bundles=[])  # from here on Ray Data and Ray Train ask for what they need
    node = worker_nodes(use_gpu)[0]
    return f"a worker node joined after {time.monotonic() - started:.0f} s ({_describe(node)})"
