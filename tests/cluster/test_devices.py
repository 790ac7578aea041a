"""--device: auto (a CUDA GPU where there is one), or a name checked against this machine, in one line."""

from __future__ import annotations

import pytest
import torch

from raydiff.cluster.devices import require_visible, resolve_device, torch_threads, worker_cpus
from raydiff.cluster.errors import GpuNotVisible
from raydiff.config import load_config


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose torch sees no CUDA device")
def test_a_worker_given_a_gpu_it_cannot_see_says_why_in_one_line(monkeypatch):
    """Ray gives GPUs by what a node advertises: a container started without `--gpus` still gets one."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(GpuNotVisible) as seen:
        require_visible(torch.device("cuda"))
    assert str(seen.value) == (
        "Ray gave this worker a GPU (CUDA_VISIBLE_DEVICES=0), but torch sees none: a container started without the "
        "node's GPU (a cluster-launcher node type needs docker: {worker_run_options: [--gpus all]}; python -m "
        "raydiff.cluster_check checks it), or no NVIDIA driver on the node")
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(GpuNotVisible, match=r"but torch sees none: this torch \(.*\) has no CUDA: install a CUDA "):
        require_visible(torch.device("cuda:0"))
    require_visible(torch.device("cpu"))  # a CPU worker has nothing to see


def test_a_cuda_device_this_machine_lacks_is_refused_in_one_line():
    count = torch.cuda.device_count()
    message = (f"--device cuda:{count}: this machine has {count} CUDA device" if count
               else f"--device cuda:{count}: no CUDA device on this machine")
    with pytest.raises(ValueError, match=message):
        resolve_device(f"cuda:{count}")


def test_a_worker_gets_its_set_cpus_else_one_beside_a_gpu_else_an_even_share_and_whole_threads_up_to_omp_s():
    def scaling(*overrides: str):
        return load_config("smoke", list(overrides), check_source=False).scaling

    assert worker_cpus(scaling("scaling.cpus_per_worker=2.5"), use_gpu=True, cpus=16) == 2.5
    assert worker_cpus(scaling(), use_gpu=True, cpus=16) == 1.0
    assert worker_cpus(scaling("scaling.num_workers=[1,4]"), use_gpu=False, cpus=16) == 4  # over the most workers
    assert worker_cpus(scaling("scaling.num_workers=4"), use_gpu=False, cpus=2) == 0.5  # several to a CPU
    # Ray rounds amounts to 1e-4: three workers of 0.6667 would ask for 2.0001 of 2 CPUs, and one never start
    thirds = worker_cpus(scaling("scaling.num_workers=[1,3]"), use_gpu=False, cpus=2)
    assert thirds == pytest.approx(0.6666) and round(thirds * 1e4) * 3 <= 2e4
    assert [torch_threads(c, {}) for c in (0.5, 1.0, 2.5, 4)] == [1, 1, 2, 4]
    # OMP_NUM_THREADS caps them (Ray sets it to the worker's whole CPUs where the environment does not)
    assert [torch_threads(4, {"OMP_NUM_THREADS": n}) for n in ("1", "3", "8", "0", "", "x")] == [1, 3, 4, 4, 4, 4]
