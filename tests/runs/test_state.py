"""Training state: which checkpoint a (re)start restores, falling back past bad ones (and only those: a read that
fails this time raises, for Ray to restart the worker), and a bad one named in words."""

from __future__ import annotations

import errno
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from raydiff.config import Config
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import make_ema
from raydiff.runs.checkpoint import checkpoint_name, read_state, write_state
from raydiff.runs.state import (
    Progress,
    TrainingState,
    Unresumable,
    apply_config,
    checkpoint_candidates,
    checkpoint_state,
    read_newest,
    restore,
    restore_newest,
)
from raydiff.storage.errors import StorageFailure
from raydiff.storage.rundir import RunDir


def _objects(seed: int):
    torch.manual_seed(seed)
    model = build_model(Config())
    optimizer = torch.optim.AdamW(model.parameters())
    return TrainingState(model, make_ema(model), optimizer, torch.amp.GradScaler("cpu", enabled=False))


def _write(run_dir, step, objects, name=None):
    folder = run_dir / (name or checkpoint_name(step))
    folder.mkdir(parents=True)
    write_state(folder, checkpoint_state(TrainingState(*objects), Progress(step=step), 64, Config().to_dict()))
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
    restored = restore_newest(checkpoint_candidates(tmp_path), fresh)
    assert restored.checkpoint == RunDir(good) and restored.progress.step == 10
    for a, b in zip(saved[0].state_dict().values(), fresh[0].state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert restore_newest(checkpoint_candidates(tmp_path), _objects(1)) is None


def test_nothing_restorable_refuses_and_changes_nothing(tmp_path):
    unreadable = _write(tmp_path, 10, _objects(0))
    (unreadable / "state.pt").write_bytes(b"not a checkpoint")
    other_model = _objects(0)
    other_model[0].conv_in = torch.nn.Conv2d(1, 8, 3)  # a different shape: the load fails half way
    misfit = _write(tmp_path, 20, other_model)
    fresh = _objects(1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises(Unresumable, match="checkpoint_00000020 .*checkpoint_00000010 "):
        restore_newest(checkpoint_candidates(tmp_path), fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items())
    assert (unreadable / "state.pt").read_bytes() == b"not a checkpoint" and (misfit / "state.pt").exists()


def test_a_part_that_does_not_fit_leaves_every_object_untouched(tmp_path):
    saved = _objects(0)
    folder = _write(tmp_path, 10, saved)
    state = read_state(folder)
    state["optimizer"]["param_groups"] = []  # model and EMA fit, the optimizer does not
    fresh = _objects(1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises(ValueError):
        restore(state, fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items())


def test_switching_to_fp16_drops_the_missing_loss_scale_with_a_note(tmp_path):
    _write(tmp_path, 10, _objects(0))  # trained without a loss scaler (fp32 or bf16)
    model, ema, optimizer, _, _ = _objects(1)
    scaler = torch.amp.GradScaler("cpu", enabled=True, init_scale=1024.0)
    restored = restore_newest(checkpoint_candidates(tmp_path), TrainingState(model, ema, optimizer, scaler))
    assert restored.progress.step == 10 and scaler.get_scale() == 1024.0
    assert any("loss scale starts afresh" in note for note in restored.notes)


def test_transient_storage_errors_are_retried(tmp_path, monkeypatch):
    import raydiff.runs.state as state_module

    folder = _write(tmp_path, 10, _objects(0))
    calls = []

    def flaky(path):
        calls.append(path)
        if len(calls) < 3:
            raise OSError("connection reset")
        return read_state(path)

    monkeypatch.setattr(state_module, "read_state", flaky)
    monkeypatch.setattr(state_module, "READ_RETRY_S", 0.0)
    assert restore_newest([RunDir(folder)], _objects(1)).progress.step == 10 and len(calls) == 3


def test_a_changed_weight_decay_reaches_the_restored_optimizer(tmp_path):
    model, ema, optimizer, scaler, _ = _objects(0)
    _write(tmp_path, 10, (model, ema, optimizer, scaler))  # saved with weight_decay 0.01 (AdamW's default)
    fresh = _objects(1)
    restore_newest(checkpoint_candidates(tmp_path), fresh)
    apply_config(fresh[2], weight_decay=0.25)
    assert [g["weight_decay"] for g in fresh[2].param_groups] == [0.25]


@pytest.mark.parametrize("fused", [True, False])
def test_a_run_continued_in_channels_last_makes_the_update_of_an_uninterrupted_run(tmp_path, fused):
    """A run checkpointed in NCHW (on a CPU, say) and continued in channels_last (compiled on a GPU): the restored
    AdamW moments take the parameters' layout, since the fused and foreach kernels pair elements by memory
    position; without that the next update moves the wrong weights. Same gradients, so the same update bit for
    bit."""
    def objects(channels_last: bool) -> TrainingState:
        torch.manual_seed(0)
        model = build_model(Config())
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
        return TrainingState(model, make_ema(model), optimizer, torch.amp.GradScaler("cpu", enabled=False))

    def step_with_gradients(o: TrainingState, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for p in o.model.parameters():
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=generator))
        o.optimizer.step()

    uninterrupted, continued = objects(False), objects(True)
    for seed in (1, 2):
        step_with_gradients(uninterrupted, seed)
        if seed == 1:
            write_state(tmp_path, checkpoint_state(uninterrupted, Progress(step=1), 4, Config().to_dict()))
    restore(read_state(tmp_path), continued)
    step_with_gradients(continued, 2)
    assert any(not p.is_contiguous() for p in continued.model.parameters())
    for (name, a), b in zip(uninterrupted.model.named_parameters(), continued.model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_the_post_hoc_averages_travel_in_the_checkpoint_and_are_required_by_a_post_hoc_run(tmp_path):
    from raydiff.model.weight_averages import PowerEma

    model, ema, optimizer, scaler, _ = _objects(0)
    tracker = PowerEma(model, [0.05, 0.1])
    for step in (1, 2, 3):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        tracker(step)
    _write(tmp_path, 3, TrainingState(model, ema, optimizer, scaler, tracker))
    fresh = _objects(1)
    fresh_tracker = PowerEma(fresh.model, [0.05, 0.1])
    restored = restore_newest(checkpoint_candidates(tmp_path), fresh._replace(posthoc=fresh_tracker))
    assert restored.progress.step == 3
    for saved, loaded in zip(tracker.profiles, fresh_tracker.profiles, strict=True):
        assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in saved.state_dict().items())

    # A checkpoint without the averages (or of other widths) is no start for a post-hoc run: refused whole.
    classic = tmp_path / "classic"
    _write(classic, 3, _objects(0))
    other = _objects(2)
    before = {k: v.clone() for k, v in other.model.state_dict().items()}
    with pytest.raises(Unresumable, match="missing posthoc_ema"):
        restore_newest(checkpoint_candidates(classic), other._replace(posthoc=PowerEma(other.model, [0.05])))
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())

    # An average that does not fit (its second width's tensors cut): refused before anything, the first width's
    # average included, changed.
    state = read_state(tmp_path / "checkpoint_00000003")
    name, tensor = next(iter(state["posthoc_ema"]["profiles"][1].items()))
    state["posthoc_ema"]["profiles"][1][name] = tensor[..., :1].clone()
    live = PowerEma(other.model, [0.05, 0.1])
    averages_before = [{k: v.clone() for k, v in p.state_dict().items()} for p in live.profiles]
    with pytest.raises(RuntimeError, match="size mismatch"):
        restore(state, other._replace(posthoc=live))
    assert all(torch.equal(before[k], v) for k, v in other.model.state_dict().items())
    for kept, profile in zip(averages_before, live.profiles, strict=True):
        assert all(torch.equal(v, profile.state_dict()[k]) for k, v in kept.items())


def test_a_checkpoint_keeps_the_newest_measurements_and_older_ones_restore_without(tmp_path):
    """A run resumed at its last step trains nothing and must still end with its validation loss and quality
    (a sweep's trial reports them to Tune from there); checkpoints from before they were kept restore empty."""
    measured = {"val_loss": 0.0421, "quality": {"digits_fd": 44.31, "eval_s": 3.5}, "loss": 0.0181}
    # A metric computed in numpy is kept as a Python number: the checkpoint stays readable with weights_only.
    progress = Progress(step=40, measured={**measured, "quality": {"digits_fd": np.float64(44.31), "eval_s": 3.5}})
    write_state(tmp_path, checkpoint_state(_objects(0), progress, 16, Config().to_dict()))
    state = read_state(RunDir(tmp_path))
    assert restore(state, _objects(1))[0].measured == measured
    del state["measured"]
    assert restore(state, _objects(1))[0].measured == {}


def _unreachable_newest(monkeypatch, error: OSError) -> list:
    """Reads of the newest checkpoint (step 20) fail with `error` every time; the others read. Returns the reads."""
    import raydiff.runs.state as state_module

    reads = []

    def read(path):
        reads.append(path.name)
        if path.name == checkpoint_name(20):
            raise error
        return read_state(path)

    monkeypatch.setattr(state_module, "read_state", read)
    monkeypatch.setattr(state_module, "READ_RETRY_S", 0.0)
    return reads


@pytest.mark.parametrize("error, attempts", [
    (ConnectionError("connection reset by peer"), 3), (OSError(errno.EIO, "I/O error"), 3),
    (OSError("AWS Error NETWORK_CONNECTION during GetObject operation"), 3),
    (OSError(errno.EACCES, "Permission denied"), 1),  # no retry can fix it
], ids=["ConnectionError", "EIO", "a bucket's network error", "EACCES"])
def test_a_checkpoint_that_cannot_be_read_this_time_is_not_passed_over_for_an_older_one(tmp_path, monkeypatch,
                                                                                         error, attempts):
    """Storage that fails is no fault of the checkpoint: the worker fails and Ray restarts it from the same
    checkpoint, where falling back would throw the newest steps away (or refuse a run that is fine)."""
    objects = _objects(0)
    _write(tmp_path, 10, objects)
    _write(tmp_path, 20, objects)
    reads = _unreachable_newest(monkeypatch, error)
    fresh = _objects(1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises(type(error)):
        restore_newest(checkpoint_candidates(tmp_path), fresh)
    assert reads == [checkpoint_name(20)] * attempts  # and never the older one
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items())
    # A command that reads a checkpoint (sample, evaluate, export) stops in one line rather than use an older one.
    reads.clear()
    with pytest.raises(StorageFailure, match=r"checkpoint .*checkpoint_00000020: reading it failed \(.*\); no "
                                             r"older checkpoint was used in its place: check the storage"):
        read_newest(tmp_path)
    assert reads == [checkpoint_name(20)] * attempts


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                   RuntimeError("CUDA error: an illegal memory access was encountered")])
def test_memory_or_the_device_failing_while_restoring_is_not_taken_for_a_bad_checkpoint(tmp_path, monkeypatch, error):
    import raydiff.runs.state as state_module

    _write(tmp_path, 10, _objects(0))
    _write(tmp_path, 20, _objects(0))

    def failing(twin, state):
        raise error

    monkeypatch.setattr(state_module, "check_load", failing)
    with pytest.raises(type(error)):
        restore_newest(checkpoint_candidates(tmp_path), _objects(1))


