"""A profile of the training loop (`log.profile_steps`): its steps, its files, and the profiler's own lines kept
out of the worker's log. The run that writes one through the CLI is tests/test_train.py's smoke run; one that
trains bit for bit as without it, tests/training/test_loop.py."""

from __future__ import annotations

import gzip
import json
import os
import threading

import pytest
import torch

from raydiff.training.profiling import StepProfile, kineto_lines_kept

CPU = torch.device("cpu")


def test_a_profile_spans_its_steps_and_says_where_their_time_went(capfd):
    # In a thread, as Ray Train runs the loop: there Kineto prints an error-looking line as it starts.
    profile, profiled = StepProfile(2, 3, CPU), []
    x = torch.randn(64, 64)

    def loop():
        for step in (1, 2, 3):
            profile.before_step(step)
            assert profile.recording == (step >= 2)
            (x @ x).relu().sum()
        profiled.append(profile.end(3))

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()

    (result,) = profiled
    assert (result.first, result.last, result.name) == (2, 3, "profile/steps_2-3")
    events = json.loads(gzip.decompress(result.trace_gz))["traceEvents"]
    names = {e.get("name") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3", "aten::mm"} <= names and "ProfilerStep#1" not in names
    assert result.table.startswith("# raydiff's training loop on rank 0, steps 2-3 on cpu: ")
    assert "aten::mm" in result.table
    assert result.figures["steps"] == [2, 3] and result.figures["wall_ms_per_step"] > 0
    assert result.figures["device_ms_per_step"] is None  # no GPU
    assert not profile.recording
    err = capfd.readouterr().err
    assert "USDT" not in err and "ERROR" not in err, err


def test_a_start_profiles_the_steps_left_of_its_range_and_only_on_rank_0():
    planned = StepProfile.planned((5, 9), resumed_at=0, device=CPU, is_chief=True)
    assert planned is not None and (planned.first, planned.last) == (5, 9)
    resumed = StepProfile.planned((5, 9), resumed_at=6, device=CPU, is_chief=True)
    assert resumed is not None and (resumed.first, resumed.last) == (7, 9)
    assert StepProfile.planned((5, 9), resumed_at=9, device=CPU, is_chief=True) is None  # all recorded before
    assert StepProfile.planned((5, 9), resumed_at=0, device=CPU, is_chief=False) is None
    assert StepProfile.planned((), resumed_at=0, device=CPU, is_chief=True) is None


def test_a_profile_ended_by_an_error_is_discarded_without_files():
    profile = StepProfile(1, 5, CPU)
    profile.before_step(1)
    assert profile.recording
    profile.discard()
    assert not profile.recording
    profile.discard()  # twice is harmless


def test_a_profile_whose_files_cannot_be_made_has_stopped_recording(monkeypatch):
    """The trace is written through a temporary folder: where that fails (a full disk), the error reaches the
    caller, who goes on training, with the profiler stopped, not recording every step that follows."""
    import tempfile

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    profile = StepProfile(1, 2, CPU)
    for step in (1, 2):
        profile.before_step(step)
    monkeypatch.setattr(tempfile, "TemporaryDirectory", no_room)
    with pytest.raises(OSError):
        profile.end(2)
    profile.discard()  # what the training loop does next
    assert not profile.recording and not torch.autograd.profiler._is_profiler_enabled


def test_kineto_s_lines_are_kept_out_of_the_log_and_every_other_line_passes(capfd):
    kept: list[str] = []
    with kineto_lines_kept(kept):
        os.write(2, b"USDT:2026-12-06 02:44:34 25082:25214 SyncActivityProfilerHandler.cpp:39] profiler_start\n")
        os.write(2, b"ERROR: External init callback must run in same thread as registerClient (1 != 2)\n")
        os.write(2, b"[raydiff] a line of the worker's own\n")
    assert [line.split(" ")[0] for line in kept] == ["USDT:2026-12-06", "ERROR:"]
    assert capfd.readouterr().err == "[raydiff] a line of the worker's own\n"
