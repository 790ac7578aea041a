"""Where a memory-mode dataset's decoded chunks live: on the nodes the run trains on, not on those that decoded
them.

Why: Ray keeps a node that holds the primary copy of an object the run still uses, however idle it is
(ray-project/ray#27985), and the run uses its decoded chunks until it ends. Decoded on a cluster's CPU nodes (the
cluster launcher's and KubeRay's configs add them for Ray Data), the chunks would keep those nodes, and their
cost, for the whole run. Each training node fetches every chunk anyway, so a chunk made on another node is
copied once to a training node, whose copy becomes the primary one, and the first is dropped: the autoscaler can
then remove the decoding nodes once they are idle.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import ray
from ray.experimental import get_object_locations
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydiff.cluster.nodes import worker_nodes
from raydiff.data.image_store import ImageStore


@ray.remote(num_cpus=0)
def _kept_here(chunk: np.ndarray) -> np.ndarray:
    return chunk  # returned, it is stored on this node, owned by the caller


def on_training_nodes(store: ImageStore, use_gpu: bool | str) -> tuple[ImageStore, int]:
    """`store` with each chunk that no node of the run's workers holds (`raydiff.cluster.nodes.worker_nodes`)
    copied to one of them, in turn; and how many chunks were moved. Returns when the copies are made."""
    nodes = [n["NodeID"] for n in worker_nodes(use_gpu)]
    if not nodes:
        return store, 0
    locations = get_object_locations(list(store.chunks))
    chunks: list[ray.ObjectRef] = list(store.chunks)
    moved: list[ray.ObjectRef] = []
    for i, chunk in enumerate(chunks):
        held_on = locations.get(chunk, {}).get("node_ids") or []
        if held_on and not set(held_on) & set(nodes):  # [] : a small object, in the driver's own memory
            target = NodeAffinitySchedulingStrategy(nodes[len(moved) % len(nodes)], soft=False)
            chunks[i] = _kept_here.options(scheduling_strategy=target).remote(chunk)
            moved.append(chunks[i])
    if moved:
        ray.wait(moved, num_returns=len(moved), fetch_local=False)
    return replace(store, chunks=tuple(chunks)), len(moved)