@pytest.mark.parametrize("damage", ["empty", "garbage", "cut in half", "cut by one byte"])
def test_a_damaged_checkpoint_is_named_in_words_and_passed_over_at_once(tmp_path, monkeypatch, damage):
    """torch's own message would be cut at 200 characters, empty ("EOFError: "), or tell the user to switch the
    safe loader off (weights_only=False). A damaged file is not read again."""
    import raydiff.runs.state as state_module

    objects = _objects(0)
    _write(tmp_path, 10, objects)
    state_file = _write(tmp_path, 20, objects) / "state.pt"
    whole = state_file.read_bytes()
    state_file.write_bytes({"empty": b"", "garbage": b"not a checkpoint", "cut in half": whole[:len(whole) // 2],
                            "cut by one byte": whole[:-1]}[damage])
    reads = []
    monkeypatch.setattr(state_module, "read_state", lambda path: reads.append(path.name) or read_state(path))
    monkeypatch.setattr(state_module, "READ_RETRY_S", 0.0)

    restored = restore_newest(checkpoint_candidates(tmp_path), _objects(1))
    assert restored.checkpoint.name == checkpoint_name(10)
    assert reads == [checkpoint_name(20), checkpoint_name(10)]
    with pytest.raises(Unresumable) as refused:
        restore_newest([RunDir(state_file.parent)], _objects(1))
    with pytest.raises(FileNotFoundError) as unread:
        read_newest(state_file.parent)
    for message in (str(refused.value), str(unread.value)):
        assert "checkpoint_00000020 (not a readable checkpoint (truncated, empty, or not a torch file))" in message
        assert "weights_only" not in message and "Error" not in message


NOT_RAYDIFFS = "not a raydiff checkpoint"
# What is wrong with a torch file: (its content, from a real checkpoint's state, the reason given).
FOREIGN_STATES = {
    "a model's state_dict": (lambda state: state["model"], f"{NOT_RAYDIFFS} (no 'config', 'ema', 'step')"),
    "a list": (lambda state: [1, 2], f"{NOT_RAYDIFFS} (it holds a list, not a dict with 'config', 'ema', 'step')"),
    "a config of no sections": (lambda state: {**state, "config": {"model": 16}},
                                f"{NOT_RAYDIFFS} (its 'config' is not a mapping of sections)"),
    "an EMA of ints": (lambda state: {**state, "ema": {k: 1 for k in state["ema"]}},
                       f"{NOT_RAYDIFFS} (its 'ema' is not a mapping of names to tensors)"),
    "an EMA of lists": (lambda state: {**state, "ema": {k: [1, 2] for k in state["ema"]}},
                        f"{NOT_RAYDIFFS} (its 'ema' is not a mapping of names to tensors)"),
    "an EMA named by numbers": (lambda state: {**state, "ema": dict(enumerate(state["ema"].values()))},
                                f"{NOT_RAYDIFFS} (its 'ema' is not a mapping of names to tensors)"),
    "online weights of ints": (lambda state: {**state, "model": {k: 0 for k in state["model"]}},
                               f"{NOT_RAYDIFFS} (its 'model' is not a mapping of names to tensors)"),
    "a step that is a word": (lambda state: {**state, "step": "20"}, f"{NOT_RAYDIFFS} (its 'step' is not an int >= 0)"),
    "a step of null": (lambda state: {**state, "step": None}, f"{NOT_RAYDIFFS} (its 'step' is not an int >= 0)"),
    "classes that are a list": (lambda state: {**state, "classes": ["a", "b"]},
                                f"{NOT_RAYDIFFS} (its 'classes' is not a mapping of 'names' and 'counts' lists)"),
}


@pytest.mark.parametrize("foreign", list(FOREIGN_STATES))
def test_a_torch_file_raydiff_did_not_write_is_named_and_passed_over_as_a_damaged_one(tmp_path, capsys, foreign):
    """torch loads these with its safe loader; every command then met a KeyError's or TypeError's traceback
    (state["config"]) where a damaged checkpoint gets one line or an older checkpoint; entries of other kinds (an
    EMA of ints, a step that is a word) met one in load_state_dict, export's model card or --class."""
    objects = _objects(0)
    _write(tmp_path, 10, objects)
    folder = _write(tmp_path, 20, objects)
    change, reason = FOREIGN_STATES[foreign]
    torch.save(change(read_state(folder)), folder / "state.pt")

    assert restore_newest(checkpoint_candidates(tmp_path), _objects(1)).checkpoint.name == checkpoint_name(10)
    found, state = read_newest(tmp_path)  # sample, evaluate, export, --guide, model.init_from
    assert found.name == checkpoint_name(10) and state["step"] == 10
    assert f"checkpoint {folder} cannot be read ({reason}); using {checkpoint_name(10)}" in capsys.readouterr().err
    with pytest.raises(Unresumable, match=re.escape(f"{checkpoint_name(20)} ({reason})")):
        restore_newest([RunDir(folder)], _objects(1))
    with pytest.raises(FileNotFoundError) as unread:
        read_newest(folder)
    assert str(unread.value) == f"{folder}: no checkpoint can be read: {checkpoint_name(20)} ({reason})"


MISFITS = {  # weights of a dict of tensors that the config's model does not have: (the EMA, the reason given)
    "other names": (lambda ema: {f"net.{k}": v for k, v in ema.items()},
                    lambda ema: f"no 'temb.0.weight' and {len(ema) - 1} more"),
    "another shape": (lambda ema: {**ema, "conv_in.weight": torch.zeros(3)},
                      lambda ema: f"'conv_in.weight' of shape [3], where the model's is "
                                  f"{list(ema['conv_in.weight'].shape)}"),
    "one weight too many": (lambda ema: {**ema, "extra.weight": torch.zeros(3)},
                            lambda ema: "'extra.weight', which the model lacks"),
}


@pytest.mark.parametrize("misfit", list(MISFITS))
def test_a_checkpoint_whose_ema_does_not_fit_its_own_model_is_named_and_passed_over(tmp_path, capsys, misfit):
    """Tensors under names or of shapes the config's model lacks: sample, evaluate and export met
    load_state_dict's traceback (export: a ValueError's), where a damaged checkpoint gets one line or an older
    one."""
    objects = _objects(0)
    _write(tmp_path, 10, objects)
    folder = _write(tmp_path, 20, objects)
    state = read_state(folder)
    change, problem = MISFITS[misfit]
    torch.save({**state, "ema": change(state["ema"])}, folder / "state.pt")
    reason = f"its 'ema' does not fit the model its config describes ({problem(state['ema'])})"

    found, state = read_newest(tmp_path)
    assert found.name == checkpoint_name(10) and state["step"] == 10
    assert f"checkpoint {folder} cannot be read ({reason}); using {checkpoint_name(10)}" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError) as unread:
        read_newest(folder)
    assert str(unread.value) == f"{folder}: no checkpoint can be read: {checkpoint_name(20)} ({reason})"


