"""Whether a local `run.storage` is shared by every node of the cluster (an NFS mount), probed from each node.

Why: on a multi-node cluster a run directory on one node's disk fails at the first checkpoint of a worker on
another node; the driver refuses such storage up front, with what to use instead.
"""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydiff.cluster.nodes import alive_nodes
from raydiff.config import ConfigError


@ray.remote(num_cpus=0)
def _sees(path: str) -> bool:
    return os.path.exists(path)


def unreachable_nodes(folder: str, probe=None) -> list[str]:
    """Addresses of the cluster's live nodes on which `folder` (a local path) does not show a file the driver
    just wrote there: the storage is not shared with them. `probe(path, node_id)` -> bool is for tests."""
    os.makedirs(folder, exist_ok=True)
    marker = os.path.join(folder, f".raydiff-shared-{uuid.uuid4().hex}")
    open(marker, "w").close()
    try:
        nodes = alive_nodes()
        if probe is None:
            def probe(path: str, node_id: str) -> bool:
                strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
                return ray.get(_sees.options(scheduling_strategy=strategy).remote(path), timeout=60)
        return [n["NodeManagerAddress"] for n in nodes if not probe(marker, n["NodeID"])]
    finally:
        os.remove(marker)


def check_shared_storage(storage: str, probe=None) -> None:
    """On a multi-node cluster a local run.storage must be a shared (NFS) mount: refuse it up front, with what to
    use instead, rather than fail at the first checkpoint of a remote worker."""
    if "://" in storage or len(alive_nodes()) < 2:
        return
    missing = unreachable_nodes(storage, probe)
    if missing:
        raise ConfigError(f"run.storage = {storage!r} is not shared: node(s) {', '.join(sorted(set(missing)))} cannot "
                          f"see it. A multi-node cluster needs storage every node reaches: an s3:// or gs:// URI, or "
                          f"an NFS path mounted at the same place on every node")
