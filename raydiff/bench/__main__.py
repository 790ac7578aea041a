"""Benchmarks that print numbers (JSON on stdout), each against a baseline measured in the same run.

    python -m raydiff.bench checkpoint [--config cifar10] [--set key=value ...] [--repeat 3]
    python -m raydiff.bench recovery [--config smoke] [--set key=value ...]
    python -m raydiff.bench ingest [--source PATH] [--resolution 32] [--batch 128] [--epochs 5] [--synthetic 4000]
        [--cache memory|stream]
    python -m raydiff.bench throughput [--config cifar10] [--set key=value ...] [--steps 50] [--batch N[,N...]]
        [--peak-tflops F] [--profile FILE] [--rerun]
    python -m raydiff.bench step [--config cifar10] [--set key=value ...] [--steps 20] [--batch N]
    python -m raydiff.bench memory [--config default] [--set key=value ...] [--micro-batch N]
    python -m raydiff.bench sampling [--config default] [--set key=value ...] [--sampler ddim] [--steps S]
        [--num 256] [--batch 64] [--pairs 3] [--device auto]

`checkpoint`: how long writing and reading the full training state (model, EMA, AdamW state, scaler,
counters) takes and how large it is, for a preset's model; baseline: the bare weights, as `torch.save` of
`model.state_dict()`. Training stalls only for the write: a bucket's upload runs in the background.

`recovery`: trains a preset in a fresh local Ray instance, kills a training worker process after the first
checkpoint, and measures the time from the kill to the worker group training again; baseline: the cold start
of the same run (launch to first training step).

`ingest`: img/s that raydiff's training ingest delivers from raw files and from prepared Parquet (held in memory,
and with --cache stream also streamed shard by shard), against the textbook torch DataLoader on the same files,
with peak object-store and RSS memory (see `raydiff.bench.ingest`); without --source it writes --synthetic
JPEGs first (64x64, or a quarter larger than --resolution above 51).

`throughput`: img/s of raydiff's training (one Ray Train worker, its defaults for the device) against the
textbook eager PyTorch loop and the best bare loop on the same device, with FLOPs per image, TFLOP/s, MFU, peak
memory and warm-up, one JSON line per `--batch` (see `raydiff.bench.throughput`).

`step`: img/s and the host's milliseconds per step of raydiff's optimizer step in this process (no Ray) against
the bare loop's step on one compiled loss, its parts added one at a time: the step, the loader thread, the EMA
(see `raydiff.bench.step`).

`memory`: the memory one training step needs at a micro-batch (weights, gradients, AdamW state, EMA,
activations), with and without `train.activation_checkpointing` (see `raydiff.bench.memory`).

`sampling`: img/s of raydiff's sampling (`sample`, and each of `evaluate`'s tasks) with the config's
`train.keep_host_memory`, against the same sampling with glibc's allocator as it is, in processes taking turns
(see `raydiff.bench.sampling`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from raydiff import cli
from raydiff.bench import load_model_config
from raydiff.config.schema import MAX_SAMPLING_STEPS, SAMPLERS


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_checkpoint(config: str, overrides: list[str], repeat: int) -> dict:
    import torch

    from raydiff.model.diffusion import build_diffusion
    from raydiff.model.unet import build_model, count_parameters
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs.checkpoint import read_state, write_state
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state

    cfg = load_model_config(config, overrides, "checkpoint")
    torch.manual_seed(0)
    model = build_model(cfg)
    ema = make_ema(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    # One real step, so that the optimizer holds its moment buffers as it does in a checkpoint mid-run.
    d = cfg.data
    x0 = torch.randn(2, d.channels, d.resolution, d.resolution)
    diffusion = build_diffusion(cfg)
    diffusion.loss_per_sample(model, x0, torch.tensor([10, 500]), torch.randn_like(x0)).mean().backward()
    optimizer.step()
    objects = TrainingState(model, ema, optimizer, scaler)
    state = checkpoint_state(objects, Progress(step=1), cfg.train.global_batch, cfg.to_dict())

    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as tmp:
        folder = Path(tmp)
        write_s = [_timed(lambda: write_state(folder, state)) for _ in range(repeat)]
        read_s = [_timed(lambda: read_state(folder)) for _ in range(repeat)]
        size = (folder / "state.pt").stat().st_size
        weights = folder / "weights.pt"
        weights_s = [_timed(lambda: torch.save(model.state_dict(), weights)) for _ in range(repeat)]
        weights_size = weights.stat().st_size
    write, base = statistics.median(write_s), statistics.median(weights_s)
    return {
        "bench": "checkpoint", "config": config, "parameters": count_parameters(model),
        "state_mb": round(size / 2**20, 1), "write_s": round(write, 3), "read_s": round(statistics.median(read_s), 3),
        "baseline_weights_mb": round(weights_size / 2**20, 1), "baseline_weights_write_s": round(base, 3),
        "size_ratio": round(size / weights_size, 2), "write_ratio": round(write / base, 2),
    }


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(condition, timeout: float, what: str, proc: subprocess.Popen, errors: Path):
    """`condition()`'s first truthy value, within `timeout` and while the run `proc` goes on."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:  # it ended: what it said last, not a wait of minutes
            said = errors.read_text(errors="replace").strip().splitlines()[-1:] or ["nothing"]
            raise RuntimeError(f"the run ended (exit code {proc.returncode}) before {what}; it said: {said[0]}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def bench_recovery(config: str, overrides: list[str]) -> dict:
    from raydiff.config import load_config

    load_config(config, overrides)  # what the run would refuse, refused here in one line
    with tempfile.TemporaryDirectory(prefix="raydiff-bench-") as storage:
        run_dir = Path(storage) / "recovery"
        errors = Path(storage) / "stderr.txt"
        args = [sys.executable, "-m", "raydiff.train", "--config", config, *[f"--set={o}" for o in overrides],
                "--set", f"run.storage={storage}", "--set", "run.name=recovery"]
        launched = time.time()
        with errors.open("wb") as stderr:
            proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=stderr, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, RAY_ADDRESS="local"))  # its own Ray: we kill only our worker
        try:
            first = _wait(lambda: next(iter(_events(run_dir)), None), 600, "the first start", proc, errors)
            _wait(lambda: any(run_dir.glob("checkpoint_*/state.pt")), 600, "the first checkpoint", proc, errors)
            killed = time.time()
            os.kill(first["pid"], signal.SIGKILL)
            restart = _wait(lambda: next((e for e in _events(run_dir) if e["event"] == "start" and e["time"] > killed),
                                         None), 600, "the restart", proc, errors)
            returncode = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
        summary = json.loads((run_dir / "summary.json").read_text())
    cold = first["time"] - launched
    recovery = restart["time"] - killed
    return {
        "bench": "recovery", "config": config, "kill_to_training_s": round(recovery, 1),
        "resumed_at_step": restart["step"], "baseline_cold_start_s": round(cold, 1),
        "ratio": round(recovery / cold, 2), "run_status": summary["status"], "run_restarts": summary["restarts"],
        "exit_code": returncode,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(prog="python -m raydiff.bench", description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench", required=True)
    ckpt = sub.add_parser("checkpoint", help="full training state: write/read time and size")
    ckpt.add_argument("--config", default="cifar10")
    ckpt.add_argument("--repeat", type=int, default=3)
    rec = sub.add_parser("recovery", help="time from a killed worker to training again")
    rec.add_argument("--config", default="smoke")
    speed = sub.add_parser("throughput", help="img/s of raydiff's training vs the textbook eager loop and the best "
                                              "bare loop, MFU, warm-up")
    speed.add_argument("--config", default="cifar10")
    speed.add_argument("--steps", type=int, default=50, help="warm-up steps, then as many measured (default 50)")
    speed.add_argument("--batch", default=None, metavar="N[,N...]",
                       help="per-device batches to measure, one JSON line each (default: the config's global batch)")
    speed.add_argument("--peak-tflops", type=float, default=None,
                       help="the device's peak dense TFLOP/s at the run's precision, for MFU (known GPUs' bf16 and "
                            "fp16 peaks are looked up; fp32 runs need it)")
    speed.add_argument("--profile", default=None, metavar="FILE",
                       help="write the top kernels of raydiff's steady-state step to FILE, and of its run, profiled "
                            "in its worker, to FILE-worker (FILE-N and FILE-N-worker per batch)")
    speed.add_argument("--rerun", action="store_true",
                       help="continue raydiff's run once more, as a restart does: its warm-up with the compile cache")
    step = sub.add_parser("step", help="raydiff's optimizer step in one process vs the bare step, its parts one at "
                                       "a time: img/s and host ms per step")
    step.add_argument("--config", default="cifar10")
    step.add_argument("--steps", type=int, default=20, help="warm-up steps per row, then as many measured (default 20)")
    step.add_argument("--batch", type=int, default=None, help="images per step (default: the config's global batch)")
    memory = sub.add_parser("memory", help="one training step's peak memory, with and without activation "
                                            "checkpointing")
    memory.add_argument("--config", default="default")
    memory.add_argument("--micro-batch", type=int, default=None,
                        help="images per forward pass (default: the preset's micro-batch; 1 where it is auto)")
    sampling = sub.add_parser("sampling", help="img/s of raydiff's sampling, host memory kept vs the allocator as "
                                               "it is")
    sampling.add_argument("--config", default="default")
    sampling.add_argument("--sampler", choices=SAMPLERS, default="ddim")
    sampling.add_argument("--steps", type=int, default=None, help="sampling steps (default: the sampler's)")
    sampling.add_argument("--num", type=int, default=256, help="images timed per process (default 256)")
    sampling.add_argument("--batch", type=int, default=64, help="images per pass (default 64)")
    sampling.add_argument("--pairs", type=int, default=3, help="processes per side, taking turns (default 3)")
    sampling.add_argument("--device", default="auto", help="auto (GPU if present), cpu, cuda, cuda:N")
    for p in (ckpt, rec, speed, step, memory, sampling):
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ingest = sub.add_parser("ingest", help="img/s of raydiff's ingest (raw, prepared) vs the torch DataLoader")
    ingest.add_argument("--source", default=None, help="folder of images (default: synthetic JPEGs)")
    ingest.add_argument("--resolution", type=int, default=32)
    ingest.add_argument("--batch", type=int, default=128)
    ingest.add_argument("--epochs", type=int, default=5, help="epochs per pipeline; the first is not timed")
    ingest.add_argument("--synthetic", type=int, default=4000, help="synthetic JPEGs to write without --source")
    ingest.add_argument("--cache", choices=("memory", "stream"), default="memory",
                        help="stream: also stream the prepared copy shard by shard (data.cache=stream)")
    args = parser.parse_args(argv)
    refuse = sub.choices[args.bench].error  # one line naming the sub-command (cli.Parser)
    if getattr(args, "repeat", 1) < 1:
        refuse(f"--repeat {args.repeat}: must be >= 1")
    if args.bench == "memory" and args.micro_batch is not None and args.micro_batch < 1:
        refuse(f"--micro-batch {args.micro_batch}: must be >= 1")
    if args.bench == "throughput" and args.steps < 2:
        refuse(f"--steps {args.steps}: must be >= 2")
    if args.bench == "step" and args.steps < 2:
        refuse(f"--steps {args.steps}: must be >= 2")
    if args.bench == "step" and args.batch is not None and args.batch < 1:
        refuse(f"--batch {args.batch}: must be >= 1")
    if args.bench == "throughput" and args.peak_tflops is not None and args.peak_tflops <= 0:
        refuse(f"--peak-tflops {args.peak_tflops}: must be > 0")
    if args.bench == "throughput" and args.batch is not None:
        try:
            args.batch = [int(n) for n in args.batch.split(",")]
        except ValueError:
            refuse(f"--batch {args.batch}: expected N or N,N,... (images per device per step)")
        if min(args.batch) < 1:
            refuse(f"--batch {','.join(map(str, args.batch))}: every batch must be >= 1")
        if len(set(args.batch)) < len(args.batch):  # a second run of a batch would find the first one finished
            refuse(f"--batch {','.join(map(str, args.batch))}: every batch once")
    if args.bench == "sampling":
        for name in ("num", "batch", "pairs", "steps"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                refuse(f"--{name} {getattr(args, name)}: must be >= 1")
        if args.steps is not None and args.steps > MAX_SAMPLING_STEPS:
            refuse(f"--steps {args.steps}: must be in [1, {MAX_SAMPLING_STEPS:,}]")
        from raydiff.cluster.devices import resolve_device

        try:
            resolve_device(args.device)
        except ValueError as exc:
            refuse(str(exc))
    if args.bench == "ingest":
        for name in ("resolution", "batch", "synthetic"):
            if getattr(args, name) < 1:
                refuse(f"--{name} {getattr(args, name)}: must be >= 1")
        if args.epochs < 2:
            refuse(f"--epochs {args.epochs}: must be >= 2 (the first epoch is not timed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.bench == "checkpoint":
        result = bench_checkpoint(args.config, args.set, args.repeat)
    elif args.bench == "ingest":
        from raydiff.bench.ingest import bench_ingest

        result = bench_ingest(args.source, resolution=args.resolution, batch=args.batch, epochs=args.epochs,
                              synthetic=args.synthetic, cache=args.cache)
    elif args.bench == "memory":
        from raydiff.bench.memory import bench_memory

        result = bench_memory(args.config, args.set, args.micro_batch)
    elif args.bench == "sampling":
        from raydiff.bench.sampling import bench_sampling

        result = bench_sampling(args.config, args.set, sampler=args.sampler, steps=args.steps, num=args.num,
                                batch=args.batch, pairs=args.pairs, device=args.device)
    elif args.bench == "step":
        from raydiff.bench.step import bench_step

        result = bench_step(args.config, args.set, steps=args.steps, batch=args.batch)
    elif args.bench == "throughput":
        from raydiff.bench.throughput import bench_throughput

        for line in bench_throughput(args.config, args.set, steps=args.steps, batches=args.batch,
                                     peak=args.peak_tflops, profile=Path(args.profile) if args.profile else None,
                                     rerun=args.rerun):
            print(json.dumps(line), flush=True)
        return 0
    else:
        result = bench_recovery(args.config, ["train.total_steps=200", "train.checkpoint_every=20",
                                              "train.sample_every=0", *args.set])
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    cli.exit_with(main)
