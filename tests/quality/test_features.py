"""Feature networks: the shipped digits classifier, the weights' digests that key cached statistics, and the
Inception weights' one-line error."""

from __future__ import annotations

import pytest
import torch

from raydiff.quality import features as features_module
from raydiff.quality.digits_classifier import digits_arrays, shipped_classifier
from raydiff.quality.errors import QualityError
from raydiff.quality.features import (
    DigitsFeatures,
    InceptionFeatures,
    ModuleFeatures,
    features_for,
    inception_weights_path,
)

# The shipped weights, and a distance measured with them: the same on every machine (up to float rounding).
DIGITS_KEY = "digits-classifier-v2-47347c7366896c46"
DIGITS_HALVES_FD = 91.56574170996737  # the first 900 digits against the other 897


def test_the_digits_classifier_ships_with_raydiff_and_measures_the_same_everywhere():
    from raydiff.quality.stats import FeatureStats, frechet_distance

    net, accuracy = shipped_classifier()
    assert accuracy > 0.95
    features = DigitsFeatures()
    assert features.key == DIGITS_KEY  # the reference statistics' cache key names these weights
    images, labels = digits_arrays()
    halves = []
    for part in (images[:900], images[900:]):
        f, logits = features(torch.from_numpy(part))
        stats = FeatureStats.empty(f.shape[1], classes=10, keep_features=False)
        stats.add(f, logits)
        halves.append(stats.mu_sigma())
    assert f.shape == (897, 128) and (logits.argmax(-1) == torch.from_numpy(labels[900:])).float().mean() > 0.95
    assert frechet_distance(*halves) == pytest.approx(DIGITS_HALVES_FD, rel=1e-4)


def test_the_cache_key_follows_the_weights():
    module = torch.nn.Linear(4, 2)
    first = ModuleFeatures(module, "tiny").key
    with torch.no_grad():
        module.weight[0, 0] += 1
    assert ModuleFeatures(module, "tiny").key != first and first.startswith("tiny-")


def test_auto_features_follow_the_source(tmp_path):
    assert isinstance(features_for("auto", "builtin:digits", None), DigitsFeatures)
    weights = tmp_path / "inception.pth"
    torch.save({"fc.weight": torch.ones(2, 2)}, weights)
    assert isinstance(features_for("auto", "/data/cifar10", str(weights)), InceptionFeatures)


def test_inception_weights_travel_with_the_extractor(tmp_path, monkeypatch):
    """Read on the driver, pickled to the workers: a node without the file still builds the network from them."""
    import pickle

    from torch_fidelity import feature_extractor_inceptionv3

    state = {"Conv2d_1a_3x3.conv.weight": torch.randn(4, 3, 3, 3)}
    weights = tmp_path / "inception.pth"
    torch.save(state, weights)
    features = pickle.loads(pickle.dumps(InceptionFeatures(str(weights))))
    weights.unlink()  # as on a worker node that never had the file
    built = {}

    class FakeInception(torch.nn.Module):  # the real one needs the 92 MB weights
        def __init__(self, name, features_list, feature_extractor_weights_path=None):
            super().__init__()
            built["state"] = torch.load(feature_extractor_weights_path, weights_only=True)

        def forward(self, x):
            assert x.dtype == torch.uint8 and x.shape[1] == 3
            return (x.float().mean((2, 3)),)

    monkeypatch.setattr(feature_extractor_inceptionv3, "FeatureExtractorInceptionV3", FakeInception)
    out, logits = features(torch.zeros(2, 1, 8, 8, dtype=torch.uint8))  # grayscale is repeated to 3 channels
    assert out.shape == (2, 3) and logits is None
    assert torch.equal(built["state"]["Conv2d_1a_3x3.conv.weight"], state["Conv2d_1a_3x3.conv.weight"])
    broken = tmp_path / "broken.pth"
    broken.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(QualityError, match="not the Inception-v3 weights"):
        InceptionFeatures(str(broken))


def test_missing_inception_weights_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))

    def offline(url, dst, progress=True):
        raise OSError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", offline)
    with pytest.raises(QualityError) as excinfo:
        inception_weights_path(None)
    message = str(excinfo.value)
    assert "\n" not in message and features_module.INCEPTION_URL in message and "eval.inception_weights=PATH" in message
    with pytest.raises(QualityError, match="no such file"):
        inception_weights_path(str(tmp_path / "missing.pth"))
