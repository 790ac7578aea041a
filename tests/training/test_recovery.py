"""Recovery: a rollback under two gloo processes restores the checkpoint rank 0 chose, on every rank."""

from __future__ import annotations

import json

import torch
from gloo_groups import end_process_group

from raydiff.config import load_config
from raydiff.storage.rundir import RunDir


def _roll_back_on(rank: int, init_file: str, run_dir: str, out: str) -> None:
    """One of two gloo processes: roll back while rank 0 cannot read the newest checkpoint (it is still being
    written when rank 0 tries) and rank 1 can (it has been completed since)."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch.distributed as dist

    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs import state as state_module
    from raydiff.runs.state import Progress
    from raydiff.training.debug import DebugHooks
    from raydiff.training.recovery import roll_back
    from raydiff.training.step import make_optimizer
    from raydiff.training.worker import Worker

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 0:
        real_read = state_module.read_state

        def read_state(path):
            if path.name == "checkpoint_00000020":
                raise RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory")
            return real_read(path)

        state_module.read_state = read_state
    cfg = load_config("smoke", check_source=False)
    model = build_model(cfg)
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    w = Worker(cfg=cfg, run_dir=RunDir(run_dir), rank=rank, world_size=2, device=torch.device("cpu"), model=model,
               ema=make_ema(model), ema_update=None, posthoc=None, diffusion=None, speed=None, memory_plan="",
               step_parts=SimpleNamespace(optimizer=optimizer, scaler=torch.amp.GradScaler("cpu", enabled=False)),
               table=None, device_images=None, data_placement="", order=None, validation=None, quality=None,
               micro_batch=8,
               metrics_log=None, events=None,
               writes=None, debug=DebugHooks(cfg, RunDir(run_dir), rank), compile_cache=None, restore_notes=[],
               compile_cache_note=None)
    back = roll_back(w.training_state, w.run_dir, Progress(step=25), is_chief=rank == 0, weight_decay=0.05).progress
    checksum = float(sum(p.double().sum() for p in model.parameters()))
    Path(out, f"rank{rank}.json").write_text(json.dumps({"step": back.step, "weights": checksum,
                                                         "weight_decay": optimizer.param_groups[0]["weight_decay"]}))
    end_process_group()


def test_a_rollback_restores_the_checkpoint_rank_0_chose_on_every_worker(tmp_path):
    """Rank 0 chooses the checkpoint (falling back past one it cannot read); the other workers restore that one,
    not a newer one they could read: replicas that differ would train apart, or hang a collective. The run's own
    settings (weight decay) replace the checkpoint's, as at a start."""
    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs.checkpoint import write_state
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state
    from raydiff.training.step import make_optimizer

    cfg = load_config("smoke", check_source=False)
    for step in (10, 20):
        torch.manual_seed(step)  # different weights in each checkpoint
        model = build_model(cfg)
        objects = TrainingState(model, make_ema(model), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                                torch.amp.GradScaler("cpu", enabled=False))
        state = checkpoint_state(objects, Progress(step=step), 16, cfg.to_dict())
        (tmp_path / f"checkpoint_{step:08d}").mkdir()
        write_state(tmp_path / f"checkpoint_{step:08d}", state)
    out = tmp_path / "out"
    out.mkdir()
    torch.multiprocessing.spawn(_roll_back_on, args=(str(tmp_path / "init"), str(tmp_path), str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1] and ranks[0]["step"] == 10
    assert ranks[0]["weight_decay"] == 0.05  # the checkpoints were written with 0.0


def _restore_refused_on(rank: int, init_file: str, run_dir: str, out: str) -> None:
    """One of two gloo processes restoring while rank 0 is refused the newest checkpoint (permission denied)."""
    from pathlib import Path

    import torch.distributed as dist

    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs import state as state_module
    from raydiff.runs.state import TrainingState
    from raydiff.storage.errors import StorageFailure
    from raydiff.training.recovery import restore_agreed
    from raydiff.training.step import make_optimizer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 0:
        def read_state(path):
            raise PermissionError(13, "Permission denied", str(path))

        state_module.read_state = read_state
    cfg = load_config("smoke", check_source=False)
    model = build_model(cfg)
    objects = TrainingState(model, make_ema(model), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                            torch.amp.GradScaler("cpu", enabled=False))
    try:
        restore_agreed(objects, RunDir(run_dir), is_chief=rank == 0, weight_decay=0.0)
        said = "restored"
    except StorageFailure as exc:
        said = str(exc)
    Path(out, f"rank{rank}.json").write_text(json.dumps({"said": said}))
    end_process_group()


def test_a_checkpoint_refused_for_good_stops_every_worker_in_one_line_without_restarts(tmp_path):
    """Permission denied is no moment of the network: a restart would meet it again (each one spending
    run.max_failures), so every worker stops with the same line, which the driver prints."""
    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs.checkpoint import write_state
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state
    from raydiff.training.step import make_optimizer

    cfg = load_config("smoke", check_source=False)
    model = build_model(cfg)
    objects = TrainingState(model, make_ema(model), make_optimizer(model, lr=1e-3, weight_decay=0.0),
                            torch.amp.GradScaler("cpu", enabled=False))
    (tmp_path / "checkpoint_00000010").mkdir()
    write_state(tmp_path / "checkpoint_00000010", checkpoint_state(objects, Progress(step=10), 16, cfg.to_dict()))
    out = tmp_path / "out"
    out.mkdir()
    torch.multiprocessing.spawn(_restore_refused_on, args=(str(tmp_path / "init"), str(tmp_path), str(out)),
                                nprocs=2)
    said = [json.loads((out / f"rank{r}.json").read_text())["said"] for r in range(2)]
    assert said[0] == said[1] and said[0].startswith(f"storage {tmp_path}: reading the newest checkpoint failed: "
                                                     f"permission denied"), said


def test_the_divergence_report_s_timestep_buckets_are_the_metrics_rows_quarters():
    """With T not a multiple of 4 (30 here), t = 7 is in the rows' first quarter (7 * 4 // 30 = 0): the report
    put it in the second."""
    from raydiff.training.recovery import divergence_report
    from raydiff.training.step import StepResult

    t = torch.arange(30)
    losses = (t * 4 // 30).float()  # each sample's loss: its quarter, as the rows count it
    result = StepResult(finite=torch.tensor(False), grad_norm=torch.tensor(float("inf")), loss_sum=losses.sum(),
                        samples=30, quarter_sums=torch.zeros(2, 4), images=torch.zeros(30, 3, 4, 4, dtype=torch.uint8),
                        timesteps=t, losses=losses)
    line = divergence_report(load_config("smoke").train, 40, 1e30, result, num_timesteps=30, streak=9)
    assert "(t 0-7: 0; t 8-14: 1; t 15-22: 2; t 23-29: 3)" in line
    assert line.startswith("training diverged: 9 non-finite steps in a row at step 40")  # the streak, not the limit
