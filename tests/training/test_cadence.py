"""A step's end as rank 0 writes it, in parts that need no Ray: what a metrics row holds."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from raydiff.training import cadence


def test_each_rows_peak_memory_is_its_own_not_the_starts(monkeypatch):
    """The peak allocated since the previous row: compilation's and autotuning's transients at the start (and
    the micro-batch probe's) would otherwise be every row's peak, the bench's steady-state figure included."""
    allocated = {"peak": 9e9}

    def reset(device):
        allocated["peak"] = 2e9  # what the steps since then reach
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(cadence, "ema_drift", lambda ema, model: 0.0)
    at_row = SimpleNamespace(w=SimpleNamespace(device=torch.device("cuda", 0), ema=None, model=None), run_start=0.0)
    first = cadence.Cadence._extra_metrics(at_row, None, None)
    second = cadence.Cadence._extra_metrics(at_row, None, None)
    assert (first["peak_memory_gb"], second["peak_memory_gb"]) == (9.0, 2.0)


def test_a_pause_that_does_work_starts_its_clock_when_the_device_has_done_the_steps_before(monkeypatch):
    """A GPU runs several steps behind the host: a pause (validation, a checkpoint) whose clock started at once would
    count the queued steps' time as paused, and overstate the row's img/s. A pause with nothing due neither waits
    for the device (it runs at every step) nor counts."""
    clock = {"s": 100.0}
    calls = []

    def synchronize(device):
        calls.append(device)
        clock["s"] += 5.0  # the steps queued before the pause
    monkeypatch.setattr(time, "perf_counter", lambda: clock["s"])
    monkeypatch.setattr(cadence, "synchronize", synchronize)
    at_step = SimpleNamespace(w=SimpleNamespace(device=torch.device("cuda", 0)),
                              live=SimpleNamespace(window=SimpleNamespace(paused_s=0.0)))
    with cadence.Cadence._paused(at_step, False):
        clock["s"] += 0.001  # a few checks on the host
    assert calls == [] and at_step.live.window.paused_s == 0.0
    with cadence.Cadence._paused(at_step, True):
        clock["s"] += 2.0  # the validation itself
    assert calls == [torch.device("cuda", 0)] and at_step.live.window.paused_s == 2.0