def _refuse_ray(monkeypatch) -> None:
    """raydiff.evaluate is to stop before it starts Ray (these tests are not marked `ray`)."""
    import raydiff.cluster.start

    def init_ray() -> None:
        raise AssertionError("raydiff.evaluate started Ray for a checkpoint it cannot use")

    monkeypatch.setattr(raydiff.cluster.start, "init_ray", init_ray)


@pytest.mark.parametrize("command", ["sample", "export", "evaluate"])
def test_every_command_names_the_checkpoint_whose_config_this_raydiff_cannot_read(tmp_path, capsys, monkeypatch,
                                                                                   command):
    """A key a newer raydiff wrote: the commands said "unknown key 'model.wings'" and not whose (model.init_from
    named it). The newest checkpoint is refused, not passed over for an older one: it is not damaged, and the older
    one is not what was asked for."""
    import importlib

    from conftest import write_checkpoint

    from raydiff import cli
    from raydiff.config import load_config

    run = tmp_path / "run"
    cfg = load_config("smoke", ["diffusion.timesteps=50"], check_source=False)
    write_checkpoint(run, cfg, step=10)
    newest = write_checkpoint(run, cfg, step=20)
    state = read_state(newest)
    state["config"]["model"]["wings"] = 2
    write_state(newest, state)
    _refuse_ray(monkeypatch)
    out = tmp_path / ("grid.png" if command == "sample" else "out")
    args = ["--checkpoint", str(run), *(["--out", str(out)] if command != "evaluate" else ["--num", "2"])]
    assert cli.run(importlib.import_module(f"raydiff.{command}").main, args) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        f"raydiff: config error: --checkpoint {run}: the config in {newest} cannot be read (unknown key 'model.wings'")
    assert not out.exists() and not (run / "eval").exists()


