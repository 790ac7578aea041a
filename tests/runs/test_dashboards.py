"""Dashboards: TensorBoard read back with its own reader, MLflow against a real server on loopback, W&B offline.
No Ray: the class is what rank 0 and the driver call."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port
from PIL import Image

from raydiff.config import Config
from raydiff.runs.dashboards import Dashboards, dashboards_for
from raydiff.storage.rundir import RunDir


def _config(name: str = "dash", *, tensorboard: bool = True, mlflow_uri: str | None = None,
            mlflow_experiment: str = "raydiff", wandb_project: str | None = None) -> Config:
    cfg = Config()
    cfg.run.name = name
    cfg.log.tensorboard, cfg.log.mlflow_uri, cfg.log.wandb_project = tensorboard, mlflow_uri, wandb_project
    cfg.log.mlflow_experiment = mlflow_experiment
    return cfg.resolve()


def _png(color: int = 200) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (32, 16), color).save(buffer, format="PNG")
    return buffer.getvalue()


def _row(step: int, loss: float) -> dict:
    # What metrics.jsonl rows hold, plus what must not become a curve: a bool, a None, a NaN, a string.
    return {"step": step, "loss": loss, "lr": 1e-3, "images_seen": step * 64, "diverged": False,
            "peak_memory_gb": None, "grad_norm": float("nan"), "note": "x"}


def _crash_and_resume(cfg: Config, run_dir: RunDir) -> None:
    """A session logs steps 10..50 and crashes after its checkpoint at 30; the next continues from 30."""
    first = Dashboards(cfg, run_dir, resume_step=0)
    for step in range(10, 60, 10):
        first.metrics(_row(step, loss=1.0 / step))
    first.image("samples", _png(), 20)
    first.flush()
    first.close()
    # TensorBoard's event files are named by the second; real sessions are far apart, and the reader takes
    # the files in name order.
    time.sleep(1.1)
    second = Dashboards(cfg, run_dir, resume_step=30)
    for step in range(40, 70, 10):
        second.metrics(_row(step, loss=100.0 + step))
    second.image("samples", _png(50), 60)
    second.summary({"status": "finished", "steps": 60, "final_loss": 160.0, "world_sizes": [2, 1], "error": None})
    second.close()


def _read_tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_tensorboard_resume_drops_the_crashed_sessions_points(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    _crash_and_resume(_config(), run_dir)
    acc = _read_tensorboard(tmp_path / "run" / "tensorboard")
    assert sorted(acc.Tags()["scalars"]) == ["images_seen", "loss", "lr"]  # no bool, None, NaN or string
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert [e.step for e in acc.Scalars("loss")] == [10, 20, 30, 40, 50, 60]  # each step once, in order
    assert loss[30] == pytest.approx(1 / 30) and loss[40] == pytest.approx(140) and loss[50] == pytest.approx(150)
    images = acc.Images("samples")
    assert [e.step for e in images] == [20, 60] and (images[0].width, images[0].height) == (32, 16)
    texts = {tag: acc.Tensors(tag) for tag in acc.Tags()["tensors"]}
    config_text = texts["config/text_summary"][0].tensor_proto.string_val[0].decode()
    assert config_text.startswith("```yaml\n") and "name: dash" in config_text
    assert len(texts["config/text_summary"]) == 1  # written by the fresh start only
    assert '"final_loss": 160.0' in texts["summary/text_summary"][0].tensor_proto.string_val[0].decode()


def test_a_start_over_before_the_first_checkpoint_shows_the_config_once_and_the_summary_without_nan(tmp_path):
    """Restarted from step 0 (killed before its first checkpoint), the run's config text at step 0 was shown
    twice: a purge from step 1 kept the first session's. A non-finite summary number is left out, not "NaN"."""
    run_dir = RunDir(tmp_path / "run")
    for session in range(2):
        dashboards = Dashboards(_config(), run_dir, resume_step=0)
        dashboards.metrics(_row(10, loss=1.0 + session))
        dashboards.close()
    dashboards = Dashboards(_config(), run_dir, resume_step=10)
    dashboards.summary({"status": "finished", "steps": 10, "final_val_loss": math.inf, "quality": {"fid": math.nan}})
    dashboards.close()
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator

    shown = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"tensors": 0})  # the app's
    shown.Reload()                                                               # (--load_fast=false) reader
    assert len(shown.Tensors("config/text_summary")) == 1
    acc = _read_tensorboard(tmp_path / "run" / "tensorboard")
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(10, 2.0)]
    summary = acc.Tensors("summary/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "NaN" not in summary and "Infinity" not in summary and '"fid": null' in summary


def test_a_rollback_hides_the_lost_steps_on_tensorboard_without_waiting_for_mlflow(tmp_path, monkeypatch):
    """Rolled back from step 50 to 30: TensorBoard shows each step once, the steps trained again; an MLflow server
    that does not answer holds nothing up (the dashboards were closed and reopened, which waited up to a minute for
    MLflow's queue, with every worker held at the next all-reduce)."""
    import raydiff.runs.dashboards as dashboards_module

    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never answers
    run_dir = RunDir(tmp_path / "run")
    dash = Dashboards(_config(mlflow_uri=f"http://127.0.0.1:{silent.getsockname()[1]}"), run_dir, resume_step=0)
    for step in range(10, 60, 10):
        dash.metrics(_row(step, loss=1.0 / step))
    time.sleep(1.1)  # event files are named by the second
    started = time.perf_counter()
    dash.rewind(30)
    rewind_s = time.perf_counter() - started
    for step in (40, 50):
        dash.metrics(_row(step, loss=100.0 + step))
    monkeypatch.setattr(dashboards_module, "_CLOSE_WAIT_S", 1.0)  # the end's wait, cut short here
    dash.close()
    silent.close()
    assert rewind_s < 10
    acc = _read_tensorboard(tmp_path / "run" / "tensorboard")
    assert [(e.step, round(e.value, 4)) for e in acc.Scalars("loss")] == [(10, 0.1), (20, 0.05), (30, 0.0333),
                                                                          (40, 140.0), (50, 150.0)]
    assert len(acc.Tensors("config/text_summary")) == 1


def test_a_rollback_on_an_object_store_uploads_both_event_files(tmp_path, monkeypatch):
    monkeypatch.setattr(RunDir, "local", property(lambda self: None))  # the object-store path, writing to tmp_path
    dash = Dashboards(_config(), RunDir(tmp_path / "run"), resume_step=0)
    for step in (10, 20, 30):
        dash.metrics(_row(step, loss=1.0))
    time.sleep(1.1)
    dash.rewind(20)
    dash.metrics(_row(30, loss=2.0))
    dash.close()
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 2
    loss = _read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")
    assert [(e.step, e.value) for e in loss] == [(10, 1.0), (20, 1.0), (30, 2.0)]


def test_tensorboard_on_an_object_store_uploads_at_flush(tmp_path, monkeypatch):
    # A RunDir that reports no local folder takes the object-store path; its writes still land in tmp_path.
    monkeypatch.setattr(RunDir, "local", property(lambda self: None))
    run_dir = RunDir(tmp_path / "run")
    dash = Dashboards(_config(), run_dir, resume_step=0)
    for step in (10, 20):
        dash.metrics(_row(step, loss=0.5))
    assert not (tmp_path / "run" / "tensorboard").exists()  # nothing uploaded per row
    dash.flush()  # uploads in the background
    # The folder appears before the upload's file is renamed into place: wait for the file itself.
    deadline = time.time() + 10
    while not list((tmp_path / "run" / "tensorboard").glob("events*")) and time.time() < deadline:
        time.sleep(0.05)
    assert [e.step for e in _read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")] == [10, 20]
    dash.metrics(_row(30, loss=0.5))
    dash.close()
    assert [e.step for e in _read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")] == [10, 20, 30]
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1


def test_tensorboard_on_an_object_store_uploads_off_the_calling_thread(tmp_path, monkeypatch):
    """flush() runs at every checkpoint on rank 0's training thread: the growing events file must not be uploaded
    there (an object store PUT of megabytes takes seconds)."""
    monkeypatch.setattr(RunDir, "local", property(lambda self: None))  # the object-store path, writing to tmp_path
    uploads, real_write = [], RunDir.write_bytes

    def write_bytes(self, name, data):
        if name.startswith("tensorboard/"):
            time.sleep(0.2)  # a slow PUT
            uploads.append((threading.current_thread().name, len(data)))
        real_write(self, name, data)

    monkeypatch.setattr(RunDir, "write_bytes", write_bytes)
    dash = Dashboards(_config(), RunDir(tmp_path / "run"), resume_step=0)
    dash.metrics(_row(10, loss=0.5))
    started = time.perf_counter()
    dash.flush()
    assert time.perf_counter() - started < 0.15  # did not wait for the upload
    dash.metrics(_row(20, loss=0.25))
    dash.close()  # waits for the uploads, then uploads the final file
    assert len(uploads) == 2 and all(thread.startswith("raydiff-writes") for thread, _ in uploads)
    assert [e.step for e in _read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")] == [10, 20]


def test_a_full_temporary_folder_turns_tensorboard_off_on_an_object_store_and_trains_on(tmp_path, monkeypatch,
                                                                                            caplog):
    """On an object store TensorBoard writes to a temporary folder first: where that cannot be made (a full /tmp),
    TensorBoard is off with one warning, like any dashboard failure, and the run goes on (it stopped training,
    and was told as a full run storage)."""
    import errno
    import tempfile

    monkeypatch.setattr(RunDir, "local", property(lambda self: None))  # the object-store path, writing to tmp_path

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tempfile, "mkdtemp", full)
    with caplog.at_level(logging.WARNING, logger="raydiff"):
        dash = Dashboards(_config(), RunDir(tmp_path / "run"), resume_step=0)
        dash.metrics(_row(10, loss=0.5))
        dash.flush()
        dash.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["[raydiff] WARNING: TensorBoard logging failed and is off for the rest of this session: "
                        "OSError: [Errno 28] No space left on device"]
    assert not (tmp_path / "run" / "tensorboard").exists()


def test_nothing_configured_means_no_dashboards(tmp_path):
    assert dashboards_for(_config(tensorboard=False), RunDir(tmp_path), resume_step=0) is None
    assert isinstance(dashboards_for(_config(), RunDir(tmp_path), resume_step=0), Dashboards)


@pytest.mark.parametrize(("module", "key", "what"), [("mlflow", "mlflow_uri", "MLflow"),
                                                     ("wandb", "wandb_project", "W&B")])
def test_a_worker_node_without_the_package_trains_on_without_that_dashboard(tmp_path, monkeypatch, caplog, module,
                                                                            key, what):
    """The driver refuses the config where it lacks the package (tests/config/test_checks.py); a worker node that
    lacks it raised ImportError in rank 0, and Ray Train restarted the workers until run.max_failures."""
    monkeypatch.setitem(sys.modules, module, None)
    cfg = _config()
    setattr(cfg.log, key, "http://127.0.0.1:1" if key == "mlflow_uri" else "proj")
    with caplog.at_level(logging.WARNING, logger="raydiff"):
        dash = Dashboards(cfg, RunDir(tmp_path / "run"), resume_step=0)
        dash.metrics(_row(10, loss=0.5))
        dash.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith(f"[raydiff] WARNING: log.{key} needs {what}, which this "
                                                         f"node (")
    assert f"pip install 'raydiff[{module}]' on every node; {what} is off for this session" in warnings[0]
    assert len(_read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")) == 1


# MLflow.
@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free loopback port with a SQLite store; only its own process group is stopped."""
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, cwd=root,
        # No job runner: it starts eight worker processes the tests never use.
        env=dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                tail = (root / "server.log").read_text()[-2000:]
                pytest.fail(f"mlflow server did not answer {url}/health within 60 s "
                            f"(exit code {server.poll()}); its log ends with:\n{tail}")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def test_mlflow_one_run_continued_across_sessions(tmp_path, mlflow_server):
    import mlflow

    cfg = _config(tensorboard=False, mlflow_uri=mlflow_server, mlflow_experiment="continued")
    run_dir = RunDir(tmp_path / "run")
    _crash_and_resume(cfg, run_dir)

    client = mlflow.MlflowClient(tracking_uri=mlflow_server)
    experiment = client.get_experiment_by_name("continued")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the resume continued the run
    run = runs[0]
    assert json.loads((tmp_path / "run" / "dashboards.json").read_text())["mlflow_run_id"] == run.info.run_id
    assert run.info.run_name == "dash" and run.info.status == "FINISHED"
    assert run.data.params["run.name"] == "dash" and run.data.params["model.channel_mult"] == "[1, 2, 2]"
    assert run.data.params["log.wandb_project"] == "null" and len(run.data.params) > 50
    history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")]
    # MLflow cannot delete points: the crashed session's 40 and 50 stay beside the continued run's.
    assert {s for s, _ in history} == {10, 20, 30, 40, 50, 60}
    assert (40, 140.0) in history and (60, 160.0) in history
    assert "grad_norm" not in run.data.metrics and "diverged" not in run.data.metrics
    assert run.data.metrics["final_loss"] == 160.0 and run.data.metrics["final_steps"] == 60
    assert run.data.tags["raydiff.status"] == "finished" and run.data.tags["raydiff.world_sizes"] == "[2, 1]"
    samples = sorted(f.path for f in client.list_artifacts(run.info.run_id, "samples"))
    assert samples == ["samples/step_00000020.png", "samples/step_00000060.png"]
    png = Path(client.download_artifacts(run.info.run_id, "samples/step_00000020.png", str(tmp_path)))
    assert png.read_bytes() == _png()

    # A third session (say, the run extended) re-opens the finished run instead of starting another.
    again = Dashboards(cfg, run_dir, resume_step=60)
    again.metrics(_row(70, loss=170.0))
    again.close()
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "RUNNING" and runs[0].data.metrics["loss"] == 170.0


def test_mlflow_server_down_does_not_stop_training(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once instead of retrying for minutes
    cfg = _config(mlflow_uri=f"http://127.0.0.1:{free_port()}")
    dash = Dashboards(cfg, RunDir(tmp_path / "run"), resume_step=0)
    with caplog.at_level(logging.WARNING, logger="raydiff"):
        for step in range(10, 60, 10):
            dash.metrics(_row(step, loss=0.5))
        dash.close()
    warnings = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(warnings) == 1 and "off for the rest of this session" in warnings[0]
    # TensorBoard went on regardless.
    assert len(_read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")) == 5


def test_an_mlflow_uri_mlflow_cannot_take_is_one_warning_not_a_failed_worker_group(tmp_path, caplog):
    """The client was made outside the guard: a typo's scheme raised in every worker group's start."""
    cfg = _config(mlflow_uri="htp://127.0.0.1:5000")
    with caplog.at_level(logging.WARNING, logger="raydiff"):
        dash = Dashboards(cfg, RunDir(tmp_path / "run"), resume_step=0)
        dash.metrics(_row(10, loss=0.5))
        dash.close()
    warnings = [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()]
    assert len(warnings) == 1 and "off for the rest of this session" in warnings[0]
    assert len(_read_tensorboard(tmp_path / "run" / "tensorboard").Scalars("loss")) == 1


# Weights & Biases.
@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, with its own folders and settings in tmp_path: nothing reaches the network or ~/."""
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    import wandb

    wandb.teardown()  # stop the wandb-core service process: it would otherwise live as long as pytest


def test_wandb_offline_keeps_one_run_id(tmp_path, wandb_offline):
    cfg = _config(tensorboard=False, wandb_project="raydiff-tests")
    run_dir = RunDir(tmp_path / "run")
    _crash_and_resume(cfg, run_dir)

    run_id = json.loads((tmp_path / "run" / "dashboards.json").read_text())["wandb_run_id"]
    sessions = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(sessions) == 2
    for folder in sessions:
        assert folder.name.split("-")[3] == run_id  # offline-run-<date>_<time>-<id>[-n]
        assert (folder / f"run-{run_id}.wandb").stat().st_size > 0
    assert list((tmp_path / "run" / "wandb").rglob("media/images/samples_*.png"))


def test_wandb_offline_on_an_object_store_uploads_the_run_files(tmp_path, monkeypatch, wandb_offline):
    monkeypatch.setattr(RunDir, "local", property(lambda self: None))  # the object-store path, writing to tmp_path
    dash = Dashboards(_config(tensorboard=False, wandb_project="raydiff-tests"), RunDir(tmp_path / "run"),
                      resume_step=0)
    dash.metrics(_row(10, loss=0.5))
    dash.close()
    run_id = json.loads((tmp_path / "run" / "dashboards.json").read_text())["wandb_run_id"]
    assert list((tmp_path / "run" / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))


def test_a_wandb_finish_that_does_not_return_holds_the_end_of_a_session_for_a_bounded_time(tmp_path, monkeypatch,
                                                                                          caplog, wandb_offline):
    """An online run's finish uploads what is left; with a server that does not answer it held rank 0, and the
    job, for as long as W&B kept trying."""
    import raydiff.runs.dashboards as dashboards_module

    dash = Dashboards(_config(tensorboard=False, wandb_project="raydiff-tests"), RunDir(tmp_path / "run"),
                      resume_step=0)
    dash.metrics(_row(10, loss=0.5))
    run = dash._backends[0].run
    finish, released = run.finish, threading.Event()
    monkeypatch.setattr(run, "finish", lambda **kwargs: released.wait(60), raising=False)
    monkeypatch.setattr(dashboards_module, "_CLOSE_WAIT_S", 1.0)
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="raydiff"):
        dash.close()
    assert time.perf_counter() - started < 10
    assert [r.getMessage() for r in caplog.records if r.name == "raydiff"] == [
        "[raydiff] WARNING: W&B did not finish this session's run within 1 s; what it had not uploaded is lost"]
    released.set()
    finish()
