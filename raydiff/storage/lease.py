"""One holder at a time for a folder of a run's storage (a run directory, a stream preparation), held where the
folder lives: a lock on local or NFS storage, a lease object with a heartbeat on S3 and GCS.

A claim inside one Ray cluster (a named actor) cannot see another Ray instance on the same machine, or another
cluster sharing the bucket, and two drivers of one run directory would interleave their checkpoints, metrics and
moves. So the claim lives beside the folder, in `<parent>/.raydiff-leases/<name>`, and names its holder (host,
pid, Ray job, since) for the one-line refusal:

- local or NFS storage: the file is held with an exclusive `flock`. The kernel (on NFS, the server's lock manager)
  releases it when the holder ends, however it ends; the file itself is never deleted (deleting a lock file lets
  two holders lock two different files).
- S3 and GCS: the object is created only if absent (S3 `If-None-Match: *`, GCS `ifGenerationMatch=0`), renewed
  every quarter of `stale_s` by an overwrite conditional on the version the holder wrote, and deleted on release.
  A lease that is not renewed belongs to a holder that is gone: a claimant that has watched it unchanged for
  `stale_s` (its own, or the holder's where that is longer: the lease says it) since its last renewal (by the
  store's clock on S3; on GCS, whose answers carry no time, by this machine's), and for at least half of
  `stale_s` itself, takes it over with an overwrite conditional on the version it watched, so that of two
  claimants only one wins. A holder
  whose renewal fails that condition reads the object back: a body with its own lease id is its own write, whose
  answer was lost; another's means it has lost the lease, and is told (`on_lost`, at once where it was lost
  before the holder asked to be told): it must write nothing more there. A network error is not a loss by
  itself: the next renewal tries again. But a holder that has had no renewal confirmed for half of `stale_s`
  gives the lease up as lost (`Lease.unrenewed_s` says for how long): a claimant may take it over at `stale_s`,
  and a holder that cannot reach the store may still have workers that can. A renewal runs on a thread of its
  own and is waited for only until then, so that one hanging request does not outlast it.

A run's workers do not wait to be told by their driver alone: a driver that is paused (Ctrl-Z, a suspended
laptop) renews nothing, tells nothing, and its lease is taken over at `stale_s` while its workers, elsewhere,
train on. Rank 0 reads the lease object itself (`watch_for_takeover`) and stops them once another driver holds
it. (A paused holder of a local lock keeps it: no one takes its run.)
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from raydiff.storage.errors import StorageFailure, permanent_reason, storage_failure
from raydiff.storage.lease_objects import GcsLeaseObject, S3LeaseObject, request_timeout_s
from raydiff.storage.rundir import RunDir, RunInUse

FOLDER = ".raydiff-leases"
POLL_S = 0.5  # how often a claimant looks at a lease it waits for
# Where an object store's client errors come from (boto3's, Google's, and the HTTP stacks under them): a failure of
# the store or the network, not of raydiff's code.
CLIENT_MODULES = ("botocore", "boto3", "google", "urllib3", "requests", "s3transfer")
TAKE_ATTEMPTS = 5  # a claimant's requests to an object store that fail in a row before the error is the command's
logger = logging.getLogger("raydiff")


def _number(value: Any) -> float:
    """A lease body's number, or 0 where it holds none (a lease of before stale_s was written into it)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def lease_of(folder: RunDir) -> RunDir:
    """Where the lease of `folder` lives: beside it, so that moving the folder aside keeps it."""
    return folder.parent / FOLDER / folder.name


