"""Generating and measuring images on Ray tasks, with a small injected feature extractor (the Inception path's
code without its download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from raydiff.cluster.host_memory import host_memory_kept
from raydiff.config import Config
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.quality.digits_classifier import digits_arrays
from raydiff.quality.features import ModuleFeatures
from raydiff.quality.measure import SampleJob, parallel_stats, scores, task_options
from raydiff.quality.reference_stats import Reference

pytestmark = pytest.mark.ray


def small_extractor() -> ModuleFeatures:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten())
    return ModuleFeatures(net, "test-conv")


def _reference(stats) -> Reference:
    mu, sigma = stats.mu_sigma()
    return Reference(mu, sigma, stats.count, stats.all_features() if stats.features else None, "test")


def test_fid_of_a_set_against_itself_shifted_and_over_1_or_2_workers(ray_session):
    images = digits_arrays()[0][:600]
    features = small_extractor()
    # The same chunks, summed alike, over one or two workers, whether their processes keep host memory or not.
    one = parallel_stats("arrays", images, features, len(images), host_memory=False, workers=1, keep_features=True)
    two = parallel_stats("arrays", images, features, len(images), host_memory="auto", workers=2, keep_features=True)
    assert np.array_equal(one.sum, two.sum) and np.array_equal(one.outer, two.outer)
    brighter = np.clip(images.astype(np.int16) + 60, 0, 255).astype(np.uint8)
    shifted = parallel_stats("arrays", brighter, features, len(images), host_memory="auto", workers=2,
                             keep_features=True)
    reference = _reference(one)
    same, moved = (scores(s, reference, features, ("fid", "kid")) for s in (two, shifted))
    assert same["features_fd"] == pytest.approx(0, abs=1e-8) and abs(same["features_kid"]) < 1e-3
    assert moved["features_fd"] > 1e-3 and moved["features_kid"] > 1e-3


def test_measuring_tasks_on_cpus_start_with_their_freed_host_memory_kept(ray_session):
    probe = ray_session.remote(host_memory_kept)  # in the task's own process
    kept = ray_session.get(probe.options(**task_options(False, "auto")).remote())
    returned = ray_session.get(probe.options(**task_options(False, False)).remote())
    assert kept and not returned
    assert "runtime_env" not in task_options(True, "auto")  # on a GPU, the activations are not in host memory


def test_image_i_depends_on_seed_and_i_only():
    cfg = Config.from_dict({"data": {"resolution": 8}, "model": {"base_channels": 16, "channel_mult": [1, 2],
                                                                 "attention_resolutions": [4], "norm_groups": 8}})
    torch.manual_seed(0)
    job = SampleJob(model=build_model(cfg).eval(), diffusion=build_diffusion(cfg), shape=(1, 8, 8), sampler="ddpm",
                    steps=5, seed=3)
    for p in job.model.parameters():  # the zero-initialised output layers would make every image the same
        nn.init.normal_(p, std=0.05)
    batch = job.images(range(5), torch.device("cpu"))
    alone = job.images(range(3, 4), torch.device("cpu"))
    assert batch.dtype == torch.uint8 and torch.equal(batch[3], alone[0]) and not torch.equal(batch[2], batch[3])
    other_seed = SampleJob(**{**job.__dict__, "seed": 4}).images(range(3, 4), torch.device("cpu"))
    assert not torch.equal(other_seed, alone)
    # At most 2 images per forward pass (a 256x256 model on a small GPU): the same images.
    assert torch.equal(SampleJob(**{**job.__dict__, "batch": 2}).images(range(5), torch.device("cpu")), batch)


def test_a_reference_of_another_networks_features_is_refused_before_any_sampling(tmp_path):
    """An Inception .npz (2048-d) given to a run measured with the digits classifier (128-d) failed in the
    metrics package's assertion, after every image had been sampled."""
    from raydiff.config import load_config
    from raydiff.quality.errors import QualityError
    from raydiff.quality.features import DigitsFeatures
    from raydiff.quality.reference_stats import reference_for

    np.savez(tmp_path / "inception.npz", mu=np.zeros(2048), sigma=np.eye(2048))
    cfg = load_config("default", [f"eval.ref={tmp_path / 'inception.npz'}"], check_source=False)
    with pytest.raises(QualityError, match=r"^eval.ref = .*inception.npz': statistics of 2048-d features, and this "
                                           r"run measures with digits-classifier-v\d+, whose features are 128-d"):
        reference_for(cfg, DigitsFeatures(), keep_features=False)


def test_the_best_row_of_an_evaluation_is_chosen_by_whichever_distance_it_measured():
    from raydiff.evaluate import best_line

    rows = [{"sigma_rel": 0.05, "kid": 0.2}, {"sigma_rel": 0.1, "kid": 0.1}]  # --metrics kid
    assert best_line(rows) == "sigma_rel 0.1: kid 0.1"
    rows = [{"guidance": 1.0, "features_fd": 3.0, "features_kid": 0.1}, {"guidance": 2.0, "features_fd": 2.0}]
    assert best_line(rows) == "guidance 2: features_fd 2"


def test_a_streamed_reference_leaves_out_the_images_a_run_does_not_train_on(tmp_path, monkeypatch):
    """Streamed, the reference took every row of the shards, rows without a label included; in memory, the usable
    images only: one key, two sets of images, whichever ran first cached. Now the usable ones either way."""
    from raydiff.config import load_config
    from raydiff.data.errors import BadSample
    from raydiff.data.shard_format import write_prepared
    from raydiff.data.sharded import ShardedImages
    from raydiff.data.sources import open_source
    from raydiff.quality import reference_stats
    from raydiff.quality.stats import FeatureStats

    shape = (1, 8, 8)
    images = np.random.default_rng(0).integers(0, 256, (40, *shape), dtype=np.uint8)
    digits = tmp_path / "digits"
    source = open_source(str(_one_png(tmp_path / "raw")))
    write_prepared(iter([(images, [])]), source, str(digits), shape=shape, rows_per_shard=16)
    prepared = open_source(str(digits))
    sharded = ShardedImages(uri=str(digits), source=str(digits), filesystem=prepared.filesystem, files=prepared.files,
                            counts=(16, 16, 8), shape=shape, window_shards=1, buffer_bytes=1,
                            bad=tuple(BadSample(index=i, where=f"row {i}", reason="no label") for i in (3, 20, 39)))
    seen: list[int] = []

    def stats(kind, arrays, features, n, **kw):
        seen.extend(int(v) for v in arrays.reshape(len(arrays), -1)[:, 0])
        out = FeatureStats.empty(1)
        out.add(torch.from_numpy(arrays.reshape(len(arrays), -1)[:, :1].astype(np.float64)))
        return out

    monkeypatch.setattr(reference_stats, "parallel_stats", stats)
    cfg = load_config("smoke", [f"data.source={digits}", f"run.storage={tmp_path / 'runs'}", "data.channels=1",
                                "data.resolution=8"], check_source=False)
    features = ModuleFeatures(nn.Flatten(), "flat")
    reference = reference_stats.reference_for(cfg, features, keep_features=False, images=sharded)
    usable = [i for i in range(40) if i not in (3, 20, 39)]
    assert reference.count == 37 and seen == [int(images[i].reshape(-1)[0]) for i in usable]


def _one_png(folder):
    from PIL import Image

    folder.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "a.png")
    return folder
