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


def test_auto_checks_the_batch_once_resolved():
    cfg = load_config("smoke", ["scaling.num_workers=auto", "train.micro_batch=16"])  # fine for 1 worker
    assert _workers(cfg, gpus=1) == 1
    with pytest.raises(ConfigError, match="train.micro_batch"):
        _workers(cfg, gpus=2)  # 8 images per worker: not a multiple of 16
    explicit = load_config("smoke", ["scaling.num_workers=2"])
    assert resolve_run(explicit, gpus=8, images=IMAGES)[0] is explicit
