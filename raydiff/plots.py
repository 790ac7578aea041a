"""PNG plots for the LR range test and for sweeps (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on clusters, CI or laptops over ssh
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter

from raydiff.storage.atomic import new_file


def _save(fig, path: Path) -> Path:
    try:
        with new_file(path) as tmp:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)
    return Path(path)


def plot_lr_find(lrs: Sequence[float], raw: Sequence[float], smoothed: Sequence[float], *, suggested: float,
                 steepest: float, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(lrs, raw, color="0.75", linewidth=0.8, label="loss")
    ax.plot(lrs, smoothed, color="C0", label="smoothed loss")
    ax.axvline(suggested, color="C2", linestyle="--", label=f"suggested {suggested:.2g}")
    ax.axvline(steepest, color="C3", linestyle=":", label=f"steepest descent {steepest:.2g}")
    ax.set(xscale="log", xlabel="learning rate", ylabel="training loss", title="LR range test")
    ax.xaxis.set_minor_formatter(NullFormatter())  # decade labels only: minor ones overlap
    finite = [v for v in smoothed if v == v]
    if finite:
        ax.set_ylim(min(finite) * 0.9, min(max(finite), 4 * min(finite)) * 1.1)
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_sweep(rows: Sequence[dict], path: Path) -> Path:
    """Validation loss against the base learning rate: one line per batch size, one panel per scaling rule.
    Filled markers: trials that used the whole image budget; crosses: stopped early or diverged (the value at their
    last validation point)."""
    rules = sorted({r["rule"] for r in rows})
    fig, axes = plt.subplots(1, len(rules), figsize=(5 * len(rules), 4), squeeze=False, sharey=True)
    for ax, rule in zip(axes[0], rules, strict=True):
        for i, batch in enumerate(sorted({r["batch"] for r in rows if r["rule"] == rule})):
            trials = sorted((r for r in rows
                             if r["rule"] == rule and r["batch"] == batch and r["val_loss"] is not None),
                            key=lambda r: r["base_lr"])
            done = [r for r in trials if r["status"] == "finished"]
            stopped = [r for r in trials if r["status"] != "finished"]
            ax.plot([r["base_lr"] for r in done], [r["val_loss"] for r in done], "o-", color=f"C{i}",
                    label=f"batch {batch}")
            ax.plot([r["base_lr"] for r in stopped], [r["val_loss"] for r in stopped], "x", color=f"C{i}")
        ax.set(xscale="log", xlabel="base learning rate (at train.base_batch)", title=f"lr scaling: {rule}")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("validation loss (x: stopped early or diverged)")
    return _save(fig, path)
