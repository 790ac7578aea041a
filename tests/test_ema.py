"""python -m raydiff.ema: a run's EMA rebuilt at any width from its post-hoc snapshots, as checkpoint folders that
raydiff.sample and raydiff.export take; and the refusals. The run is written here as training writes it (the
tracked averages, their snapshots, a checkpoint), without Ray; training's own snapshots are held to exact resume
in tests/runs/test_fault_tolerance.py."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli, write_posthoc_run

from raydiff import cli
from raydiff import ema as ema_command
from raydiff.runs.checkpoint import read_state
from raydiff.runs.ema_snapshots import list_snapshots
from raydiff.storage.rundir import RunDir

STEPS = 60  # write_posthoc_run: a snapshot every 10 steps


@pytest.fixture(scope="module")
def posthoc_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("posthoc") / "run"
    return run_dir, *write_posthoc_run(run_dir)


def relative_error(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-12))
               for k in b if b[k].is_floating_point())


def test_the_tracked_widths_come_back_exactly_and_others_close_to_tracking_them(posthoc_run, tmp_path, capsys):
    run_dir, _, tracker, between = posthoc_run
    out = tmp_path / "rebuilt"
    assert cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.05,0.1,0.07",
                                      "--out", str(out)]) == 0
    assert "sigma_rel 0.07 at step 60 (from 6 snapshots)" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["sigma_rel-0.050", "sigma_rel-0.070", "sigma_rel-0.100"]
    for sigma_rel, profile in zip((0.05, 0.1), tracker.profiles, strict=True):
        assert relative_error(read_state(out / f"sigma_rel-{sigma_rel:.3f}")["ema"], profile.state_dict()) < 1e-3
    rebuilt = read_state(out / "sigma_rel-0.070")
    assert rebuilt["step"] == STEPS and rebuilt["posthoc"]["sigma_rel"] == 0.07 and "model" not in rebuilt
    narrow, wide = (p.state_dict() for p in tracker.profiles)
    spread = relative_error(narrow, wide)
    assert relative_error(rebuilt["ema"], between.profiles[0].state_dict()) < 0.1 * spread


def test_an_earlier_snapshot_step_is_rebuilt_from_the_snapshots_up_to_it(posthoc_run, tmp_path, capsys):
    run_dir = posthoc_run[0]
    assert list_snapshots(RunDir(run_dir)) == [10, 20, 30, 40, 50, 60]
    assert cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.05", "--step", "30",
                                      "--out", str(tmp_path)]) == 0
    assert "sigma_rel 0.05 at step 30 (from 3 snapshots)" in capsys.readouterr().out
    snapshot = torch.load(run_dir / "ema_snapshots" / "step_00000030.pt", weights_only=True)
    assert relative_error(read_state(tmp_path / "sigma_rel-0.050")["ema"], snapshot["profiles"][0]) < 1e-3


def test_sample_and_export_take_a_rebuilt_average(posthoc_run, tmp_path):
    run_dir = posthoc_run[0]
    assert cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.08", "--out",
                                      str(tmp_path / "rebuilt")]) == 0
    folder = tmp_path / "rebuilt" / "sigma_rel-0.080"
    proc = run_cli("raydiff.sample", "--checkpoint", str(folder), "--num", "4", "--steps", "5",
                   "--out", str(tmp_path / "s.png"))
    assert proc.returncode == 0 and "post-hoc EMA sigma_rel 0.08 weights" in proc.stdout, proc.stderr
    proc = run_cli("raydiff.export", "--checkpoint", str(folder), "--out", str(tmp_path / "pipeline"))
    assert proc.returncode == 0, proc.stderr
    assert "| weights | post-hoc EMA (EDM2), sigma_rel 0.08, rebuilt from 6 snapshots |" in (
        tmp_path / "pipeline" / "README.md").read_text()
    # The weights are as readable as the rest of the folder (safetensors wrote them for their owner alone).
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "pipeline").rglob("*")
             if p.is_file()}
    assert len(set(modes.values())) == 1 and "pipeline/unet/diffusion_pytorch_model.safetensors" in modes, modes
    proc = run_cli("raydiff.sample", "--checkpoint", str(tmp_path / "pipeline"), "--num", "4", "--steps", "5",
                   "--out", str(tmp_path / "e.png"))
    assert proc.returncode == 0 and "post-hoc EMA sigma_rel 0.08 weights" in proc.stdout, proc.stderr
    proc = run_cli("raydiff.sample", "--checkpoint", str(folder), "--no-ema", "--out", str(tmp_path / "n.png"))
    assert proc.returncode == 2 and "holds no online weights" in proc.stderr
    assert not (tmp_path / "n.png").exists()


@pytest.mark.parametrize("args, fragment", [
    (["--sigma-rel", "0.3"], "--sigma-rel = '0.3': must be comma-separated different numbers in [0.0001, 0.28)"),
    (["--sigma-rel", "0.05,0.05"], "must be comma-separated different numbers"),
    (["--sigma-rel", "1e-200"], "--sigma-rel = '1e-200': must be comma-separated different numbers in [0.0001, 0.28)"),
    (["--sigma-rel", "wide"], "--sigma-rel = 'wide'"),
    (["--sigma-rel", "0.05", "--step", "35"], "--step 35: no snapshot of"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(posthoc_run, tmp_path, args, fragment, capsys):
    out = tmp_path / "out"
    assert cli.run(ema_command.main, ["--checkpoint", str(posthoc_run[0]), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_run_without_snapshots_and_a_taken_folder_are_refused(posthoc_run, tmp_path, capsys):
    (tmp_path / "classic").mkdir()
    assert cli.run(ema_command.main, ["--checkpoint", str(tmp_path / "classic"), "--sigma-rel", "0.05",
                                      "--out", str(tmp_path / "out")]) == 2
    assert "no post-hoc EMA snapshots (ema_snapshots/); train with --set train.ema=posthoc" in capsys.readouterr().err
    (tmp_path / "taken" / "sigma_rel-0.050").mkdir(parents=True)
    assert cli.run(ema_command.main, ["--checkpoint", str(posthoc_run[0]), "--sigma-rel", "0.05,0.1",
                                      "--out", str(tmp_path / "taken")]) == 2
    assert "sigma_rel-0.050 exists already" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["sigma_rel-0.050"]


def test_a_run_path_that_does_not_exist_is_named_as_such_not_as_a_run_to_train_again(tmp_path, monkeypatch, capsys):
    # A typo was told "no post-hoc EMA snapshots ...; train with --set train.ema=posthoc".
    monkeypatch.chdir(tmp_path)
    assert cli.run(ema_command.main, ["--checkpoint", "nope", "--sigma-rel", "0.07", "--out", "em3"]) == 2
    assert capsys.readouterr().err == f"raydiff: error: {tmp_path.resolve() / 'nope'}: no such run folder\n"
    assert list(tmp_path.iterdir()) == []


def test_a_rebuild_holds_one_snapshot_at_a_time_and_gives_what_combining_them_all_gives(posthoc_run, monkeypatch):
    """The rebuild held every snapshot's averages until it combined them: a long run's hundreds of snapshots of
    hundreds of MB each. Now none is alive when the next is read, and the result is the same to the bit."""
    import weakref

    from raydiff.model.weight_averages import solve_coefficients
    from raydiff.runs import ema_snapshots

    run_dir = posthoc_run[0]
    read = ema_snapshots.read_snapshot
    loaded: list[list[weakref.ref]] = []  # per snapshot read: its tensors
    alive_at_each_read: list[int] = []

    def read_counted(run, step, where=None):
        alive_at_each_read.append(sum(any(t() is not None for t in tensors) for tensors in loaded))
        snapshot = read(run, step, where=where)
        loaded.append([weakref.ref(t) for profile in snapshot["profiles"] for t in profile.values()])
        return snapshot

    monkeypatch.setattr(ema_snapshots, "read_snapshot", read_counted)
    rebuilt = ema_snapshots.rebuild(RunDir(run_dir), [0.05, 0.07], step=50)
    assert max(alive_at_each_read) == 0
    assert len(alive_at_each_read) == 6  # the snapshot at step 50 for the widths it tracked, then steps 10 to 50
    monkeypatch.undo()
    snapshots = [torch.load(run_dir / "ema_snapshots" / f"step_{s:08d}.pt", weights_only=True)
                 for s in (10, 20, 30, 40, 50)]
    inputs = [(s["step"], sigma, profile) for s in snapshots
              for sigma, profile in zip(s["sigma_rels"], s["profiles"], strict=True)]
    coefficients = solve_coefficients([i[0] for i in inputs], [i[1] for i in inputs], 50, [0.05, 0.07])
    for j, average in enumerate(rebuilt):  # every snapshot at once, summed in float64 as the rebuild always did
        assert average.state["step"] == 50 and average.state["posthoc"]["snapshots"] == len(snapshots) == 5
        assert average.state["posthoc"]["profiles"] == len(inputs) == 10
        assert list(average.state["ema"]) == list(inputs[-1][2])
        for name, last in inputs[-1][2].items():
            total = torch.zeros(last.shape, dtype=torch.float64)
            for i, (_, _, profile) in enumerate(inputs):
                total += float(coefficients[i, j]) * profile[name].double()
            assert torch.equal(average.state["ema"][name], total.to(last.dtype)), name


def test_widths_that_share_a_folder_are_refused_before_anything_is_written(posthoc_run, tmp_path, capsys):
    # Both were sigma_rel-0.070: the first was written, then the second failed on the folder it had just made.
    out = tmp_path / "out"
    assert cli.run(ema_command.main, ["--checkpoint", str(posthoc_run[0]), "--sigma-rel", "0.05,0.0701,0.0704",
                                      "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == ("raydiff: config error: --sigma-rel = '0.05,0.0701,0.0704': 0.0701 and 0.0704 would both be "
                   "written to sigma_rel-0.070; give widths that differ in their first 3 decimals (3 significant "
                   "digits below 0.001)\n")
    assert not out.exists()


def rebuilt_with_one_snapshot_changed(posthoc_run, tmp_path, step: int, change) -> tuple[int, object]:
    """`raydiff.ema` at width 0.07 on a copy of the run's snapshots whose snapshot at `step` is `change(snapshot)`:
    (its exit status, the copy's folder)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(posthoc_run[0] / "ema_snapshots", run_dir / "ema_snapshots")
    path = run_dir / "ema_snapshots" / f"step_{step:08d}.pt"
    torch.save(change(torch.load(path, weights_only=True)), path)
    return cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.07",
                                      "--out", str(tmp_path / "out")]), run_dir


