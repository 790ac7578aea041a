"""Shared fixtures. Tests marked `ray` share one local Ray cluster per pytest process (2 logical CPUs)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Ray Train's controller collects each worker's reports when it polls them (every 2 s by default). Tests
# checkpoint every few steps, so the end of every test run would wait on that queue; every Ray process the
# tests start (local instances, test clusters, CLI runs) inherits this.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
# Each test run would also start Ray Train's preemption watcher (a process that watches for node drains, which no
# test cluster sees: the tests simulate a notice with debug.preemption_from_step) and Ray's prestarted idle
# workers, which no test uses: CPU the suite is bound by (docs/benchmarks.md#the-test-suite). The job tests' head
# runs with Ray's defaults, as users do.
TEST_ONLY_RAY_SETTINGS = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_enable_worker_prestart": "0",
                          "RAY_prestart_worker_first_driver": "0"}
for _name, _value in TEST_ONLY_RAY_SETTINGS.items():
    os.environ.setdefault(_name, _value)
# Ray counts a disk over 95% in use as full: its raylets then print a warning every ten seconds, which reaches a
# test's output (raydiff's commands pass it on once: docs/resume-and-elastic.md#rays-own-temp-directory). The tests'
# clusters live on this machine's disk, which CI shares with whatever else is there (a CI run failed so once, the
# disk just over 95%): here a disk is full at 99%. The tests of Ray's temp directory itself give their runs Ray's
# default, on a small disk of their own (tests/cluster/test_ray_temp_dir.py).
os.environ.setdefault("RAY_local_fs_capacity_threshold", "0.99")
# Every process of the tests computes on one torch thread: this pytest process, the commands it runs, and the Ray
# clusters' workers, which take OMP_NUM_THREADS as their cap (raydiff.cluster.devices.torch_threads). The tests'
# models are small, and every bit-exact comparison then compares runs on the same number of threads, whatever
# their workers' CPUs. (Measured against two threads: the one-worker runs end sooner beside the other group's,
# and the suite takes as long, docs/benchmarks.md#the-test-suite.)
os.environ["OMP_NUM_THREADS"] = "1"
# S3 tests talk to a moto server on loopback. Ray processes the tests start inherit these dummy credentials
# (the standard way to pass them); real credentials and the EC2 metadata service are never consulted.
os.environ["AWS_ACCESS_KEY_ID"] = "raydiff-tests"
os.environ["AWS_SECRET_ACCESS_KEY"] = "raydiff-tests"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# Tests report no usage to Ray (no network). This also keeps Ray Data's usage poller out of every test process: a
# thread that, with no Prometheus to ask, formats a traceback every 10 s, and Python 3.11 formats tracebacks with
# `ast`, whose conversion is not safe against a second parse interleaved with it (CPython gh-106905): the layout
# and config-reference tests, which parse raydiff's source, failed on it once ("AST constructor recursion depth
# mismatch").
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


# The tests that start Ray, in two groups of about equal time (docs/benchmarks.md#the-test-suite): each group runs
# on one pytest-xdist worker with a Ray cluster of its own, beside the other. A file stays in one group, so that its
# module fixtures (reference runs) run once; files not named here are in the first group.
SECOND_RAY_GROUP = ("test_jobs.py", "test_tune.py", "test_storage_failures.py", "test_rundir.py", "test_train.py",
                    "test_evaluate.py", "test_export.py", "test_class_conditional.py", "test_lease.py")


def ray_group(item) -> str:
    return "ray-b" if item.path.name in SECOND_RAY_GROUP else "ray-a"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`-n 2 --dist loadgroup`, the README's test command) the tests that start Ray run in two
    groups, each on one worker, one test after another on that worker's Ray cluster, and first; the other tests run
    after them, or beside them on a worker whose group is done."""
    groups: dict[str, list] = {"ray-a": [], "ray-b": []}
    others = []
    for item in items:
        if item.get_closest_marker("ray"):
            groups[ray_group(item)].append(item)
        else:
            others.append(item)
    for name, group in groups.items():
        for item in group:
            item.add_marker(pytest.mark.xdist_group(name))
    items[:] = groups["ray-a"] + groups["ray-b"] + others


