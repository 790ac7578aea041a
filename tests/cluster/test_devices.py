"""--device: auto (a CUDA GPU where there is one), or a name checked against this machine, in one line."""

from __future__ import annotations

import pytest
import torch

from raydiff.cluster.devices import resolve_device


def test_auto_is_a_gpu_where_there_is_one_else_the_cpu():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name,message", [("tpu9", "--device tpu9: expected auto, cpu, cuda or cuda:N"),
                                          ("mps", "--device mps: expected auto, cpu, cuda or cuda:N"),
                                          ("meta", "--device meta: expected auto, cpu, cuda or cuda:N")])
def test_a_device_this_machine_cannot_name_is_one_line(name, message):
    with pytest.raises(ValueError, match=message):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--device cuda: no CUDA device on this machine"):
        resolve_device("cuda")


def test_a_cuda_device_this_machine_lacks_is_refused_in_one_line():
    count = torch.cuda.device_count()
    message = (f"--device cuda:{count}: this machine has {count} CUDA device" if count
               else f"--device cuda:{count}: no CUDA device on this machine")
    with pytest.raises(ValueError, match=message):
        resolve_device(f"cuda:{count}")
