"""Generating images and reducing them to feature statistics, on one process or spread over Ray tasks.

Image i of an evaluation is a pure function of (seed, i): it has its own noise generator on the sampling device, as
in EDM, and for a class-conditional model the class it is asked for comes from its own key (seed, i, tag), drawn in
the training data's class frequencies (`eval_labels`). Images are generated and measured in fixed chunks of
`CHUNK_IMAGES` (the same batches whatever the number of workers), and the chunks' float64 sums are added in chunk
order, so the result does not depend on the worker count.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydiff.cluster.host_memory import HOST_MEMORY_ENV, keep_host_memory
from raydiff.cluster.tasks import free_now, results_of, waiting_note
from raydiff.model.diffusion import full_fp32
from raydiff.quality.features import DigitsFeatures, Features, metric_names
from raydiff.quality.stats import FeatureStats, coverage, frechet_distance, kernel_distance
from raydiff.seeds import EVAL_NOISE, derive_seed

CHUNK_IMAGES = 100
EVAL_LABELS = 0x6C6162656C  # the key tag of the class asked of each evaluated image: apart from its noise's


def chunks(num: int) -> list[range]:
    return [range(start, min(start + CHUNK_IMAGES, num)) for start in range(0, num, CHUNK_IMAGES)]


def eval_labels(seed: int, indices: range, counts: Sequence[int]) -> list[int]:
    """The class each image of `indices` is generated for, in the proportions of `counts` (images per class in the
    training data). Image i's class is a pure function of (seed, i): a uniform integer below sum(counts) from the
    key (seed, i, EVAL_LABELS), looked up in the counts' cumulative sums; so it does not depend on how the images
    are split over workers or batches, and a class with no images is never asked for."""
    cumulative, running = [], 0
    for count in counts:
        running += int(count)
        cumulative.append(running)
    if running <= 0:
        raise ValueError(f"class counts {list(counts)}: need at least one image")
    # derive_seed gives 63 uniform bits: scaling them (exact integer arithmetic) is uniform on [0, total).
    return [bisect.bisect_right(cumulative, (derive_seed(seed, int(i), EVAL_LABELS) * running) >> 63)
            for i in indices]


def class_targets(features: Features, names: Sequence[str] | None,
                  counts: Sequence[int] | None = None) -> tuple[int, ...] | None:
    """The feature classifier's class for each of the model's classes, where they correspond: the digits
    classifier reads digits, so a model whose classes are named "0".."9" can be checked against it (the class
    match). Classes with no training images (`counts` 0: never asked for) may have any name (-1). None where they
    do not correspond (other features, other names)."""
    if not names or not isinstance(features, DigitsFeatures):
        return None
    targets = []
    for k, name in enumerate(names):
        if re.fullmatch(r"[0-9]", str(name)):
            targets.append(int(name))
        elif counts is not None and k < len(counts) and int(counts[k]) == 0:
            targets.append(-1)
        else:
            return None
    return tuple(targets)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] -> uint8 [0, 255], rounded as a PNG of the image would be."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


@dataclass
class SampleJob:
    """What to generate: `sampler` with `steps` from a model, image i seeded by (seed, i). A class-conditional
    model's images are asked for classes drawn in the proportions of `class_counts` (`eval_labels`), with
    classifier-free `guidance` (diffusers' convention: 1 = conditional, 0 = unconditional)."""

    model: torch.nn.Module
    diffusion: Any  # raydiff.model.diffusion.GaussianDiffusion
    shape: tuple[int, int, int]
    sampler: str
    steps: int
    seed: int
    batch: int | None = None  # the most images per forward pass (None: a whole chunk); images do not depend on it
    class_counts: tuple[int, ...] | None = None  # training images per class; None: unconditional
    guidance: float = 1.0
    class_targets: tuple[int, ...] | None = None  # the feature classifier's class per class id (`class_targets`)

    def labels(self, indices: range) -> list[int] | None:
        """The class asked of each image of `indices` (None for an unconditional model)."""
        return None if self.class_counts is None else eval_labels(self.seed, indices, self.class_counts)

    def targets(self, labels: list[int] | None) -> list[int] | None:
        """The classifier's class for each asked class, where the class match applies."""
        if labels is None or self.class_targets is None:
            return None
        return [self.class_targets[label] for label in labels]

    @torch.no_grad()
    def images(self, indices: range, device: torch.device, labels: list[int] | None = None) -> torch.Tensor:
        """uint8 images `indices` (`labels`: their classes, if already drawn)."""
        labels = self.labels(indices) if labels is None else labels
        chunks = self.diffusion.sample_in_chunks(self.model, indices, self.shape, batch=self.batch or len(indices),
                                                 seed=self.seed, tag=EVAL_NOISE, device=device,
                                                 sampler=self.sampler, steps=self.steps, labels=labels,
                                                 guidance=self.guidance)
        return to_uint8(torch.cat(list(chunks)))


def empty_stats(features: Features, keep_features: bool, dim: int) -> FeatureStats:
    return FeatureStats.empty(dim, classes=features.classes, keep_features=keep_features)


@torch.no_grad()
def stats_of(images: torch.Tensor, features: Features, keep_features: bool,
             targets: list[int] | None = None) -> FeatureStats:
    """The statistics of one batch of uint8 images (features in full fp32, as the reference's); `targets`: the
    classifier's class each image was generated for."""
    with full_fp32():
        f, logits = features(images)
    stats = empty_stats(features, keep_features, f.shape[1])
    stats.add(f, logits, targets)
    return stats


def total(parts: list[FeatureStats]) -> FeatureStats:
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


def sample_stats(job: SampleJob, features: Features, ranges: list[range], device: torch.device,
                 keep_features: bool) -> list[FeatureStats]:
    """Generate and measure each range of image indices (one batch each) on this process."""
    job.model.to(device).eval()
    out = []
    for r in ranges:
        labels = job.labels(r)
        out.append(stats_of(job.images(r, device, labels), features, keep_features, job.targets(labels)))
    return out


def array_stats(arrays: np.ndarray, features: Features, ranges: list[range], device: torch.device,
                keep_features: bool) -> list[FeatureStats]:
    """Measure ranges of rows of a uint8 (N, C, H, W) array (real images, for the reference)."""
    return [stats_of(torch.from_numpy(np.array(arrays[r.start:r.stop])).to(device), features,
                     keep_features) for r in ranges]


@ray.remote
def _remote(kind: str, payload: Any, features: Features, ranges: list[range], keep_features: bool):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(1)  # one task per CPU
    if kind == "sample":
        return sample_stats(payload, features, ranges, device, keep_features)
    return array_stats(payload, features, ranges, device, keep_features)


def parallel_stats(kind: str, payload: Any, features: Features, num: int, *, host_memory: Literal["auto"] | bool,
                   workers: int | None = None, keep_features: bool = False) -> FeatureStats:
    """Statistics of `num` images (kind "sample": a SampleJob; "arrays": a uint8 array) over `workers` Ray tasks
    (default: one per free GPU of the cluster, else one per free CPU; one per GPU or CPU, all waiting, where none
    is free, said in one line), each taking an equal run of chunks. `host_memory`: the run's
    `train.keep_host_memory`, for the tasks' processes."""
    resources = ray.cluster_resources()
    unit = "GPU" if resources.get("GPU", 0) >= 1 else "CPU"  # what each task takes one of
    units = int(resources.get(unit, 1))
    all_chunks = chunks(num)
    tasks = max(1, min(workers or units, len(all_chunks)))
    free = free_now(unit, min(tasks, units))
    if workers is None and free:
        tasks = min(tasks, free)  # no part queued behind what another job holds
    note = waiting_note(unit, units, free, min(tasks, units))  # beyond the cluster's units, tasks wait for each other
    if note:
        print(f"[raydiff] {note}", flush=True)
    payload_ref, features_ref = ray.put(payload), ray.put(features)  # once, not once per task (Inception: 92 MB)
    parts = np.array_split(np.arange(len(all_chunks)), tasks)
    options = task_options(unit == "GPU", host_memory)
    futures = [_remote.options(**options).remote(kind, payload_ref, features_ref, [all_chunks[i] for i in part],
                                                 keep_features) for part in parts]
    return total([s for result in results_of(futures) for s in result])


def task_options(use_gpu: bool, host_memory: Literal["auto"] | bool) -> dict[str, Any]:
    """A measuring task's Ray options: a whole GPU, or one CPU; outside the caller's placement group (a Tune
    trial's holds no CPU for this: the cluster's free resources); and, where its process computes on CPUs, the
    allocator's settings that keep what each pass frees, read as Ray starts the process."""
    options: dict[str, Any] = {"num_gpus": 1, "num_cpus": 0} if use_gpu else {"num_cpus": 1}
    # Ray documents placement_group=None as "no group", but annotates the parameter without None.
    options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group=None)  # type: ignore[arg-type]
    if keep_host_memory(host_memory, use_gpu=use_gpu):
        options["runtime_env"] = {"env_vars": HOST_MEMORY_ENV}
    return options


