"""Feature networks: the digits classifier and its cache, and the Inception weights' one-line error."""

from __future__ import annotations

import pytest
import torch

from raydiff.quality import features as features_module
from raydiff.quality.digits_classifier import cached_classifier, digits_arrays
from raydiff.quality.features import (
    DigitsFeatures,
    InceptionFeatures,
    QualityError,
    features_for,
    inception_weights_path,
)


def test_digits_classifier_is_accurate_and_cached(one_torch_thread):
    net, accuracy = cached_classifier()  # trains once per cache (the session's)
    assert accuracy > 0.95
    again, same = cached_classifier()
    assert same == accuracy
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))
    images, labels = digits_arrays()
    features, logits = DigitsFeatures()(torch.from_numpy(images[:200]))
    assert features.shape == (200, 128) and (logits.argmax(-1) == torch.from_numpy(labels[:200])).float().mean() > 0.95


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
