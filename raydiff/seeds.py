"""Every random number raydiff draws is a pure function of a key: the run's seed and where the number is used (a
stream position, an image index, a tag that keeps streams apart). So a run's samples, noise and grids do not
depend on the world size, the batch they fall in or the restarts before them; dropout masks are keyed by where
their micro-batch starts, so they do not depend on restarts, but another world size or micro-batch size draws
other ones.

Why on the ground floor: the data stream, the training step, sampling and evaluation all key their draws here, and
none of them should import another for it.
"""

from __future__ import annotations

import numpy as np
import torch

EVAL_NOISE = 7  # the key tag of the images of an evaluation (raydiff.evaluate, eval.every)
GRID_NOISE = 8  # the key tag of sample grids and raydiff.sample


def keyed_rng(*key: int) -> np.random.Generator:
    """A random generator that is a pure function of the key. Trailing zeros do not count: (s, e) and
    (s, e, 0) are the same key, so give each stream a distinct non-zero tag."""
    return np.random.default_rng(np.random.SeedSequence(list(key)))


def derive_seed(*key: int) -> int:
    """A 63-bit seed that is a pure function of the key, for torch generators."""
    return int(np.random.SeedSequence(list(key)).generate_state(2, np.uint64)[0] >> np.uint64(1))


def image_generators(seed: int, indices, device: torch.device | str, tag: int) -> list[torch.Generator]:
    """One generator per image, on `device`, seeded by (seed, image index, tag): image i is a pure function of
    (seed, i) on a given kind of device, whatever the batch it is generated in, and its noise is drawn where it
    is used (a CUDA generator's numbers differ from a CPU generator's)."""
    generators = []
    for i in indices:
        generator = torch.Generator(device=device)
        generator.manual_seed(derive_seed(seed, int(i), tag))
        generators.append(generator)
    return generators
