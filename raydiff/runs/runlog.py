"""Run-directory logs: `metrics.jsonl` (one row per log step), `events.jsonl` (starts, rollbacks, preemption
checkpoints), and the human progress line."""

from __future__ import annotations

import json
import math
import time
from typing import Any

from raydiff.storage.atomic import whole_lines
from raydiff.storage.rundir import RunDir
from raydiff.storage.writes import BackgroundWrites


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float, however deep, as None: JSON has no NaN or Infinity (Python writes them,
    strict readers refuse them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class JsonlLog:
    """A file of JSON rows in a run directory. Locally each row is appended at once (`tail -f` works); on an
    object store, which cannot append, rows are kept in memory and the file is rewritten by `flush()`, which
    `append` calls itself once `flush_every_s` has passed since the last write.

    :param run: the run directory.
    :param name: the file's name in it.
    :param flush_every_s: object stores: the longest an appended row waits to be written (0 = at once).
    :param writes: object stores: rewrite the file on this background thread (`writes.drain()` waits for it).
    """

    def __init__(self, run: RunDir, name: str, *, flush_every_s: float = 0.0,
                 writes: BackgroundWrites | None = None) -> None:
        self.run, self.name, self.writes = run, name, writes
        self._rows: list[dict[str, Any]] | None = None  # object stores: every row, written by flush()
        self._dirty = False
        self._flush_every_s, self._flushed_at = flush_every_s, time.monotonic()

    def rows(self) -> list[dict[str, Any]]:
        if self._rows is not None:
            return list(self._rows)
        if not self.run.is_file(self.name):
            return []
        return [json.loads(line) for line in whole_lines(self.run.read_text(self.name)) if line.strip()]

    def _write(self, rows: list[dict[str, Any]]) -> None:
        self.run.write_text(self.name, "".join(json.dumps(r) + "\n" for r in rows))

    def truncate_after(self, step: int) -> None:
        """Drop rows whose `step` is past `step` (work lost in a crash), atomically."""
        rows = self.rows()
        kept = [r for r in rows if r["step"] <= step]
        if self.run.remote:
            self._rows, self._dirty = kept, self._dirty or len(kept) != len(rows)
        elif len(kept) != len(rows):
            self._write(kept)

    def append(self, row: dict[str, Any]) -> None:
        self.extend([row])

    def extend(self, rows: list[dict[str, Any]]) -> None:
        """Append `rows`, locally in one write: all or none."""
        clean = [json_safe(row) for row in rows]
        if not self.run.remote:
            self.run.append_text(self.name, "".join(json.dumps(row) + "\n" for row in clean))
            return
        if self._rows is None:
            self._rows = self.rows()
        self._rows.extend(clean)
        self._dirty = True
        if time.monotonic() - self._flushed_at >= self._flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Write buffered rows (object stores only; a no-op for local files); in the background with `writes`."""
        if self._dirty and self._rows is not None:
            if self.writes is not None:
                self.writes.submit(self.name, self._write, list(self._rows))  # a snapshot: appends go on meanwhile
            else:
                self._write(self._rows)
            self._dirty = False
        self._flushed_at = time.monotonic()


def progress_line(row: dict[str, Any], total_steps: int, start_step: int, elapsed_s: float) -> str:
    """`step 200/1000 | loss 0.0412 | 236 img/s | data wait 0.1% | ETA 3m24s`."""
    done = row["step"] - start_step
    eta = elapsed_s / done * (total_steps - row["step"]) if done > 0 else float("nan")
    skipped = f" | skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
    return (f"[raydiff] step {row['step']}/{total_steps} | loss {row['loss']:.4f} | "
            f"{row['images_per_s']:.0f} img/s | data wait {100 * row['data_wait_frac']:.1f}%{skipped} | "
            f"ETA {_fmt_duration(eta) if math.isfinite(eta) else '?'}")
