"""Run-directory logs: `metrics.jsonl` (one row per log step), `events.jsonl` (starts, rollbacks, preemption
checkpoints), and the human progress line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class JsonlLog:
    """An append-only file of JSON rows."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def rows(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def truncate_after(self, step: int) -> None:
        """Drop rows whose `step` is past `step` (work lost in a crash), atomically."""
        rows = self.rows()
        kept = [r for r in rows if r["step"] <= step]
        if len(kept) == len(rows):
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def append(self, row: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")


def progress_line(row: dict[str, Any], total_steps: int, start_step: int, elapsed_s: float) -> str:
    """`step 200/1000 | loss 0.0412 | 236 img/s | data wait 0.1% | ETA 3m24s`."""
    done = row["step"] - start_step
    eta = elapsed_s / done * (total_steps - row["step"]) if done > 0 else float("nan")
    skipped = f" | skipped {row['skipped_steps']}" if row.get("skipped_steps") else ""
    return (f"[raydiff] step {row['step']}/{total_steps} | loss {row['loss']:.4f} | "
            f"{row['images_per_s']:.0f} img/s | data wait {100 * row['data_wait_frac']:.1f}%{skipped} | "
            f"ETA {_fmt_duration(eta) if math.isfinite(eta) else '?'}")
