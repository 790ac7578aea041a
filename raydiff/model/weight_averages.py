"""Averages of the weights that samples and exports use: the classic EMA, and EDM2's post-hoc EMA.

The classic EMA (`make_ema`, `EmaUpdater`, `ema_decay_at`) is updated once per optimizer step with a warmup of
its window.

Post-hoc EMA (Karras et al., EDM2, 2024) chooses the EMA's length after training, by measured quality. Why: the
length changes sample quality several-fold and is usually guessed before the run. Training tracks a few
power-function averages (`PowerEma`), whose profile over past steps is t^gamma, and stores them as snapshots
every few steps; the average of any other relative width sigma_rel at a snapshot's step is then the
least-squares combination of the stored snapshots (`solve_coefficients`, `combine`, `reconstruct`), which is
exact for the tracked widths themselves. Widths are relative to the training time (sigma_rel = the profile's standard
deviation / its length), so one sigma_rel means the same at any batch size or run length. The formulas are
EDM2's (its `training/phema.py`, equations 121-151 and algorithms 2-3 of the paper), in float64; time is counted
in optimizer steps (EDM2 counts images; with a fixed global batch the two differ by a scale the coefficients do
not depend on).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from raydiff.model.flat import views_of
from raydiff.model.meta_twin import check_load, meta_twin


def ema_decay_at(step: int, decay: float, warmup_steps: int) -> float:
    """Decay for the update of the optimizer step that follows `step` steps (0: the first).

    The EMA averages over a window of about 1 / (1 - decay) steps. During warmup that window grows
    linearly from 1 step (the first update copies the online weights) to its full length at `warmup_steps`,
    so the average holds nothing of the random initialisation (where the first step is skipped as non-finite, the
    initialisation stands in for its weights, which differ from it by one warmup step's update).
    """
    if warmup_steps <= 0:
        return decay
    full_window = 1.0 / (1.0 - decay)
    window = min(full_window, 1.0 + (full_window - 1.0) * step / warmup_steps)
    return 1.0 - 1.0 / window


def make_ema(model: nn.Module) -> nn.Module:
    """An fp32 copy of `model` for averaging: eval mode, no gradients."""
    return copy.deepcopy(model).float().eval().requires_grad_(False)


class EmaUpdater:
    """Updates `ema` towards `model` once per optimizer step. The parameter lists are built once (they are views
    of the live tensors, so restores and DDP wrapping keep them valid), and a step's weight can be a device
    tensor: an update weighted by `finite` (0 or 1) is skipped on the device, without a host sync.

    On a CPU, where an operation's launch is cheap, a model of the EMA's dtype is averaged one lerp per tensor,
    which reads and writes the averages once. Anywhere else the EMA's parameters become views of one buffer, and
    each step copies the model's weights into a second buffer of the same layout (one multi-tensor copy, which
    also converts another dtype; another updater of the same model can read it, `staged_by`) and lerps the first
    towards it (one kernel): nothing is allocated per step, and the host launches two operations where one per
    tensor, or three multi-tensor ones with a temporary per tensor, would cost it more (`bench step`'s `ema`
    row)."""

    def __init__(self, ema: nn.Module, model: nn.Module, *, staged_by: EmaUpdater | None = None) -> None:
        self._ema: list[torch.Tensor] = list(ema.parameters())
        self._model = [p.detach() for p in model.parameters()]
        self._ema_buffers, self._model_buffers = list(ema.buffers()), list(model.buffers())
        self._lerp_each = all(e.device.type == "cpu" and e.dtype == m.dtype and e.device == m.device
                              for e, m in zip(self._ema, self._model, strict=True))
        self._flat = self._staged = self._weight = torch.empty(0)
        self._staged_views: list[torch.Tensor] = []
        self._staged_by: EmaUpdater | None = None  # whose copy of the weights this one reads (made before its update)
        if not self._lerp_each:
            self._flatten(staged_by)

    def _flatten(self, staged_by: EmaUpdater | None = None) -> None:
        """Move the EMA's parameters into one buffer (their values and layouts unchanged), and make the buffer the
        weights are copied into (or read `staged_by`'s, an updater of the same model called before this one) and
        the weight's tensor beside it."""
        first = self._ema[0]
        self._flat = torch.empty(sum(e.numel() for e in self._ema), dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for e, view in zip(self._ema, views_of(self._flat, self._ema), strict=True):
                view.copy_(e)
                e.data = view
        self._weight = torch.zeros((), dtype=first.dtype, device=first.device)
        # Another updater's copy serves only where it is one of the same weights in the same layout (it may keep none:
        # one lerp per tensor).
        shares = staged_by is not None and all(getattr(staged_by._staged, a) == getattr(self._flat, a)
                                               for a in ("shape", "dtype", "device"))
        self._staged_by = staged_by if shares else None
        if self._staged_by is not None:
            self._staged, self._staged_views = self._staged_by._staged, []
        else:
            self._staged = torch.empty_like(self._flat)
            self._staged_views = views_of(self._staged, self._ema)

    @property
    def staging_bytes(self) -> int:
        """The bytes of the copy of the weights this updater keeps (0 on a CPU's one lerp per tensor, or where
        it reads another updater's)."""
        return self._staged.numel() * self._staged.element_size() if self._staged_by is None else 0

    @torch.no_grad()
    def __call__(self, decay: float, finite: torch.Tensor | None = None) -> None:
        # ema += weight * (model - ema), with `finite` a tensor on the model's device (a number made of it would be
        # read back to the host: a sync every step). A weight of 0 leaves the EMA exactly as it was.
        if self._lerp_each:
            weight = 1.0 - decay if finite is None else finite.to(self._ema[0].dtype) * (1.0 - decay)
            for e, m in zip(self._ema, self._model, strict=True):
                e.lerp_(m, weight)
        else:
            # Something gave the EMA (or the updater whose copy it reads) new tensors (`.to()`): anew, on its own.
            if self._ema[0].data_ptr() != self._flat.data_ptr() or (
                    self._staged_by is not None and self._staged_by._staged is not self._staged):
                self._flatten()
            if self._staged_by is None:
                torch._foreach_copy_(self._staged_views, self._model)
            if finite is None:
                self._flat.lerp_(self._staged, 1.0 - decay)
            else:
                self._weight.fill_(1.0 - decay).mul_(finite)
                self._flat.lerp_(self._staged, self._weight)
        for e, b in zip(self._ema_buffers, self._model_buffers, strict=True):
            e.copy_(b)


# Post-hoc EMA.
def exponent_of(sigma_rel: float) -> float:
    """The power-function exponent gamma whose profile has relative standard deviation `sigma_rel` (EDM2's
    algorithm 2: the largest real root of gamma^3 + 7 gamma^2 + (16 - s^-2) gamma + (12 - s^-2))."""
    t = float(sigma_rel) ** -2
    return float(np.roots([1.0, 7.0, 16.0 - t, 12.0 - t]).real.max())


def sigma_rel_of(exponent: float) -> float:
    """The inverse of `exponent_of` (EDM2's equation 123)."""
    g = float(exponent)
    return float(np.sqrt((g + 1) / (g + 2) ** 2 / (g + 3)))


def power_decay(step: int, exponent: float) -> float:
    """The decay of the update at optimizer step `step` (counted from 1) that keeps an average's profile
    proportional to t^exponent: (1 - 1/step)^(exponent + 1); 0 at step 1 (a copy of the weights)."""
    return (1.0 - 1.0 / step) ** (exponent + 1.0)


def _correlation(a_step: np.ndarray, a_exp: np.ndarray, b_step: np.ndarray, b_exp: np.ndarray) -> np.ndarray:
    """Inner products of power-function profiles ending at `a_step` / `b_step` (EDM2's equation 151)."""
    ratio = a_step / b_step
    exp = np.where(a_step < b_step, b_exp, -a_exp)
    return (a_exp + 1) * (b_exp + 1) * ratio**exp / ((a_exp + b_exp + 1) * np.maximum(a_step, b_step))


def solve_coefficients(in_steps: Sequence[int], in_sigma_rels: Sequence[float], out_step: int,
                       out_sigma_rels: Sequence[float]) -> np.ndarray:
    """[len(in), len(out)] weights: output j = sum_i w[i, j] * snapshot i, the least-squares fit of the profile
    of width out_sigma_rels[j] ending at `out_step` by the snapshots' profiles (EDM2's algorithm 3); each column
    sums to 1."""
    col = lambda x: np.asarray(x, dtype=np.float64).reshape(-1, 1)  # noqa: E731
    row = lambda x: np.asarray(x, dtype=np.float64).reshape(1, -1)  # noqa: E731
    in_exp = [exponent_of(s) for s in in_sigma_rels]
    out_exp = [exponent_of(s) for s in out_sigma_rels]
    a = _correlation(col(in_steps), col(in_exp), row(in_steps), row(in_exp))
    b = _correlation(col(in_steps), col(in_exp), row([out_step] * len(out_exp)), row(out_exp))
    x = np.linalg.solve(a, b)
    return x / x.sum(axis=0)


class PowerEma:
    """The power-function averages that training tracks, one fp32 copy of the model per sigma_rel, updated once
    per optimizer step, a skipped one too (its unchanged weights): the rebuild takes each average's profile to be
    t^gamma over every step, and an average that skipped steps would have another one."""

    def __init__(self, model: nn.Module, sigma_rels: Sequence[float], *, staged_by: EmaUpdater | None = None) -> None:
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.exponents = tuple(exponent_of(s) for s in self.sigma_rels)
        self.profiles = [make_ema(model) for _ in self.sigma_rels]
        # One copy of the model's weights per step serves every average: the first update makes it, or reads
        # `staged_by`'s (the classic EMA's updater of the same model, called before this one each step).
        first = EmaUpdater(self.profiles[0], model, staged_by=staged_by)
        self._updates = [first] + [EmaUpdater(profile, model, staged_by=first) for profile in self.profiles[1:]]

    def __call__(self, step: int) -> None:
        """The update of optimizer step `step` (counted from 1)."""
        for exponent, update in zip(self.exponents, self._updates, strict=True):
            update(power_decay(step, exponent))

    def state_dict(self) -> dict:
        return {"sigma_rels": list(self.sigma_rels), "profiles": [p.state_dict() for p in self.profiles]}

    def load_state_dict(self, state: dict, *, check_only: bool = False) -> None:
        """`check_only`: raise as the load would, changing nothing (each average tried on a twin of itself alone
        that holds no memory: a copy of this object would copy the model and the classic EMA its updates reach
        too)."""
        if tuple(state["sigma_rels"]) != self.sigma_rels:
            raise ValueError(f"the checkpoint tracks sigma_rel {state['sigma_rels']}, this run "
                             f"{list(self.sigma_rels)}")
        for profile, saved in zip(self.profiles, state["profiles"], strict=True):
            if check_only:
                check_load(meta_twin(profile), saved)
            else:
                profile.load_state_dict(saved)


def reconstruct(snapshots: Sequence[tuple[int, float, dict[str, torch.Tensor]]], out_sigma_rels: Sequence[float],
                out_step: int) -> list[dict[str, torch.Tensor]]:
    """The averages of widths `out_sigma_rels` at `out_step`, as state dicts, from `snapshots` of (step,
    sigma_rel, state dict) up to `out_step` (`combine`)."""
    used = [s for s in snapshots if 0 < s[0] <= out_step]
    if not used:
        raise ValueError(f"no snapshot at or before step {out_step}")
    coefficients = solve_coefficients([s[0] for s in used], [s[1] for s in used], out_step, out_sigma_rels)
    return combine((s[2] for s in used), coefficients)


def combine(states: Iterable[dict[str, torch.Tensor]], coefficients: np.ndarray) -> list[dict[str, torch.Tensor]]:
    """Output j = sum_i coefficients[i, j] * state i (`solve_coefficients`' [len(in), len(out)] weights), as state
    dicts. Floating-point tensors are summed in float64 and returned in their own dtype; others (integer buffers)
    are taken from the last state. The states are taken one at a time and none is kept once the next is asked for:
    a caller that loads each only when asked holds one snapshot at a time (EDM2's reconstruction does the same),
    not every one of a long run."""
    totals: list[dict[str, torch.Tensor]] = [{} for _ in range(coefficients.shape[1])]
    last: dict[str, torch.Tensor] = {}  # the last state's names in order: its dtype's empty tensor, or its copy
    rows = 0
    for state in states:  # not enumerate(): its reused tuple would hold on to this state while the next loads
        if rows >= len(coefficients):
            raise ValueError(f"more states than the {len(coefficients)} rows of coefficients")
        last = _add(totals, state, coefficients[rows])
        rows += 1
        del state  # not held while the next is loaded
    if rows != len(coefficients):
        raise ValueError(f"{rows} states for {len(coefficients)} rows of coefficients")
    return [{name: total[name].to(like.dtype) if like.is_floating_point() else like.clone()
             for name, like in last.items()} for total in totals]


def _add(totals: list[dict[str, torch.Tensor]], state: dict[str, torch.Tensor],
         weights: np.ndarray) -> dict[str, torch.Tensor]:
    """Add `weights[j]` times `state`'s floating-point tensors to output j (float64 sums); returns, in `state`'s
    order, an empty tensor of each floating-point one's dtype and a copy of each other one."""
    like = {}
    for name, value in state.items():
        if not value.is_floating_point():
            like[name] = value.clone()
            continue
        like[name] = torch.empty(0, dtype=value.dtype)
        wide = value.double()
        for j, total in enumerate(totals):
            if name not in total:
                total[name] = torch.zeros(value.shape, dtype=torch.float64)
            total[name] += float(weights[j]) * wide
    return like