_snapshots_taken = 0


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that uses a Ray cluster and fails: what the cluster held then (tests/cluster_snapshot.py), kept with
    the report for the run's end."""
    global _snapshots_taken
    report = yield
    if report.failed and _cluster_address and item.get_closest_marker("ray") and _snapshots_taken < 2:
        from cluster_snapshot import snapshot

        _snapshots_taken += 1  # the end shows two: a cluster that does not answer costs no more
        report.user_properties.append(("ray_cluster", snapshot(_cluster_address)))
    return report


@pytest.hookimpl(trylast=True)  # after the durations, just above the short summary: the end CI shows
def pytest_terminal_summary(terminalreporter):
    """At the end of the output, which is what CI shows: what the Ray cluster held as each of the first two failed
    tests failed (read in the process that ran them, where the cluster is)."""
    failed = [r for r in terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
              if dict(r.user_properties).get("ray_cluster")]  # a fixture's failure is an error
    for report in failed[:2]:
        terminalreporter.write_line(f"Ray cluster as {report.nodeid} failed ({report.when}):")
        for line in dict(report.user_properties)["ray_cluster"].splitlines()[:6]:
            terminalreporter.write_line(f"  {line}")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Built-in datasets go to a per-session cache, never the user's ~/.cache."""
    monkeypatch.setenv("RAYDIFF_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_cluster_address: str | None = None  # set while the session's cluster runs; run_cli joins it


def own_head(**args) -> dict:
    """Head-node arguments for a test's `ray.cluster_utils.Cluster`: a GCS port chosen here, and RAY_ADDRESS naming
    it in the environment of every process the node starts. Ray looks its cluster up without an address in places
    (Ray Train's placement-group cleaner), and finds another one when two run on this machine (the two groups'
    clusters, a test's own): docs/training.md#which-ray."""
    port = free_port()
    return {**args, "gcs_server_port": port, "env_vars": {"RAY_ADDRESS": f"127.0.0.1:{port}"}}


def own_node(cluster, **args) -> dict:
    """Arguments for a node added to a test's Cluster: its processes, too, name their cluster (see `own_head`)."""
    return {**args, "env_vars": {"RAY_ADDRESS": cluster.address}}


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One local Ray cluster (a head with 2 CPUs, like this machine) for every test of this worker's group that
    needs Ray: joining it saves each CLI run the start of a Ray instance of its own. Stopped by the session: only
    what it started."""
    global _cluster_address
    from ray.cluster_utils import Cluster

    os.environ["RAYDIFF_CACHE"] = str(tmp_path_factory.getbasetemp() / "cache")
    # With the dashboard: Ray Train's placement-group cleaner (which Tune sweeps rely on) uses the state API.
    c = Cluster(initialize_head=True, head_node_args=own_head(num_cpus=2, include_dashboard=True,
                                                              dashboard_host="127.0.0.1", dashboard_port=free_port()))
    _cluster_address = c.address
    yield c
    _cluster_address = None
    c.shutdown()


@pytest.fixture(autouse=True)
def _ray_tests_join_the_cluster(request):
    if request.node.get_closest_marker("ray"):
        if getattr(request.config.option, "loadgroup", False) and "@ray-" not in request.node.nodeid:
            # pytest-xdist's grouping fails silently on some pytest releases (pytest-dev/pytest-xdist#1386): the
            # tests of a group would then run on both workers, and start a Ray cluster on each.
            pytest.fail("pytest-xdist did not group the tests that start Ray on one worker: use pytest < 9.2 "
                        "(pytest-dev/pytest-xdist#1386) or run with -n 0", pytrace=False)
        request.getfixturevalue("cluster")
        import ray

        if ray.is_initialized():  # this process is a driver of the cluster: what a command does as it joins
            from raydiff.cluster.leftovers import remove_groups_of_ended_jobs

            try:
                remove_groups_of_ended_jobs()
            except Exception as exc:  # noqa: BLE001 - as a command's start: best effort, the test goes on
                print(f"removing the placement groups of ended jobs failed: {exc!r}")


@pytest.fixture(scope="session")
def ray_session(cluster):
    """This process as a driver of the session's cluster (for tests that call Ray directly). Its processes' output
    is not forwarded here: connected for the rest of the session, it would print into whichever later test's captured
    output is open (a raylet's disk warning once did, failing a test that checks a command's one-line error)."""
    import ray

    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def leftover_placement_groups(ray_session) -> list[str]:
    """The placement groups of the cluster that still hold resources though the job that made them has ended (none
    of the tests' groups outlives its job; a group's id ends with its job's)."""
    from ray._private.state import jobs
    from ray.util.placement_group import placement_group_table

    ended = [job["JobID"] for job in jobs() if job["IsDead"]]
    return [group_id for group_id, group in placement_group_table().items()
            if group["state"] != "REMOVED" and any(group_id.endswith(job) for job in ended)]


def reserving(ray_session) -> set[str]:
    """The Ray Train runs that hold a reservation with the cluster's autoscaling coordinator."""
    from raydiff.training.reservations import COORDINATOR

    try:
        coordinator = ray_session.get_actor(*COORDINATOR)
    except ValueError:
        return set()
    requesters = ray_session.get(coordinator.__ray_call__.remote(lambda actor: list(actor._ongoing_reqs)))
    return {r for r in requesters if r.startswith("train-")}


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's) on a free loopback port; yields (endpoint URL, boto3 client)."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    server.stop()


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator (gcp-storage-emulator) on a free loopback port with a bucket `raydiff-gcs`; yields
    (endpoint URL, pyarrow filesystem). It takes no credentials: clients connect with data.anonymous=true."""
    import pyarrow.fs as pafs
    from gcp_storage_emulator.server import create_server

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket="raydiff-gcs")
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    yield endpoint, pafs.GcsFileSystem(anonymous=True, endpoint_override=f"127.0.0.1:{port}", scheme="http")
    server.stop()


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory):
    """A stand-in for the Hugging Face Hub on a free loopback port (tests/hub_server.py): dataset OWNER/NAME is the
    folder `hub_server.root / OWNER / NAME`; clients reach it with data.endpoint = hub_server.endpoint."""
    from hub_server import HubServer

    server = HubServer(tmp_path_factory.mktemp("hub")).start()
    yield server
    server.stop()


def run_cli(module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 600):
    """Run `python -m <module> args...` as a user would, in a fresh process. Ray tests join the session's
    cluster; other tests get `local` (a fresh Ray if they start one), never someone else's cluster."""
    full_env = dict(os.environ, RAY_ADDRESS=_cluster_address or "local")
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env, cwd=ROOT, stdin=subprocess.DEVNULL)


def run_cli_interrupted(module: str, *args: str, at: str, sig: int = signal.SIGINT, after_s: float = 0.0,
                        timeout: float = 600) -> tuple[int, str]:
    """Run like `run_cli`, and press Ctrl-C (SIGINT to the command), or send `sig`, `after_s` seconds after a line
    of its output contains `at`. Returns the exit code and the output (stdout and stderr together)."""
    def press(proc: subprocess.Popen) -> None:
        time.sleep(after_s)
        proc.send_signal(sig)

    return run_cli_acting(module, *args, at=at, act=press, timeout=timeout)


def run_cli_acting(module: str, *args: str, at: str, act: Callable[[subprocess.Popen], None],
                   env: dict[str, str] | None = None, timeout: float = 600,
                   own_process_group: bool = False) -> tuple[int, str]:
    """Run like `run_cli`, and call `act(process)` once, as soon as a line of its output contains `at` (something
    done to the command, or around it, at a known point of its work). Returns the exit code and the output (stdout
    and stderr together). `own_process_group`: the command leads a process group of its own (as under `timeout`),
    which `act` may signal."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "RAY_ADDRESS": _cluster_address or "local", **(env or {})},
                            cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=own_process_group)
    output, acted = [], False
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            output.append(line)
            if at in line and not acted:
                act(proc)
                acted = True
        return proc.wait(timeout=timeout), "".join(output)
    finally:
        proc.kill()


def wait_for(condition, timeout: float = 180, what: str = "condition"):
    """`condition()`'s first true value, asked every 50 ms; an AssertionError naming `what` after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def processes_mentioning(marker: str) -> list[int]:
    """PIDs whose command line mentions `marker` (a temp dir of the test's own): what the test started."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


@pytest.fixture
def short_path():
    """A folder whose path is short enough for Ray's Unix sockets under it (a test's tmp_path is not)."""
    folder = Path(tempfile.mkdtemp(prefix="rd-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


SMOKE_EVAL = ["--set", "eval.every=10", "--set", "eval.at_end=true", "--set", "eval.num=200", "--set", "eval.steps=10"]


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, cluster):
    """One run of the smoke preset (2 workers, 20 steps), with the digits' quality measured at steps 10 and 20 and
    steps 3-7 profiled; yields (run directory, the CLI's output). Tests only read it."""
    storage = tmp_path_factory.mktemp("runs")
    proc = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={storage}", *SMOKE_EVAL,
                   "--set", "log.profile_steps=[3,7]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return storage / "smoke", proc.stdout + proc.stderr


def write_messy_folder(folder: Path, good: int = 40) -> dict[str, list[str]]:
    """`good` synthetic images, one of each awkward mode raydiff converts (CMYK, 16-bit, palette with
    transparency, RGBA), and one of each kind it must skip (truncated, corrupt, empty, not an image).
    Returns the file names by fate: {"good": [...], "converted": [...], "bad": [...]}."""
    import io

    import numpy as np
    from PIL import Image

    from raydiff.data.builtin import write_synthetic

    names = {"good": [p.name for p in write_synthetic(folder, num=good, resolution=24, fmt="jpg", seed=3)]}
    Image.new("CMYK", (24, 24), (0, 255, 255, 0)).save(folder / "cmyk.jpg")
    Image.fromarray(np.full((24, 24), 40000, np.uint16)).save(folder / "gray16.png")
    rgba = Image.new("RGBA", (24, 24), (0, 0, 0, 0))
    rgba.paste((0, 128, 0, 255), (0, 0, 12, 24))
    rgba.save(folder / "alpha.png")
    rgba.convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png", transparency=0)
    names["converted"] = ["cmyk.jpg", "gray16.png", "alpha.png", "palette.png"]
    jpeg = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(jpeg, format="JPEG")
    (folder / "truncated.jpg").write_bytes(jpeg.getvalue()[:200])
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is text, not a JPEG")
    names["bad"] = ["truncated.jpg", "corrupt.png", "empty.jpg", "notes.jpg"]
    return names


def write_checkpoint(run_dir, cfg, *, step: int = 20, classes=None, seed: int = 0, flat_ema: bool = False):
    """A checkpoint of `cfg`'s model as training writes it, without Ray: random weights (from `seed`), and an EMA
    that differs from them (`classes`: a class-conditional run's {"names", "counts"}; `flat_ema`: the EMA's
    tensors views of one buffer, as a GPU worker's `EmaUpdater` keeps and saves them); returns its folder."""
    import torch

    from raydiff.model.flat import views_of
    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import make_ema
    from raydiff.runs.checkpoint import write_state
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state

    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # nothing ~0, so the samples depend on every layer
    ema = make_ema(model)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.9)
        if flat_ema:
            averaged = list(ema.parameters())
            flat = torch.empty(sum(p.numel() for p in averaged))
            for p, view in zip(averaged, views_of(flat, averaged), strict=True):
                view.copy_(p)
                p.data = view
    folder = run_dir / f"checkpoint_{step:08d}"
    folder.mkdir(parents=True)
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    objects = TrainingState(model, ema, optimizer, scaler)
    state = checkpoint_state(objects, Progress(step=step), cfg.train.global_batch, cfg.to_dict())
    if classes:
        state["classes"] = classes
    write_state(folder, state)
    return folder


