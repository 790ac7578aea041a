"""torch.compile's compiled code kept in the run directory, so that a worker that starts again (after a fault, a
resize or a re-run, on this node or another) loads it instead of compiling the step again.

Why: compiling the step is most of a GPU run's warm-up, and every worker restart paid it again. torch keeps its
own caches on the node (inductor's cache folder under /tmp), which a new node or a fresh machine does not have;
its portable cache artifacts (`torch.compiler.save_cache_artifacts`, torch 2.7 and later) travel with the run
instead, in `<run>/compile_cache/<key>.bin`. The key covers what compiled code depends on (torch, triton, CUDA
and Python versions, the device, the model, the micro-batch shapes, precision and the compile options), and torch
checks its own content keys again when it looks code up, so a change of any of them never runs wrong code: the
step is simply compiled afresh, and its artifacts saved under the new key.

The device includes a GPU's index: compiled code names the GPU it runs on, and torch's own cache keys hold the
index, so the code rank 0 compiled on cuda:0 is of no use to a worker on cuda:3. With several GPUs in a node each
index has its file, kept by the first worker on it (`keeps`); workers on other nodes with the same index load it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
from typing import Any

import torch

from raydiff.storage.rundir import RunDir

logger = logging.getLogger("raydiff")
CACHE_FOLDER = "compile_cache"


def available() -> bool:
    """Whether this torch can save and load portable compile caches (2.7 and later)."""
    return hasattr(torch.compiler, "save_cache_artifacts") and hasattr(torch.compiler, "load_cache_artifacts")


def cache_key(parts: dict[str, Any], device: torch.device) -> str:
    """A short digest of `parts` (what the caller's compiled code depends on) and of the software and device."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    environment = {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
                   "python": platform.python_version(), "machine": platform.machine(),
                   "device": (torch.cuda.get_device_name(device), list(torch.cuda.get_device_capability(device)),
                              device.index) if device.type == "cuda" else device.type}
    text = json.dumps({"environment": environment, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompileCache:
    """The compiled code of one key in a run directory.

    :param run_dir: the run's directory (local, NFS or a bucket).
    :param key: `cache_key(...)` of what the code was compiled for.
    :param keeps: this worker keeps what it compiles anew: the first worker of the run with this key.
    """

    def __init__(self, run_dir: RunDir, key: str, *, keeps: bool = True) -> None:
        self.run_dir, self.key, self.keeps = run_dir, key, keeps
        self.name = f"{CACHE_FOLDER}/{key}.bin"
        self.loaded = False

    def load(self) -> str:
        """Put the saved artifacts into torch's caches on this node, before anything is compiled; returns a phrase
        for the start line. A file that does not load (torch cannot read it) is skipped: the step compiles."""
        if not available():
            return "compile cache unavailable (torch < 2.7)"
        if not self.run_dir.is_file(self.name):
            return "compile cache: none yet for this setup"
        data = self.run_dir.read_bytes(self.name)
        torch_log = logging.getLogger("torch.compiler._cache")  # it logs a damaged file's traceback, then goes on
        level = torch_log.level
        torch_log.setLevel(logging.CRITICAL)
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as exc:  # noqa: BLE001 - a cache from another build of torch: compile afresh
            return f"compile cache not loaded ({type(exc).__name__}), compiling afresh"
        finally:
            torch_log.setLevel(level)
        count = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
        if not count:
            return "compile cache not loaded (no artifacts read from it), compiling afresh"
        self.loaded = True
        return f"compile cache: {count} artifacts loaded ({len(data) / 1e6:.1f} MB)"

    def artifacts(self) -> bytes | None:
        """This process's compiled code, serialized, or None where there is nothing new to keep: everything came
        from the run's cache, loaded, or inductor compiled nothing. Code this node's own cache gave (a warm cache
        of an earlier run, a sweep's trial, a bench) is kept where the run has none yet: a restart on another node
        would compile it all again."""
        misses, hits = graph_counts()
        if not available() or not (misses or (hits and not self.loaded)):
            return None
        saved = torch.compiler.save_cache_artifacts()
        return saved[0] if saved is not None and saved[0] else None

    def save(self, data: bytes) -> None:
        """Write `artifacts()` to the run directory (whole-file and atomic: see RunDir.write_bytes)."""
        self.run_dir.write_bytes(self.name, data)

    def save_or_warn(self, data: bytes, rank: int) -> None:
        """`save`, on a worker other than rank 0, whose writes are not the run's (rank 0's storage failures end the
        run): a failure here costs only the next start on this GPU index its compilation, said in one line."""
        try:
            self.save(data)
        except OSError as exc:
            logger.warning(f"[raydiff] rank {rank}: its compiled step not kept in {self.name} ({exc}); "
                           f"training goes on")


def graph_counts() -> tuple[int, int]:
    """(graphs inductor compiled, graphs it found in its on-disk cache) in this process so far. A process that
    starts with a warm cache (torch's FX graph cache under TORCHINDUCTOR_CACHE_DIR) compiles none."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
