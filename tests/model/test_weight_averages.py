"""The weight averages: the classic EMA with its warmup, and post-hoc EMA's mathematics (the power-function
averages training tracks and the least-squares rebuild of any other width from their snapshots; EDM2, Karras et
al. 2024)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raydiff.model.weight_averages import (
    EmaUpdater,
    PowerEma,
    ema_decay_at,
    exponent_of,
    make_ema,
    power_decay,
    reconstruct,
    sigma_rel_of,
    solve_coefficients,
)


def test_warmup_grows_the_window_linearly_to_its_full_length():
    assert ema_decay_at(0, 0.999, 100) == 0.0  # window of 1 step: the EMA copies the weights
    assert ema_decay_at(50, 0.999, 100) == pytest.approx(1 - 1 / (1 + 999 * 0.5))
    assert ema_decay_at(100, 0.999, 100) == pytest.approx(0.999)
    assert ema_decay_at(10_000, 0.999, 100) == pytest.approx(0.999)
    assert ema_decay_at(0, 0.9999, 0) == 0.9999  # no warmup


def test_update_is_an_exponential_moving_average():
    model = torch.nn.Linear(2, 1)
    ema = make_ema(model)
    with torch.no_grad():
        model.weight.fill_(1.0)
        ema.weight.fill_(0.0)
    update = EmaUpdater(ema, model)
    update(0.9)
    assert torch.allclose(ema.weight, torch.full_like(ema.weight, 0.1))
    update(0.9)
    assert torch.allclose(ema.weight, torch.full_like(ema.weight, 0.19))
    assert not ema.weight.requires_grad and not ema.training



def test_the_ema_is_the_same_average_for_a_model_of_its_own_dtype_and_of_another():
    """A CPU model in the EMA's dtype is averaged one tensor at a time (lerp), any other with multi-tensor
    operations: the same average either way, a skipped step (finite false) leaving it exactly as it was."""
    walk = trajectory(12, seed=3)
    averages = []
    for dtype in (torch.float32, torch.float64):
        model = Weights().to(dtype)
        ema = make_ema(model)
        update = EmaUpdater(ema, model)
        assert (update.staging_bytes == 0) == (dtype == torch.float32)  # one lerp per tensor keeps no copy
        for step, weights in enumerate(walk):
            with torch.no_grad():
                model.w.copy_(weights)
            before = ema.w.clone()
            update(ema_decay_at(step, 0.9, 4), finite=torch.tensor(step != 7))
            if step == 7:
                assert torch.equal(ema.w, before)
        averages.append(ema.w)
    torch.testing.assert_close(averages[0], averages[1], rtol=1e-6, atol=1e-6)
    assert not torch.equal(averages[0], ema.w.new_zeros(6))


def test_the_multi_tensor_ema_keeps_its_weights_in_one_buffer_and_allocates_nothing_per_step(monkeypatch):
    """Off the CPU's one-lerp-per-tensor path (on an accelerator; here a model of another dtype) the EMA's
    parameters become views of one buffer, with their values and layouts (NHWC too), and an update allocates
    nothing of the weights' size: they are copied into a buffer kept for it, and the average is one lerp."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("KINETO_LOG_LEVEL", "5")  # no "gpuGetDeviceCount failed" from the profiler on a CPU
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Linear(4, 4)).double()
    model[0].to(memory_format=torch.channels_last)
    ema = make_ema(model)
    before = {name: t.clone() for name, t in ema.state_dict().items()}
    update = EmaUpdater(ema, model)
    weights = list(ema.parameters())
    assert len({w.untyped_storage().data_ptr() for w in weights}) == 1
    assert weights[0].is_contiguous(memory_format=torch.channels_last) and weights[0].dim() == 4
    assert update.staging_bytes == sum(w.numel() * w.element_size() for w in weights)  # what `bench memory` counts
    for name, t in ema.state_dict().items():
        assert torch.equal(t, before[name])

    finite = torch.tensor(True)
    update(0.9, finite)  # anything made once is made by now
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        for _ in range(3):
            update(0.9, finite)
            update(0.9)
    allocated = [e.self_cpu_memory_usage for e in profiled.events() if e.self_cpu_memory_usage > 0]
    assert max(allocated, default=0) <= 8  # at most a number: a CPU's cast of the step's 0-dim weight

    expected = {name: t.double() for name, t in before.items()}
    for weight in [0.1] * 7:  # the seven updates above, in float64 one tensor at a time
        for name, p in model.state_dict().items():
            expected[name] += weight * (p - expected[name])
    for name, t in ema.state_dict().items():
        torch.testing.assert_close(t.double(), expected[name], rtol=1e-6, atol=1e-6)


# Post-hoc EMA.
def test_the_papers_widths_have_the_papers_exponents():
    # EDM2, section 3.1: sigma_rel 0.05 and 0.10 are gamma = 16.97 and 6.94.
    assert exponent_of(0.05) == pytest.approx(16.97, abs=0.005)
    assert exponent_of(0.10) == pytest.approx(6.94, abs=0.005)
    for sigma_rel in (0.01, 0.05, 0.1, 0.2, 0.27):
        assert sigma_rel_of(exponent_of(sigma_rel)) == pytest.approx(sigma_rel, rel=1e-12)


class Weights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, dtype=torch.float64))


def trajectory(steps: int, seed: int = 0) -> torch.Tensor:
    """A random walk of 6 weights, one row per step."""
    return torch.randn(steps, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).cumsum(0)