def test_a_snapshot_of_other_widths_is_refused_in_one_line(posthoc_run, tmp_path, capsys):
    # The coefficients are solved before the snapshots are read, for the widths the newest one tracks.
    code, run_dir = rebuilt_with_one_snapshot_changed(
        posthoc_run, tmp_path, 20, lambda snapshot: {**snapshot, "sigma_rels": [0.05],
                                                     "profiles": snapshot["profiles"][:1]})
    assert code == 2
    err = capsys.readouterr().err
    assert err == (f"raydiff: config error: {run_dir}: ema_snapshots/step_00000020.pt tracks sigma_rel [0.05], "
                   f"ema_snapshots/step_00000060.pt [0.05, 0.1]: snapshots of different widths cannot be combined\n")
    assert not (tmp_path / "out").exists()


def test_a_snapshot_of_another_model_is_refused_in_one_line(posthoc_run, tmp_path, capsys):
    # Its tensors were added in, broadcast where they could be (silently wrong weights), a traceback where not.
    def narrowed(snapshot):
        return {**snapshot, "profiles": [{name: value[..., :1] if value.dim() else value
                                          for name, value in profile.items()} for profile in snapshot["profiles"]]}
    code, run_dir = rebuilt_with_one_snapshot_changed(posthoc_run, tmp_path, 40, narrowed)
    assert code == 2
    assert capsys.readouterr().err == (
        f"raydiff: config error: {run_dir}: ema_snapshots/step_00000040.pt holds weights of other names or shapes "
        f"than ema_snapshots/step_00000010.pt: snapshots of different models cannot be combined\n")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_folder_of_a_posthoc_run_is_answered_with_its_run_folder(posthoc_run, tmp_path, capsys):
    # It was told to train again with train.ema=posthoc: the snapshots are the run's, beside its checkpoints.
    checkpoint = posthoc_run[0] / "checkpoint_00000060"
    assert cli.run(ema_command.main, ["--checkpoint", str(checkpoint), "--sigma-rel", "0.07",
                                      "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"raydiff: error: {checkpoint}: a checkpoint folder; the post-hoc EMA's snapshots are its run's: give the run "
        f"folder, {posthoc_run[0]} (and --step for this checkpoint's step)\n")
    assert not (tmp_path / "out").exists()


def test_widths_below_a_thousandth_are_written_to_folders_of_their_own(posthoc_run, tmp_path, capsys):
    # 3 decimals wrote both to sigma_rel-0.000, and refused the second.
    assert cli.run(ema_command.main, ["--checkpoint", str(posthoc_run[0]), "--sigma-rel", "0.0001,0.0002",
                                      "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sigma_rel-0.0001", "sigma_rel-0.0002"]
    assert "(from 6 snapshots)" in capsys.readouterr().out

    # A rebuilt average given back as the run was told it was a checkpoint folder of the run {tmp_path}.
    rebuilt = tmp_path / "sigma_rel-0.0001"
    assert cli.run(ema_command.main, ["--checkpoint", str(rebuilt), "--sigma-rel", "0.07",
                                      "--out", str(tmp_path / "again")]) == 2
    assert capsys.readouterr().err == (
        f"raydiff: error: {rebuilt}: an average raydiff.ema rebuilt; the post-hoc EMA's snapshots are its run's: "
        f"give the run folder it was rebuilt from\n")


def test_a_post_hoc_run_before_its_first_snapshot_is_told_when_one_comes_not_to_train_with_post_hoc(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("train: {ema: posthoc, ema_snapshot_every: 100}\n")
    assert cli.run(ema_command.main, ["--checkpoint", str(run), "--sigma-rel", "0.07",
                                      "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        f"raydiff: error: {run}: no post-hoc EMA snapshot yet (ema_snapshots/): the run writes one every "
        f"train.ema_snapshot_every steps and at its end\n")


def test_a_damaged_snapshot_is_named_in_one_line_without_torchs_advice(posthoc_run, tmp_path, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(posthoc_run[0] / "ema_snapshots", run_dir / "ema_snapshots")
    path = run_dir / "ema_snapshots" / "step_00000030.pt"
    path.write_bytes(path.read_bytes()[:1000])  # cut short
    assert cli.run(ema_command.main, ["--checkpoint", str(run_dir), "--sigma-rel", "0.07",
                                      "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"raydiff: config error: {run_dir}/ema_snapshots/step_00000030.pt: not a readable "
                          f"snapshot (truncated, empty, or not a torch file") and err.count("\n") == 1, err
    assert "weights_only" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("out", ["", " "])
def test_an_empty_out_is_refused_and_nothing_is_written_in_the_current_folder(posthoc_run, tmp_path, monkeypatch,
                                                                              capsys, out):
    # Path("") is "." (an unset shell variable): sigma_rel-0.050/ appeared in the current folder.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as caught:
        ema_command.main(["--checkpoint", str(posthoc_run[0]), "--sigma-rel", "0.05", "--out", out])
    assert caught.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: --out {out!r}: must name a local folder (an empty value "
                                       f"would mean the current folder) (python -m raydiff.ema --help)\n")
    assert list(tmp_path.iterdir()) == []
