"""Decisions every worker must take alike, agreed through collectives (a no-op with one process)."""

from __future__ import annotations

from typing import Any

import ray.train
import torch
import torch.distributed as dist

from raydiff.training.stop import LEASE_LOST, stop_reason


def in_a_group() -> bool:
    """Whether this process is in a torch.distributed group: then every rank must take part in each collective."""
    return dist.is_available() and dist.is_initialized()


def from_rank_zero(value: Any) -> Any:
    """Every worker takes rank 0's value."""
    if not in_a_group():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_rank_zero_code(code: int, device: torch.device) -> int:
    """Rank 0's small non-negative number, on every worker (the others pass 0): one all-reduce of one integer."""
    return _reduced(code, device, dist.ReduceOp.MAX)


def smallest(value: int, device: torch.device) -> int:
    """The smallest of every worker's value."""
    return _reduced(value, device, dist.ReduceOp.MIN)


def _reduced(value: int, device: torch.device, op) -> int:
    if not in_a_group():
        return value
    box = torch.tensor(value, device=device)
    dist.all_reduce(box, op=op)
    return int(box)


def summed(values: list[float], device: torch.device) -> list[float]:
    """Each value summed over all workers (float64)."""
    box = torch.tensor(values, dtype=torch.float64, device=device)
    if in_a_group():
        dist.all_reduce(box)
    return box.tolist()


def first_to_hold(value: Any) -> bool:
    """Whether no lower rank holds a value equal to this worker's: one worker per distinct value decides (the first
    worker on each GPU index keeps that index's compiled code)."""
    if not in_a_group():
        return True
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return value not in values[:dist.get_rank()]


# By code: the workers agree on the largest code any of them asked.
INTERRUPTS = (None, "preemption", "stop", "lease_lost")


def interrupt_asked(stop_flag, is_chief: bool, simulated_preemption: bool = False) -> int:
    """This worker's answer to whether to checkpoint now, from Ray alone (round trips on the host, nothing on the
    device), as a code of INTERRUPTS: "stop" when the driver was asked to stop (rank 0 asks it), "lease_lost" when
    another driver has taken the run over, "preemption" when a node is about to be reclaimed. Every worker calls it
    at the same steps, then `agreed_interrupt`."""
    preempted = ray.train.get_preemption_info() is not None  # a collective itself: every rank must call it
    preempted = preempted or simulated_preemption
    reason = stop_reason(stop_flag) if is_chief else None
    return INTERRUPTS.index("lease_lost" if reason == LEASE_LOST else "stop" if reason else
                            "preemption" if preempted else None)


def agreed_interrupt(asked: int, device: torch.device) -> str | None:
    """Every worker's `interrupt_asked` code as one decision, alike on every worker: "lease_lost", "stop",
    "preemption" or None."""
    return INTERRUPTS[_reduced(asked, device, dist.ReduceOp.MAX)]
