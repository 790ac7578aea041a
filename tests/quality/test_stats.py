"""Feature sums, the Frechet distance, KID and class coverage (no Ray)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from raydiff.quality.stats import FeatureStats, coverage, frechet_distance, kernel_distance


def _stats(features: np.ndarray, logits: np.ndarray | None = None, keep: bool = False) -> FeatureStats:
    stats = FeatureStats.empty(features.shape[1], classes=0 if logits is None else logits.shape[1], keep_features=keep)
    stats.add(torch.from_numpy(features), None if logits is None else torch.from_numpy(logits))
    return stats


def test_sums_of_parts_give_numpys_mean_and_covariance():
    features = np.random.default_rng(0).normal(size=(300, 6)).astype(np.float32)
    parts = [_stats(features[a:b], keep=True) for a, b in ((0, 100), (100, 130), (130, 300))]
    whole = parts[0] + parts[1] + parts[2]
    mu, sigma = whole.mu_sigma()
    assert whole.count == 300
    np.testing.assert_allclose(mu, features.astype(np.float64).mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(features.astype(np.float64), rowvar=False), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(whole.all_features(), features)
    again = whole.unpacked(whole.packed())
    assert again.count == 300 and np.array_equal(again.outer, whole.outer) and np.array_equal(again.sum, whole.sum)
    with pytest.raises(ValueError, match="at least 2"):
        _stats(features[:1]).mu_sigma()


def test_frechet_distance_is_zero_for_equal_sets_and_grows_with_a_shift():
    features = np.random.default_rng(1).normal(size=(2000, 4))
    a = _stats(features).mu_sigma()
    assert frechet_distance(a, a) == pytest.approx(0, abs=1e-6)
    shifted = _stats(features + 0.5).mu_sigma()
    assert frechet_distance(a, shifted) == pytest.approx(4 * 0.5**2, rel=1e-6)  # ||mu_a - mu_b||^2, same sigma
    wider = _stats(features * 2).mu_sigma()
    assert frechet_distance(a, wider) == pytest.approx(4 * (1 - 2) ** 2, rel=0.05)  # Tr(S_a + S_b - 2 sqrt(S_a S_b))


def test_the_frechet_distance_of_non_finite_features_is_nan_never_a_perfect_zero():
    """A diverged model's NaN images gave NaN means, and max(0, nan) reported a distance of 0.0; NaN covariances
    raised scipy's LinAlgError."""
    a = _stats(np.random.default_rng(1).normal(size=(200, 4))).mu_sigma()
    for broken in ((a[0] * np.nan, a[1]), (a[0], a[1] * np.nan)):
        assert math.isnan(frechet_distance(broken, a)) and math.isnan(frechet_distance(a, broken))


def test_kernel_distance_near_zero_for_one_distribution_positive_for_another():
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(400, 8)).astype(np.float32), rng.normal(size=(400, 8)).astype(np.float32)
    same, _ = kernel_distance(a, b)
    other, _ = kernel_distance(a, b + 1.0)
    assert abs(same) < 0.02 < other


def test_coverage_counts_classes_and_confident_samples():
    features = np.zeros((100, 2), np.float32)
    uniform = np.eye(10, dtype=np.float32)[np.arange(100) % 10] * 10  # each class 10 times, confidently
    assert coverage(_stats(features, uniform)) == {"coverage": 1.0, "confident": 1.0}
    collapsed = np.eye(10, dtype=np.float32)[np.zeros(100, int)] * 0.1  # one class, unsure
    assert coverage(_stats(features, collapsed)) == {"coverage": 0.1, "confident": 0.0}


def test_kernel_distance_takes_any_seed_the_config_does():
    """eval.seed is any integer >= 0; numpy's RandomState, which draws KID's subsets, takes seeds below 2**32
    only: a larger one raised after every image of an evaluation had been sampled."""
    a, b = np.random.default_rng(0).normal(size=(2, 50, 8))
    assert kernel_distance(a, b, seed=2**32 + 5) == kernel_distance(a, b, seed=5)
