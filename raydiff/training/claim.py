"""One live driver per run directory on a Ray cluster, and the reservation a killed driver leaves behind.

Two drivers training one run directory would interleave their checkpoints, metrics and summaries. Each driver
therefore creates its run's `StopFlag` under a name derived from the run directory. The flag is an actor the
driver owns, so Ray removes it when the driver ends, however it ends. A second driver of the same run on the
same cluster finds the name taken and is refused before it writes anything.

Holding the claim also proves that every earlier driver of the run has ended. One killed outright (SIGKILL, out
of memory) never cancelled its Ray Train run's resource reservation, which Ray keeps for 3 minutes; the new
driver cancels it, so that an elastic run does not wait for CPUs/GPUs nobody uses. `driver.json` in the run
directory records the driver and the name its run reserves resources under.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import ray

from raydiff.runs.rundir import RunDir, RunInUse
from raydiff.training.reservations import cancel_requests
from raydiff.training.stop import StopFlag

NAMESPACE = "raydiff"  # named actors are per namespace; every driver of every job must see the claims
DRIVER_FILE = "driver.json"
GRACE_S = 10.0  # a killed driver's actors are gone within a second or two; its claim gets this long to go
logger = logging.getLogger("raydiff")


def claim_name(run_dir: RunDir) -> str:
    return "run-" + hashlib.sha256(run_dir.uri.encode()).hexdigest()[:32]


def this_driver(invocation: str) -> dict[str, Any]:
    """Who is driving: enough for a user to find the process (or its Ray job) that holds a run."""
    return {"invocation": invocation, "host": socket.gethostname(), "pid": os.getpid(),
            "ray_job": ray.get_runtime_context().get_job_id(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}


@contextlib.contextmanager
def claim_run_dir(run_dir: RunDir, driver: dict[str, Any], grace_s: float = GRACE_S) -> Iterator[Any]:
    """Hold `run_dir` for `driver` (this_driver()) while the block runs; yield the run's StopFlag (the claim
    itself). Raises RunInUse if another live driver on this cluster holds it."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            flag = StopFlag.options(name=claim_name(run_dir), namespace=NAMESPACE, get_if_exists=True).remote(driver)
            holder = ray.get(flag.driver.remote(), timeout=60)
        except Exception:
            # The holder's driver has just ended and Ray is removing its claim: the actor is dead, or its class
            # went with the driver's job ("Expected str or bytes" from Ray). Once gone, the name is free.
            if time.monotonic() > deadline:
                raise
        else:
            if holder["invocation"] == driver["invocation"]:
                break
            if time.monotonic() > deadline:
                raise RunInUse(f"run directory {run_dir} is in use by another raydiff run on this Ray cluster (pid "
                               f"{holder['pid']} on {holder['host']}, Ray job {holder['ray_job']}, since "
                               f"{holder['started']}): wait for it to finish or stop it, or set run.name to start "
                               f"another run")
        time.sleep(0.5)
    try:
        yield flag
    finally:
        with contextlib.suppress(Exception):  # never hide what ended the block; the driver's exit removes it too
            ray.kill(flag)


def take_over_reservation(run_dir: RunDir, driver: dict[str, Any], requester: str) -> None:
    """Record this driver and its run's reservation name in `driver.json`, first cancelling the reservation of
    the previous driver, if it left one. Call only while holding the claim: that driver has ended, so its run
    can no longer renew the reservation."""
    previous: dict[str, Any] = {}
    if run_dir.is_file(DRIVER_FILE):
        with contextlib.suppress(ValueError):
            previous = json.loads(run_dir.read_text(DRIVER_FILE))
    stale = previous.get("requester")
    if stale and stale != requester:
        try:
            cancel_requests([stale])
        except Exception:  # Ray expires it within 3 minutes anyway
            logger.debug("cancelling the previous driver's reservation failed", exc_info=True)
    run_dir.write_text(DRIVER_FILE, json.dumps({**driver, "requester": requester}, indent=2) + "\n")
