"""Starting or joining Ray, the same way for every command and for the library.

Why one place: every command (train, tune, prepare, evaluate, lr_find, bench) must join the cluster that
RAY_ADDRESS or `ray start` names, or else start a local instance, print one line saying which, and quiet what
Ray prints that a newcomer would read as a failure.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from typing import Any

import ray
from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
from ray._private.services import canonicalize_bootstrap_address

from raydiff.cluster.nodes import alive_nodes


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS or started on this machine (`ray start`), else start a local one."""
    if ray.is_initialized():
        return
    # What ray.init() will join, if anything (None: RAY_ADDRESS, else a local `ray start`; Ray's hint says str).
    existing = canonicalize_bootstrap_address(None)  # type: ignore[arg-type]
    ray.init(logging_level=logging.WARNING)
    resources = ray.cluster_resources()
    what = f"joined the Ray cluster at {existing}" if existing else "started a local Ray instance"
    print(f"[raydiff] {what}: {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU, "
          f"{len(alive_nodes())} node(s)")
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # raydiff prints its own one-line data summary
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
    ray.data.DataContext.get_current().enable_progress_bars = os.isatty(2)
    _drop_harmless_worker_lines()


# Error-level lines that Ray's own processes print in runs that succeed. Each pattern matches one known message
# exactly, so every other line, real errors included, still reaches the driver's terminal.
HARMLESS_WORKER_LINES = (
    # Ray Train's controller starts its PreemptionWatcher with worker handles as arguments and max_restarts=-1;
    # Ray's core worker warns, at error level, that a restart could lose them (ray-project/ray#53727).
    re.compile(r"class name: 'PreemptionWatcher' .* has constructor arguments in the object store and "
               r"max_restarts > 0"),
)
_INSTALLED_FILTERS: list[Callable[[dict[str, Any]], None]] = []  # installed once per process, not stacked


def _drop_harmless_worker_lines() -> None:
    """Filter the worker output Ray forwards to this driver: a newcomer reads an error line as a failure."""
    printers = [(name, handler) for name, handler in dispatcher.handlers if name == "ray_print_logs"]
    if not printers or printers[0][1] in _INSTALLED_FILTERS:
        return
    print_lines = printers[0][1]

    def filtered(data: dict[str, Any]) -> None:
        lines = [line for line in data.get("lines", []) if not any(p.search(line) for p in HARMLESS_WORKER_LINES)]
        if lines:
            print_lines({**data, "lines": lines})

    _INSTALLED_FILTERS.append(filtered)
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("ray_print_logs", filtered)
