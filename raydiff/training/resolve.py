"""The config a run trains with, resolved once from the config the user asked for: every `auto` the driver can
know made concrete, in one place.

A config is resolved in three stages, each by what only it can see: when it is loaded, what the config alone
decides (`train.lr` by the scaling rule: `raydiff.config.learning_rate`); here, on the driver, what the cluster
and the data decide (`scaling.num_workers`, `model.num_classes`); on each worker at its set-up, what only the
device can tell (`train.micro_batch: auto` and activation checkpointing, `raydiff.training.microbatch`; compile,
NHWC, CUDA graphs, `raydiff.training.speed`). `requested` stays as the user wrote it (it is what a continuing run
is compared with); `resolved` is what the workers get.
"""

from __future__ import annotations

from typing import Any

from raydiff.cluster.devices import trains_on_gpus
from raydiff.config import Config, ConfigError
from raydiff.config.checks import check_workers
from raydiff.data.run_images import RunImages
from raydiff.model.diffusers_io import check_classes


def resolve_run(requested: Config, *, gpus: float, images: RunImages,
                init_weights: Any = None) -> tuple[Config, dict[str, Any] | None]:
    """(the resolved config, the run's classes as {"names", "counts"} or None for an unconditional run). `gpus`:
    the cluster's GPUs; `images`: the run's decoded images; `init_weights`: model.init_from's state dict, if a new
    run starts from it. Refused in one line: a batch the resolved workers cannot split, fewer classes than the
    data has, init_from weights made for another number of classes."""
    resolved = requested
    if requested.scaling.auto:
        resolved = resolved.replaced("scaling", num_workers=auto_workers(requested, gpus))
        check_workers(resolved)
    wanted = requested.model.num_classes
    if not wanted:
        return resolved, None
    names = list(images.classes)
    found = len(names)
    if wanted == "auto":
        if init_weights is not None:  # an int model.num_classes was checked against the UNet's config before
            check_classes(init_weights, found, init_from=str(requested.model.init_from), auto=True)
        resolved, wanted = resolved.replaced("model", num_classes=found), found
    elif wanted < found:
        raise ConfigError(f"model.num_classes = {wanted}: smaller than the {found} classes found in "
                          f"data.source = {requested.data.source!r}; set it to at least {found}, or auto")
    counts = images.class_counts()
    # A model may have more classes than the data (model.num_classes = N): the extra ones are named by their id.
    names += [str(i) for i in range(found, wanted)]
    counts = list(counts) + [0] * (wanted - found)
    return resolved, {"names": names, "counts": counts}


def auto_workers(requested: Config, gpus: float) -> int:
    """What `scaling.num_workers: auto` becomes: one worker per GPU of the cluster (`gpus`, at most one per image of
    the global batch), or one worker with every CPU where the run does not use GPUs."""
    use_gpu = trains_on_gpus(requested.scaling, gpus)  # auto: with any GPU (one worker is the fewest)
    return max(1, min(int(gpus), requested.train.global_batch)) if use_gpu else 1
