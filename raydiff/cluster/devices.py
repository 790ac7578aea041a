"""Which device a command computes on: `--device auto` (a CUDA GPU where there is one, else the CPU) or a name
checked against this machine. (Training workers get theirs from Ray Train.)"""

from __future__ import annotations

import torch


def resolve_device(name: str) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` as a device of this machine; ValueError (one line) for others."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name}: expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device on this machine")
    return device