def scores(samples: FeatureStats, reference: Any, features: Features, metrics: tuple[str, ...],
           seed: int = 0) -> dict[str, float]:
    """The metrics row of an evaluation: the Frechet distance, KID if asked (and the class coverage for a
    classifier, and the class match where the images were asked for classes it reads). `reference` is a
    `raydiff.quality.reference_stats.Reference`."""
    fd_name, kid_name = metric_names(features)
    out: dict[str, float] = {}
    if "fid" in metrics:
        out[fd_name] = frechet_distance(samples.mu_sigma(), (reference.mu, reference.sigma))
    if "kid" in metrics:
        out[kid_name], out[f"{kid_name}_std"] = kernel_distance(samples.all_features(), reference.features_for_kid(),
                                                               seed=seed)
    if features.classes:
        prefix = fd_name.removesuffix("_fd")
        out.update({f"{prefix}_{k}": v for k, v in coverage(samples).items()})
        if samples.asked:
            out[f"{prefix}_class_match"] = samples.matched / samples.asked
    return out


def result_line(result: dict[str, Any]) -> str:
    """One line of a metrics row (with its guidance where it has one)."""
    numbers = ", ".join(f"{k} {v:.4g}" for k, v in result.items()
                        if k.endswith(("fd", "fid", "kid", "coverage", "confident", "class_match"))
                        and isinstance(v, float))
    kind = "autoguidance" if result.get("guide_step") is not None else "guidance"
    guided = f", {kind} {result['guidance']:g}" if result.get("guidance") is not None else ""
    posthoc = f", post-hoc EMA sigma_rel {result['sigma_rel']:g}" if result.get("sigma_rel") is not None else ""
    return (f"step {result['step']}, {result['num']} images ({result['sampler']}, {result['steps']} steps, seed "
            f"{result['seed']}{guided}{posthoc}): {numbers}")
