"""The config a run trains with, resolved from the requested one: what `scaling.num_workers: auto` becomes."""

from __future__ import annotations

import pytest

from raydiff.config import ConfigError, load_config
from raydiff.data.image_store import ImageStore
from raydiff.training.resolve import resolve_run

IMAGES = ImageStore(chunks=(), counts=(), shape=(1, 8, 8), source="test")  # an unconditional run reads no classes


def _workers(cfg, gpus: int):
    return resolve_run(cfg, gpus=gpus, images=IMAGES)[0].scaling.num_workers


def test_auto_is_one_worker_per_gpu_and_one_on_cpus():
    cfg = load_config("smoke", ["scaling.num_workers=auto"])
    assert _workers(cfg, gpus=0) == 1
    assert _workers(cfg, gpus=1) == 1
    assert _workers(cfg, gpus=8) == 8
    # 16 images over 3 GPUs: split as evenly as possible (6, 5, 5), as an elastic run of exactly 3 does.
    assert _workers(cfg, gpus=3) == (3, 3)
    # More GPUs than images per step: one image per worker at most.
    assert _workers(cfg, gpus=64) == 16
    assert cfg.scaling.num_workers == "auto"  # the requested config is left as it is
    no_gpu = load_config("smoke", ["scaling.num_workers=auto", "scaling.use_gpu=false"])
    assert _workers(no_gpu, gpus=8) == 1


def test_auto_splits_a_batch_that_whole_micro_batches_do_not_as_an_elastic_run_of_that_size():
    """16 images over 2 GPUs with micro-batches of 6: 8 per worker is no multiple of 6, which a fixed number of
    workers is refused for; `auto` splits it as an elastic run of exactly 2 does, in micro-batches of up to 6, as
    it does a batch that the GPUs do not divide (which was accepted where this one was refused)."""
    cfg = load_config("smoke", ["scaling.num_workers=auto", "train.micro_batch=6"])
    assert _workers(cfg, gpus=1) == (1, 1)
    assert _workers(cfg, gpus=2) == (2, 2)
    assert _workers(cfg, gpus=3) == (3, 3)
    fits = load_config("smoke", ["scaling.num_workers=auto", "train.micro_batch=4"])
    assert _workers(fits, gpus=2) == 2 and _workers(fits, gpus=4) == 4 and _workers(fits, gpus=8) == (8, 8)
    with pytest.raises(ConfigError, match="8 images per worker must be a multiple of micro_batch"):
        load_config("smoke", ["scaling.num_workers=2", "train.micro_batch=6"])  # a number the user fixed
    explicit = load_config("smoke", ["scaling.num_workers=2"])
    assert resolve_run(explicit, gpus=8, images=IMAGES)[0] is explicit
