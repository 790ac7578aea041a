"""The debug.* hooks: nothing by default; the faults and the order audit when asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raydiff.config import load_config
from raydiff.data.loader import MicroBatch
from raydiff.storage.rundir import RunDir
from raydiff.training.debug import DebugHooks
from raydiff.training.worker_io import WorkerResult, WorkerStatus


def _batch(position: int, indices: list[int]) -> MicroBatch:
    n = len(indices)
    return MicroBatch(images=torch.zeros(n, 1, 4, 4, dtype=torch.uint8), flips=torch.zeros(n, dtype=torch.bool),
                      position=position, indices=np.array(indices))


def test_the_hooks_do_nothing_by_default(tmp_path):
    hooks = DebugHooks(load_config("default", check_source=False), RunDir(tmp_path), rank=0)
    hooks.before_step(1, [_batch(0, [3, 4])])
    assert hooks.fault(1) is None and not hooks.preemption_notice(10**6)
    hooks.close()
    assert not list(tmp_path.iterdir())  # no order log


def test_faults_preemption_and_the_order_audit(tmp_path):
    cfg = load_config("default", ["debug.nan_at_steps=[2]", "debug.nan_at_samples=[7]", "debug.record_order=true",
                                  "debug.preemption_from_step=5"], check_source=False)
    chief, other = DebugHooks(cfg, RunDir(tmp_path), rank=0), DebugHooks(cfg, RunDir(tmp_path), rank=1)
    clean, poisoned = _batch(0, [1, 2]), _batch(2, [7, 8])
    assert not chief.fault(1)(clean) and chief.fault(1)(poisoned)  # a poisoned sample, every time it is trained
    assert chief.fault(2)(clean) and not chief.fault(2)(clean)  # a transient fault: once per step number, rank 0
    assert not other.fault(2)(clean)
    assert [chief.preemption_notice(s) for s in (4, 5, 6)] == [False, True, True]
    chief.before_step(3, [clean, poisoned])
    chief.close()
    other.close()
    rows = [json.loads(line) for f in sorted((tmp_path / "order").iterdir()) for line in f.read_text().splitlines()]
    assert rows == [{"step": 3, "positions": [0, 4], "indices": [1, 2, 7, 8]}]


def test_the_order_audit_needs_local_storage():
    cfg = load_config("default", ["debug.record_order=true"], check_source=False)
    with pytest.raises(ValueError, match="debug.record_order needs a local run.storage"):
        DebugHooks(cfg, RunDir("s3://bucket/runs"), rank=0)


def test_a_worker_result_reads_as_plain_json():
    result = WorkerResult(WorkerStatus.DIVERGED, steps=40, diagnostic="training diverged: ...")
    row = result.to_dict()
    assert row["status"] == "diverged" and row["steps"] == 40 and json.loads(json.dumps(row)) == row
