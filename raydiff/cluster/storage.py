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

PROBE_TIMEOUT_S = 60
SHARED_INSTEAD = ("an s3:// or gs:// URI, or an NFS path mounted at the same place on every node")


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def nodes_seeing(path: str, node_ids: list[str]) -> list[bool]:
    """Whether `path` exists on each of the nodes, asked of a task on each (all at once)."""
    futures = [_sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(path)
               for n in node_ids]
    return ray.get(futures, timeout=PROBE_TIMEOUT_S)


def nodes_without(path: str, probe=None) -> list[str]:
    """Addresses of the cluster's live nodes on which `path` does not exist. `probe(path, node_ids)` -> one bool
    per node is for tests (default `nodes_seeing`)."""
    nodes = alive_nodes()
    seen = (probe or nodes_seeing)(path, [n["NodeID"] for n in nodes])
    return sorted({n["NodeManagerAddress"] for n, sees in zip(nodes, seen, strict=True) if not sees})


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
    if "://" in storage or len(alive_nodes()) < 2:
        return
    missing = unreachable_nodes(storage, probe)
    if missing:
        raise ConfigError(f"run.storage = {storage!r} is not shared: node(s) {', '.join(missing)} cannot see it. A "
                          f"multi-node cluster needs storage every node reaches: {SHARED_INSTEAD}")


def check_source_on_every_node(source: str, file: str, probe=None) -> None:
    """On a multi-node cluster a local data.source that the cluster's tasks read (`file`: one of its files) must be
    on every node: refuse it up front, with what to use instead."""
    if len(alive_nodes()) < 2:
        return
    missing = nodes_without(file, probe)
    if missing:
        raise ConfigError(f"data.source = {source!r} is not on every node: node(s) {', '.join(missing)} cannot see "
                          f"{file}. On a multi-node cluster Ray Data reads it from every node: use {SHARED_INSTEAD} "
                          f"(`python -m raydiff.prepare` copies a folder to a bucket)")
