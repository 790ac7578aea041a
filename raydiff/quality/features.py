"""Feature extractors: uint8 images (N, C, H, W) -> features (N, D), and class logits for classifiers.

Each is small to pickle (Ray ships it to the evaluation workers) and builds its network on first use. Each has a
`key` that names its network and a digest of its weights: cached reference statistics are keyed by it, so that
statistics measured with other weights (another machine's, an older release's) are never used.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Protocol

import torch
from torch import nn

from raydiff.quality.errors import QualityError

INCEPTION_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                 "weights-inception-2015-12-05-6726825d.pth")


class Features(Protocol):
    name: str  # the network, as results name it
    key: str  # the network and a digest of its weights: the reference statistics' cache key
    classes: int  # > 0 for a classifier, whose logits give the class coverage

    @property
    def dim(self) -> int | None:  # the features' length, where known: a reference's statistics must be of as many
        ...

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def require_metrics_package(what: str) -> None:
    """The Frechet distance and KID are torch-fidelity's formulas: where it is missing (a Ray job whose runtime
    env's pip list lacks it), refuse in one line before any work, not after training."""
    try:
        import torch_fidelity  # noqa: F401
    except ImportError:
        raise QualityError(f"{what} needs torch-fidelity (the FID and KID formulas): pip install "
                           f"'torch-fidelity>=0.4' (in a Ray job, add it to the runtime env's pip list)") from None


def weights_digest(state: dict[str, torch.Tensor]) -> str:
    """A digest of a state dict's names, dtypes, shapes and bytes."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def inception_weights_path(configured: str | None) -> str:
    """The Inception-v3 weights file: `eval.inception_weights`, else torch hub's cache, downloaded there if
    missing. Raises QualityError (how to get the file) when it cannot be had."""
    if configured:
        if not os.path.isfile(configured):
            raise QualityError(f"eval.inception_weights = {configured!r}: no such file; download {INCEPTION_URL}")
        return configured
    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(INCEPTION_URL))
    if not os.path.isfile(cached):
        try:
            torch.hub.download_url_to_file(INCEPTION_URL, cached, progress=False)
        except Exception as exc:  # noqa: BLE001 - any network failure means the same thing here
            raise QualityError(f"the Inception-v3 weights for FID/KID could not be downloaded ({type(exc).__name__}); "
                               f"download {INCEPTION_URL} on a machine with internet and set "
                               f"eval.inception_weights=PATH (--weights PATH for raydiff.evaluate)") from None
    return cached


class InceptionFeatures:
    """The 2048-d pool features of the TF Inception-v3 of 2015-12-05 (the network of every published FID), as
    torch-fidelity reimplements it bit for bit, including TF's bilinear resize to 299 px.

    The weights are read here, on the driver, and travel with the object: the file need not exist on the nodes
    that compute the features."""

    name, classes, dim = "inception-2015-12-05-pool3", 0, 2048

    def __init__(self, weights_path: str) -> None:
        try:
            self.state = torch.load(weights_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - a truncated download, a wrong file: one message
            raise QualityError(f"{weights_path}: not the Inception-v3 weights ({type(exc).__name__}); download "
                               f"{INCEPTION_URL} again") from None
        self.key = f"{self.name}-{weights_digest(self.state)}"
        self._net: nn.Module | None = None

    def __getstate__(self) -> dict:
        return {"state": self.state, "key": self.key, "_net": None}

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, None]:
        if self._net is None:
            from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

            # torch-fidelity takes its weights from a file or a download: give it a file of the weights we carry.
            with tempfile.TemporaryDirectory() as folder:
                path = os.path.join(folder, os.path.basename(INCEPTION_URL))
                torch.save(self.state, path)
                self._net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                        feature_extractor_weights_path=path)
        self._net.to(images.device)
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        return self._net(images)[0], None


class DigitsFeatures:
    """The built-in digits' classifier (`raydiff.quality.digits_classifier`): 128-d features and 10 classes, with
    the weights that ship with raydiff."""

    name, classes, dim = "digits-classifier", 10, 128

    def __init__(self) -> None:
        from raydiff.quality.digits_classifier import VERSION, shipped_classifier

        net, self.accuracy = shipped_classifier()
        self.state = net.state_dict()
        self.name = f"digits-classifier-v{VERSION}"
        self.key = f"{self.name}-{weights_digest(self.state)}"
        self._net: nn.Module | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_net": None}

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._net is None:
            from raydiff.quality.digits_classifier import DigitsNet

            self._net = DigitsNet().eval()
            self._net.load_state_dict(self.state)
        return self._net.to(images.device)(images)


class ModuleFeatures:
    """Any module from float images in [0, 1] to (N, D) features: a domain-specific network, or a small one in
    tests. `name` keys the cached reference statistics."""

    classes = 0

    dim = None

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module, self.name = module.eval(), name
        self.key = f"{name}-{weights_digest(module.state_dict())}"

    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self.module.to(images.device)(images.float() / 255), None


def feature_kind(kind: str, source: str | None) -> str:
    """`eval.features` made concrete: auto = digits for builtin:digits, else inception."""
    if kind == "auto":
        return "digits" if source == "builtin:digits" else "inception"
    return kind


def features_for(kind: str, source: str | None, inception_weights: str | None) -> Features:
    """The feature network `eval.features` names (see `feature_kind`)."""
    if feature_kind(kind, source) == "digits":
        return DigitsFeatures()
    return InceptionFeatures(inception_weights_path(inception_weights))


def metric_names(features: Features) -> tuple[str, str]:
    """The metrics row's names for the Frechet distance and KID with these features."""
    if isinstance(features, InceptionFeatures):
        return "fid", "kid"
    prefix = "digits" if isinstance(features, DigitsFeatures) else "features"
    return f"{prefix}_fd", f"{prefix}_kid"
