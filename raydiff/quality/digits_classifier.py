"""The feature network for the built-in digits: a small classifier trained on them, shipped with the package.

Inception-v3 knows nothing of 16-pixel handwritten digits (and needs a download); this network does. Its
penultimate layer gives the features of the digits' Frechet distance, its predictions the class coverage of a
set of samples. Its weights ship in `digits_classifier.pt` beside this module: trained once, by

    python -m raydiff.quality.digits_classifier --write      # rewrites digits_classifier.pt (and bump VERSION)
    python -m raydiff.quality.digits_classifier --out PATH   # trains and writes them elsewhere, to compare

so every machine measures with the same network. (Trained on each machine, as before, CPU kernels that differ by
machine gave networks, and so distances, that differ too.)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from raydiff.data.decode import fit_array

RESOLUTION = 16  # every image is seen at 16x16 grayscale, whatever the run's resolution
FEATURES = 128
VERSION = 2  # bump when the network, its training or the shipped weights change
WEIGHTS_FILE = Path(__file__).with_name("digits_classifier.pt")


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


def _split(seed: int) -> tuple[torch.Generator, torch.Tensor, torch.Tensor]:
    """(the generator, drawn on), the held-out fifth of the digits and the rest."""
    generator = torch.Generator().manual_seed(seed)
    split = torch.randperm(len(digits_arrays()[0]), generator=generator)
    return generator, split[: len(split) // 5], split[len(split) // 5:]


def held_out_accuracy(net: DigitsNet, seed: int = 0) -> float:
    """The network's accuracy on the digits `train_classifier(seed=seed)` held out."""
    images, labels = (torch.from_numpy(a) for a in digits_arrays())
    _, held_out, _ = _split(seed)
    with torch.no_grad():
        return (net.eval()(images[held_out])[1].argmax(-1) == labels[held_out]).float().mean().item()


def train_classifier(*, epochs: int = 30, seed: int = 0) -> tuple[DigitsNet, float]:
    """Train on 80% of the digits (random 1-pixel shifts), return the network and its accuracy on the rest."""
    images, labels = (torch.from_numpy(a) for a in digits_arrays())
    generator, _, train = _split(seed)
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
    return net.eval(), held_out_accuracy(net, seed)


def shipped_classifier() -> tuple[DigitsNet, float]:
    """The network with the weights that ship with raydiff, and its held-out accuracy."""
    if not WEIGHTS_FILE.is_file():
        raise FileNotFoundError(f"{WEIGHTS_FILE} is missing: reinstall raydiff, or write it with "
                                f"python -m raydiff.quality.digits_classifier --write")
    saved = torch.load(WEIGHTS_FILE, map_location="cpu", weights_only=True)
    net = DigitsNet()
    net.load_state_dict({k: v.float() for k, v in saved["state"].items()})
    return net.eval(), float(saved["accuracy"])


def write_weights(path: Path = WEIGHTS_FILE) -> float:
    """Train the network and write the weights that ship (fp16: half the bytes; they load as fp32, and define the
    network from then on). Returns the held-out accuracy of the weights as written."""
    with torch.random.fork_rng():
        net, _ = train_classifier()
    state = {k: v.half() for k, v in net.state_dict().items()}
    net.load_state_dict({k: v.float() for k, v in state.items()})
    accuracy = held_out_accuracy(net)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    torch.save({"state": state, "accuracy": accuracy, "version": VERSION}, tmp)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return accuracy


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m raydiff.quality.digits_classifier",
                                     description="Train the built-in digits' classifier and write its weights.")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--write", action="store_true",
                       help=f"overwrite the weights that ship with raydiff ({WEIGHTS_FILE.name}; bump VERSION)")
    where.add_argument("--out", type=Path, default=None, metavar="PATH", help="write the weights here instead")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The shipped weights define every digits measurement: replaced only when asked by name.
    if not args.write and args.out is None:
        print(f"raydiff: error: retraining the digits classifier overwrites the weights that ship with raydiff "
              f"({WEIGHTS_FILE}): pass --write to do so, or --out PATH to write them elsewhere", file=sys.stderr)
        return 2
    path = WEIGHTS_FILE if args.write else args.out
    if not path.parent.is_dir():
        print(f"raydiff: error: --out {path}: no such folder {path.parent}", file=sys.stderr)
        return 2
    print(f"wrote {path}: held-out accuracy {write_weights(path):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
