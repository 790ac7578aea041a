"""Copies that hold no memory, for checking a load before it is made.

A restore is all or nothing: every part of a checkpoint is loaded into a copy first, and into the live objects only
once all parts fit. A real copy of the model, the EMA and the optimizer (its parameters and moments) costs several
model sizes of GPU memory at every start, enough to fail one that trains fine. A twin whose tensors are on the meta
device runs the same `load_state_dict` checks (keys, shapes, parameter groups, dtype casts) without allocating them.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors a module or an optimizer holds (parameters, buffers, optimizer state)."""
    if isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
        yield from obj.buffers()
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            yield from group["params"]
        for state in obj.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def meta_twin(obj: T) -> T:
    """A deep copy of `obj` (a module, an optimizer, or a tuple of them: shared tensors stay shared) whose tensors
    are empty tensors of the same shape, dtype and layout on the meta device."""
    objects = obj if isinstance(obj, tuple) else (obj,)
    memo: dict[int, Any] = {}
    for source in objects:
        for tensor in _tensors(source):
            twin = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, torch.nn.Parameter):
                twin = torch.nn.Parameter(twin, requires_grad=tensor.requires_grad)
            memo.setdefault(id(tensor), twin)
    return copy.deepcopy(obj, memo)


def check_load(twin: torch.nn.Module | torch.optim.Optimizer, state: dict) -> None:
    """`twin.load_state_dict(state)`, raising as a load into the original would; a module's warning that copying
    into meta tensors is a no-op is the point here, and not shown. A tensor that is not dense memory (sparse, or on
    the meta device itself: no file raydiff writes) is refused here, as a copy into real memory would refuse it."""
    for tensor in _saved_tensors(state):
        if tensor.layout != torch.strided or tensor.is_meta:
            raise RuntimeError(f"a {tensor.layout} tensor{' on the meta device' if tensor.is_meta else ''} where "
                               f"weights or optimizer state are dense")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*meta parameter.*no-op")
        twin.load_state_dict(state)


def _saved_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _saved_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _saved_tensors(item)
