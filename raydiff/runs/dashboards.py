"""A run on the dashboards people already use: TensorBoard (on by default), MLflow and Weights & Biases.

Rank 0 of the training workers writes every metrics row and sample grid; the driver may open another session to
add the final summary. Each backend is independent: a backend that fails while logging (a server down, a full
disk) logs one warning and is off for the rest of the session, because a dashboard must never stop training.
A backend whose package is missing raises ImportError when the session opens: that is a config mistake.

A continuing run (a resume, a worker-group restart, the driver's summary session) continues the same MLflow run
and W&B run: their ids are kept in `<run>/dashboards.json`.
"""

from __future__ import annotations

import importlib
import io
import json
import logging
import math
import numbers
import queue
import secrets
import shutil
import socket
import string
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from raydiff.config import Config
from raydiff.runs.runlog import json_safe
from raydiff.storage.atomic import scratch_folder
from raydiff.storage.rundir import RunDir
from raydiff.storage.writes import BackgroundWrites

logger = logging.getLogger("raydiff")

IDS_FILE = "dashboards.json"
TENSORBOARD_DIR = "tensorboard"
_MLFLOW_MAX_QUEUED = 1000  # calls waiting for a slow MLflow server before it is turned off
_CLOSE_WAIT_S = 60.0  # what rank 0 gives MLflow's last calls, and W&B's finish, at the end of a session


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The row's plottable values: finite numbers (numpy's too), not bools, not the step itself."""
    return {k: float(v) for k, v in row.items() if k != "step" and _is_number(v)}


def _flat_params(cfg: Config) -> dict[str, str]:
    """`section.key` -> value as the YAML config spells it (null, true, [1, 2, 2])."""
    return {f"{section}.{key}": value if isinstance(value, str) else json.dumps(value)
            for section, values in cfg.to_dict().items() for key, value in values.items()}


def _import_or_warn(module: str, key: str, what: str, extra: str) -> Any:
    """The dashboard's package, or None with a warning. The driver refuses a config whose package it lacks (one
    line, before anything starts: `config.checks`); a worker node without it (an image, or a runtime_env, that
    the driver's environment does not match) trains on, without that dashboard, as when its server is down."""
    try:
        return importlib.import_module(module)
    except ImportError:
        logger.warning("[raydiff] WARNING: %s needs %s, which this node (%s) lacks: pip install 'raydiff[%s]' on "
                       "every node; %s is off for this session", key, what, socket.gethostname(), extra, what)
        return None


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


class _Ids:
    """`<run>/dashboards.json`: the MLflow and W&B run ids, shared by every session of the run."""

    def __init__(self, run_dir: RunDir) -> None:
        self.run_dir, self._lock = run_dir, threading.Lock()  # the MLflow thread writes too
        try:
            self._ids: dict[str, str] = json.loads(run_dir.read_text(IDS_FILE)) if run_dir.is_file(IDS_FILE) else {}
        except ValueError:
            self._ids = {}

    def get(self, key: str) -> str | None:
        with self._lock:
            return self._ids.get(key)

    def set(self, key: str, value: str) -> None:
        with self._lock:
            if self._ids.get(key) != value:
                self._ids[key] = value
                self.run_dir.write_text(IDS_FILE, json.dumps(self._ids, indent=1) + "\n")


class _Backend:
    name = ""

    def __init__(self) -> None:
        self.on = True

    def guard(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call fn; on the first failure warn once and turn this backend off."""
        if not self.on:
            return
        try:
            fn(*args)
        except Exception as error:  # noqa: BLE001 -- any failure of a dashboard must leave training alone
            self.on = False
            logger.warning("[raydiff] WARNING: %s logging failed and is off for the rest of this session: %s",
                           self.name, _one_line(error))

    def metrics(self, step: int, scalars: dict[str, float]) -> None: ...
    def image(self, tag: str, png: bytes, step: int) -> None: ...
    def summary(self, summary: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def rewind(self, step: int) -> None: ...
    def close(self, publish: bool = True) -> None: ...


class _TensorBoard(_Backend):
    name = "TensorBoard"

    def __init__(self, cfg: Config, run_dir: RunDir, resume_step: int) -> None:
        super().__init__()
        self.run_dir = run_dir
        # An object store cannot append: write locally and upload whole event files at flush() and close(). The
        # file grows all run long; flush() (at every checkpoint) uploads it on a thread of its own, not on the
        # training thread. (Made in _open, under the guard: a full temporary folder turns TensorBoard off.)
        self._tmp: Path | None = None
        self._uploads: BackgroundWrites | None = None
        self._uploaded: dict[str, int] = {}
        self._config_yaml = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
        self.guard(self._open, resume_step)

    def _open(self, resume_step: int) -> None:
        _quiet_writer_thread_failures()
        local = self.run_dir.local
        if local is None:
            self._tmp = self._folder = scratch_folder("tensorboard")
            self._uploads = BackgroundWrites()
        else:
            self._folder = local / TENSORBOARD_DIR
        self._start_writer(resume_step)

    def _start_writer(self, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step writes a SessionLog.START: TensorBoard's reader then drops the points at or past it that
        # earlier files hold (rows a crashed session logged after its last checkpoint, or a rollback's lost
        # steps), so curves don't rewind; from a start over, all of them (the config's text at step 0 too,
        # written again below).
        self.writer = SummaryWriter(str(self._folder), purge_step=resume_step + 1 if resume_step else 0,
                                    flush_secs=30)
        if resume_step == 0:
            self.writer.add_text("config", f"```yaml\n{self._config_yaml}```", 0)

    def metrics(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def image(self, tag: str, png: bytes, step: int) -> None:
        import numpy as np
        from PIL import Image

        self.writer.add_image(tag, np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), step, dataformats="HWC")

    def summary(self, summary: dict[str, Any]) -> None:
        step = summary.get("steps") if isinstance(summary.get("steps"), int) else 0
        self.writer.add_text("summary", f"```json\n{json.dumps(summary, indent=1, default=str)}\n```", step)

    def flush(self, *, wait: bool = False) -> None:
        self.writer.flush()
        if self._tmp is None:
            return
        assert self._uploads is not None  # made with the temporary folder
        for path in sorted(p for p in self._tmp.iterdir() if p.is_file()):
            size = path.stat().st_size
            if self._uploaded.get(path.name) != size:
                # Read now (what the writer has flushed), upload in the background, in order; a failed upload
                # turns TensorBoard off like any other failure.
                name = f"{TENSORBOARD_DIR}/{path.name}"
                self._uploads.submit(name, self.guard, self.run_dir.write_bytes, name, path.read_bytes())
                self._uploaded[path.name] = size
        if wait:
            self._uploads.drain()

    def rewind(self, step: int) -> None:
        """A new event file that purges the points past `step` (its predecessor's upload goes on in the
        background, before the new file's)."""
        self.writer.close()
        self.flush()
        self._start_writer(step)

    def close(self, publish: bool = True) -> None:
        try:
            self.writer.close()
            if publish:
                self.flush(wait=True)
        finally:
            if self._tmp is not None:
                assert self._uploads is not None  # made with the temporary folder
                self._uploads.close()
                shutil.rmtree(self._tmp, ignore_errors=True)


def _quiet_writer_thread_failures() -> None:
    """TensorBoard writes its event files on a thread of its own: a write that fails there (a full disk) printed a
    traceback and was kept for the writer's next call, which raises it, and `guard` says it in one line. The hook
    leaves out the first of the two. Installed once per process; other threads' failures print as before."""
    try:  # tensorboard's private writer thread: if it is renamed, its traceback shows again (cosmetic)
        from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread
    except ImportError:
        return
    previous = threading.excepthook
    if getattr(previous, "raydiff_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        thread = args.thread
        if not (isinstance(thread, _AsyncWriterThread) and getattr(thread, "exception", None) is args.exc_value):
            previous(args)

    hook.raydiff_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class _WandB(_Backend):
    name = "W&B"

    def __init__(self, wandb: Any, cfg: Config, run_dir: RunDir, ids: _Ids) -> None:
        super().__init__()
        self.wandb, self._exit_code = wandb, 0
        self.run: Any = None  # wandb's Run once _open succeeds (wandb is imported at run time: untyped here)
        # W&B writes its files under <dir>/wandb/; on an object store that is a temporary folder, uploaded at
        # close() in offline mode (online, the W&B server has it all).
        self.run_dir = run_dir
        self._tmp: Path | None = None  # made in _open, under the guard, as TensorBoard's
        self.guard(self._open, cfg, run_dir, ids)

    def _open(self, cfg: Config, run_dir: RunDir, ids: _Ids) -> None:
        if run_dir.local is None:
            self._tmp = scratch_folder("wandb")
        run_id = ids.get("wandb_run_id") or "".join(secrets.choice(string.ascii_lowercase + string.digits)
                                                     for _ in range(8))
        self.run = self.wandb.init(
            project=cfg.log.wandb_project, entity=cfg.log.wandb_entity, id=run_id, resume="allow",
            name=cfg.run.name, config=cfg.to_dict(), allow_val_change=True, dir=str(self._tmp or run_dir.local),
            # A run object of our own: no global wandb.run to leak into (or take over from) the user's code.
            reinit="create_new",
            # Ray forwards the worker's output already; W&B's console capture would wrap it a second time.
            settings=self.wandb.Settings(console="off"))
        ids.set("wandb_run_id", run_id)
        # `step` as a field, not W&B's own step: W&B refuses steps below its last one, which a resume rewinds to.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def metrics(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log({**scalars, "step": step})

    def image(self, tag: str, png: bytes, step: int) -> None:
        from PIL import Image

        self.run.log({tag: self.wandb.Image(Image.open(io.BytesIO(png))), "step": step})

    def summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(json.loads(json.dumps(summary, default=str)))
        self._exit_code = 0 if summary.get("status") == "finished" else 1

    def _finish(self, failed: list[Exception]) -> None:
        try:
            self.run.finish(exit_code=self._exit_code)
        except Exception as error:  # noqa: BLE001 -- said by the caller, as any failure to close
            failed.append(error)

    def close(self, publish: bool = True) -> None:
        try:
            if self.run is not None:
                # On a thread, waited for a while: an online run's finish uploads what is left, and a server that
                # does not answer would hold rank 0, and the job, with it.
                failed: list[Exception] = []
                finish = threading.Thread(target=self._finish, args=(failed,), name="raydiff-wandb", daemon=True)
                finish.start()
                finish.join(_CLOSE_WAIT_S)
                if finish.is_alive():
                    logger.warning("[raydiff] WARNING: W&B did not finish this session's run within %.0f s; what it "
                                   "had not uploaded is lost", _CLOSE_WAIT_S)
                    self._tmp = None  # its folder stays: the finish still running writes there
                    return
                if failed:
                    raise failed[0]
                if publish and self._tmp is not None and self.run.offline:
                    for path in sorted(self._tmp.rglob("*")):
                        if path.is_file() and not path.is_symlink():
                            self.run_dir.write_bytes(path.relative_to(self._tmp).as_posix(), path.read_bytes())
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


class _MLflow(_Backend):
    """Every MLflow call runs on a thread of its own, in order: the client retries an unreachable server for
    minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES), which would stall every training worker at the next all-reduce."""

    name = "MLflow"

    def __init__(self, mlflow: Any, cfg: Config, run_dir: RunDir, ids: _Ids) -> None:
        super().__init__()
        from mlflow.entities import Metric, Param, RunTag

        self._Metric, self._Param, self._RunTag = Metric, Param, RunTag
        # A client of our own, not the fluent API's globals: this runs inside a Ray worker next to user code. Made
        # under the guard: a URI MLflow cannot take (a typo's scheme) is a warning, not a failed worker group.
        self.client: Any = None
        self.guard(self._connect, mlflow, cfg.log.mlflow_uri)
        self.run_id: str | None = None
        self._queue: queue.Queue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="raydiff-mlflow", daemon=True)
        self._thread.start()
        self._submit(self._open, cfg, run_dir, ids)

    def _connect(self, mlflow: Any, uri: str) -> None:
        self.client = mlflow.MlflowClient(tracking_uri=uri)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            self.guard(fn, *args)  # a no-op once off: what is queued behind a failure is dropped

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._queue.qsize() >= _MLFLOW_MAX_QUEUED:
            raise RuntimeError(f"the server at {self.client.tracking_uri} is {_MLFLOW_MAX_QUEUED} calls behind")
        self._queue.put((fn, args))

    def _open(self, cfg: Config, run_dir: RunDir, ids: _Ids) -> None:
        run = None
        if run_id := ids.get("mlflow_run_id"):
            try:
                run = self.client.get_run(run_id)
            except Exception as error:
                if getattr(error, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                    raise
        if run is None or run.info.lifecycle_stage == "deleted":  # e.g. log.mlflow_uri names another server now
            run = self.client.create_run(self._experiment_id(cfg.log.mlflow_experiment), run_name=cfg.run.name,
                                         tags={"raydiff.run_dir": str(run_dir)})
            ids.set("mlflow_run_id", run.info.run_id)
        elif run.info.status != "RUNNING":
            self.client.update_run(run.info.run_id, status="RUNNING")  # a finished or failed run continues
        self.run_id = run.info.run_id
        # Params cannot change in MLflow: a continuing run logs the keys it lacks, and changed values as tags.
        logged, params = run.data.params, _flat_params(cfg)
        new = [self._Param(k, v) for k, v in params.items() if k not in logged]
        changed = [self._RunTag(f"raydiff.changed.{k}", v) for k, v in params.items() if logged.get(k, v) != v]
        for i in range(0, max(len(new), len(changed)), 100):  # log_batch takes at most 100 params
            self.client.log_batch(self.run_id, params=new[i:i + 100], tags=changed[i:i + 100])

    def _experiment_id(self, name: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return self.client.create_experiment(name)
            except Exception:
                experiment = self.client.get_experiment_by_name(name)  # a parallel sweep trial created it first
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            self.client.restore_experiment(experiment.experiment_id)
        return experiment.experiment_id

    def _log_batch(self, metrics: list[Any], tags: Sequence[Any] = ()) -> None:
        self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def _log_png(self, name: str, png: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="raydiff-mlflow-") as folder:
            path = Path(folder) / name
            path.write_bytes(png)
            self.client.log_artifact(self.run_id, str(path), artifact_path="samples")

    def _end(self, summary: dict[str, Any]) -> None:
        self.client.log_text(self.run_id, json.dumps(summary, indent=1, default=str), "summary.json")
        self.client.set_terminated(self.run_id, "FINISHED" if summary.get("status") == "finished" else "FAILED")

    def metrics(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        self._submit(self._log_batch, [self._Metric(k, v, now, step) for k, v in scalars.items()])

    def image(self, tag: str, png: bytes, step: int) -> None:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)
        self._submit(self._log_png, f"step_{step:08d}.png" if tag == "samples" else f"{safe}_step_{step:08d}.png",
                     png)

    def summary(self, summary: dict[str, Any]) -> None:
        steps = summary.get("steps")
        step, now = steps if isinstance(steps, int) else 0, int(time.time() * 1000)
        # Numbers are final metrics (final_loss stays final_loss); everything else is a tag.
        metrics = [self._Metric(k if k.startswith("final_") else f"final_{k}", float(v), now, step)
                   for k, v in summary.items() if _is_number(v)]
        tags = [self._RunTag(f"raydiff.{k}", (v if isinstance(v, str) else json.dumps(v, default=str))[:5000])
                for k, v in summary.items() if not _is_number(v) and v is not None]
        self._submit(self._log_batch, metrics, tags)
        self._submit(self._end, summary)

    def close(self, publish: bool = True) -> None:  # its calls go to the server, not the run directory
        self._queue.put(None)
        self._thread.join(_CLOSE_WAIT_S if self.on else 1.0)  # once off, nothing queued will be sent
        if self._thread.is_alive() and self.on:
            logger.warning("[raydiff] WARNING: MLflow did not take this session's last %d calls within %.0f s; "
                           "they are lost", self._queue.qsize(), _CLOSE_WAIT_S)


class Dashboards:
    """Rank 0's writers to TensorBoard, MLflow and Weights & Biases for one run.

    :param cfg: the run's resolved config (`cfg.log` says which dashboards).
    :param run_dir: the run directory: TensorBoard writes `tensorboard/` in it, W&B `wandb/` (local folders).
    :param resume_step: the step this session continues from (0 for a new run): TensorBoard hides the points
        past it that an earlier session logged. A session that only adds the summary passes the run's last step.
    """

    def __init__(self, cfg: Config, run_dir: RunDir, *, resume_step: int) -> None:
        log = cfg.log
        mlflow = _import_or_warn("mlflow", "log.mlflow_uri", "MLflow", "mlflow") if log.mlflow_uri else None
        wandb = _import_or_warn("wandb", "log.wandb_project", "W&B", "wandb") if log.wandb_project else None
        ids = _Ids(run_dir)
        self._backends: list[_Backend] = []
        if log.tensorboard:
            self._backends.append(_TensorBoard(cfg, run_dir, resume_step))
        if wandb is not None:
            self._backends.append(_WandB(wandb, cfg, run_dir, ids))
        if mlflow is not None:
            self._backends.append(_MLflow(mlflow, cfg, run_dir, ids))
        self._closed = False

    def _each(self, method: str, *args: Any) -> None:
        for backend in self._backends:
            backend.guard(getattr(backend, method), *args)

    def metrics(self, row: dict[str, Any]) -> None:
        """One metrics.jsonl row: `step` is the x axis, every other finite number a curve."""
        self._each("metrics", int(row["step"]), _scalars(row))

    def image(self, tag: str, png: bytes, step: int) -> None:
        """A sample grid as PNG bytes."""
        self._each("image", tag, png, step)

    def summary(self, summary: dict[str, Any]) -> None:
        """The run's summary.json: final metrics and tags in MLflow (which then ends the run FINISHED or FAILED
        by `status`), the W&B run's summary, a text panel in TensorBoard; a non-finite number as none (left out)."""
        self._each("summary", json_safe(summary))

    def rewind(self, step: int) -> None:
        """Back to `step` (a rollback): TensorBoard hides the points past it. MLflow and W&B keep their runs open
        (reopening them waited on their servers, for up to a minute, with every worker held at the next
        all-reduce): their points past `step` stay, and the steps trained again are logged beside them."""
        self._each("rewind", step)

    def flush(self) -> None:
        """Make what was logged visible (at checkpoints): TensorBoard's files, uploaded on object stores by a
        thread of their own, so that the caller (the training thread) does not wait for the upload."""
        self._each("flush")

    def close(self, *, publish: bool = True) -> None:
        """`publish=False` (the run's lease is another driver's now): TensorBoard's and offline W&B's files are not
        uploaded to an object store's run directory (a local one has a lock, and no other driver)."""
        if not self._closed:
            self._closed = True
            for backend in self._backends:
                try:
                    backend.close(publish)  # also when off: MLflow's thread ends, temporary folders go
                except Exception as error:  # noqa: BLE001
                    if backend.on:
                        logger.warning("[raydiff] WARNING: %s failed to close: %s", backend.name, _one_line(error))


def dashboards_for(cfg: Config, run_dir: RunDir, *, resume_step: int) -> Dashboards | None:
    """None when nothing is configured (log.tensorboard false, no MLflow URI, no W&B project)."""
    log = cfg.log
    if not (log.tensorboard or log.mlflow_uri or log.wandb_project):
        return None
    return Dashboards(cfg, run_dir, resume_step=resume_step)
