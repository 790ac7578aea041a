"""Measuring class-conditional models, without Ray: the class each evaluated image is asked for (its frequencies,
its purity), the class match of the digits classifier, and its statistics' sums over workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydiff.config import ConfigError, load_config
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.quality.features import DigitsFeatures, ModuleFeatures
from raydiff.quality.measure import SampleJob, class_targets, eval_labels, scores
from raydiff.quality.reference_stats import Reference
from raydiff.quality.stats import FeatureStats, class_matches

DIGITS = [str(d) for d in range(10)]


def test_labels_follow_the_class_frequencies_and_depend_on_seed_and_i_only():
    counts = [600, 0, 300, 100]
    labels = eval_labels(5, range(20000), counts)
    shares = np.bincount(labels, minlength=4) / len(labels)
    assert shares[1] == 0  # a class without images is never asked for
    assert shares == pytest.approx([0.6, 0, 0.3, 0.1], abs=0.015)
    # Image i's class is the same whatever range (worker, batch) it is drawn in; the seed changes it.
    assert eval_labels(5, range(1000, 1100), counts) == labels[1000:1100]
    assert eval_labels(5, range(7, 8), counts) == labels[7:8]
    assert eval_labels(6, range(200), counts) != labels[:200]
    assert eval_labels(0, range(50), [0, 3]) == [1] * 50
    with pytest.raises(ValueError, match="at least one image"):
        eval_labels(0, range(3), [0, 0])


def test_class_match_counts_the_argmax_that_equals_the_class_asked_for():
    logits = torch.tensor([[5.0, 0, 0], [0, 5, 0], [0, 0, 5], [0, 5, 0]])
    assert class_matches(logits, [0, 1, 2, 1]) == 4
    assert class_matches(logits, [0, 2, 2, 0]) == 2
    with pytest.raises(ValueError):
        class_matches(logits, [0, 1])
    # Sums over workers: split, added, packed for the all-reduce and unpacked, the share is the same.
    features = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    halves = [FeatureStats.empty(3, classes=3) for _ in range(2)]
    halves[0].add(features[:2], logits[:2], [0, 2])
    halves[1].add(features[2:], logits[2:], [2, 0])
    total = halves[0] + halves[1]
    assert (total.asked, total.matched) == (4, 2)
    again = total.unpacked(total.packed())
    assert (again.asked, again.matched, again.confident) == (4, 2, total.confident)
    assert np.array_equal(again.class_counts, total.class_counts) and np.array_equal(again.outer, total.outer)
    reference = Reference(*again.mu_sigma(), 4, None, "test")
    digits = DigitsFeatures.__new__(DigitsFeatures)  # only its type and classes matter to `scores`
    digits.classes = 3
    assert scores(again, reference, digits, ("fid",))["digits_class_match"] == 0.5
    unasked = FeatureStats.empty(3, classes=3)
    unasked.add(features, logits)
    assert "digits_class_match" not in scores(unasked, reference, digits, ("fid",))


def test_class_targets_only_where_the_classifier_reads_the_classes():
    digits = DigitsFeatures.__new__(DigitsFeatures)
    assert class_targets(digits, DIGITS) == tuple(range(10))
    assert class_targets(digits, ["7", "1"]) == (7, 1)
    assert class_targets(digits, ["cat", "dog"]) is None
    assert class_targets(digits, ["0", "10"]) is None
    assert class_targets(digits, [*DIGITS, "10"], [1] * 10 + [0]) == (*range(10), -1)  # "10": never asked for
    assert class_targets(digits, None) is None
    other = ModuleFeatures(torch.nn.Flatten(), "test-flat")
    assert class_targets(other, DIGITS) is None


def test_a_conditional_job_asks_each_image_for_its_class():
    cfg = load_config("smoke", ["data.labels=auto", "model.num_classes=3"], check_source=False)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    for p in model.parameters():  # the zero-initialised output layers would make every image the same
        torch.nn.init.normal_(p, std=0.05)
    job = SampleJob(model=model, diffusion=build_diffusion(cfg), shape=(1, 8, 8), sampler="ddim", steps=3, seed=1,
                    class_counts=(2, 1, 1), guidance=2.0, class_targets=(4, 5, 6))
    labels = job.labels(range(6))
    assert labels == eval_labels(1, range(6), (2, 1, 1)) and job.targets(labels) == [(4, 5, 6)[k] for k in labels]
    images = job.images(range(6), torch.device("cpu"))
    # Image i with its own class, alone or in a batch; another guidance gives other images.
    assert torch.equal(job.images(range(4, 5), torch.device("cpu"))[0], images[4])
    conditional = SampleJob(**{**job.__dict__, "guidance": 1.0}).images(range(6), torch.device("cpu"))
    assert not torch.equal(conditional, images)


def test_eval_guidance_is_checked():
    assert load_config("smoke", check_source=False).eval.guidance == 2.0
    assert load_config("smoke", ["data.labels=auto", "model.num_classes=auto", "eval.guidance=3"],
                       check_source=False).eval.guidance == 3.0
    with pytest.raises(ConfigError, match=r"eval.guidance = -1.0: must be a number >= 0"):
        load_config("smoke", ["data.labels=auto", "model.num_classes=3", "eval.guidance=-1"], check_source=False)
