"""What every command's entry point does with an error: a user's mistake is one line and exit 2, an interrupt
the signal's exit code, and anything else a traceback (a bug should be seen); a mistake found before torch and
Ray are needed is answered without importing them."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from raydiff import cli
from raydiff.config import ConfigError
from raydiff.storage.errors import StorageFailure
from raydiff.training.interrupts import SAME_SIGTERM_S, Interrupted, interrupt_on_signals


def failing(exc: BaseException):
    def main(argv):
        raise exc
    return main


@pytest.mark.parametrize("exc, line", [
    (ConfigError("train.lr = -1: must be > 0"), "raydiff: config error: train.lr = -1: must be > 0"),
    (FileNotFoundError("runs/x: no such run or checkpoint folder"),
     "raydiff: error: runs/x: no such run or checkpoint folder"),
    (StorageFailure("no space left on /mnt/runs"), "raydiff: error: no space left on /mnt/runs"),
])
def test_a_user_error_is_one_line_and_exit_2(exc, line, capsys):
    assert cli.run(failing(exc), []) == 2
    assert capsys.readouterr().err == line + "\n"


def test_an_interrupt_exits_with_its_signal_and_says_nothing_was_trained(capsys):
    assert cli.run(failing(Interrupted("SIGTERM")), []) == 128 + 15
    assert "stopped by SIGTERM before training began; nothing was trained" in capsys.readouterr().err
    assert cli.run(failing(KeyboardInterrupt()), []) == 130


def test_sigterm_stops_any_command_in_one_line_even_where_ray_re_raises_it_as_ctrl_c(capsys):
    """SIGTERM raises Interrupted; inside ray.get Ray catches it (a KeyboardInterrupt) and raises a plain
    KeyboardInterrupt in its place: the command still names the signal and exits 143."""
    def waiting_in_ray_get(argv):
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(5)  # never reached
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None  # what ray.get raises in its place
        return 0

    assert cli.run(waiting_in_ray_get, []) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "raydiff: stopped by SIGTERM\n"
    assert cli.run(failing(KeyboardInterrupt()), []) == 130  # a later Ctrl-C is one again
    assert capsys.readouterr().err == "raydiff: interrupted\n"


def test_timeouts_second_sigterm_breaks_into_no_cleanup(capsys):
    """`timeout` sends SIGTERM to the command, then to its process group, which holds the command too: the second
    one, arriving while the first one's cleanups run, is the same request. A SIGTERM a second or more later stops
    the cleanups too, as a second Ctrl-C does."""
    cleaned = []

    def preparing(argv):
        with interrupt_on_signals():
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                signal.raise_signal(signal.SIGTERM)  # the second, as what was half written is removed
                cleaned.append("half-written output")
        return 0

    assert cli.run(preparing, []) == 128 + signal.SIGTERM
    assert cleaned == ["half-written output"]
    assert capsys.readouterr().err.endswith("raydiff: stopped by SIGTERM before training began; nothing was trained "
                                            "(the same command starts again)\n")

    def insisting(argv):
        with interrupt_on_signals():
            try:
                signal.raise_signal(signal.SIGTERM)
            finally:
                time.sleep(SAME_SIGTERM_S)
                signal.raise_signal(signal.SIGTERM)
                cleaned.append("never")
        return 0

    assert cli.run(insisting, []) == 128 + signal.SIGTERM
    assert cleaned == ["half-written output"]


def test_a_signal_after_training_ended_does_not_say_that_nothing_was_trained(capsys):
    """The driver's records after training (summary.json, a dashboard's close, which may take seconds) run inside
    its before-training handler: a Ctrl-C there said "before training began; nothing was trained" of a run that
    had trained to its end."""
    def finishing(argv):
        with interrupt_on_signals() as stage:  # the driver's, from before training to the lease's release
            stage.before_training, stage.note = False, "training had ended (the same command goes on from its last " \
                                                       "checkpoint)"
            signal.raise_signal(signal.SIGINT)  # while the dashboards close, or the lease is let go
        return 0

    assert cli.run(finishing, []) == 128 + signal.SIGINT
    assert capsys.readouterr().err == ("raydiff: stopped by SIGINT; training had ended (the same command goes on "
                                       "from its last checkpoint)\n")


def test_a_bug_is_not_hidden_behind_a_one_line_error():
    with pytest.raises(ZeroDivisionError):
        cli.run(failing(ZeroDivisionError("a bug")), [])
    with pytest.raises(PermissionError):  # may be a bug (a signal to a process not ours): shown whole
        cli.run(failing(PermissionError(errno.EPERM, "Operation not permitted")), [])
    with pytest.raises(OSError):
        cli.run(failing(OSError(errno.EIO, "Input/output error")), [])


@pytest.mark.parametrize("exc, line", [
    (OSError(errno.ENOSPC, "No space left on device"),
     "raydiff: error: no space left on device; make room there, then run the same command again"),
    (OSError(errno.EROFS, "Read-only file system", "/mnt/ro/x.png"),
     "raydiff: error: read-only file system (/mnt/ro/x.png); make it writable, then run the same command again"),
    (OSError(errno.EFBIG, "File too large", "/data/big.parquet"),
     "raydiff: error: file too large (/data/big.parquet); raise the file-size limit, then run the same command again"),
    (OSError(errno.EDQUOT, "Disk quota exceeded", "/home/me/.cache/raydiff/digits"),
     "raydiff: error: disk quota exceeded (/home/me/.cache/raydiff/digits); make room there, then run the same "
     "command again"),
])
def test_a_full_or_read_only_disk_met_anywhere_is_one_line_not_a_traceback(exc, line, capsys):
    assert cli.run(failing(exc), []) == 2
    assert capsys.readouterr().err == line + "\n"


def test_a_command_s_own_exit_status_passes_through():
    assert cli.run(lambda argv: 0, []) == 0
    assert cli.run(lambda argv: 3, []) == 3


@pytest.mark.parametrize("command, args, line", [
    ("raydiff.train", ["--set", "train.lr=x"], "raydiff: config error: train.lr = 'x': expected a finite number"),
    ("raydiff.train", ["--set", "debug.nan_at_steps=5,*"],  # was a YAML traceback
     "raydiff: config error: debug.nan_at_steps = '5,*': expected list of integer"),
    ("raydiff.tune", ["--batch", "16", "--lr", "1e-5:inf"], "raydiff: config error: --lr '1e-5:inf': expected finite"),
    ("raydiff.lr_find", ["--end", "inf"], "--end inf: must be a finite learning rate"),
    ("raydiff.tune", ["--batch", "16", "--lr", "1e-3", "--set", "train.nope=1"],
     "raydiff: config error: unknown key 'train.nope'"),
    ("raydiff.bench", ["throughput", "--steps", "1"], "--steps 1: must be >= 2"),
    ("raydiff.sample", ["--checkpoint", "run", "--out", "a.png", "--steps", "0"], "--steps 0: must be in [1, 100,000]"),
    ("raydiff.sample", ["--checkpoint", "run", "--out", "a.png", "--sampler", "euler"],
     "argument --sampler: invalid choice: 'euler'"),
    ("raydiff.evaluate", ["--checkpoint", "run", "--sigma-rel", "0.5"], "--sigma-rel = '0.5': must be"),
    ("raydiff.evaluate", ["--checkpoint", "run", "--guidance", "-1"], "--guidance = '-1': must be"),
    ("raydiff.export", ["--checkpoint", "run", "--out", "pipe", "--guidance", "2"], "only with --guide"),
    ("raydiff.ema", ["--checkpoint", "run", "--out", "averages", "--sigma-rel", "0.3"], "--sigma-rel = '0.3'"),
    ("raydiff.lr_find", ["--steps", "5"], "--steps 5: must be in [10, 100,000]"),
    ("raydiff.prepare", ["images", "prepared", "--resolution", "4"], "--resolution 4: must be between 8 and 1024"),
])
def test_a_mistake_found_before_training_imports_neither_torch_nor_ray(command, args, line):
    """Each takes seconds to import: a bad --set or argument is answered in a fraction of that."""
    proc, error, imported = _run_module(command, args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert line in error and imported == "[]"


def _run_module(command: str, args: list[str], cwd=None) -> tuple[subprocess.CompletedProcess, str, str]:
    """`python -m command args` in a fresh process: (the process, its last line of stderr before the list of torch
    and Ray where it imported them, that list)."""
    check = (f"import runpy, sys; sys.argv = [{command!r}, *{args!r}]\n"
             f"try:\n    runpy.run_module({command!r}, run_name='__main__')\n"
             "finally:\n    print(sorted({'torch', 'ray'} & set(sys.modules)), file=sys.stderr)")
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120, cwd=cwd)
    *_, error, imported = ["", "", *proc.stderr.strip().splitlines()]
    return proc, error, imported


@pytest.mark.parametrize("command, args, out, allowed", [
    ("raydiff.sample", ["--checkpoint", "run", "--out", ""], "--out ''",
     "a grid image (.png, .jpg, .jpeg, .webp) or a folder"),
    ("raydiff.export", ["--checkpoint", "run", "--out", ""], "--out ''", "a new or empty folder"),
    ("raydiff.export", ["--checkpoint", "run", "--out", " "], "--out ' '", "a new or empty folder"),
    ("raydiff.ema", ["--checkpoint", "run", "--out", "", "--sigma-rel", "0.1"], "--out ''", "a local folder"),
    ("raydiff.prepare", ["images", "", "--resolution", "8"], "OUT = ''",
     "a new or empty folder, or an s3:// / gs:// URI"),
    ("raydiff.datasets", ["synthetic", "", "--num", "1"], "OUT = ''", "a new or empty folder"),
    # An empty --checkpoint read the current folder as the run.
    *[(command, ["--checkpoint", "", *more], "--checkpoint ''", "a run directory or checkpoint")
      for command, more in (("raydiff.sample", ["--out", "x"]), ("raydiff.evaluate", []),
                            ("raydiff.export", ["--out", "x"]), ("raydiff.ema", ["--out", "x", "--sigma-rel", "0.1"]))],
    # An empty --guide read the current folder as the guiding model.
    *[(command, ["--checkpoint", "run", "--guide", "", *more], "--guide ''", "a run directory or checkpoint")
      for command, more in (("raydiff.sample", ["--out", "x"]), ("raydiff.evaluate", []),
                            ("raydiff.export", ["--out", "x"]))],
])
def test_an_empty_out_is_one_line_in_every_command_that_writes_one_and_the_current_folder_is_left_alone(
        command, args, out, allowed, tmp_path):
    """An unset shell variable: Path("") is the current folder, which sample wrote into (and pruned the samples
    there), export, ema and datasets wrote into; every command answers it in the same words, before torch or Ray."""
    prog = f"python -m {command}" + (" synthetic" if command == "raydiff.datasets" else "")
    proc, error, imported = _run_module(command, args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error == (f"raydiff: error: {out}: must name {allowed} (an empty value would mean the current folder) "
                     f"({prog} --help)")
    assert proc.stderr.count("\n") == 2  # the error, and the list of imports the check prints
    assert imported == "[]" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, args", [
    ("raydiff.sample", ["--checkpoint", "run", "--out", "s3://bucket/grid.png"]),
    ("raydiff.export", ["--checkpoint", "run", "--out", "gs://bucket/pipeline"]),
    ("raydiff.ema", ["--checkpoint", "run", "--out", "s3://bucket/averages", "--sigma-rel", "0.1"]),
    ("raydiff.lr_find", ["--out", "s3://bucket/lr_find.png"]),
])
def test_a_bucket_as_an_output_only_written_locally_is_one_line_not_a_local_folder_named_s3(command, args, tmp_path):
    """Path() reads s3://bucket/x as the local folders s3:/bucket/x: the output went there, exit 0."""
    proc, error, imported = _run_module(command, args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert error.startswith(f"raydiff: error: --out {args[args.index('--out') + 1]!r}: must be a local path "
                            f"(write it here, then copy it to the bucket")
    assert imported == "[]" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, args, wanted", [
    ("sample", ["--out", "grid.png"], "a run folder or a checkpoint folder"),
    ("export", ["--out", "pipeline"], "a run folder or a checkpoint folder"),
    ("evaluate", [], "a run folder or a checkpoint folder"),
    ("ema", ["--out", "averages", "--sigma-rel", "0.1"], "the run folder"),  # its snapshots are the run's
])
def test_a_checkpoint_that_is_a_file_or_out_of_reach_is_one_line_in_every_command_that_reads_one(
        command, args, wanted, tmp_path, monkeypatch, capsys):
    """--checkpoint naming a file (state.pt itself, a typo) or a bucket behind an endpoint that does not answer was
    a traceback (pyarrow's NotADirectoryError, its OSError after its retries) in the commands that read a run; an
    object store URI without a bucket is one line too."""
    import importlib

    from conftest import free_port

    main = importlib.import_module(f"raydiff.{command}").main
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoint_00000010").mkdir()
    (tmp_path / "checkpoint_00000010" / "state.pt").write_bytes(b"")
    assert cli.run(main, ["--checkpoint", "checkpoint_00000010/state.pt", *args]) == 2
    state = tmp_path / "checkpoint_00000010" / "state.pt"
    hint = "the run folder" if command == "ema" else f"the checkpoint folder that holds it, {state.parent}"
    assert capsys.readouterr().err == (f"raydiff: error: --checkpoint checkpoint_00000010/state.pt: {state} is a "
                                       f"file; give {hint}\n")
    (tmp_path / "notes.txt").write_text("")
    assert cli.run(main, ["--checkpoint", "notes.txt", *args]) == 2
    assert capsys.readouterr().err == (f"raydiff: error: --checkpoint notes.txt: {tmp_path / 'notes.txt'} is a file; "
                                       f"give {wanted}\n")

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert cli.run(main, ["--checkpoint", "s3://runs/cifar", "--endpoint", endpoint, *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("raydiff: error: --checkpoint s3://runs/cifar: cannot read it (When getting information "
                            "for key 'cifar"), error
    assert error.endswith(f"; check the address, the credentials, the network and the endpoint ({endpoint})\n"), error
    assert error.count("\n") == 1 and not list(tmp_path.glob("[!cn]*"))  # nothing written

    # A URI without its bucket was read as a local folder named "s3:".
    assert cli.run(main, ["--checkpoint", "s3://", *args]) == 2
    assert capsys.readouterr().err == ("raydiff: error: --checkpoint s3://: an object store location is "
                                       "s3://BUCKET[/PREFIX]\n")
    assert not list(tmp_path.glob("[!cn]*"))


def test_the_digits_classifier_command_overwrites_the_shipped_weights_only_when_told_to(monkeypatch, capsys):
    """It took no arguments (--help neither) and retrained over the tracked digits_classifier.pt."""
    from raydiff.quality import digits_classifier

    with pytest.raises(SystemExit) as helped:
        digits_classifier.main(["--help"])
    assert helped.value.code == 0 and "--write" in capsys.readouterr().out

    def train_and_write(path=digits_classifier.WEIGHTS_FILE):
        pytest.fail(f"trained and wrote {path}")

    monkeypatch.setattr(digits_classifier, "write_weights", train_and_write)
    shipped = digits_classifier.WEIGHTS_FILE.read_bytes()
    assert digits_classifier.main([]) == 2
    assert capsys.readouterr().err == (
        f"raydiff: error: retraining the digits classifier overwrites the weights that ship with raydiff "
        f"({digits_classifier.WEIGHTS_FILE}): pass --write to do so, or --out PATH to write them elsewhere\n")
    assert digits_classifier.WEIGHTS_FILE.read_bytes() == shipped


@pytest.mark.parametrize("module, argv, line", [
    ("sample", ["--checkpoint", "run", "--out", "a.png", "--num", "0"], "--num 0: must be >= 1"),
    ("sample", ["--checkpoint", "run", "--out", "a.png", "--bogus"], "unrecognized arguments: --bogus"),
    ("sample", ["--checkpoint", "run", "--out", "a.png", "--num"], "argument --num: expected one argument"),
    ("sample", ["--out", "a.png"], "the following arguments are required: --checkpoint"),
    ("export", ["--checkpoint", "run", "--out", "pipe", "--guidance", "2"],
     "--guidance 2: a number >= 0, and only with --guide"),
    ("ema", ["--checkpoint", "run", "--sigma-rel", "0.1", "--out", ""],
     "--out '': must name a local folder (an empty value would mean the current folder)"),
    ("evaluate", ["--checkpoint", "run", "--workers", "0"], "--workers 0: must be >= 1"),
    ("prepare", ["images", "prepared", "--resolution", "4"], "--resolution 4: must be between 8 and 1024"),
    ("datasets synthetic", ["x", "--num", "0"], "--num 0: must be >= 1"),
    ("datasets", ["nope"], "argument command: invalid choice: 'nope' (choose from 'digits', 'synthetic')"),
    ("lr_find", ["--steps", "5"], "--steps 5: must be in [10, 100,000]"),
    ("tune", ["--lr", "1e-3"], "the following arguments are required: --batch"),
    ("train", ["--dry-run", "--config"], "argument --config: expected one argument"),
    ("bench step", ["--steps", "1"], "--steps 1: must be >= 2"),
])
def test_every_command_s_argument_errors_are_one_line_naming_the_command(module, argv, line, tmp_path, monkeypatch,
                                                                         capsys):
    """argparse's usage block (3-7 lines) came before its `error:` line, where every other refusal is one line."""
    import importlib

    monkeypatch.chdir(tmp_path)
    command, *sub = module.split()
    main = importlib.import_module(f"raydiff.{command}.__main__" if command == "bench" else f"raydiff.{command}").main
    with pytest.raises(SystemExit) as exited:
        main([*sub, *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err == f"raydiff: error: {line} (python -m raydiff.{module} --help)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("module, argv", [
    ("train", ["--set", "train.lr", "1e-3", "--dry-run"]),
    ("train", ["--set=train.lr", "1e-3"]),
    ("train", ["--set", "train.batch_size=8", "--set", "train.lr", "1e-3"]),
    ("tune", ["--lr", "1e-3", "--batch", "16", "--set", "train.lr", "1e-3"]),
    ("lr_find", ["--set", "train.lr", "1e-3"]),
    ("bench step", ["--set", "train.lr", "1e-3"]),
])
def test_a_set_value_without_its_equals_sign_is_told_as_that_typo(module, argv, capsys):
    """`--set train.lr 1e-3` was `unrecognized arguments: 1e-3`, which does not say what is wrong."""
    import importlib

    command, *sub = module.split()
    parse_args = importlib.import_module(f"raydiff.{command}.__main__" if command == "bench"
                                         else f"raydiff.{command}").parse_args
    with pytest.raises(SystemExit) as exited:
        parse_args([*sub, *argv])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (f"raydiff: error: --set train.lr: expected KEY=VALUE, as --set train.lr=1e-3 "
                                       f"(python -m raydiff.{module} --help)\n")


def test_a_set_option_is_not_guessed_at_in_a_command_that_takes_none(capsys):
    from raydiff import sample

    with pytest.raises(SystemExit):
        sample.parse_args(["--checkpoint", "run", "--out", "a.png", "--set", "train.lr", "1e-3"])
    assert capsys.readouterr().err == ("raydiff: error: unrecognized arguments: --set train.lr 1e-3 (python -m "
                                       "raydiff.sample --help)\n")


def _unprivileged() -> list[str]:
    """The prefix that runs a command as a user whom a file's mode binds (root, without its override of it)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("as root, a folder of mode 000 is readable; setpriv drops the override and is not here")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("command, args, locked, line", [
    ("sample", ["--checkpoint", "run", "--out", "a.png"], "run", "--checkpoint run: cannot read it"),
    ("export", ["--checkpoint", "run", "--out", "pipe"], "run", "--checkpoint run: cannot read it"),
    ("evaluate", ["--checkpoint", "run"], "run", "--checkpoint run: cannot read it"),
    ("ema", ["--checkpoint", "run", "--sigma-rel", "0.1", "--out", "averages"], "run",
     "--checkpoint run: cannot read it"),
    ("sample", ["--checkpoint", "run/checkpoint_00000010", "--out", "a.png"], "run/checkpoint_00000010",
     "--checkpoint run/checkpoint_00000010: cannot read it"),
    ("sample", ["--checkpoint", "run", "--out", "a.png"], "run/checkpoint_00000010",
     "--checkpoint run: cannot read HERE/run/checkpoint_00000010"),
    ("export", ["--checkpoint", "run", "--out", "pipe"], "run/checkpoint_00000010",
     "--checkpoint run: cannot read HERE/run/checkpoint_00000010"),
    ("ema", ["--checkpoint", "run", "--sigma-rel", "0.1", "--out", "averages"], "run/ema_snapshots",
     "--checkpoint run: cannot read HERE/run/ema_snapshots"),
    ("ema", ["--checkpoint", "run", "--sigma-rel", "0.1", "--out", "averages"], "run/ema_snapshots/step_00000010.pt",
     "--checkpoint run: cannot read HERE/run/ema_snapshots/step_00000010.pt"),
])
def test_an_input_this_user_may_not_read_is_one_line_naming_it_in_every_command_that_reads_one(
        command, args, locked, line, tmp_path):
    """A run or checkpoint folder of mode 000 was a traceback (pathlib's PermissionError at model_index.json,
    pyarrow's at state.pt), and so were a post-hoc EMA snapshot folder or snapshot (pyarrow's "Cannot list
    directory", "Failed to open local file"); an unreadable state.pt was one line already. Nothing is written."""
    prefix = _unprivileged()
    run = tmp_path / "run"
    (run / "checkpoint_00000010").mkdir(parents=True)
    (run / "checkpoint_00000010" / "state.pt").write_bytes(b"")  # never read: refused before
    (run / "ema_snapshots").mkdir()
    (run / "ema_snapshots" / "step_00000010.pt").write_bytes(b"")
    (tmp_path / locked).chmod(0)
    try:
        proc = subprocess.run([*prefix, sys.executable, "-m", f"raydiff.{command}", *args], capture_output=True,
                              text=True, timeout=120, cwd=tmp_path, env=dict(os.environ, RAY_ADDRESS="127.0.0.1:1"))
    finally:
        (tmp_path / locked).chmod(0o755)
    expected = f"raydiff: error: {line.replace('HERE', str(tmp_path.resolve()))} (permission denied)\n"
    assert (proc.returncode, proc.stderr) == (2, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
