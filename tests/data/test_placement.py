"""A memory-mode dataset decoded on worker nodes the run does not train on is kept on the nodes it trains on
(`raydiff.data.placement`), so that the autoscaler may remove the decoding nodes; on a cluster of three nodes of
its own, as the cloud configs have them: a head that runs nothing, a CPU node that decodes, a GPU node that trains
(its GPU a logical one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import ROOT, own_head, own_node

pytestmark = pytest.mark.ray

STORE = 150 * 2 ** 20
OPEN = textwrap.dedent("""
    import json, sys, time
    import numpy as np, ray
    from ray._private.internal_api import node_stats
    from ray.experimental import get_object_locations
    from raydiff.config import load_config
    from raydiff.data import image_store
    from raydiff.data.run_images import open_images
    from raydiff.data.sources import source_of

    def primary_bytes(node):  # what the node holds as the primary copies of objects
        stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
        return stats.store_stats.object_store_bytes_primary_copy

    ray.init(logging_level="ERROR", log_to_driver=False)
    image_store.DRIVER_DECODE_BYTES = 0  # decoded by Ray Data's tasks: on the CPU node, the only one with CPUs
    cfg = load_config("smoke", [f"data.source={sys.argv[1]}", "data.cache=memory", "data.resolution=32",
                                "data.channels=3", "model.attention_resolutions=[16]", f"run.storage={sys.argv[2]}"])
    store, why = open_images(cfg.data, source_of(cfg.data), storage=cfg.run.storage, endpoint=None,
                             use_gpu=sys.argv[3] == "gpu", for_training=True)
    where = get_object_locations(list(store.chunks))
    gpu = next(n for n in ray.nodes() if n["Resources"].get("GPU"))
    cpu = next(n for n in ray.nodes() if n["Resources"].get("CPU"))
    deadline = time.monotonic() + 20
    while primary_bytes(cpu) and sys.argv[3] == "gpu" and time.monotonic() < deadline:
        time.sleep(0.5)  # Ray Data's blocks and the first copies are freed a moment after their last reference
    np.save(sys.argv[4], np.concatenate(store.arrays()))
    print(json.dumps({"why": why, "held_on": [sorted(where[c]["node_ids"]) for c in store.chunks],
                      "gpu": gpu["NodeID"], "cpu_primary_bytes": primary_bytes(cpu)}))
""")


def test_chunks_decoded_off_the_training_nodes_move_to_them_and_leave_the_decoding_node_empty(tmp_path):
    from ray.cluster_utils import Cluster

    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path / "images", num=120, resolution=32)  # 360 kB decoded: one chunk, in the object store
    c = Cluster(initialize_head=True, head_node_args=own_head(num_cpus=0, object_store_memory=STORE,
                                                              include_dashboard=False))
    try:
        c.add_node(**own_node(c, num_cpus=2, object_store_memory=STORE))
        c.add_node(**own_node(c, num_cpus=0, num_gpus=1, object_store_memory=STORE))
        c.wait_for_nodes()
        runs = {}
        for use_gpu in ("gpu", "cpu"):
            proc = subprocess.run([sys.executable, "-c", OPEN, str(tmp_path / "images"), str(tmp_path / "runs"),
                                   use_gpu, str(tmp_path / f"{use_gpu}.npy")], capture_output=True, text=True,
                                  timeout=300, cwd=ROOT, env=dict(os.environ, RAY_ADDRESS=c.address))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[use_gpu] = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        c.shutdown()
    on_gpus, on_cpus = runs["gpu"], runs["cpu"]
    # Training on the GPU node: the chunk decoded on the CPU node is held there alone, the same images, and the CPU
    # node holds nothing of the run's (the autoscaler may remove it).
    assert on_gpus["held_on"] == [[on_gpus["gpu"]]] and "1 chunk(s) moved to the training nodes" in on_gpus["why"]
    assert on_gpus["cpu_primary_bytes"] == 0
    assert np.array_equal(np.load(tmp_path / "gpu.npy"), np.load(tmp_path / "cpu.npy"))
    # Training on CPUs: the CPU node, which decoded it, trains too; nothing moves.
    assert on_cpus["held_on"] != [[on_cpus["gpu"]]] and "moved" not in on_cpus["why"]
    assert on_cpus["cpu_primary_bytes"] > 0
