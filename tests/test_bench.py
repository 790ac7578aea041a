"""The benchmark commands print one JSON line with their numbers and the baseline's."""

from __future__ import annotations

import json
import platform

import pytest
from conftest import run_cli


def test_checkpoint_bench_reports_size_time_and_baseline():
    proc = run_cli("raydiff.bench", "checkpoint", "--config", "smoke", "--repeat", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["bench"] == "checkpoint" and result["parameters"] > 0
    # Full state = weights + EMA + two Adam moments (+ small extras): about 4x the bare weights.
    assert 3.9 < result["size_ratio"] < 4.5 and result["write_s"] > 0 and result["read_s"] > 0


def test_bench_rejects_bad_arguments():
    proc = run_cli("raydiff.bench", "checkpoint", "--repeat", "0")
    assert proc.returncode == 2 and "--repeat 0: must be >= 1" in proc.stderr


@pytest.mark.ray
@pytest.mark.slow
def test_ingest_bench_measures_raydiff_against_the_dataloader(tmp_path):
    from raydiff.data.builtin import write_synthetic

    write_synthetic(tmp_path, num=64, resolution=24, fmt="jpg")
    proc = run_cli("raydiff.bench", "ingest", "--source", str(tmp_path), "--resolution", "16", "--batch", "16",
                   "--epochs", "2", "--cache", "stream", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "ingest" and result["images"] == 64
    for name in ("dataloader", "raw", "cached", "stream"):
        assert result[f"{name}_img_s"] > 0 and result[f"{name}_first_epoch_s"] > 0
    for name in ("raw", "cached", "stream"):  # measured, not left out
        assert isinstance(result[f"{name}_peak_store_mb"], float) and isinstance(result[f"{name}_peak_rss_mb"], float)
    assert result["stream_shards"] == 16  # the bench cuts the prepared copy into STREAM_SHARDS shards


@pytest.mark.ray
@pytest.mark.slow
def test_throughput_bench_shows_where_the_time_goes(tmp_path):
    """raydiff against the textbook loop and the bare loop with raydiff's own speed plan, warm-up split at the first
    step, the restart's warm-up (--rerun), and the top operators of raydiff's step (--profile), alone and inside
    the run's worker."""
    top = tmp_path / "top.txt"
    proc = run_cli("raydiff.bench", "throughput", "--config", "smoke", "--steps", "3", "--batch", "16",
                   "--peak-tflops", "1.0", "--rerun", "--profile", str(top))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "throughput" and result["device"] == "cpu" and result["precision"] == "fp32"
    assert result["global_batch"] == 16 and len(result["plain"]["runs"]) == 2  # the plain loop brackets raydiff
    for side in ("plain", "bare", "raydiff"):
        assert result[side]["img_s"] > 0 and result[side]["mfu"] is not None
    ours = result["raydiff"]
    assert ours["start_s"] > 0 and 0 < ours["first_step_s"] <= ours["warmup_s"]
    assert ours["rerun"]["img_s"] > 0 and ours["rerun"]["start_s"] > 0
    assert ours["compile_cache"] is None  # nothing is compiled on a CPU: no cache
    assert result["bare"]["graphs_compiled"] == result["bare"]["graphs_cached"] == 0
    # The smoke UNet at 8x8 costs a few MFLOPs per image, forward and backward.
    assert 1e6 < result["flops_per_image"] < 1e9
    assert result["options"]["fused_adamw"] and result["options"]["compile"] is False
    described = result["options"]["described"]  # raydiff's worker's own start line
    assert "compile off" in described
    assert result["options"]["data"] == "data on the host (data.on_device auto: not CUDA)"  # where it gathered
    assert "host memory kept" in described or platform.libc_ver()[0] != "glibc"  # CPU workers: glibc keeps it
    table = top.read_text()
    assert "raydiff's step, 16 images per step" in table and "aten::convolution" in table
    # On a GPU: its busy time per step, the host's launches, and the share of raydiff's step the GPU works.
    assert ours["profile"] == {"device_ms_per_step": None, "launches_per_step": 0}
    # The run's own profile, inside its worker, over ten steps after the measured ones (here steps 7-16).
    worker_table = (tmp_path / "top-worker.txt").read_text()
    assert worker_table.startswith("# raydiff's training loop on rank 0, steps 7-16 on cpu")
    assert ours["worker_profile"]["steps"] == [7, 16] and ours["worker_profile"]["wall_ms_per_step"] > 0
    assert ours["worker_profile"]["device_busy"] is None  # no GPU


def test_a_run_whose_profile_was_not_made_leaves_the_throughput_figures_standing(tmp_path, capsys):
    """The worker makes no profile where it cannot (a warning in its log): the bench says so and goes on."""
    from raydiff.bench.throughput import _worker_profile

    run_dir = tmp_path / "run"
    (run_dir / "profile").mkdir(parents=True)
    assert _worker_profile(run_dir, None, [21, 30], tmp_path / "top-worker.txt") is None  # no profile row
    assert "the run's profile of steps 21-30 was not made" in capsys.readouterr().err
    assert not (tmp_path / "top-worker.txt").exists()
    figures = {"steps": [21, 30], "wall_ms_per_step": 25.0, "device_ms_per_step": 22.0, "device_busy": 0.88,
               "launches_per_step": 80.0}
    row = {"event": "profile", **figures, "time": 1.0}  # the run's events.jsonl row
    assert _worker_profile(run_dir, row, [21, 30], tmp_path / "top-worker.txt") == figures  # the figures, no table
    assert "the run's profile of steps 21-30 has figures but no table" in capsys.readouterr().err
    (run_dir / "profile" / "steps_21-30.txt").write_text("# table\n")
    assert _worker_profile(run_dir, row, [21, 30], tmp_path / "top-worker.txt") == figures
    assert (tmp_path / "top-worker.txt").read_text() == "# table\n"
    # A profile a stop ended early is named by the steps it recorded.
    early = {**figures, "steps": [21, 25]}
    (run_dir / "profile" / "steps_21-25.txt").write_text("# early\n")
    assert _worker_profile(run_dir, {"event": "profile", **early, "time": 2.0}, [21, 30],
                           tmp_path / "top-worker.txt") == early
    assert (tmp_path / "top-worker.txt").read_text() == "# early\n"


def test_the_throughput_bench_s_raydiff_rows_fall_on_the_loop_s_checks_where_the_steps_allow():
    """A row waits for the device, as a check does: on the checks, the bench's run waits as often as a user's."""
    from raydiff.bench.throughput import rows_every
    from raydiff.training.cadence import CHECK_EVERY_STEPS

    assert CHECK_EVERY_STEPS == 10
    assert [rows_every(steps) for steps in (20, 30, 40, 60, 100, 200)] == [10, 10, 10, 10, 20, 40]
    assert [rows_every(steps) for steps in (3, 25, 42)] == [1, 5, 8]  # the chunks, where no multiple of 10 fits


def test_throughput_bench_rejects_bad_arguments():
    proc = run_cli("raydiff.bench", "throughput", "--steps", "1")
    assert proc.returncode == 2 and "--steps 1: must be >= 2" in proc.stderr
    proc = run_cli("raydiff.bench", "throughput", "--peak-tflops", "0")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("raydiff: error: --peak-tflops 0.0: must be > 0 (")
    proc = run_cli("raydiff.bench", "throughput", "--batch", "128,x")
    assert proc.returncode == 2 and "--batch 128,x: expected N or N,N,..." in proc.stderr
    proc = run_cli("raydiff.bench", "throughput", "--batch", "128,0")
    assert proc.returncode == 2 and "--batch 128,0: every batch must be >= 1" in proc.stderr
    proc = run_cli("raydiff.bench", "throughput", "--batch", "128,512,128")  # the second 128 found the first run
    assert proc.returncode == 2 and "--batch 128,512,128: every batch once" in proc.stderr


def test_each_batch_of_one_throughput_bench_compiles_afresh_past_dynamos_eight_graphs(monkeypatch):
    """dynamo keeps at most 8 compiled graphs of one function (the step's loss, compiled with static shapes):
    a 9th --batch of one bench ran eagerly under the compiled plan's name. Each batch starts afresh."""
    import torch

    from raydiff.bench import throughput
    from raydiff.cluster import start

    compiled: list[int] = []

    def counting(graph, example_inputs):
        compiled.append(1)
        return graph.forward

    def step(x):  # one function, as DenoisingLoss.forward is, compiled anew for each batch
        return (x * 2).sum()

    def one_batch(cfg, device, **kwargs):
        torch.compile(step, backend=counting, dynamic=False)(torch.ones(cfg.train.global_batch))
        return {"global_batch": cfg.train.global_batch}

    monkeypatch.setattr(start, "init_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(throughput, "_one_batch", one_batch)
    batches = list(range(1, 11))
    try:
        rows = list(throughput.bench_throughput("smoke", [], steps=2, batches=batches, peak=None))
    finally:
        torch._dynamo.reset()
    assert [row["global_batch"] for row in rows] == batches and len(compiled) == len(batches)


def test_mfu_is_against_the_devices_own_bf16_peak_the_first_name_it_contains():
    from raydiff.bench.throughput import peak_tflops

    assert [peak_tflops(f"NVIDIA {name}") for name in ("H100 80GB HBM3", "H100 PCIe", "H200", "H200 NVL",
                                                        "L40S", "L40", "L4", "B200")] == \
        [989.0, 756.0, 989.0, 835.0, 362.0, 181.0, 121.0, None]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's allocator's")
def test_sampling_bench_measures_raydiff_s_sampling_against_the_allocator_left_as_it_is():
    args = ["raydiff.bench", "sampling", "--num", "64", "--batch", "16", "--steps", "2", "--pairs", "1"]
    proc = run_cli(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "sampling" and result["device"] == "cpu" and result["steps"] == 2
    raydiff, baseline = result["raydiff"], result["baseline"]
    assert raydiff["host_memory_kept"] and not baseline["host_memory_kept"]
    # Without the settings each pass faults in fresh pages; with them, a few (the heap's one-off growths: more on
    # a busy host, as in CI: 27 per image against 216 at --num 32).
    assert baseline["faults_per_image"] > 50 and raydiff["faults_per_image"] < baseline["faults_per_image"] / 4
    assert result["ratio"] == pytest.approx(raydiff["img_s"] / baseline["img_s"], rel=0.01)
    off = json.loads(run_cli(*args, "--set", "train.keep_host_memory=false").stdout.strip().splitlines()[-1])
    assert not off["raydiff"]["host_memory_kept"]  # the config's setting decides raydiff's side

    for bad, message in ((["--pairs", "0"], "--pairs 0: must be >= 1"),
                         (["--device", "tpu"], "--device tpu: expected auto, cpu, cuda or cuda:N")):
        proc = run_cli("raydiff.bench", "sampling", *bad)
        assert proc.returncode == 2 and proc.stderr == (f"raydiff: error: {message} (python -m raydiff.bench sampling "
                                                        f"--help)\n"), proc.stderr


@pytest.mark.parametrize("bench", ["checkpoint", "memory", "sampling", "throughput"])
def test_a_bench_that_reads_no_data_asks_for_the_number_of_classes_in_one_line(bench, capsys):
    # Each builds the model without counting the data's classes (was a ValueError traceback).
    from raydiff import cli
    from raydiff.bench.__main__ import main

    args = [bench, "--config", "smoke", "--set", "data.labels=auto", "--set", "model.num_classes=auto"]
    assert cli.run(main, args) == 2
    assert capsys.readouterr().err.strip() == (
        f"raydiff: config error: model.num_classes = auto: `bench {bench}` builds the model without counting the "
        "data's classes; set model.num_classes to their number (--set model.num_classes=N)")


def test_memory_bench_reports_the_parts_with_and_without_activation_checkpointing():
    proc = run_cli("raydiff.bench", "memory", "--config", "default", "--micro-batch", "32")
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["micro_batch"] == 32 and result["device"] == "cpu" and result["parameters"] > 10**6
    fixed = sum(result[f"{part}_gb"] for part in ("weights", "gradients", "optimizer", "ema"))
    assert result["optimizer_gb"] == pytest.approx(2 * result["weights_gb"], abs=0.002)  # AdamW's two moments
    for suffix in ("", "_checkpointed"):
        assert result[f"peak_memory_gb{suffix}"] == pytest.approx(fixed + result[f"activations_gb{suffix}"], abs=0.004)
    assert 0 < result["activations_gb_checkpointed"] < result["activations_gb"]
    assert result["checkpointing_saves"] > 0.2 and "counted on CPU" in result["method"]
    smaller = json.loads(run_cli("raydiff.bench", "memory", "--config", "default", "--micro-batch", "8")
                         .stdout.strip().splitlines()[-1])
    assert smaller["activations_gb"] < result["activations_gb"] / 2  # activations grow with the micro-batch

    proc = run_cli("raydiff.bench", "memory", "--micro-batch", "0")
    assert proc.returncode == 2 and "--micro-batch 0: must be >= 1" in proc.stderr


def test_step_bench_adds_raydiffs_step_parts_one_at_a_time():
    """raydiff's step in one process against the bare step on the same compiled loss: the step alone, with the
    loader thread, with the EMA, and with the EMA on batches gathered on the device (no loader thread); each with
    its chunks and the host's time per step."""
    proc = run_cli("raydiff.bench", "step", "--config", "smoke", "--steps", "3", "--batch", "8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["bench"] == "step" and result["device"] == "cpu" and result["global_batch"] == 8
    assert list(result["rows"]) == ["bare", "step", "loader", "ema", "on_device"]
    for row in result["rows"].values():
        assert row["img_s"] > 0 and row["host_ms"] > 0 and len(row["chunks_img_s"]) == 3
        assert min(row["chunks_img_s"]) <= row["img_s"] <= max(row["chunks_img_s"])
    assert set(result["ratio_bare"]) == {"step", "loader", "ema", "on_device"} and "compile off" in result["described"]
    assert result["first_step_s"] > 0 and result["graphs_compiled"] == result["graphs_cached"] == 0  # eager
    # The loader thread's own CPU time per step it made (on a CPU it draws the noise too): what it takes from the host.
    assert result["rows"]["loader"]["loader_cpu_ms"] > 0 and result["rows"]["ema"]["loader_cpu_ms"] > 0
    assert "loader_cpu_ms" not in result["rows"]["on_device"]  # no thread beside the training thread


def test_step_bench_with_the_post_hoc_ema_updates_its_averages_in_the_ema_rows(monkeypatch):
    """`--set train.ema=posthoc` measured the classic EMA alone, under a post-hoc name in the GPU check's table."""
    import torch

    from raydiff.bench.step import step_rows
    from raydiff.config import load_config
    from raydiff.model.weight_averages import PowerEma

    steps: list[int] = []
    real = PowerEma.__call__
    monkeypatch.setattr(PowerEma, "__call__", lambda self, step: (steps.append(step), real(self, step))[1])
    cfg = load_config("smoke", ["train.ema=posthoc", "train.global_batch=8"], check_source=False)
    result = step_rows(cfg, torch.device("cpu"), steps=2)
    assert result["ema"] == "posthoc" and list(result["rows"]) == ["bare", "step", "loader", "ema", "on_device"]
    assert steps and steps == list(range(1, len(steps) + 1))  # the ema and on_device rows, every step counted
    assert step_rows(load_config("smoke", ["train.global_batch=8"], check_source=False), torch.device("cpu"),
                     steps=2)["ema"] == "classic"


def test_a_measured_loop_counts_the_graphs_it_compiled_and_those_a_warm_start_found_in_the_cache():
    """What `bench step` and the bare loop report with their first step: a start with the compile cache warm (as
    `.ci/gpu check` prepares for its later benchmarks) compiles nothing."""
    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import fresh_inductor_cache

    from raydiff.bench.step import measure

    x = torch.randn(8)
    # An empty cache folder of its own, whatever this process compiled before; the cache on, as torch's default is.
    with fresh_inductor_cache(), inductor_config.patch(fx_graph_cache=True):
        cold_loop = torch.compile(lambda v: (v.sin() * 2).sum())
        cold = measure(lambda: cold_loop(x), torch.device("cpu"), steps=2, batch=8)
        torch._dynamo.reset()  # this process forgets its compiled code; the cache on disk keeps it
        warm_loop = torch.compile(lambda v: (v.sin() * 2).sum())
        warm = measure(lambda: warm_loop(x), torch.device("cpu"), steps=2, batch=8)
    assert (cold["graphs_compiled"], cold["graphs_cached"]) == (1, 0)
    assert (warm["graphs_compiled"], warm["graphs_cached"]) == (0, 1)


def test_on_a_gpu_the_bench_runs_with_a_gpu_worker_s_intra_op_threads_and_on_a_cpu_with_its_own(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS")  # the suite's cap (conftest.py), which a GPU worker's environment lacks

    from raydiff.bench import load_model_config
    from raydiff.bench.step import take_gpu_worker_threads

    before = torch.get_num_threads()
    try:
        take_gpu_worker_threads(load_model_config("cifar10", [], "step"), torch.device("cuda"))
        assert torch.get_num_threads() == 1  # scaling.cpus_per_worker's default on a GPU
        take_gpu_worker_threads(load_model_config("cifar10", ["scaling.cpus_per_worker=2.5"], "step"),
                                torch.device("cuda"))
        assert torch.get_num_threads() == 2
        torch.set_num_threads(before)
        take_gpu_worker_threads(load_model_config("cifar10", [], "step"), torch.device("cpu"))
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_step_bench_rejects_bad_arguments():
    proc = run_cli("raydiff.bench", "step", "--steps", "1")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("raydiff: error: --steps 1: must be >= 2 (")
    proc = run_cli("raydiff.bench", "step", "--batch", "0")
    assert proc.returncode == 2 and proc.stderr.strip().startswith("raydiff: error: --batch 0: must be >= 1 (")


def test_the_bare_loop_runs_with_a_workers_backend_settings_and_puts_back_those_before(monkeypatch):
    """The bare loop is measured as a worker trains (TF32 as planned, cuDNN's autotuning on CUDA: the worker's
    own had it, the bench's loops had not); the plain loop after it runs with the settings from before, not TF32
    switched off (which is not torch's default)."""
    import torch

    from raydiff.bench.throughput import bare_loop
    from raydiff.config import load_config
    from raydiff.training import speed
    from raydiff.training.speed import backend_flags, restore_backend_flags

    applied: list[tuple] = []
    apply = speed.apply_training_flags
    monkeypatch.setattr(speed, "apply_training_flags", lambda plan, device: applied.append((plan.tf32, device.type))
                        or apply(plan, device))
    before = backend_flags()
    torch.set_float32_matmul_precision("high")  # not what a CPU's plan sets
    try:
        bare_loop(load_config("smoke", ["train.global_batch=4"], check_source=False), torch.device("cpu"), steps=2)
        assert applied == [(False, "cpu")]
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        restore_backend_flags(before)


def test_the_recovery_bench_refuses_a_bad_config_in_one_line_at_once(capsys):
    """It started the run with its output dropped and waited 10 minutes for a first start that never came."""
    from raydiff import cli
    from raydiff.bench.__main__ import main

    assert cli.run(main, ["recovery", "--config", "smoke", "--set", "train.lr=fast"]) == 2
    assert capsys.readouterr().err == "raydiff: config error: train.lr = 'fast': expected a finite number | null\n"
