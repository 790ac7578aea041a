"""--device: auto (a CUDA GPU where there is one), or a name checked against this machine, in one line."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch

from raydiff.cluster.devices import require_visible, resolve_device, torch_threads, worker_cpus
from raydiff.cluster.errors import GpuNotVisible
from raydiff.config import ScalingSection, load_config


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
        "raydiff.cluster_check checks it), or no NVIDIA driver on the node, or one too old for this torch's CUDA "
        "13.0 (CUDA 12.8 needs driver 570 or newer, CUDA 13 580)")
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


def _cpu_scaling(num_workers: int | tuple[int, int]) -> ScalingSection:
    return ScalingSection(num_workers=num_workers)


def _counted_by_ray(node_cpus: list[float], size: float, workers: int) -> int:
    """The workers Ray counts for an elastic run, in its floats: its reservation takes `size` from a node while
    what is left holds one more (up to `workers` in all), and Train counts `reserved // size` on each node."""
    placed = counted = 0
    for node in node_cpus:
        left, reserved = float(node), 0.0
        while placed < workers and left >= size:
            left, reserved, placed = left - size, reserved + size, placed + 1
        counted += int(reserved // size)
    return counted


@pytest.mark.parametrize("node_cpus,num_workers,cpus,expected", [
    ([8, 8], 1, 16, 8),  # num_workers: auto on CPUs is one worker: the largest node's CPUs, not the cluster's 16
    ([2, 8], 2, 10, 4),  # 5 each would fit the larger node only
    ([4, 12], 2, 16, 6),  # 8 each would fit the larger node only
    ([8, 8], 1, 4, 4),  # a Tune trial's part of the CPUs is still the most a worker gets
])
def test_cpu_workers_are_sized_to_fit_on_the_nodes_not_in_the_cluster_s_total(node_cpus, num_workers, cpus, expected):
    scaling = _cpu_scaling(num_workers)
    size = worker_cpus(scaling, use_gpu=False, cpus=cpus, node_cpus=node_cpus)
    assert size == expected
    assert sum(math.floor(n / size) for n in node_cpus) >= scaling.max_workers  # each worker on one node
    assert worker_cpus(scaling, use_gpu=True, cpus=cpus, node_cpus=node_cpus) == 1.0  # one beside each GPU


def test_an_elastic_cpu_run_counts_its_most_workers_where_ray_floor_divides_floats():
    """Ray's reservation subtracts and adds worker CPUs in floats and Train floor-divides them: 2 CPUs over up to 5
    workers at 0.4 each counted 4, and a run of exactly 5 never started."""
    for nodes, most in [([2], 5), ([2], 6), ([4], 10), ([8], 10), ([2, 8], 25), ([1, 3], 7), ([4, 4, 4], 31)]:
        size = worker_cpus(_cpu_scaling((2, most)), use_gpu=False, cpus=sum(nodes), node_cpus=nodes)
        assert _counted_by_ray(nodes, size, most) == most, (nodes, most, size)
    for cpus in range(1, 17):
        for most in range(2, 33):
            size = worker_cpus(_cpu_scaling((most, most)), use_gpu=False, cpus=cpus, node_cpus=[cpus])
            assert _counted_by_ray([cpus], size, most) == most, (cpus, most, size)
            assert round(cpus * 1e4) // round(size * 1e4) >= most  # and Ray's scheduler, in 1e-4 units, places them
            assert size >= 0.8 * max(cpus // most, cpus / most if cpus < most else 0)  # near the even share
    # Many workers per CPU: the largest size Ray counts them all at (only a node's final reservation is floor-
    # divided: requiring every partial sum to count took 0.016 and 0.0005 here).
    for cpus, most, largest in [(4, 173, 0.023), (1, 1000, 0.0009)]:
        assert worker_cpus(_cpu_scaling((1, most)), use_gpu=False, cpus=cpus, node_cpus=[cpus]) == largest


def test_ray_s_own_reservation_and_count_reach_an_elastic_cpu_run_s_most_workers():
    """The same, with Ray's autoscaling coordinator's and Train's elastic policy's own code (run without Ray)."""
    coordinator = pytest.importorskip("ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator")
    strategies = pytest.importorskip("ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator")
    elastic = pytest.importorskip("ray.train.v2._internal.execution.scaling_policy.elastic")
    import ray.train

    fields = {f.name for f in dataclasses.fields(coordinator.OngoingRequest)}

    def counted(nodes: list[int], most: int) -> int:
        size = worker_cpus(_cpu_scaling((1, most)), use_gpu=False, cpus=sum(nodes), node_cpus=nodes)
        # Train V2's class at run time; type checkers see V1's, which takes no (min, max)
        options: dict[str, Any] = {"num_workers": (1, most), "use_gpu": False, "resources_per_worker": {"CPU": size}}
        config = ray.train.ScalingConfig(**options)
        bundles = [{"CPU": size}] * most
        request = {"first_request_time": 0, "requested_resources": bundles, "expiration_time": 1e18,
                   "request_remaining": frozenset(), "priority": 0, "reserved_resources": {},
                   "requested_label_selectors": [{}] * most, "strategy": strategies.ResourceRequestStrategy.PACK}
        reserved = coordinator._compute_reservations(
            ongoing_request=coordinator.OngoingRequest(**{k: v for k, v in request.items() if k in fields}),
            node_resources={f"node{i}": {"CPU": float(n)} for i, n in enumerate(nodes)})
        return elastic.ElasticScalingPolicy(config)._count_possible_workers(reserved)

    cases = [([cpus], most) for cpus in range(1, 17) for most in range(2, 33)]
    cases += [([2, 8], 25), ([1, 3], 7), ([4, 4, 4], 31), ([8, 8, 1], 31), ([8, 8, 2], 20)]
    assert [(nodes, most) for nodes, most in cases if counted(nodes, most) != most] == []


@pytest.mark.parametrize(("setting", "workers", "gpus", "expected"), [
    ("auto", "2", 1, False),  # the default preset on a one-GPU machine: it asked for 2 GPUs and waited for ever
    ("auto", "2", 2, True),
    ("auto", "auto", 1, True),
    ("auto", "[2, 8]", 1, False),
    ("auto", "[1, 8]", 1, True),
    ("auto", "2", 0, False),
    ("true", "2", 1, True),  # waits for more, as asked
    ("false", "1", 4, False),
])
def test_auto_trains_on_gpus_where_the_cluster_has_one_for_each_of_the_fewest_workers(setting, workers, gpus,
                                                                                        expected):
    from raydiff.cluster.devices import trains_on_gpus

    config = load_config("smoke", [f"scaling.use_gpu={setting}", f"scaling.num_workers={workers}"], check_source=False)
    assert trains_on_gpus(config.scaling, gpus) is expected


def test_the_default_run_on_a_one_gpu_machine_trains_on_cpus_and_says_why(monkeypatch, capsys):
    import ray

    from raydiff.training.driver import plan_scaling

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    monkeypatch.setattr(ray, "nodes", lambda: [{"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0}}])
    plan, _ = plan_scaling(load_config("default", check_source=False))
    assert not plan.use_gpu and plan.num_workers == 2
    assert capsys.readouterr().out == (
        "[raydiff] scaling.use_gpu auto: the cluster has 1 GPU(s), fewer than the run's 2 workers: training on CPUs "
        "(scaling.num_workers=1 trains on the GPUs; scaling.use_gpu=true waits for more)\n")