@pytest.mark.parametrize("command", ["sample", "export", "evaluate"])
def test_every_command_refuses_a_checkpoint_whose_ema_holds_no_tensors_in_one_line(tmp_path, capsys, monkeypatch,
                                                                                    command):
    """An EMA of ints: sample met load_state_dict's traceback, export an AttributeError's ('float')."""
    import importlib

    from conftest import write_checkpoint

    from raydiff import cli
    from raydiff.config import load_config

    run = tmp_path / "run"
    folder = write_checkpoint(run, load_config("smoke", ["diffusion.timesteps=50"], check_source=False))
    state = read_state(folder)
    torch.save({**state, "ema": {k: 1 for k in state["ema"]}}, folder / "state.pt")
    _refuse_ray(monkeypatch)
    out = tmp_path / ("grid.png" if command == "sample" else "out")
    args = ["--checkpoint", str(run), *(["--out", str(out)] if command != "evaluate" else ["--num", "2"])]
    assert cli.run(importlib.import_module(f"raydiff.{command}").main, args) == 2
    assert capsys.readouterr().err == (f"raydiff: error: {run}: no checkpoint can be read: {folder.name} (not a "
                                       f"raydiff checkpoint (its 'ema' is not a mapping of names to tensors))\n")
    assert not out.exists() and not (run / "eval").exists()


