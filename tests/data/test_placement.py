"""A memory-mode dataset decoded on nodes the run does not train on is kept on the nodes it trains on
(`raydiff.data.placement`), so that the autoscaler may remove the decoding nodes; on a cluster of two nodes of
its own: a head that decodes (CPUs, no GPU) and a GPU node that trains (its GPU a logical one)."""

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

OPEN = textwrap.dedent("""
    import json, sys
    import numpy as np, ray
    from ray.experimental import get_object_locations
    from raydiff.config import load_config
    from raydiff.data import image_store
    from raydiff.data.run_images import open_images
    from raydiff.data.sources import source_of

    ray.init(logging_level="ERROR", log_to_driver=False)
    image_store.DRIVER_DECODE_BYTES = 0  # decoded by Ray Data's tasks: on the head, the only node with CPUs
    cfg = load_config("smoke", [f"data.source={sys.argv[1]}", "data.cache=memory", "data.resolution=32",
                                "data.channels=3", "model.attention_resolutions=[16]", f"run.storage={sys.argv[2]}"])
    store, why = open_images(cfg.data, source_of(cfg.data), storage=cfg.run.storage, endpoint=None,
                             use_gpu=sys.argv[3] == "gpu")
    where = get_object_locations(list(store.chunks))
    gpu = [n["NodeID"] for n in ray.nodes() if n["Resources"].get("GPU")]
    np.save(sys.argv[4], np.concatenate(store.arrays()))
    print(json.dumps({"why": why, "held_on": [sorted(where[c]["node_ids"]) for c in store.chunks], "gpu": gpu}))
""")


def test_chunks_decoded_off_the_training_nodes_move_to_them_and_nowhere_else_stay(tmp_path):
    from ray.cluster_utils import Cluster

    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path / "images", num=120, resolution=32)  # 360 kB decoded: one chunk, in the object store
    c = Cluster(initialize_head=True, head_node_args=own_head(num_cpus=2, object_store_memory=150 * 2 ** 20,
                                                              include_dashboard=False))
    try:
        c.add_node(**own_node(c, num_cpus=0, num_gpus=1, object_store_memory=150 * 2 ** 20))
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
    gpu_node = runs["gpu"]["gpu"][0]
    # Training on the GPU node: the chunk decoded on the head is held there alone, the same images.
    assert runs["gpu"]["held_on"] == [[gpu_node]] and "1 chunk(s) moved to the training nodes" in runs["gpu"]["why"]
    assert np.array_equal(np.load(tmp_path / "gpu.npy"), np.load(tmp_path / "cpu.npy"))
    # Training on CPUs: the head, which decoded it, trains too; nothing moves.
    assert runs["cpu"]["held_on"] != [[gpu_node]] and "moved" not in runs["cpu"]["why"]
