"""A process that computes on CPUs keeps the host memory its steps free (`train.keep_host_memory`): the setting
the driver gives the workers' processes, what the worker says it got, and that it does what it is for: raydiff's
step in a thread of its own, as Ray Train runs it, or in the main thread of a command that set it on itself
(`lr_find`, `sample`), stops faulting in fresh pages every step. (Here the thresholds do it; inside a Ray worker,
whose many threads share glibc's arenas, one arena is needed too: docs/benchmarks.md#training-throughput.) The
commands' and Ray runs' own lines: tests/test_lr_find.py, tests/test_sample.py, tests/test_train.py and
tests/test_bench.py."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from raydiff.cluster.host_memory import HOST_MEMORY_ENV, keep_host_memory
from raydiff.config import TrainSection
from raydiff.training.speed import plan_speed

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's allocator's")


def test_auto_keeps_host_memory_for_cpu_workers_only():
    auto = TrainSection().keep_host_memory
    assert keep_host_memory(auto, use_gpu=False) and not keep_host_memory(auto, use_gpu=True)
    assert keep_host_memory(True, use_gpu=True) and not keep_host_memory(False, use_gpu=False)


@glibc
def test_the_start_line_says_whether_the_process_started_with_the_settings(monkeypatch):
    cpu = torch.device("cpu")
    for name in HOST_MEMORY_ENV:
        monkeypatch.delenv(name, raising=False)
    assert "host memory returned" in plan_speed(TrainSection(), cpu, 1).describe()
    for name, value in HOST_MEMORY_ENV.items():
        monkeypatch.setenv(name, value)
    assert plan_speed(TrainSection(), cpu, 1).host_memory_kept
    assert "host memory kept" in plan_speed(TrainSection(), cpu, 1).describe()
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # another value is not what raydiff asked for
    assert not plan_speed(TrainSection(), cpu, 1).host_memory_kept


# Minor page faults in a typical optimizer step (the median: an odd step still grows the heap once, more on a busy
# host) of raydiff's own step (`optimizer_step`, its loader thread and EMA) on the
# `default` preset's model, trained in a thread that is not the process's main one, as Ray Train runs it
# (argument "thread"), or in the main thread of a process that first set the settings on itself ("here").
FAULTS_PER_STEP = """
import json, resource, statistics, sys, threading, torch
if sys.argv[1] == "here":
    from raydiff.cluster.host_memory import keep_host_memory_here
    assert keep_host_memory_here()
import numpy as np
from raydiff.config import load_config
from raydiff.data.loader import BatchStream, ImageTable
from raydiff.data.order import SampleOrder, rank_share
from raydiff.model.diffusion import build_diffusion
from raydiff.model.unet import build_model
from raydiff.model.weight_averages import EmaUpdater, make_ema
from raydiff.training.step import StepParts, make_optimizer, optimizer_step

cfg = load_config("default", [])
t, d = cfg.train, cfg.data
torch.manual_seed(0)
model = build_model(cfg)
parts = StepParts.build(model, build_diffusion(cfg), make_optimizer(model, lr=1e-4, weight_decay=0.0),
                        torch.amp.GradScaler("cpu", enabled=False), device=torch.device("cpu"), autocast_dtype=None,
                        seed=0, flip=d.flip, global_batch=t.global_batch, world_size=1, grad_clip=1.0, dropout=False)
ema = EmaUpdater(make_ema(model), model)
faults = []

def train(steps=14, warm_up=3):
    images = np.random.default_rng(0).integers(0, 256, (256, d.channels, d.resolution, d.resolution), np.uint8)
    stream = BatchStream(table=ImageTable([images]), order=SampleOrder(len(images), seed=0),
                         global_batch=t.global_batch, share=rank_share(t.global_batch, 1, 0),
                         micro_batch=t.global_batch, start_step=0, pin_memory=False, noise=(0, 1000))
    for i in range(steps):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        optimizer_step(parts, next(stream), lr=1e-4, ema=ema, ema_decay=0.999)
        if i >= warm_up:
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    stream.close()

if sys.argv[2] == "thread":
    thread = threading.Thread(target=train)
    thread.start()
    thread.join()
else:
    train()
print(json.dumps(statistics.median(faults)))
"""


def _faults_per_step(env: dict[str, str], *, settings: str = "env", thread: str = "thread") -> float:
    clean = {k: v for k, v in os.environ.items() if k not in HOST_MEMORY_ENV}
    proc = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, settings, thread],
                          env={**clean, **env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(json.loads(proc.stdout))


@glibc
def test_a_training_thread_started_with_the_settings_reuses_its_freed_memory():
    returned, kept = _faults_per_step({}), _faults_per_step(HOST_MEMORY_ENV)
    # Without them, the step's activations come back as fresh pages (thousands of faults a step); with them, from
    # memory the process already has.
    assert returned > 1000 and kept < returned / 20, (returned, kept)


@glibc
def test_a_command_that_keeps_host_memory_here_reuses_what_its_main_thread_frees():
    returned, kept = _faults_per_step({}, thread="main"), _faults_per_step({}, settings="here", thread="main")
    assert returned > 1000 and kept < returned / 20, (returned, kept)
