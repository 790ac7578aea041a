"""Training state: which checkpoint a (re)start restores, and falling back past unreadable ones."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from raydiff.runs.checkpoint import checkpoint_name, write_state
from raydiff.config import Config
from raydiff.model.ema import make_ema
from raydiff.runs.rundir import RunDir
from raydiff.runs.state import Progress, checkpoint_candidates, restore_newest, training_state
from raydiff.model.unet import build_model


def _objects(seed: int):
    torch.manual_seed(seed)
    model = build_model(Config())
    optimizer = torch.optim.AdamW(model.parameters())
    return model, make_ema(model), optimizer, torch.amp.GradScaler("cpu", enabled=False)


def _write(run_dir, step, objects, name=None):
    folder = run_dir / (name or checkpoint_name(step))
    folder.mkdir(parents=True)
    write_state(folder, training_state(*objects, Progress(step=step), 64, Config().to_dict()))
    return folder


def test_candidates_are_newest_first_and_include_what_ray_never_registered(tmp_path):
    objects = _objects(0)
    ten, twenty, twenty_again = (_write(tmp_path, 10, objects), _write(tmp_path, 20, objects),
                                 _write(tmp_path, 20, objects, "checkpoint_00000020-1"))
    # Ray registered only step 10; step 20 reached storage just before a crash.
    ray_latest = SimpleNamespace(path=str(ten))
    assert checkpoint_candidates(tmp_path, ray_latest) == [RunDir(twenty_again), RunDir(twenty), RunDir(ten)]
    assert checkpoint_candidates(tmp_path / "missing") == []


def test_restore_falls_back_past_a_truncated_checkpoint(tmp_path):
    saved = _objects(0)
    good = _write(tmp_path, 10, saved)
    bad = _write(tmp_path, 20, saved)
    state_file = bad / "state.pt"
    state_file.write_bytes(state_file.read_bytes()[:1000])

    fresh = _objects(1)
    progress, restored = restore_newest(checkpoint_candidates(tmp_path), *fresh)
    assert restored == RunDir(good) and progress.step == 10
    for a, b in zip(saved[0].state_dict().values(), fresh[0].state_dict().values()):
        assert torch.equal(a, b)


def test_nothing_readable_starts_from_scratch(tmp_path):
    bad = _write(tmp_path, 10, _objects(0))
    (bad / "state.pt").write_bytes(b"not a checkpoint")
    progress, restored = restore_newest(checkpoint_candidates(tmp_path), *_objects(1))
    assert restored is None and progress.step == 0
