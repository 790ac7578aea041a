"""Where a memory-mode dataset's decoded chunks live while a run trains on them: on the nodes it trains on, not
on the worker nodes that decoded them.

Why: Ray keeps a node that holds the primary copy of an object still in use, however idle the node is
(ray-project/ray#27985), and a run uses its decoded chunks until it ends. Decoded on a cluster's CPU nodes (the
cluster launcher's and KubeRay's configs add them for Ray Data), the chunks would keep those nodes, and their
cost, for the whole run. Each training node fetches every chunk anyway, so a chunk made on another worker node is
copied once to a training node, whose copy becomes the primary one, and the first is dropped: the autoscaler can
then remove the decoding nodes once they are idle. The head is never removed, so what it holds stays there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import ray
from ray.experimental import get_object_locations
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydiff.cluster.nodes import alive_nodes, worker_nodes
from raydiff.data.image_store import ImageStore

HEAD = "node:__internal_head__"  # the head node's own resource (ray._common.constants.HEAD_NODE_RESOURCE_NAME)
INLINE_BYTES = 100 * 1024  # a task's smaller return stays in its caller's memory, not on a node (Ray's limit)


@ray.remote(num_cpus=0)
def _kept_here(chunk: np.ndarray) -> np.ndarray:
    return chunk  # returned, it is stored on this node, owned by the caller


def on_training_nodes(store: ImageStore, use_gpu: bool | str) -> tuple[ImageStore, int]:
    """`store` with each chunk held on a worker node that the run's workers do not run on
    (`raydiff.cluster.nodes.worker_nodes`) copied to one of theirs, in turn; and how many chunks were moved.
    Chunks the driver decoded stay where it put them: Ray could not rebuild them if a node holding their only
    copy were lost. Returns when the copies are made."""
    nodes = [n["NodeID"] for n in worker_nodes(use_gpu)]
    if not nodes or store.decoded_by == "the driver":
        return store, 0
    chunks: list[ray.ObjectRef] = list(store.chunks)
    ray.wait(chunks, num_returns=len(chunks), fetch_local=False)  # made, so that they have a place
    heads = {n["NodeID"] for n in alive_nodes() if n["Resources"].get(HEAD)}
    locations = get_object_locations(chunks)
    moved: list[ray.ObjectRef] = []
    for i, chunk in enumerate(chunks):
        location = locations.get(chunk, {})
        held_on = set(location.get("node_ids") or [])
        if (location.get("object_size") or 0) < INLINE_BYTES or not held_on or held_on & (set(nodes) | heads):
            continue
        target = NodeAffinitySchedulingStrategy(nodes[len(moved) % len(nodes)], soft=False)
        chunks[i] = _kept_here.options(scheduling_strategy=target).remote(chunk)
        moved.append(chunks[i])
    if moved:
        ray.wait(moved, num_returns=len(moved), fetch_local=False)
    return replace(store, chunks=tuple(chunks)), len(moved)
