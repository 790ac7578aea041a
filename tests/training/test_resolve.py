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
    # 16 images over 3 GPUs: split as evenly as possible (6, 5, 5), as any number of workers is.
    assert _workers(cfg, gpus=3) == 3
    # More GPUs than images per step: one image per worker at most.
    assert _workers(cfg, gpus=64) == 16
    assert cfg.scaling.num_workers == "auto"  # the requested config is left as it is
    no_gpu = load_config("smoke", ["scaling.num_workers=auto", "scaling.use_gpu=false"])
    assert _workers(no_gpu, gpus=8) == 1


def test_a_batch_that_the_workers_or_whole_micro_batches_do_not_divide_is_accepted_for_any_number_of_workers():
    """16 images over 3 workers, or over 2 in micro-batches of 6: split as evenly as it goes (6, 5, 5; 6 + 2 per
    worker), as an elastic run does at every world size. A number the user fixed was refused for it ("must be a
    multiple"), where `auto` and `[n, n]` trained it."""
    cfg = load_config("smoke", ["scaling.num_workers=auto", "train.micro_batch=6"])
    assert [_workers(cfg, gpus=n) for n in (1, 2, 3)] == [1, 2, 3]
    assert load_config("smoke", ["scaling.num_workers=3"]).scaling.num_workers == 3
    assert load_config("smoke", ["scaling.num_workers=2", "train.micro_batch=6"]).train.micro_batch == 6
    with pytest.raises(ConfigError, match="must be at least the number of workers"):
        load_config("smoke", ["scaling.num_workers=17"])
    explicit = load_config("smoke", ["scaling.num_workers=2"])
    assert resolve_run(explicit, gpus=8, images=IMAGES)[0] is explicit
