"""The learning-rate rule and warmup, and how the config resolves train.lr."""

from __future__ import annotations

import math

import pytest

from raydiff.config import load_config
from raydiff.config.learning_rate import describe_lr, lr_at, scaled_lr


@pytest.mark.parametrize("rule, batch, expected", [
    ("linear", 64, 2e-4), ("linear", 128, 4e-4), ("linear", 512, 1.6e-3), ("linear", 32, 1e-4),
    # Above the knee (512) linear turns into sqrt: 2048 = 4 x 512 -> 2x the LR at 512.
    ("linear", 2048, 3.2e-3),
    ("sqrt", 256, 4e-4), ("sqrt", 16, 1e-4),
    ("none", 1024, 2e-4),
])
def test_scaling_rules(rule, batch, expected):
    assert scaled_lr(2e-4, batch, base_batch=64, rule=rule, knee=512) == pytest.approx(expected)


def test_knee_below_the_base_batch_is_continuous():
    below = scaled_lr(1e-3, 1023, base_batch=1024, rule="linear", knee=256)
    assert below == pytest.approx(1e-3 * math.sqrt(1023 / 1024))


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown lr scaling rule 'cubic'"):
        scaled_lr(1e-3, 64, base_batch=64, rule="cubic", knee=512)


def test_config_resolves_the_lr_from_the_global_batch(tmp_path):
    storage = f"run.storage={tmp_path}"
    scaled = load_config("smoke", [storage, "train.global_batch=64"])  # smoke: base_lr 1e-3 at 16
    assert scaled.train.lr == pytest.approx(4e-3)
    assert "scaled to batch 64 by the linear rule" in describe_lr(scaled.train)
    sqrt = load_config("smoke", [storage, "train.global_batch=64", "train.lr_scaling=sqrt"])
    assert sqrt.train.lr == pytest.approx(2e-3)
    explicit = load_config("smoke", [storage, "train.global_batch=64", "train.lr=5e-4"])
    assert explicit.train.lr == 5e-4 and "set explicitly" in describe_lr(explicit.train)
    # The world size has no say: elastic ranges resolve to the same learning rate.
    elastic = load_config("smoke", [storage, "train.global_batch=64", "scaling.num_workers=[1,4]"])
    assert elastic.train.lr == scaled.train.lr
    # The resolved value is what the run directory's config.yaml records, and it reloads unchanged.
    assert type(scaled).from_dict(scaled.to_dict()).resolve().train.lr == scaled.train.lr


def _train(*overrides: str):
    return load_config("smoke", ["train.lr=1", *overrides], check_source=False).train


def test_warmup_is_linear_then_constant():
    assert [lr_at(s, _train("train.warmup_steps=4")) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_at(0, _train("train.warmup_steps=0")) == 1.0


def test_cosine_decay_follows_warmup_down_a_half_cosine_to_0_at_the_last_step():
    train = _train("train.warmup_steps=2", "train.lr_decay=cosine", "train.total_steps=6")
    # Steps 1 and 2 warm up; step 3 starts the decay at the full rate; the last step (6) runs at 3/4 of the way
    # down the cosine: (1 + cos(3 pi / 4)) / 2.
    assert [lr_at(s, train) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 0.85355339, 0.5, 0.14644661])
    assert lr_at(6, train) == pytest.approx(0.0, abs=1e-12)  # at total_steps (an extended run goes on from here)
    assert "cosine decay to 0 at step 6" in describe_lr(train)


def test_rsqrt_decay_is_edm2_s_inverse_square_root_from_its_step_and_ignores_the_total():
    train = _train("train.warmup_steps=0", "train.lr_decay=rsqrt", "train.lr_decay_steps=100")
    assert [lr_at(s, train) for s in (0, 50, 100, 400, 10_000)] == pytest.approx([1, 1, 1, 0.5, 0.1])
    longer = _train("train.warmup_steps=0", "train.lr_decay=rsqrt", "train.lr_decay_steps=100",
                    "train.total_steps=100000")
    assert [lr_at(s, longer) for s in range(0, 1000, 37)] == [lr_at(s, train) for s in range(0, 1000, 37)]
    assert "falling as 1/sqrt(step / 100) from step 100" in describe_lr(train)
