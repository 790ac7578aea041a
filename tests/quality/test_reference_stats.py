"""The reference statistics that samples are compared with: an .npz given as eval.ref, and the cache of those
computed from a run's data (no Ray: the feature sums are stubbed)."""

from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from raydiff.config import load_config
from raydiff.quality import reference_stats
from raydiff.quality.errors import QualityError
from raydiff.quality.features import ModuleFeatures
from raydiff.quality.stats import FeatureStats


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


WHOLE = _npz(mu=np.zeros(4), sigma=np.eye(4), count=10)


@pytest.mark.parametrize("content, problem", [
    (b"", "not a readable .npz (empty, cut short, or another kind of file)"),
    (WHOLE[:len(WHOLE) // 2], "not a readable .npz (empty, cut short, or another kind of file)"),
    (WHOLE[:-1], "not a readable .npz (empty, cut short, or another kind of file)"),
    (b"mu,sigma\n", "not a readable .npz (empty, cut short, or another kind of file)"),
    (_npz(sigma=np.eye(4)), "not an .npz with mu and sigma ("),
    (_npz(mu=np.zeros(4), sigma=np.eye(4), count=[1, 2]), "not an .npz with mu and sigma ("),
], ids=["empty", "cut in half", "cut by one byte", "text", "no mu", "a count of two"])
def test_an_eval_ref_that_is_no_npz_of_statistics_is_refused_in_one_line(tmp_path, content, problem):
    """raydiff.evaluate --ref ref.npz met numpy's EOFError or zipfile's BadZipFile as a traceback."""
    (tmp_path / "ref.npz").write_bytes(content)
    cfg = load_config("default", [f"eval.ref={tmp_path / 'ref.npz'}"], check_source=False)
    with pytest.raises(QualityError) as refused:
        reference_stats.reference_for(cfg, ModuleFeatures(nn.Flatten(), "flat"), keep_features=False)
    assert str(refused.value).startswith(f"eval.ref {tmp_path / 'ref.npz'}: {problem}")
    assert "\n" not in str(refused.value) and "pickle" not in str(refused.value)


def _first_two_pixels(computed: list[int]):
    """`parallel_stats` without Ray: each image's first two pixels as its features; the images' counts noted."""
    def stats(kind, arrays, features, n, **kw):
        computed.append(n)
        out = FeatureStats.empty(2)
        out.add(torch.from_numpy(arrays.reshape(len(arrays), -1)[:, :2].astype(np.float64)))
        return out

    return stats


def test_a_cached_reference_that_does_not_read_is_computed_again_and_replaced(tmp_path, monkeypatch, capsys):
    """The cache is the run's own (written whole, then renamed), yet a copy or a disk can cut it short: it is a
    cache, so the statistics are computed again, where reading it was a traceback."""
    from PIL import Image

    source = tmp_path / "images"
    source.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(source / "a.png")
    images = np.random.default_rng(0).integers(0, 256, (6, 1, 8, 8), dtype=np.uint8)
    computed = []

    monkeypatch.setattr(reference_stats, "parallel_stats", _first_two_pixels(computed))
    cfg = load_config("smoke", [f"data.source={source}", f"run.storage={tmp_path / 'runs'}", "data.channels=1",
                                "data.resolution=8"], check_source=False)
    features = ModuleFeatures(nn.Flatten(), "flat")
    data = SimpleNamespace(arrays=lambda: [images], usable_indices=lambda: np.arange(len(images)))
    first = reference_stats.reference_for(cfg, features, keep_features=False, images=data)
    (cached,) = (tmp_path / "runs" / reference_stats.CACHE_FOLDER).glob("*.npz")
    whole = cached.read_bytes()
    assert reference_stats.reference_for(cfg, features, keep_features=False).count == 6 and computed == [6]

    cached.write_bytes(whole[:len(whole) // 2])
    again = reference_stats.reference_for(cfg, features, keep_features=False, images=data)
    assert computed == [6, 6] and np.array_equal(again.mu, first.mu) and np.array_equal(again.sigma, first.sigma)
    assert cached.read_bytes() == whole  # replaced whole
    assert capsys.readouterr().err == (
        f"[raydiff] note: {cached}, where {first.description} were cached, cannot be read (not a readable .npz "
        f"(empty, cut short, or another kind of file)); computing them again\n")


def test_a_reference_of_one_image_is_refused_in_one_line_naming_it(tmp_path, monkeypatch):
    """A covariance needs two images: it was a ValueError traceback, at a run's start or in `evaluate`."""
    from PIL import Image

    ref = tmp_path / "ref"
    ref.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(ref / "a.png")

    monkeypatch.setattr(reference_stats, "parallel_stats", _first_two_pixels([]))
    cfg = load_config("smoke", [f"eval.ref={ref}", f"run.storage={tmp_path / 'runs'}", "data.channels=1",
                                "data.resolution=8"], check_source=False)
    one = SimpleNamespace(arrays=lambda: [np.zeros((1, 1, 8, 8), np.uint8)], usable_indices=lambda: np.arange(1))
    monkeypatch.setattr("raydiff.data.run_images.open_images", lambda *a, **kw: (one, ""))
    with pytest.raises(QualityError) as refused:
        reference_stats.reference_for(cfg, ModuleFeatures(nn.Flatten(), "flat"), keep_features=False)
    assert str(refused.value) == (f"eval.ref = '{ref}': 1 usable image(s); the reference statistics need at "
                                  f"least 2")
