"""The learning rate of a run: from the global batch by the scaling rule (`train.lr` when the config is
loaded), and over the steps by linear warmup and the decay after it (`lr_at`).

The rule is applied once, from `train.global_batch`, when the config is loaded: the learning rate of a run
does not depend on the world size, so elastic resizes never change it.

    linear: lr = base_lr * g(batch) / g(base_batch), with g(b) = b up to the knee and
            knee * sqrt(b / knee) beyond it (linear up to about 512, sublinear after: Goyal et al. 2017)
    sqrt:   lr = base_lr * sqrt(batch / base_batch)
    none:   lr = base_lr
"""

from __future__ import annotations

import math
from typing import Literal

LrRule = Literal["linear", "sqrt", "none"]
LR_RULES: tuple[str, ...] = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, batch: int, *, base_batch: int, rule: str, knee: int) -> float:
    """The learning rate for a global batch of `batch` images under `rule`."""
    if rule == "none":
        return base_lr
    if rule == "sqrt":
        return base_lr * math.sqrt(batch / base_batch)
    if rule == "linear":

        def g(b: int) -> float:
            return b if b <= knee else knee * math.sqrt(b / knee)

        return base_lr * g(batch) / g(base_batch)
    raise ValueError(f"unknown lr scaling rule {rule!r}; expected one of {', '.join(LR_RULES)}")


def rule_lr(train) -> float:
    """What the config's rule gives for its global batch (`train` is a config's `TrainSection`)."""
    return scaled_lr(train.base_lr, train.global_batch, base_batch=train.base_batch, rule=train.lr_scaling,
                     knee=train.lr_scaling_knee)


def describe_lr(train) -> str:
    """One line on where the run's learning rate comes from, and how it falls, for the start-up log."""
    if not math.isclose(train.lr, rule_lr(train), rel_tol=1e-12):
        origin = f"learning rate {train.lr:.3g} (train.lr set explicitly: train.lr_scaling not applied)"
    elif train.lr_scaling == "none" or train.global_batch == train.base_batch:
        origin = f"learning rate {train.lr:.3g}"
    else:
        origin = (f"learning rate {train.lr:.3g} = base_lr {train.base_lr:.3g} at batch {train.base_batch}, scaled "
                  f"to batch {train.global_batch} by the {train.lr_scaling} rule (knee {train.lr_scaling_knee})")
    if train.lr_decay == "cosine":
        return f"{origin}, cosine decay to 0 at step {train.total_steps}"
    if train.lr_decay == "rsqrt":
        return f"{origin}, falling as 1/sqrt(step / {train.lr_decay_steps}) from step {train.lr_decay_steps}"
    return origin


def lr_at(step: int, train) -> float:
    """The learning rate of the step after `step` optimizer steps, a function of the step alone (a resumed or
    resized run takes the same): linear warmup to `train.lr` over `train.warmup_steps`, then `train.lr_decay`.

        none:   constant (DDPM)
        cosine: lr * (1 + cos(pi * p)) / 2, p = (step - warmup_steps) / (total_steps - warmup_steps) in [0, 1]
        rsqrt:  lr / sqrt(max(step / lr_decay_steps, 1))  (EDM2)

    `train` is a loaded config's `TrainSection` (its `lr` resolved)."""
    lr = train.lr * min(1.0, (step + 1) / train.warmup_steps) if train.warmup_steps else train.lr
    if train.lr_decay == "cosine" and train.total_steps > train.warmup_steps:
        done = min(1.0, max(0.0, (step - train.warmup_steps) / (train.total_steps - train.warmup_steps)))
        return lr * (1 + math.cos(math.pi * done)) / 2
    if train.lr_decay == "rsqrt":
        return lr / math.sqrt(max(step / train.lr_decay_steps, 1.0))
    return lr
