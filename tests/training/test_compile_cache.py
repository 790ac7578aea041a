"""The compile cache: compiled code kept in the run directory is loaded by a worker on another node (a process
with an empty inductor cache of its own), which then compiles nothing again; its key follows what the code
depends on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from raydiff.storage.rundir import RunDir
from raydiff.training import compile_cache
from raydiff.training.compile_cache import cache_key

pytestmark = pytest.mark.skipif(not compile_cache.available(), reason="portable compile caches need torch >= 2.7")

# One worker start: load the run's cache, compile a small model with inductor and train a step, keep what is new.
WORKER = textwrap.dedent("""
    import json, sys, torch
    from torch._dynamo.utils import counters
    from raydiff.storage.rundir import RunDir
    from raydiff.training.compile_cache import CompileCache

    cache = CompileCache(RunDir(sys.argv[1]), sys.argv[2])
    note = cache.load()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1))
    torch.compile(model)(torch.randn(4, 8)).sum().backward()
    data = cache.artifacts()
    if data is not None:
        cache.save(data)
    print(json.dumps({"note": note, "saved": data is not None, "hits": counters["inductor"]["fxgraph_cache_hit"],
                      "misses": counters["inductor"]["fxgraph_cache_miss"]}))
""")


def _start_on_a_new_node(run_dir, key: str, node_cache) -> dict:
    """A worker process whose node has never compiled anything (its own empty inductor cache folder)."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(node_cache))
    proc = subprocess.run([sys.executable, "-c", WORKER, str(run_dir), key], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_restart_on_another_node_loads_the_compiled_step_instead_of_compiling(tmp_path):
    run_dir = tmp_path / "run"
    first = _start_on_a_new_node(run_dir, "key-a", tmp_path / "node-1")
    assert first == {"note": "compile cache: none yet for this setup", "saved": True, "hits": 0, "misses": 2}
    assert (run_dir / "compile_cache" / "key-a.bin").stat().st_size > 0

    # Another run on the same node: its code comes from the node's warm cache, and is kept for this run too (it
    # was not: nothing compiled, so nothing saved, and a restart elsewhere compiled everything).
    warm = _start_on_a_new_node(tmp_path / "run-2", "key-a", tmp_path / "node-1")
    assert warm == {"note": "compile cache: none yet for this setup", "saved": True, "hits": 2, "misses": 0}

    again = _start_on_a_new_node(run_dir, "key-a", tmp_path / "node-2")
    assert again["note"].startswith("compile cache: ") and "artifacts loaded" in again["note"]
    assert (again["hits"], again["misses"], again["saved"]) == (2, 0, False)  # forward and backward, from the cache
    # Another setup's key has no file: it compiles afresh (`test_the_key_follows_what_the_compiled_code_depends_on`).
    assert compile_cache.CompileCache(RunDir(run_dir), "key-b").load() == "compile cache: none yet for this setup"


def test_the_key_follows_what_the_compiled_code_depends_on():
    cpu = torch.device("cpu")
    parts = {"model": {"base_channels": 32}, "micro_batches": [64], "channels_last": False}
    assert cache_key(parts, cpu) == cache_key(dict(parts), cpu)
    for change in ({"model": {"base_channels": 64}}, {"micro_batches": [32, 64]}, {"channels_last": True}):
        assert cache_key({**parts, **change}, cpu) != cache_key(parts, cpu)


def test_a_runs_key_changes_with_the_loss_it_compiles():
    """The loss's weighting and the diffusion schedule are in the compiled step too: a re-run that changes them
    gets a key of its own rather than loading code it cannot use and writing over the other's."""
    from raydiff.config import load_config
    from raydiff.training.speed import plan_speed
    from raydiff.training.worker import compiled_step_key

    cpu = torch.device("cpu")

    def key(*overrides: str) -> str:
        cfg = load_config("smoke", list(overrides), check_source=False)
        return compiled_step_key(cfg, plan_speed(cfg.train, cpu, world_size=1), cpu, layout=[(0, 8)],
                                 autocast_dtype=None, checkpointing=False)

    assert key() == key()
    changes = ("train.loss_weighting=min_snr", "train.min_snr_gamma=3", "diffusion.schedule=cosine",
               "diffusion.timesteps=500", "diffusion.prediction=v")
    assert len({key(), *(key(change) for change in changes)}) == 1 + len(changes)
    # TF32 is in torch's own keys: without it in ours, a start after a change of train.tf32 loaded the file,
    # compiled everything again and wrote over the other setting's code.
    import dataclasses

    cfg = load_config("smoke", check_source=False)
    speed = plan_speed(cfg.train, cpu, world_size=1)
    assert compiled_step_key(cfg, dataclasses.replace(speed, tf32=True), cpu, layout=[(0, 8)], autocast_dtype=None,
                             checkpointing=False) != key()


def test_each_gpu_index_has_its_key_and_a_failed_save_off_rank_0_is_one_warning(monkeypatch, tmp_path, caplog):
    """Compiled code names its GPU: cuda:0's is no use on cuda:3, so the key holds the index (the first worker on
    each index keeps its file). Such a worker's save that fails costs a later start its compilation, not the run."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    parts = {"model": {"base_channels": 32}}
    keys = [cache_key(parts, torch.device("cuda", i)) for i in (0, 3, 3)]
    assert keys[0] != keys[1] == keys[2]

    run = tmp_path / "run"
    run.mkdir()
    (run / compile_cache.CACHE_FOLDER).write_text("a file where the folder would be")  # every write fails
    cache = compile_cache.CompileCache(RunDir(run), keys[1], keeps=True)
    with caplog.at_level("WARNING", logger="raydiff"):
        cache.save_or_warn(b"compiled", rank=3)
    (warning,) = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"[raydiff] rank 3: its compiled step not kept in compile_cache/{keys[1]}.bin (")
    assert warning.endswith("training goes on")


def test_an_unreadable_cache_file_compiles_afresh(tmp_path):
    run_dir = RunDir(tmp_path)
    run_dir.write_bytes("compile_cache/k.bin", b"not a cache")
    cache = compile_cache.CompileCache(run_dir, "k")
    assert cache.load() == "compile cache not loaded (no artifacts read from it), compiling afresh"
    assert not cache.loaded
