"""The logging window: a window split by a checkpoint makes the row an unsplit one makes, the other workers of a
resumed run start from zero, a window's img/s counts the device's time to finish its steps, and the non-finite
counter reports the longest streak since it was last asked."""

from __future__ import annotations

import time

import pytest
import torch

import raydiff.training.window
from raydiff.training.step import StepResult
from raydiff.training.window import MetricsWindow, NonFiniteSteps

CPU = torch.device("cpu")


def _result(step: int, finite: bool = True) -> StepResult:
    g = torch.Generator().manual_seed(step)
    losses = torch.rand(8, generator=g, dtype=torch.float32)
    quarters = torch.stack([torch.stack([losses[2 * q: 2 * q + 2].sum() for q in range(4)]), torch.full((4,), 2.0)])
    return StepResult(finite=torch.tensor(finite), grad_norm=torch.tensor(0.5 + step), loss_sum=losses.sum(),
                      samples=8, quarter_sums=quarters, images=torch.zeros(1, dtype=torch.uint8),
                      timesteps=torch.zeros(1), losses=losses)


def _row(window: MetricsWindow) -> dict:
    row = window.close(step=6, global_batch=8, lr=1e-3, ema_decay=0.9, world_size=1, skipped_steps=0)
    return {k: v for k, v in row.items() if k not in ("images_per_s", "data_wait_frac")}  # times differ


def test_a_window_split_by_a_checkpoint_makes_the_same_row_bit_for_bit():
    whole = MetricsWindow(CPU)
    for step in range(6):
        whole.add(_result(step), data_wait_s=0.0)
    first = MetricsWindow(CPU)
    for step in range(3):
        first.add(_result(step), data_wait_s=0.0)
    resumed = MetricsWindow(CPU, saved=first.checkpoint_state(), is_chief=True)
    for step in range(3, 6):
        resumed.add(_result(step), data_wait_s=0.0)
    expected = _row(whole)
    assert _row(resumed) == expected
    assert expected["loss_q1"] is not None and expected["grad_norm"] == sum(0.5 + s for s in range(6)) / 6


def test_only_rank_0_takes_the_saved_sums_and_a_closed_window_starts_from_zero():
    saved = MetricsWindow(CPU)
    saved.add(_result(0), data_wait_s=0.0)
    other = MetricsWindow(CPU, saved=saved.checkpoint_state(), is_chief=False)
    assert float(other.loss_sum) == 0.0 and other.samples == 0
    saved.close(step=1, global_batch=8, lr=1e-3, ema_decay=0.9, world_size=1, skipped_steps=0)
    assert float(saved.loss_sum) == 0.0 and saved.samples == 0 and saved.steps == 0


def test_a_windows_rate_counts_the_time_the_device_takes_to_finish_its_steps(monkeypatch):
    """A GPU runs behind the host: the row's img/s is that of the steps done, not issued. The device's wait is
    simulated here (a CPU never runs behind); tests/training/test_gpu.py checks it on a GPU."""
    window = MetricsWindow(CPU)
    window.add(_result(0), data_wait_s=0.0)
    monkeypatch.setattr(raydiff.training.window, "synchronize", lambda device: time.sleep(0.5))
    row = window.close(step=1, global_batch=8, lr=1e-3, ema_decay=0.9, world_size=1, skipped_steps=0)
    assert row["images_per_s"] < 8 / 0.5


def test_non_finite_steps_count_and_the_longest_streak_is_since_the_last_question():
    counter = NonFiniteSteps(CPU, {"skipped_steps": 2})
    for finite in (False, False, True, False, False, False):
        counter.add(torch.tensor(finite))
    assert counter.skipped_steps() == 7 and counter.longest_streak() == 3
    counter.add(torch.tensor(False))
    assert counter.longest_streak() == 4  # the streak goes on across the question
    counter.add(torch.tensor(True))
    assert counter.longest_streak() == 4  # the streak that was going on at the question ended after it
    assert counter.longest_streak() == 0 and counter.skipped_steps() == 8


@pytest.mark.parametrize("cut", range(1, 7))
def test_the_non_finite_counter_resumes_from_a_checkpoint_where_it_was(cut):
    """A checkpoint between two checks keeps the count, the run of bad steps going on and the longest since the
    last check: a resumed run rolls back where (and counts what) an uninterrupted one does."""
    steps = (True, False, False, True, False, False)
    whole = NonFiniteSteps(CPU)
    for finite in steps:
        whole.add(torch.tensor(finite))
    first = NonFiniteSteps(CPU)
    for finite in steps[:cut]:
        first.add(torch.tensor(finite))
    resumed = NonFiniteSteps(CPU, {"rollbacks": 0, **first.counters()})
    for finite in steps[cut:]:
        resumed.add(torch.tensor(finite))
    assert resumed.counters() == whole.counters()
    assert resumed.longest_streak() == whole.longest_streak() == 2


def test_a_skipped_step_s_losses_are_left_out_of_the_row_as_its_samples_were_of_training():
    """One non-finite step made the whole row's loss and its quarter NaN (null in metrics.jsonl, no point on any
    dashboard, `loss nan` in the progress line), where its gradient norm was already left out."""
    clean, with_nan = MetricsWindow(CPU), MetricsWindow(CPU)
    for step in range(3):
        clean.add(_result(step), data_wait_s=0.0)
        with_nan.add(_result(step), data_wait_s=0.0)
    bad = _result(9, finite=False)
    bad.loss_sum, bad.quarter_sums = torch.tensor(float("nan")), torch.full((2, 4), float("nan"))
    with_nan.add(bad, data_wait_s=0.0)
    assert _row(with_nan) == _row(clean)
    nothing = MetricsWindow(CPU)
    nothing.add(bad, data_wait_s=0.0)
    row = _row(nothing)  # every step skipped: no loss, not 0
    assert row["loss"] != row["loss"] and all(row[f"loss_q{q}"] is None for q in range(1, 5))
