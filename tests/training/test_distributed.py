"""Decisions every worker takes alike: in a real two-process gloo group, every rank ends with rank 0's value, the
smallest value, rank 0's code and the float64 sums; with one process each is the value itself. (The stop and
preemption vote needs Ray Train's context: tests/runs/test_fault_tolerance.py and tests/test_jobs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gloo_groups import end_process_group

from raydiff.training.distributed import first_to_hold, from_rank_zero, from_rank_zero_code, smallest, summed

CPU = torch.device("cpu")


def _agree(rank: int, world_size: int, rendezvous: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        decided = {
            "from_rank_zero": from_rank_zero({"plan": f"rank {rank}", "steps": [rank, 1]}),
            "code": from_rank_zero_code(7 if rank == 0 else 0, CPU),
            "smallest": smallest(100 - 30 * rank, CPU),
            "summed": summed([0.1 * (rank + 1), 1e-17], CPU),
            # One worker per distinct value: a value both hold is rank 0's; a value of its own is each worker's.
            "first_of_shared": first_to_hold(("cuda", 0)),
            "first_of_own": first_to_hold(("cuda", rank)),
        }
    finally:
        end_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(decided))


def test_every_rank_takes_the_same_decision(tmp_path):
    mp.spawn(_agree, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    decided = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [d.pop("first_of_shared") for d in decided] == [True, False]
    assert [d.pop("first_of_own") for d in decided] == [True, True]
    assert decided[0] == decided[1]
    assert decided[0]["from_rank_zero"] == {"plan": "rank 0", "steps": [0, 1]}
    assert decided[0]["code"] == 7 and decided[0]["smallest"] == 70
    assert decided[0]["summed"] == [0.1 + 0.2, 2e-17]  # float64: the tiny value survives beside 0.3


def test_one_process_keeps_its_own_values():
    assert from_rank_zero(["mine"]) == ["mine"]
    assert from_rank_zero_code(3, CPU) == 3 and smallest(5, CPU) == 5
    assert summed([0.5, 1e-17], CPU) == [0.5, 1e-17] and first_to_hold("anything")
