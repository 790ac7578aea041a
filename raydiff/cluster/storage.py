"""Whether a local folder the cluster's nodes use is on every node: a local `run.storage` (written by each node's
workers) or a local `data.source` (read by Ray Data's tasks and the stream's node caches), probed from each node.

Why: on a multi-node cluster a folder on one node's disk fails on the others only once they reach for it: the
run directory at the first checkpoint of a worker on another node, a data source in every read task placed
elsewhere (retried, then failed, after minutes of start-up). The driver refuses such a folder up front, in one
line that says what to use instead.
"""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydiff.cluster.nodes import alive_nodes
from raydiff.config import ConfigError

PROBE_TIMEOUT_S = 60  # a node's first task may wait for the job's runtime_env to be installed there
SHARED_INSTEAD = "an s3:// or gs:// URI, or an NFS path mounted at the same place on every node"


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def several_nodes() -> bool:
    """Whether the cluster has more than one live node: then a local folder must be on all of them. (Not joined
    yet, this process would start a local instance of one node.)"""
    return ray.is_initialized() and len(alive_nodes()) >= 2


def nodes_seeing(path: str, node_ids: list[str]) -> list[bool | None]:
    """Whether `path` exists on each of the nodes, asked of a task on each (all at once); None for a node that
    did not answer within PROBE_TIMEOUT_S (or died, or drained, in the meantime)."""
    futures = [_sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(path)
               for n in node_ids]
    ready, _ = ray.wait(futures, num_returns=len(futures), timeout=PROBE_TIMEOUT_S)
    answers: list[bool | None] = []
    for future in futures:
        if future not in ready:
            ray.cancel(future)
            answers.append(None)
            continue
        try:
            answers.append(bool(ray.get(future)))
        except ray.exceptions.RayError:  # the node went away: not one the run will use
            answers.append(None)
    return answers


def nodes_without(path: str, probe=None, *, seen_by: set[str] | None = None) -> list[str]:
    """Addresses of the cluster's live nodes on which `path` does not exist. A node that does not answer is not
    judged (one line says so). `seen_by`: gets the ids of the nodes that answered that it does. `probe(path,
    node_ids)` -> one answer per node is for tests (`nodes_seeing`)."""
    nodes = alive_nodes()
    answers = (probe or nodes_seeing)(path, [n["NodeID"] for n in nodes])
    silent = sorted({n["NodeManagerAddress"] for n, sees in zip(nodes, answers, strict=True) if sees is None})
    if silent:
        print(f"[raydiff] node(s) {', '.join(silent)} did not answer within {PROBE_TIMEOUT_S} s whether they see "
              f"{path}: not checked there", flush=True)
    if seen_by is not None:
        seen_by.update(n["NodeID"] for n, sees in zip(nodes, answers, strict=True) if sees)
    return sorted({n["NodeManagerAddress"] for n, sees in zip(nodes, answers, strict=True) if sees is False})


def unreachable_nodes(folder: str, probe=None) -> list[str]:
    """Addresses of the cluster's live nodes on which `folder` (a local path) does not show a file the driver
    just wrote there: the storage is not shared with them."""
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, f".raydiff-shared-{uuid.uuid4().hex}")
    open(marker, "w").close()
    try:
        return nodes_without(marker, probe)
    finally:
        os.remove(marker)


def check_shared_storage(storage: str, probe=None) -> None:
    """On a multi-node cluster a local run.storage must be a shared (NFS) mount: refuse it up front, with what to
    use instead, rather than fail at the first checkpoint of a remote worker."""
    if "://" in storage or not several_nodes():
        return
    missing = unreachable_nodes(storage, probe)
    if missing:
        raise ConfigError(f"run.storage = {storage!r} is not shared: node(s) {', '.join(missing)} cannot see it. A "
                          f"multi-node cluster needs storage every node reaches: {SHARED_INSTEAD}")