def this_process() -> dict[str, Any]:
    """Who holds a lease: enough for a user to find the process (`ray_job` is added once Ray is up)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return "a process that has not said who it is yet"
    job = f", Ray job {holder['ray_job']}" if holder.get("ray_job") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, since {holder.get('started')}"


class Lease:
    """A held lease. `update(**fields)` adds to what it says of its holder; `on_lost` is called once if an
    object-store lease is lost: from the heartbeat thread, or where that happened before it was set, as it is set.
    `lost` says whether it was; `unrenewed_s`, where the holder gave it up unrenewed rather than finding another
    holder's write, for how many seconds no renewal had been confirmed. `previous` is what the lease said of a
    holder that ended without releasing it (killed outright), where this one took it from such a holder."""

    def __init__(self, store: _LocalLock | _ObjectLease, holder: dict[str, Any],
                 previous: dict[str, Any] | None = None) -> None:
        self._store, self.holder, self.previous = store, dict(holder), previous
        self._on_lost: Callable[[], None] | None = None
        self._lost = False
        self.unrenewed_s: float | None = None
        self._guard = threading.Lock()  # `lose` and the setter: the callback runs exactly once

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def on_lost(self) -> Callable[[], None] | None:
        return self._on_lost

    @on_lost.setter
    def on_lost(self, callback: Callable[[], None] | None) -> None:
        with self._guard:
            self._on_lost, lost = callback, self._lost
        if lost and callback is not None:
            callback()

    def lose(self, unrenewed_s: float | None = None) -> None:
        """Another holder has it now, or (`unrenewed_s`) may have it: no renewal confirmed for that long (the
        heartbeat's call)."""
        with self._guard:
            if self._lost:  # told once: a renewal refused as the heartbeat gives up says nothing new
                return
            self.unrenewed_s = unrenewed_s  # before `lost`, which readers outside the guard check first
            self._lost, callback = True, self._on_lost
        if callback is not None:
            callback()

    def update(self, **fields: Any) -> None:
        self.holder.update(fields)
        self._store.rewrite(self.holder)

    def release(self) -> None:
        self._store.release()

    def leave(self) -> bool:
        """Stop holding the lease without freeing it where it can expire, for a holder that may still have
        writers (workers not yet ended): an object lease is no longer renewed, and goes stale in `stale_s`; a local
        lock is freed (the kernel frees it as the process ends anyway). Returns whether it was left to expire. A
        release after it does nothing."""
        return self._store.leave()


@contextlib.contextmanager
def hold(folder: RunDir, holder: dict[str, Any], *, stale_s: float, what: str,
         wait: bool = False) -> Iterator[Lease]:
    """Hold the lease of `folder` while the block runs. Raises RunInUse (naming the holder) when another live
    holder has it, or, with `wait`, waits for it to be released (saying so once)."""
    lease = take(folder, holder, stale_s=stale_s, what=what, wait=wait)
    try:
        yield lease
    finally:
        lease.release()


def take(folder: RunDir, holder: dict[str, Any], *, stale_s: float, what: str, wait: bool = False) -> Lease:
    """`hold` without the block: the caller releases the lease."""
    place = lease_of(folder)
    store: _LocalLock | _ObjectLease = _LocalLock(place) if place.local else _ObjectLease(place, stale_s)
    said: set[str] = set()
    failed = 0
    while True:
        try:
            state, found = store.take(holder)
        except Exception as exc:
            failed += 1
            if place.local or failed >= TAKE_ATTEMPTS or permanent_reason(exc) is not None:
                raise _one_line(exc, place, f"taking the lease of {what} {folder}", failed) from None
            # A moment of a busy or unreachable store (a claimant may poll for as long as another run prepares).
            logger.debug("asking for the lease failed; asking again", exc_info=True)
            time.sleep(POLL_S * 2**failed)
            continue
        failed = 0
        if state == "held":
            return found
        if state == "live" and not wait:
            raise RunInUse(f"{what} {folder} is in use by another raydiff run ({describe(found)}): wait for it to "
                           f"finish or stop it, or set run.name to start another run")
        message = (f"waiting for another raydiff run ({describe(found)}) that holds {what} {folder}"
                   if state == "live" else
                   f"{what} {folder} has the lease of a raydiff run ({describe(found)}) that may have ended: "
                   f"watching it for up to {stale_s:g} s (run.lease_stale_s) before taking it over")
        if message not in said:
            print(f"[raydiff] {message}", flush=True)
            said.add(message)
        time.sleep(POLL_S)


def _lease_object(place: RunDir, stale_s: float) -> S3LeaseObject | GcsLeaseObject:
    timeout_s = request_timeout_s(stale_s)
    return S3LeaseObject(place, timeout_s) if place.uri.startswith("s3://") else GcsLeaseObject(place, timeout_s)


def watch_for_takeover(folder: RunDir, invocation: str, *, stale_s: float,
                       on_taken: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    """On S3 and GCS, read `folder`'s lease every quarter of `stale_s` on a thread of its own, and call `on_taken`
    (once, with the holder) when a holder other than the driver invocation `invocation` holds it; the returned
    function ends the watch. A lease not there (released) or not readable is looked at again later. Local folders:
    nothing to watch."""
    if not folder.remote:
        return lambda: None
    objects = _lease_object(lease_of(folder), stale_s)
    ended = threading.Event()

    def watch() -> None:
        failed_reads = 0
        while not ended.wait(stale_s / 4):
            try:
                found = objects.read()
            except Exception as exc:  # noqa: BLE001 - the store or the network: the next look tries again
                failed_reads += 1
                if failed_reads == 4:  # said once: the watch goes on
                    first = (str(exc).strip().splitlines() or [""])[0][:300]
                    logger.warning(f"[raydiff] warning: rank 0 cannot read the run's lease to watch for a takeover "
                                   f"({type(exc).__name__}: {first}); it goes on trying")
                continue
            holder = found[0].get("holder") if found is not None and isinstance(found[0], dict) else None
            if isinstance(holder, dict) and holder.get("invocation") != invocation and not ended.is_set():
                try:
                    on_taken(holder)
                    return
                except Exception as exc:  # noqa: BLE001 - told again at the next look
                    logger.warning(f"[raydiff] warning: acting on the run's takeover failed ({exc!r})")

    threading.Thread(target=watch, name="raydiff-lease-watch", daemon=True).start()
    return ended.set


def _one_line(exc: Exception, place: RunDir, operation: str, attempts: int) -> Exception:
    """A lease that cannot be taken, as the one line its command ends in: a storage error no retry can fix (a
    folder of run.storage this user may not write, a bucket refused or missing), or an object store's error that
    outlasted the retries (an endpoint that does not answer: boto3's and Google's errors are not OSErrors). Any
    other error is raised as it is (a bug should be seen)."""
    failure = storage_failure(exc, str(place), operation)
    if failure is not None:
        return failure
    if place.local or not (isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in CLIENT_MODULES):
        return exc
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return StorageFailure(f"storage {place}: {operation} failed {attempts} times ({type(exc).__name__}: {first}); "
                          f"check the address, the credentials and the network, then run the same command again")


class _LocalLock:
    """A file held with an exclusive flock on a local or NFS folder."""

    def __init__(self, place: RunDir) -> None:
        assert place.local is not None  # take() makes a _LocalLock only for a local place
        self.path = Path(place.local)
        self.fd: int | None = None

    def take(self, holder: dict[str, Any]) -> tuple[str, Any]:
        folder = self.path.parent
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            # As writable as the storage folder it is in (on storage shared by a team, 1777 or group-writable):
            # made with this user's umask alone, every other user's runs there were refused their leases.
            shared = folder.parent.stat().st_mode & 0o7777
            if shared & 0o022:
                with contextlib.suppress(OSError):
                    os.chmod(folder, shared | (0o1000 if shared & 0o002 else 0))
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return "live", self._holder()  # a lock is held only while its holder lives
        self.fd = fd
        previous = self._holder()  # a holder that released it left the file empty
        try:
            self.rewrite(holder)
        except BaseException:  # not held after all (a full disk): the lock goes with its file descriptor
            self.release()
            raise
        return "held", Lease(self, holder, previous if isinstance(previous, dict) else None)

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):  # being rewritten this instant
            return None

    def rewrite(self, holder: dict[str, Any]) -> None:
        body = json.dumps(holder).encode()
        assert self.fd is not None  # held: take() set it
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, body, 0)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)  # free: nobody to name
            os.close(self.fd)  # releases the flock
            self.fd = None

    def leave(self) -> bool:
        self.release()
        return False


