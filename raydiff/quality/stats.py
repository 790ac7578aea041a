"""Feature statistics and the distances between two sets of them.

Statistics are float64 sums (count, sum, sum of outer products, class counts, class matches), so that the
statistics of a set split over any number of workers add up to those of the whole set: workers exchange sums, not
features. The Frechet distance and KID formulas are torch-fidelity's (the reference implementations behind
published FIDs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

COVERAGE_SHARE = 0.25  # a class counts as covered when it has at least this share of a uniform split
CONFIDENT_PROB = 0.9  # a sample the classifier assigns this probability to one class is a legible one


@dataclass
class FeatureStats:
    """Sums over a set of images' features; `features` are kept only when KID needs them."""

    count: int
    sum: np.ndarray  # (D,) float64
    outer: np.ndarray  # (D, D) float64: the sum of f f^T
    class_counts: np.ndarray | None = None  # (K,) predictions per class, for classifier features
    confident: int = 0  # samples predicted with probability >= CONFIDENT_PROB
    features: list[np.ndarray] | None = field(default=None, repr=False)
    asked: int = 0  # samples generated for a class the classifier knows (class-conditional models)
    matched: int = 0  # of those, the samples the classifier reads as that class

    @classmethod
    def empty(cls, dim: int, *, classes: int = 0, keep_features: bool = False) -> FeatureStats:
        return cls(0, np.zeros(dim), np.zeros((dim, dim)), np.zeros(classes) if classes else None,
                   0, [] if keep_features else None)

    def add(self, features: torch.Tensor, logits: torch.Tensor | None = None,
            targets: list[int] | None = None) -> None:
        """Add a batch. `targets`: the classifier's class that each image was generated for (class match)."""
        f = features.detach().to("cpu", torch.float64).numpy()
        self.count += len(f)
        self.sum += f.sum(0)
        self.outer += f.T @ f
        if self.features is not None:
            self.features.append(f.astype(np.float32))
        if logits is not None and self.class_counts is not None:
            probs = logits.detach().float().softmax(-1).cpu()
            self.class_counts += np.bincount(probs.argmax(-1).numpy(), minlength=len(self.class_counts))
            self.confident += int((probs.max(-1).values >= CONFIDENT_PROB).sum())
            if targets is not None:
                self.asked += len(targets)
                self.matched += class_matches(logits, targets)

    def __add__(self, other: FeatureStats) -> FeatureStats:
        features = self.features + other.features if self.features is not None and other.features is not None else None
        return FeatureStats(self.count + other.count, self.sum + other.sum, self.outer + other.outer,
                            None if self.class_counts is None else self.class_counts + other.class_counts,
                            self.confident + other.confident, features, self.asked + other.asked,
                            self.matched + other.matched)

    # Packing for one all-reduce (the in-run evaluation sums over the training workers).
    def packed(self) -> torch.Tensor:
        parts = [np.array([self.count, self.confident, self.asked, self.matched], np.float64), self.sum,
                 self.outer.ravel()]
        if self.class_counts is not None:
            parts.append(self.class_counts)
        return torch.from_numpy(np.concatenate(parts))

    def unpacked(self, box: torch.Tensor) -> FeatureStats:
        v, dim, head = box.cpu().numpy(), len(self.sum), 4
        classes = v[head + dim + dim * dim:]
        return FeatureStats(int(round(v[0])), v[head:head + dim].copy(),
                            v[head + dim:head + dim + dim * dim].reshape(dim, dim),
                            classes.copy() if self.class_counts is not None else None, int(round(v[1])),
                            self.features, int(round(v[2])), int(round(v[3])))

    def mu_sigma(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and unbiased covariance (numpy's `np.cov`, as every FID implementation uses)."""
        if self.count < 2:
            raise ValueError(f"{self.count} image(s): a covariance needs at least 2")
        mu = self.sum / self.count
        sigma = (self.outer - self.count * np.outer(mu, mu)) / (self.count - 1)
        return mu, sigma

    def all_features(self) -> np.ndarray:
        if not self.features:
            raise ValueError("these statistics kept no features (KID needs them)")
        return np.concatenate(self.features)


def frechet_distance(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^1/2), from (mu, sigma) pairs."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    def stat(mu_sigma):
        return {"mu": np.asarray(mu_sigma[0], np.float64), "sigma": np.asarray(mu_sigma[1], np.float64)}

    stats = stat(a), stat(b)
    if not all(np.isfinite(s["mu"]).all() and np.isfinite(s["sigma"]).all() for s in stats):
        return float("nan")  # features of non-finite images (a diverged model's): no distance, never max(0, nan) = 0
    return max(0.0, fid_statistics_to_metric(*stats, verbose=False)[KEY_METRIC_FID])


def kernel_distance(a: np.ndarray, b: np.ndarray, *, seed: int = 0) -> tuple[float, float]:
    """KID (mean, std over 100 random subsets of up to 1,000 images each), as Binkowski et al. define it."""
    from torch_fidelity.metric_kid import KEY_METRIC_KID_MEAN, KEY_METRIC_KID_STD, kid_features_to_metric

    subset = min(1000, len(a), len(b))
    # torch-fidelity draws the subsets with numpy's RandomState, which takes seeds below 2**32 only.
    out = kid_features_to_metric(torch.tensor(a), torch.tensor(b), kid_subsets=100, kid_subset_size=subset,
                                 verbose=False, rng_seed=seed % 2**32)
    return out[KEY_METRIC_KID_MEAN], out[KEY_METRIC_KID_STD]


def class_matches(logits: torch.Tensor, targets: list[int]) -> int:
    """How many images the classifier reads as the class each was generated for: its most likely class (the
    argmax of `logits`, (N, K)) equals `targets[i]`."""
    if len(targets) != len(logits):
        raise ValueError(f"{len(targets)} targets for {len(logits)} images")
    return int((logits.detach().argmax(-1).cpu() == torch.as_tensor(targets, dtype=torch.long)).sum())


def coverage(stats: FeatureStats) -> dict[str, float]:
    """For classifier features: the share of classes the samples cover (each with at least a quarter of its fair
    share) and the share of samples the classifier recognises confidently."""
    counts = stats.class_counts
    assert counts is not None  # classifier features: their stats count classes
    covered = counts >= COVERAGE_SHARE * stats.count / len(counts)
    return {"coverage": float(covered.mean()), "confident": stats.confident / max(stats.count, 1)}
