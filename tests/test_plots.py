"""The PNG plots of the LR range test and of sweeps: written whole (never a half-written file under the name),
one panel per scaling rule, and a diverged (NaN) loss does not break the LR plot."""

from __future__ import annotations

import math

from PIL import Image

from raydiff.plots import plot_lr_find, plot_sweep


def test_the_lr_plot_is_written_whole_even_with_a_diverged_tail(tmp_path):
    lrs = [10 ** (-6 + i / 4) for i in range(25)]
    raw = [1.0 - i / 50 for i in range(20)] + [math.nan] * 5  # the loss diverged at the end of the range
    out = plot_lr_find(lrs, raw, raw, suggested=1e-4, steepest=3e-4, path=tmp_path / "plots" / "lr.png")
    assert out == tmp_path / "plots" / "lr.png" and Image.open(out).format == "PNG"
    assert sorted(p.name for p in out.parent.iterdir()) == ["lr.png"]  # no temporary file left


def test_a_sweep_plot_has_one_panel_per_scaling_rule(tmp_path):
    def trial(rule, batch, lr, loss, status="finished"):
        return {"rule": rule, "batch": batch, "base_lr": lr, "val_loss": loss, "status": status}

    rows = [trial("linear", 32, 1e-4, 0.10), trial("linear", 64, 1e-4, 0.09),
            trial("linear", 32, 1e-3, 0.30, "stopped")]
    one = Image.open(plot_sweep(rows, tmp_path / "one.png"))
    two = Image.open(plot_sweep(rows + [trial("sqrt", 32, 1e-4, 0.11), trial("sqrt", 32, 2e-4, None)],
                                tmp_path / "two.png"))
    assert two.width > 1.6 * one.width and abs(two.height - one.height) < 0.1 * one.height