def test_export_of_a_checkpoint_raydiff_did_not_write_stops_in_one_line_and_writes_nothing(tmp_path, capsys):
    from raydiff import cli, export

    objects = _objects(0)
    folder = _write(tmp_path / "run", 10, objects)
    torch.save(objects[0].state_dict(), folder / "state.pt")
    code = cli.run(export.main, ["--checkpoint", str(folder), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"raydiff: error: {folder}: no checkpoint can be read: {checkpoint_name(10)} (not a "
                                 f"raydiff checkpoint (no 'config', 'ema', 'step'))\n")
    assert not (tmp_path / "out").exists()


def test_the_check_before_a_restore_copies_no_weights_averages_or_moments(tmp_path):
    """All or nothing costs no memory: the parts are tried on twins that hold none (real copies of the model, the
    EMA and the optimizer were several model sizes of GPU memory at every start)."""
    saved, fresh = _objects(0), _objects(1)
    for model, optimizer in ((saved[0], saved[2]), (fresh[0], fresh[2])):  # moments to restore
        sum(p.sum() for p in model.parameters()).backward()
        optimizer.step()
    state = read_state(_write(tmp_path, 10, saved))
    model_bytes = sum(p.numel() * p.element_size() for p in fresh[0].parameters())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
        restore(state, fresh)
    allocated = sum(e.cpu_memory_usage for e in profile.events() if e.name == "[memory]" and e.cpu_memory_usage > 0)
    assert allocated < model_bytes / 4
    for part, objects in ((0, fresh[0]), (1, fresh[1])):
        assert all(torch.equal(a, b) for a, b in zip(saved[part].state_dict().values(),
                                                     objects.state_dict().values(), strict=True))
    assert torch.equal(fresh[2].state_dict()["state"][0]["exp_avg"], saved[2].state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("misfit", ["optimizer group", "sparse weights"])
def test_a_checkpoint_whose_parts_misfit_on_the_twins_is_refused_changing_nothing(tmp_path, misfit):
    """What the copies refused, the memoryless twins refuse: an optimizer group of another size, and weights that
    are not dense (no file raydiff writes: a copy into meta tensors alone would take them)."""
    saved = _objects(0)
    sum(p.sum() for p in saved[0].parameters()).backward()
    saved[2].step()
    state = read_state(_write(tmp_path, 10, saved))
    if misfit == "optimizer group":
        state["optimizer"]["param_groups"][0]["params"].pop()  # one parameter fewer than this optimizer's group
    else:
        name = next(iter(state["ema"]))
        state["ema"][name] = state["ema"][name].to_sparse()
    fresh = _objects(1)
    before = {k: v.clone() for k, v in fresh[0].state_dict().items()}
    with pytest.raises((ValueError, RuntimeError), match="doesn't match the size of optimizer's group|sparse_coo"):
        restore(state, fresh)
    assert all(torch.equal(before[k], v) for k, v in fresh[0].state_dict().items()) and not fresh[2].state
