"""A profile of a run's training loop as it runs (`log.profile_steps: [first, last]`): torch.profiler over those
optimizer steps on rank 0, everything its training thread does in them (waiting for data, the step, the end of
the step: checks, metrics rows, Ray's calls, writes), to the run directory as a trace and a table.

Why: `bench step` and `bench throughput --profile` profile raydiff's step in the bench's own process. What a run
adds around the step (the loop's cadences, Ray Train, the data, rank 0's writes) shows only in the worker itself,
and on a GPU as time the device waits for the host: the table's first line gives the device's busy share of the
profiled wall time. Off (the default), a run pays one comparison per step.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raydiff.cluster.devices import device_name, synchronize

# Kineto's own lines ("USDT:2026-12-06 02:44:34 25082:25214 SyncActivityProfilerHandler.cpp:39] profiler_start",
# and, where the profiler starts in a thread other than torch's first, "ERROR: External init callback must run in
# same thread as registerClient (...)", harmless: the events are recorded).
KINETO_LINE = re.compile(r"[A-Z]+:\d{4}-\d\d-\d\d \S+ \d+:\d+ \S+\.cpp:\d+\] |ERROR: External init callback ")
# What the host calls to start work on a GPU: a kernel (CUDA's runtime, the driver API that Triton uses) or a graph.
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


@dataclass(frozen=True)
class ProfileSummary:
    """What a profile says per step: the device's kernels' time (None on a CPU), the host's launches, and the
    table of the top kernels (GPU) or operators (CPU)."""

    device_ms: float | None
    launches: float
    table: str


def summarize(profiler: torch.profiler.profile, steps: int, device: torch.device) -> ProfileSummary:
    """The kernels' own time (as the table's "Self CUDA time total" counts it, not the operators that launched
    them) and the launches, per step, and the top 30 by time."""
    from torch.autograd import DeviceType

    events = profiler.key_averages()
    cuda = device.type == "cuda"
    kernel_us = sum(e.self_device_time_total for e in events
                    if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False))
    launches = sum(e.count for e in events if e.key in LAUNCHES) / steps
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=30)
    return ProfileSummary(kernel_us / 1e3 / steps if cuda else None, launches, table)


def activities(device: torch.device) -> list[torch.profiler.ProfilerActivity]:
    """What to record on `device` (and, on a CPU, Kineto's GPU probe quiet: it prints "ERROR: ...
    gpuGetDeviceCount failed" where there is none)."""
    from torch.profiler import ProfilerActivity

    if device.type != "cuda":
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        return [ProfilerActivity.CPU]
    return [ProfilerActivity.CPU, ProfilerActivity.CUDA]


@contextlib.contextmanager
def kineto_lines_kept(lines: list[str]) -> Iterator[None]:
    """Kineto's lines on the process's stderr (file descriptor 2, where it prints them), while the profiler
    starts or stops, go to `lines` instead of the worker's log, where they read as errors; anything else written
    meanwhile is written back."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            others: list[str] = []
            for line in captured.read().decode(errors="replace").splitlines(keepends=True):
                (lines if KINETO_LINE.match(line) else others).append(line)
            if others:
                os.write(2, "".join(others).encode())


@dataclass(frozen=True)
class ProfiledSteps:
    """A finished profile: the steps it covers, its files' contents, and its figures for events.jsonl."""

    first: int
    last: int
    trace_gz: bytes  # Chrome's trace format, gzipped: Perfetto (ui.perfetto.dev) and TensorBoard read it
    table: str
    figures: dict[str, Any]

    @property
    def name(self) -> str:
        return f"profile/steps_{self.first}-{self.last}"

    @property
    def headline(self) -> str:
        return in_words(self.figures)


def in_words(figures: dict[str, Any]) -> str:
    """A profile's figures (`ProfiledSteps.figures`) as the phrase its table and log line begin with."""
    words = f"{figures['wall_ms_per_step']:.2f} ms a step of wall time"
    if figures["device_ms_per_step"] is not None:
        words += (f", the GPU's kernels {figures['device_ms_per_step']:.2f} ms of it (busy "
                  f"{figures['device_busy']:.3f}), {figures['launches_per_step']:.0f} launches a step")
    return words


class StepProfile:
    """The profile of steps [first, last] of one worker start: begun before step `first` fetches its data, ended
    after step `last` (or earlier where training ends or rolls back first).

    :param first: the first step to record (a start that resumes inside the range begins at its first step).
    :param last: the last step to record.
    :param device: the worker's device (the profile waits for it at both ends).
    """

    def __init__(self, first: int, last: int, device: torch.device) -> None:
        self.first, self.last, self.device = first, last, device
        self._profiler: torch.profiler.profile | None = None
        self._started_s = 0.0
        self._kineto_lines: list[str] = []
        # Each step's span in the trace, named as torch.profiler's schedules name theirs (TensorBoard's plugin
        # reads step times from them).
        self._step_span: torch.profiler.record_function | None = None

    @classmethod
    def planned(cls, steps: tuple[int, ...], *, resumed_at: int, device: torch.device,
                is_chief: bool) -> StepProfile | None:
        """Rank 0's profile of `log.profile_steps` (validated: empty, or [first, last]) for a start that resumes
        after step `resumed_at`; None where there is nothing left to record."""
        if not is_chief or not steps or resumed_at >= steps[1]:
            return None
        return cls(max(steps[0], resumed_at + 1), steps[1], device)

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def before_step(self, step: int) -> None:
        """Begin recording if `step` is the first to record (the device's earlier work waited for first); open
        the step's span if recording."""
        if step == self.first and self._profiler is None:
            synchronize(self.device)
            self._profiler = torch.profiler.profile(activities=activities(self.device))
            with kineto_lines_kept(self._kineto_lines):
                self._profiler.start()
            self._started_s = time.perf_counter()
        if self._profiler is not None:
            self._close_step_span()
            self._step_span = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_span.__enter__()

    def _close_step_span(self) -> None:
        if self._step_span is not None:
            self._step_span.__exit__(None, None, None)
            self._step_span = None

    def end(self, step: int) -> ProfiledSteps:
        """Stop recording after step `step` (once the device has done it) and make the files."""
        assert self._profiler is not None, "end() follows a before_step() that began recording"
        synchronize(self.device)
        self._close_step_span()
        wall_ms = (time.perf_counter() - self._started_s) * 1e3
        profiler, steps = self._profiler, step - self.first + 1
        with kineto_lines_kept(self._kineto_lines):
            profiler.stop()
        self._profiler = None  # stopped: what follows may fail (no room for the trace) without leaving it recording
        with kineto_lines_kept(self._kineto_lines), tempfile.TemporaryDirectory(prefix="raydiff-profile-") as tmp:
            summary = summarize(profiler, steps, self.device)
            trace = Path(tmp) / "trace.json"
            profiler.export_chrome_trace(str(trace))
            trace_gz = gzip.compress(trace.read_bytes(), compresslevel=6)
        figures: dict[str, Any] = {"steps": [self.first, step], "wall_ms_per_step": round(wall_ms / steps, 3),
                                   "device_ms_per_step": None, "device_busy": None,
                                   "launches_per_step": round(summary.launches, 1)}
        if summary.device_ms is not None:
            figures["device_ms_per_step"] = round(summary.device_ms, 3)
            figures["device_busy"] = round(summary.device_ms / (wall_ms / steps), 3)
        table = (f"# raydiff's training loop on rank 0, steps {self.first}-{step} on {device_name(self.device)}: "
                 f"{in_words(figures)}\n{summary.table}\n")
        if self._kineto_lines:
            table += "\n# The profiler's own messages:\n" + "".join(f"# {line}" for line in self._kineto_lines)
        return ProfiledSteps(self.first, step, trace_gz, table, figures)

    def discard(self) -> None:
        """Stop recording without files (the worker is ending on an error)."""
        if self._profiler is not None:
            self._close_step_span()
            profiler, self._profiler = self._profiler, None
            with kineto_lines_kept(self._kineto_lines):
                profiler.stop()