class _ObjectLease:
    """A lease object on S3 or GCS, renewed by a heartbeat thread while held."""

    def __init__(self, place: RunDir, stale_s: float) -> None:
        self.objects = _lease_object(place, stale_s)
        self.stale_s, self.renew_s = stale_s, stale_s / 4
        self.version: str | None = None
        self.confirmed = 0.0  # when (monotonic) the last write the store confirmed was sent
        self.first_sent: float | None = None  # when take() first asked for it (a retried create's write may be that)
        self._given_up = threading.Event()  # no renewal confirmed in time: nothing more is written to it
        # (version, since when by our monotonic clock, its age then by the store's clock)
        self.watched: tuple[str, float, float] | None = None
        self.lease: Lease | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._renewals = 0
        self.id = uuid.uuid4().hex  # in every body this holder writes

    def _body(self, holder: dict[str, Any]) -> bytes:
        # A new body at every renewal: a watcher sees the version change (an S3 ETag is the body's MD5).
        self._renewals += 1
        return json.dumps({"holder": holder, "renewal": self._renewals, "lease": self.id,
                           "stale_s": self.stale_s}).encode()

    def _mine(self, found: tuple[dict[str, Any], str, float]) -> bool:
        """Whether the lease object read back (`found`: body, version, age) is a write of this holder's: another
        writer would have replaced the body, and its id, with its own."""
        return found[0].get("lease") == self.id

    def take(self, holder: dict[str, Any]) -> tuple[str, Any]:
        """("held", Lease), ("live", holder): renewed while watched, or ("watching", holder): not decided yet."""
        sent = time.monotonic()
        self.first_sent = sent if self.first_sent is None else self.first_sent
        version = self.objects.create(self._body(holder))
        if version is None:
            found = self.objects.read()
            if found is None:
                return "watching", None  # released between the two calls: try again
            body, seen, age_s = found
            other, now = body.get("holder"), time.monotonic()
            if self._mine(found):  # a write of this take's, applied, its answer lost: the retry was refused
                self.version, self.confirmed = seen, self.first_sent
                return self._held(holder)
            self.first_sent = None  # another's lease: no create of this take's is in effect, the next one counts
            if self.watched is None or self.watched[0] != seen:
                renewed = self.watched is not None
                self.watched = (seen, now, age_s)
                return ("live" if renewed else "watching"), other
            # Unrenewed for stale_s: its age when first seen (the store's clock, or ours on GCS) and the time
            # watched since (ours), not its age now, which counts the time watched twice.
            _, since, age_when_seen_s = self.watched
            watched_s = now - since
            # The holder renews at a quarter of its own stale_s, which may be longer than this claimant's.
            stale_s = max(self.stale_s, _number(body.get("stale_s")))
            if watched_s < max(stale_s - age_when_seen_s, stale_s / 2):
                return "watching", other
            sent = time.monotonic()
            version, _ = self._replace(self._body(holder), seen)
            if version is None:
                return "watching", other  # another claimant took it over first
            logger.warning(f"[raydiff] took over the lease of {describe(other)}: not renewed for "
                           f"{max(age_s, age_when_seen_s + watched_s):.0f} s (run.lease_stale_s = {stale_s:g})")
            self.version, self.confirmed = version, sent
            return self._held(holder, other if isinstance(other, dict) else None)
        self.version, self.confirmed = version, sent
        return self._held(holder)

    def _held(self, holder: dict[str, Any], previous: dict[str, Any] | None = None) -> tuple[str, Lease]:
        self.lease = Lease(self, holder, previous)
        self._thread = threading.Thread(target=self._heartbeat, name="raydiff-lease", daemon=True)
        self._thread.start()
        return "held", self.lease

    def _replace(self, body: bytes, version: str) -> tuple[str | None, bool]:
        """The object's version once `body` replaced `version`, or None where another write came first; and
        whether it was read back. A store may apply a write and lose its answer; the client's retry is then
        refused, because of that very write. So a refusal reads the object back, and finding a write of this
        holder's there is success: this one, or an earlier one whose answer and read-back were both lost (the next
        renewal writes the holder anew)."""
        written = self.objects.replace(body, version)
        if written is None:
            found = self.objects.read()
            if found is not None and self._mine(found):
                return found[1], True
        return written, False

    def rewrite(self, holder: dict[str, Any]) -> None:
        if self._given_up.is_set():  # nothing more is written to it (and a hung renewal may hold the lock)
            return
        try:
            with self._lock:
                self._renew(holder)
        except Exception:  # a network error: the next renewal tries again, if the heartbeat's deadline allows
            logger.debug("renewing the lease failed", exc_info=True)

    def _renew(self, holder: dict[str, Any]) -> None:
        if self.version is None or self._given_up.is_set():
            return
        sent = time.monotonic()
        version, read_back = self._replace(self._body(holder), self.version)
        if self._given_up.is_set():  # the answer came after the heartbeat gave up waiting for it
            return
        if version is None:
            self.version = None
            logger.error("[raydiff] ERROR: this run's lease was taken over by another raydiff run (it was not "
                         "renewed in time)")
            if self.lease is not None:
                self.lease.lose()
            return
        # A write read back may be an earlier one, sent before this: it confirms no later time than the last.
        self.version, self.confirmed = version, (self.confirmed if read_back else sent)

    def _heartbeat(self) -> None:
        """Renew every quarter of stale_s, each renewal on a thread of its own and waited for only until half of
        stale_s has passed since the last one confirmed: then the lease is given up (`_give_up`), whatever the
        store's requests are still doing, well before a claimant may take it over, at stale_s."""
        lease = self.lease
        assert lease is not None  # take() sets it before starting this thread
        while True:
            if self._stop.wait(max(0.0, min(self.renew_s, self._deadline() - time.monotonic()))):
                return
            if time.monotonic() < self._deadline():
                renewal = threading.Thread(target=self.rewrite, args=(lease.holder,), daemon=True,
                                           name="raydiff-lease-renewal")
                renewal.start()
                while renewal.is_alive() and not self._stop.is_set() and time.monotonic() < self._deadline():
                    renewal.join(min(0.1, max(0.0, self._deadline() - time.monotonic())))  # a release: at once
            if self._stop.is_set() or self.version is None:  # released, or taken over
                return
            if time.monotonic() >= self._deadline():
                self._give_up()
                return

    def _deadline(self) -> float:
        return self.confirmed + self.stale_s / 2

    def _give_up(self) -> None:
        """Give the lease up as lost: no renewal was confirmed for half of stale_s, a claimant may take it at
        stale_s, and this holder could not tell (its renewals do not get through; its workers' writes may). Nothing
        more is written to it: it goes stale, and is free at stale_s."""
        self._given_up.set()
        unrenewed_s = time.monotonic() - self.confirmed
        logger.error(f"[raydiff] ERROR: this run's lease could not be renewed for {unrenewed_s:.0f} s (the store did "
                     f"not answer): another raydiff run may take it over at run.lease_stale_s = {self.stale_s:g} s")
        if self.lease is not None:
            self.lease.lose(unrenewed_s=unrenewed_s)

    def leave(self) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:  # after a renewal under way; then nothing to delete: it goes stale
            self.version = None
        return True

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._given_up.is_set():  # left to go stale; a renewal that hangs may hold the lock
            return
        with self._lock:  # after a renewal under way (its requests time out: `request_timeout_s`)
            if self.version is not None and not self._given_up.is_set():
                with contextlib.suppress(Exception):  # stale in stale_s anyway
                    self.objects.delete(self.version)
            self.version = None
