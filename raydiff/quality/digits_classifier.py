"""The feature network for the built-in digits: a small classifier trained once on them, then cached.

Inception-v3 knows nothing of 16-pixel handwritten digits (and needs a download); this network does, and
needs nothing but scikit-learn's digits. Its penultimate layer gives the features of the digits' Frechet
distance, its predictions the class coverage of a set of samples.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raydiff.data.datasets import cache_dir
from raydiff.data.decode import fit_array

RESOLUTION = 16  # every image is seen at 16x16 grayscale, whatever the run's resolution
FEATURES = 128
VERSION = 1  # bump when the network or its training changes: the cache key


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(),
        )
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, FEATURES), nn.ReLU())
        self.classify = nn.Linear(FEATURES, 10)

    @staticmethod
    def prepare(images: torch.Tensor) -> torch.Tensor:
        """uint8 (N, C, H, W) -> float (N, 1, 16, 16) in [-1, 1]: grayscale, resized as the training data was."""
        x = images.float() / 127.5 - 1
        if x.shape[1] == 3:
            x = x.mean(1, keepdim=True)
        if x.shape[-1] != RESOLUTION:
            x = F.interpolate(x, size=(RESOLUTION, RESOLUTION), mode="bilinear", antialias=True, align_corners=False)
        return x

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """uint8 images -> (features, logits)."""
        features = self.features(self.convs(self.prepare(images)))
        return features, self.classify(features)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as uint8 (N, 1, 16, 16), decoded as raydiff decodes images, and their labels."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    return np.stack([fit_array(p, RESOLUTION, 1) for p in pixels]), digits.target.astype(np.int64)


def train_classifier(*, epochs: int = 30, seed: int = 0) -> tuple[DigitsNet, float]:
    """Train on 80% of the digits (random 1-pixel shifts), return the network and its accuracy on the rest."""
    generator = torch.Generator().manual_seed(seed)
    images, labels = (torch.from_numpy(a) for a in digits_arrays())
    split = torch.randperm(len(images), generator=generator)
    held_out, train = split[: len(split) // 5], split[len(split) // 5:]
    torch.manual_seed(seed)
    net = DigitsNet()
    optimizer = torch.optim.Adam(net.parameters(), lr=2e-3)
    for _ in range(epochs):
        for batch in torch.randperm(len(train), generator=generator).split(64):
            x = images[train[batch]]
            shift = torch.randint(-1, 2, (2,), generator=generator).tolist()
            x = torch.roll(x, shifts=shift, dims=(2, 3))
            loss = F.cross_entropy(net(x)[1], labels[train[batch]])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    net.eval()
    with torch.no_grad():
        accuracy = (net(images[held_out])[1].argmax(-1) == labels[held_out]).float().mean().item()
    return net, accuracy


def cached_classifier() -> tuple[DigitsNet, float]:
    """The trained network from the cache ($RAYDIFF_CACHE), trained and written there on first use."""
    path = cache_dir() / f"digits-classifier-v{VERSION}.pt"
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        net = DigitsNet()
        net.load_state_dict(saved["state"])
        return net.eval(), float(saved["accuracy"])
    with torch.random.fork_rng():
        net, accuracy = train_classifier()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    torch.save({"state": net.state_dict(), "accuracy": accuracy}, tmp)
    os.replace(tmp, Path(path))
    return net, accuracy
