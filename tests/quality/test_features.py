"""Feature networks: the digits classifier and its cache, and the Inception weights' one-line error."""

from __future__ import annotations

import pytest
import torch

from raydiff.quality import features as features_module
from raydiff.quality.digits_classifier import cached_classifier, digits_arrays
from raydiff.quality.features import DigitsFeatures, QualityError, features_for, inception_weights_path


def test_digits_classifier_is_accurate_and_cached(one_torch_thread):
    net, accuracy = cached_classifier()  # trains once per cache (the session's)
    assert accuracy > 0.95
    again, same = cached_classifier()
    assert same == accuracy
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), again.state_dict().values()))
    images, labels = digits_arrays()
    features, logits = DigitsFeatures()(torch.from_numpy(images[:200]))
    assert features.shape == (200, 128) and (logits.argmax(-1) == torch.from_numpy(labels[:200])).float().mean() > 0.95


def test_auto_features_follow_the_source(monkeypatch, tmp_path):
    assert isinstance(features_for("auto", "builtin:digits", None), DigitsFeatures)
    weights = tmp_path / "inception.pth"
    weights.write_bytes(b"not read until first use")
    assert features_for("auto", "/data/cifar10", str(weights)).weights_path == str(weights)


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