def write_posthoc_run(run_dir, *, tracked=(0.05, 0.10), steps: int = 60, every: int = 10):
    """A smoke-preset run of `steps` steps whose weights take a random walk, tracked by `train.ema: posthoc`
    (snapshots every `every` steps) and by one more average of width 0.07, which the run does not store; returns
    (the config, the final tracker, the 0.07 average)."""
    import torch

    from raydiff.config import load_config
    from raydiff.model.unet import build_model
    from raydiff.model.weight_averages import PowerEma, make_ema
    from raydiff.runs.checkpoint import write_state
    from raydiff.runs.ema_snapshots import snapshot_bytes, snapshot_name
    from raydiff.runs.state import Progress, TrainingState, checkpoint_state
    from raydiff.storage.rundir import RunDir
    cfg = load_config("smoke", ["train.ema=posthoc", f"train.ema_sigma_rels=[{','.join(map(str, tracked))}]",
                                f"train.ema_snapshot_every={every}", "diffusion.timesteps=50"])
    torch.manual_seed(0)
    model = build_model(cfg)
    tracker, between = PowerEma(model, tracked), PowerEma(model, [0.07])
    run = RunDir(run_dir)
    for step in range(1, steps + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        tracker(step)
        between(step)
        if step % every == 0:
            run.write_bytes(snapshot_name(step), snapshot_bytes(tracker, step=step, images_seen=step * 16,
                                                                config=cfg.to_dict(), classes=None))
    objects = TrainingState(model, make_ema(model), torch.optim.AdamW(model.parameters()),
                            torch.amp.GradScaler("cpu", enabled=False), tracker)
    folder = run_dir / f"checkpoint_{steps:08d}"
    folder.mkdir(parents=True)
    write_state(folder, checkpoint_state(objects, Progress(step=steps), 16, cfg.to_dict()))
    return cfg, tracker, between


ENDED_JOBS_ACTORS = """
import ray
ray.init(address="{address}", logging_level="ERROR")

@ray.remote(num_cpus=0)
class Actor:
    def id(self):
        return ray.get_runtime_context().get_actor_id()

dies = Actor.remote()
lives = Actor.options(name="{detached}", namespace="{namespace}", lifetime="detached").remote()
print(ray.get_runtime_context().get_job_id(), ray.get(dies.id.remote()), ray.get(lives.id.remote()))
"""


TESTS_NAMESPACE = "raydiff-tests"


def ended_jobs_actors(ray_session, detached_name: str) -> tuple[str, str, str]:
    """A job that ran and ended on the session's cluster: (its id, its actor that died with it, its detached actor
    named `detached_name` in TESTS_NAMESPACE, alive: `kill_named(ray_session, detached_name)` when done)."""
    from ray._private.state import state as gcs_state

    address = ray_session.get_runtime_context().gcs_address
    job, dead, alive = subprocess.run(
        [sys.executable, "-c", ENDED_JOBS_ACTORS.format(address=address, detached=detached_name,
                                                         namespace=TESTS_NAMESPACE)],
        capture_output=True, text=True, check=True, env={**os.environ, "RAY_ADDRESS": address},
        timeout=120).stdout.split()[-3:]
    wait_for(lambda: any(j["JobID"] == job and j["IsDead"] for j in gcs_state.job_table()), what="the job's end")
    wait_for(lambda: gcs_state.actor_table(dead).get("State") == "DEAD", what="its actor's death")
    return job, dead, alive


def kill_named(ray_session, name: str) -> None:
    """Kill the detached actor `name` of TESTS_NAMESPACE (`ended_jobs_actors`)."""
    ray_session.kill(ray_session.get_actor(name, namespace=TESTS_NAMESPACE))


def plant_late_group(ray_session, *, job: str, creator_actor: str, cpus: float) -> str:
    """Register a placement group as a dying actor's request reaches Ray after its creators ended: its creator job
    and actor are those given, and Ray's flags for their ends unset (Ray sets them only on the groups registered
    when each ends). Waits until it is placed; returns its id. Through the GCS's own request, as a core worker
    sends it: Ray has no other way to make one at will."""
    from cluster_snapshot import gcs
    from ray.core.generated import common_pb2, gcs_service_pb2, gcs_service_pb2_grpc
    from ray.util.placement_group import placement_group_table

    group = os.urandom(14) + bytes.fromhex(job)  # a group's id ends with its job's
    spec = common_pb2.PlacementGroupSpec(
        placement_group_id=group, strategy=common_pb2.PACK, creator_job_id=bytes.fromhex(job),
        creator_actor_id=bytes.fromhex(creator_actor),
        bundles=[common_pb2.Bundle(bundle_id=common_pb2.Bundle.BundleIdentifier(placement_group_id=group),
                                   unit_resources={"CPU": cpus})])
    address = ray_session.get_runtime_context().gcs_address
    with gcs(address) as (channel, call):
        gcs_service_pb2_grpc.PlacementGroupInfoGcsServiceStub(channel).CreatePlacementGroup(
            gcs_service_pb2.CreatePlacementGroupRequest(placement_group_spec=spec), **call)
    wait_for(lambda: placement_group_table().get(group.hex(), {}).get("state") == "CREATED", what="its placement")
    return group.hex()
