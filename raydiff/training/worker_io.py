"""What the driver hands every training worker, and what a worker hands back: the typed boundary between
`raydiff.training.driver` and `raydiff.training.loop`.

Why typed: the two sides run in different processes (Ray pickles both objects), so a misspelt key in a plain dict
would surface only at run time, on a worker; a dataclass fails where it is built.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ray

    from raydiff.config import Config
    from raydiff.data.run_images import RunImages
    from raydiff.storage.rundir import RunDir


@dataclass
class WorkerArgs:
    """Ray Train's `train_loop_config` holds this under the key "args" (Ray wants a dict there)."""

    config: Config  # the resolved config (`raydiff.training.resolve`)
    images: RunImages  # decoded once by the driver; the workers read it from the object store
    run_dir: RunDir
    cpus_per_worker: float  # what Ray reserves for each worker; its torch threads follow on the worker
    invocation: str  # one id per driver invocation: the events log tells restarts within it from later re-runs
    stop_flag: ray.actor.ActorHandle | None = None  # the driver's `StopFlag`: SIGTERM / Ctrl-C / a lost lease
    init_weights: ray.ObjectRef | None = None  # model.init_from's state dict, for a new run only
    quality: ray.ObjectRef | None = None  # the in-run `InRunQuality` (eval.every / eval.at_end)
    records: dict[str, str] = field(default_factory=dict)  # files rank 0 writes to the run once it has restored
    classes: dict[str, Any] | None = None  # a class-conditional run's {"names", "counts"}, saved in checkpoints


class WorkerStatus(str, enum.Enum):
    """How a worker's training ended."""

    FINISHED = "finished"  # train.total_steps reached
    STOPPED = "stopped"  # asked to stop (a signal), after a checkpoint
    DIVERGED = "diverged"  # too many non-finite steps in a row, after at most one rollback
    UNRESUMABLE = "unresumable"  # checkpoints exist and none restores: nothing was trained or written
    LEASE_LOST = "lease_lost"  # another driver took the run over (or may): stopped without writing more
    REFUSED = "refused"  # the workers cannot train as configured (not one image fits): nothing trained or written
    STORAGE_FAILED = "storage_failed"  # rank 0 could not write to (or read from) storage, and no retry can fix it


@dataclass
class WorkerResult:
    """What `train_worker` returns; Ray Train hands rank 0's to the driver (`Result.return_value`)."""

    status: WorkerStatus
    steps: int
    # why it diverged, why no checkpoint restores, what storage refused; for LEASE_LOST, at which step it stopped
    diagnostic: str | None = None
    images_seen: int = 0
    final_loss: float | None = None
    skipped_steps: int = 0
    rollbacks: int = 0
    world_size: int = 0
    resumed_from_step: int = 0
    val_loss: float | None = None
    quality: dict[str, Any] | None = None  # the newest in-run evaluation's metrics

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value}
