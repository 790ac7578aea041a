"""`python -m raydiff.bench sampling`: img/s of raydiff's sampling (what `sample` runs, and `evaluate` on each of
its tasks) with the run's `train.keep_host_memory`, against the same sampling with glibc's allocator left as it is.

The allocator's settings hold for a whole process, so each side runs in a fresh process of its own, the two taking
turns `--pairs` times, starting with a different side each pair, so that the host's drift falls on both alike.
Each process builds the config's model with random weights (the arithmetic, not the images, sets the speed),
samples one warm-up batch, then `--num` images with `--sampler` in `--steps` steps, `--batch` at a time, timed,
and counts the minor page faults of the timed part. The line gives each side's img/s (the median over its
processes), the ratio, and the faults per image. On a GPU `auto` leaves the allocator alone, so the two sides
run the same program and the ratio shows the host's noise.
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from raydiff.config.schema import Sampler


def bench_sampling(config: str, overrides: list[str], *, sampler: Sampler, steps: int | None, num: int, batch: int,
                   pairs: int, device: str) -> dict[str, Any]:
    from raydiff.bench import load_model_config
    from raydiff.cluster.devices import resolve_device
    from raydiff.cluster.host_memory import keep_host_memory
    from raydiff.model.diffusion import steps_taken

    cfg = load_model_config(config, overrides, "sampling")  # refuses a bad config before any process starts
    keep = keep_host_memory(cfg.train.keep_host_memory, use_gpu=resolve_device(device).type == "cuda")
    job = {"config": config, "overrides": overrides, "sampler": sampler, "num": num, "batch": batch,
           "device": device, "steps": steps_taken(sampler, steps, cfg.diffusion.timesteps)}
    runs: dict[str, list[dict[str, Any]]] = {"raydiff": [], "baseline": []}
    for pair in range(pairs):
        for side in ("raydiff", "baseline") if pair % 2 == 0 else ("baseline", "raydiff"):
            runs[side].append(_run({**job, "keep": keep and side == "raydiff"}))
    sides = {side: _side(found, num) for side, found in runs.items()}
    return {"bench": "sampling", "config": config, "device": runs["raydiff"][0]["device"], "sampler": sampler,
            "steps": job["steps"], "num": num, "batch": batch, "pairs": pairs, **sides,
            "ratio": round(sides["raydiff"]["img_s"] / sides["baseline"]["img_s"], 3)}


def _side(runs: list[dict[str, Any]], num: int) -> dict[str, Any]:
    """One side's figures from its processes' measurements."""
    img_s = [num / run["seconds"] for run in runs]
    return {"img_s": round(statistics.median(img_s), 1), "host_memory_kept": runs[0]["kept"],
            "faults_per_image": round(statistics.median(run["faults"] for run in runs) / num, 1),
            "runs_img_s": [round(value, 1) for value in img_s]}


def _run(job: dict[str, Any]) -> dict[str, Any]:
    """One side's process: `python -m raydiff.bench.sampling JOB`."""
    proc = subprocess.run([sys.executable, "-m", "raydiff.bench.sampling", json.dumps(job)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the sampling process failed: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _measure(job: dict[str, Any]) -> dict[str, Any]:
    """In the side's own process: the settings first (before torch allocates), then the timed sampling."""
    from raydiff.cluster.host_memory import keep_host_memory_here

    kept = keep_host_memory_here() if job["keep"] else False
    import torch

    from raydiff.bench import load_model_config
    from raydiff.cluster.devices import device_name, resolve_device
    from raydiff.model.unet import build_model
    from raydiff.runs.generate import generate

    cfg = load_model_config(job["config"], job["overrides"], "sampling")
    device = resolve_device(job["device"])
    torch.manual_seed(0)
    state = {"config": cfg.to_dict(), "ema": build_model(cfg).state_dict()}

    def sample(num: int, seed: int) -> None:  # returns with the images on the host: the device has finished
        generate(state, num=num, sampler=job["sampler"], steps=job["steps"], eta=0.0, seed=seed, use_ema=True,
                 batch=job["batch"], device=device)

    with torch.inference_mode():
        sample(job["batch"], seed=1)  # warm-up: first-call costs, the allocator's pools
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        sample(job["num"], seed=0)
        seconds = time.perf_counter() - started
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"seconds": seconds, "faults": faults, "kept": kept, "device": device_name(device)}


if __name__ == "__main__":
    print(json.dumps(_measure(json.loads(sys.argv[1]))))
