"""The driver's decisions that do not need a cluster: what `scaling.num_workers: auto` becomes."""

from __future__ import annotations

import pytest

from raydiff.config import ConfigError, load_config
from raydiff.training.driver import auto_workers


def test_auto_is_one_worker_per_gpu_and_one_on_cpus():
    cfg = load_config("smoke", ["scaling.num_workers=auto"])
    assert auto_workers(cfg, gpus=0).scaling.num_workers == 1
    assert auto_workers(cfg, gpus=1).scaling.num_workers == 1
    assert auto_workers(cfg, gpus=8).scaling.num_workers == 8
    # 16 images over 3 GPUs: split as evenly as possible (6, 5, 5), as an elastic run of exactly 3 does.
    assert auto_workers(cfg, gpus=3).scaling.num_workers == (3, 3)
    # More GPUs than images per step: one image per worker at most.
    assert auto_workers(cfg, gpus=64).scaling.num_workers == 16
    assert cfg.scaling.num_workers == "auto"  # the user's config is left as it is
    no_gpu = load_config("smoke", ["scaling.num_workers=auto", "scaling.use_gpu=false"])
    assert auto_workers(no_gpu, gpus=8).scaling.num_workers == 1


def test_auto_checks_the_batch_once_resolved():
    cfg = load_config("smoke", ["scaling.num_workers=auto", "train.micro_batch=16"])  # fine for 1 worker
    assert auto_workers(cfg, gpus=1).scaling.num_workers == 1
    with pytest.raises(ConfigError, match="train.micro_batch"):
        auto_workers(cfg, gpus=2)  # 8 images per worker: not a multiple of 16
    explicit = load_config("smoke", ["scaling.num_workers=2"])
    assert auto_workers(explicit, gpus=8) is explicit