def track(sigma_rels, steps: int, snapshot_every: int):
    """Train-like tracking of `trajectory`; returns the tracker and (step, sigma_rel, state) snapshots."""
    model, walk = Weights(), trajectory(steps)
    tracker = PowerEma(model, sigma_rels)
    for p in tracker.profiles:
        p.double()
    snapshots = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.w.copy_(walk[step - 1])
        tracker(step)
        if step % snapshot_every == 0:
            snapshots += [(step, s, {k: v.clone() for k, v in p.state_dict().items()})
                          for s, p in zip(sigma_rels, tracker.profiles, strict=True)]
    return tracker, snapshots, walk


def test_a_tracked_average_is_the_power_function_average_of_the_weights():
    # With decay (1 - 1/t)^(g+1) the weight of step i in the average at step t is (i^(g+1) - (i-1)^(g+1)) / t^(g+1):
    # a profile proportional to t^g.
    steps = 50
    tracker, _, walk = track([0.1], steps, snapshot_every=steps)
    g = exponent_of(0.1)
    i = torch.arange(1, steps + 1, dtype=torch.float64)
    weights = (i ** (g + 1) - (i - 1) ** (g + 1)) / steps ** (g + 1)
    expected = (weights[:, None] * walk).sum(0)
    torch.testing.assert_close(tracker.profiles[0].w.detach(), expected, rtol=1e-10, atol=1e-12)


def test_the_first_update_copies_the_weights():
    assert power_decay(1, exponent_of(0.05)) == 0.0
    model = Weights()
    tracker = PowerEma(model, [0.05])
    with torch.no_grad():
        model.w.fill_(2.0)
    tracker(1)
    assert torch.equal(tracker.profiles[0].w, torch.full((6,), 2.0, dtype=torch.float32))


def test_the_tracked_averages_and_the_ema_share_one_copy_of_the_weights_per_step(monkeypatch):
    """Off the CPU's one-lerp-per-tensor path the post-hoc averages' updates and the classic EMA's (called first,
    as a step calls them) copy the model's weights once per step for all of them, and each is the average it would
    be on its own."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv("KINETO_LOG_LEVEL", "5")
    walk = trajectory(20, seed=5)
    model, alone = Weights(), Weights().float()  # float64: the multi-tensor path; float32: one lerp per tensor
    ema, ema_alone = make_ema(model), make_ema(alone)
    update, update_alone = EmaUpdater(ema, model), EmaUpdater(ema_alone, alone)
    tracker = PowerEma(model, [0.05, 0.10], staged_by=update)
    references = [PowerEma(alone, [s], staged_by=update_alone) for s in (0.05, 0.10)]  # it keeps no copy to share
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        for step in range(1, len(walk) + 1):
            with torch.no_grad():
                model.w.copy_(walk[step - 1])
                alone.w.copy_(walk[step - 1])
            finite = torch.tensor(step != 9)
            update(0.8, finite)
            tracker(step)
            update_alone(0.8, finite)
            for reference in references:
                reference(step)
    assert sum(e.name == "aten::_foreach_copy_" for e in profiled.events()) == len(walk)
    for profile_, reference in zip(tracker.profiles, references, strict=True):
        torch.testing.assert_close(profile_.w, reference.profiles[0].w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ema.w.float(), ema_alone.w, rtol=1e-6, atol=1e-6)


def test_rebuilding_a_tracked_width_gives_back_its_weights():
    tracker, snapshots, _ = track([0.05, 0.10], 120, snapshot_every=10)
    rebuilt = reconstruct(snapshots, [0.05, 0.10], out_step=120)
    for average, profile in zip(rebuilt, tracker.profiles, strict=True):
        error = (average["w"] - profile.w).abs().max() / profile.w.abs().max()
        assert error < 1e-3  # the target; the solve puts weight 1 on the profile's own last snapshot


def test_an_untracked_width_is_rebuilt_close_to_the_average_tracking_it_would_have_given():
    steps = 400
    direct, _, _ = track([0.07], steps, snapshot_every=steps)
    _, snapshots, _ = track([0.05, 0.10], steps, snapshot_every=20)
    narrow, wide = reconstruct(snapshots, [0.05, 0.10], out_step=steps)
    (between,) = reconstruct(snapshots, [0.07], out_step=steps)
    error = (between["w"] - direct.profiles[0].w).norm()
    assert error < 0.05 * (wide["w"] - narrow["w"]).norm()


def test_the_coefficients_sum_to_one_and_ignore_later_snapshots():
    x = solve_coefficients([10, 20, 30, 10, 20, 30], [0.05] * 3 + [0.1] * 3, 30, [0.06, 0.08, 0.12])
    np.testing.assert_allclose(x.sum(axis=0), 1.0, rtol=1e-12)
    _, snapshots, _ = track([0.05, 0.10], 40, snapshot_every=10)
    early = reconstruct(snapshots, [0.07], out_step=20)
    only_early = reconstruct([s for s in snapshots if s[0] <= 20], [0.07], out_step=20)
    assert torch.equal(early[0]["w"], only_early[0]["w"])
    with pytest.raises(ValueError, match="no snapshot at or before step 5"):
        reconstruct(snapshots, [0.07], out_step=5)


def test_a_checkpoint_of_other_widths_is_refused():
    tracker = PowerEma(Weights(), [0.05, 0.10])
    state = PowerEma(Weights(), [0.05]).state_dict()
    with pytest.raises(ValueError, match=r"tracks sigma_rel \[0.05\], this run \[0.05, 0.1\]"):
        tracker.load_state_dict(state)
