"""One holder per run directory, held where the directory lives: a lock on local storage (released when its
holder dies, however it dies), a lease object with a heartbeat on S3 (moto) and GCS (the emulator, taught the
generation preconditions real GCS has). And through the CLI: a live run is neither moved nor joined by a second
command, from another Ray instance or from the same cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http import HTTPStatus

import pytest
from conftest import ROOT, free_port, run_cli

from raydiff.storage.errors import StorageFailure
from raydiff.storage.lease import hold, lease_of, take, this_process
from raydiff.storage.rundir import RunDir, RunInUse

HOLDER = """
import sys, time
from raydiff.storage.lease import hold, this_process
from raydiff.storage.rundir import RunDir
with hold(RunDir(sys.argv[1], endpoint=sys.argv[2] or None), this_process(), stale_s=4, what="run directory"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(uri: str, endpoint: str = "") -> subprocess.Popen:
    """A process that holds the lease of `uri` until it is killed."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, uri, endpoint], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            stdin=subprocess.DEVNULL)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_local_lease_is_refused_while_held_and_free_once_its_holder_is_killed(tmp_path):
    run_dir = RunDir(tmp_path / "run")
    holder = _holder(str(tmp_path / "run"))
    try:
        with pytest.raises(RunInUse) as info:
            take(run_dir, this_process(), stale_s=4, what="run directory")
        assert f"run directory {run_dir} is in use by another raydiff run (pid {holder.pid} on " in str(info.value)
        assert "set run.name to start another run" in str(info.value)
    finally:
        holder.kill()  # as SIGKILL or an out-of-memory kill would: the kernel releases the lock
        holder.wait()
    with hold(run_dir, {"pid": 1}, stale_s=4, what="run directory") as lease:
        lease.update(ray_job="01000000")
        assert json.loads(lease_of(run_dir).local.read_text()) == {"pid": 1, "ray_job": "01000000"}
        with pytest.raises(RunInUse, match="pid 1 on None, Ray job 01000000"):  # a second open file: refused too
            take(run_dir, this_process(), stale_s=4, what="run directory")
    assert not run_dir.exists()  # the lease lives beside the folder: nothing written in it
    with hold(run_dir, this_process(), stale_s=4, what="run directory"):
        pass  # released


def test_a_local_lease_whose_holder_cannot_be_written_is_not_kept_locked(tmp_path, monkeypatch):
    """A full disk refuses the holder's line: the take fails, and the lock goes with it (a second take of the same
    process was refused as held by a process that had not said who it is)."""
    import errno

    from raydiff.storage import lease as lease_module

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    run_dir = RunDir(tmp_path / "run")
    with monkeypatch.context() as patched:
        patched.setattr(lease_module.os, "pwrite", full)
        with pytest.raises(StorageFailure, match="taking the lease of run directory .* failed: no space left"):
            take(run_dir, this_process(), stale_s=4, what="run directory")
    with hold(run_dir, this_process(), stale_s=4, what="run directory"):
        pass


def _object_lease_lifecycle(uri: str, endpoint: str) -> None:
    """A live holder refuses others (they see it renewed); a killed one is taken over once stale, by exactly one
    of two claimants."""
    run_dir = RunDir(uri, endpoint=endpoint)
    holder = _holder(uri, endpoint)
    try:
        started = time.monotonic()
        with pytest.raises(RunInUse, match=f"pid {holder.pid} on "):
            take(run_dir, this_process(), stale_s=4, what="run directory")
        assert time.monotonic() - started < 4  # refused once it renewed (every second), not after the stale time
    finally:
        holder.kill()
        holder.wait()
    outcomes: list = []

    def claim(name: str) -> None:
        try:
            outcomes.append(take(run_dir, {"name": name}, stale_s=4, what="run directory"))
        except RunInUse as exc:
            outcomes.append(exc)

    claimants = [threading.Thread(target=claim, args=(n,)) for n in ("a", "b")]
    started = time.monotonic()
    for t in claimants:
        t.start()
    for t in claimants:
        t.join()
    held = [o for o in outcomes if not isinstance(o, Exception)]
    assert len(held) == 1 and len(outcomes) == 2, outcomes  # one takes it over, the other sees it renewed
    assert time.monotonic() - started >= 2  # watched for at least half the stale time first
    held[0].release()
    with hold(run_dir, this_process(), stale_s=4, what="run directory"):  # released: taken at once
        pass


def test_an_s3_lease_is_renewed_taken_over_when_stale_and_released(s3_server):
    endpoint, client = s3_server
    client.create_bucket(Bucket="raydiff-leases")
    _object_lease_lifecycle("s3://raydiff-leases/runs/smoke", endpoint)
    assert "Contents" not in client.list_objects_v2(Bucket="raydiff-leases")  # released: deleted


def test_an_s3_lease_write_whose_answer_was_lost_is_still_the_holders(s3_server):
    """The store applied the lease's write (the first one, a renewal) and the answer never came: the client's retry
    is refused, the object having changed by that very write. The holder finds its own write there and holds on,
    neither watching its own lease as another run's nor stopping the run as if the lease were taken over."""
    from flaky_s3 import FlakyS3

    endpoint, client = s3_server
    client.create_bucket(Bucket="lost-answers")
    with FlakyS3(endpoint, rate=0.0) as proxy:
        run_dir = RunDir("s3://lost-answers/runs/smoke", endpoint=proxy.endpoint)
        proxy.drop_next("PUT")
        started = time.monotonic()
        lease = take(run_dir, {"name": "a"}, stale_s=4, what="run directory")
        assert time.monotonic() - started < 2  # held at once, not after watching for half the stale time
        lost: list[bool] = []
        lease.on_lost = lambda: lost.append(True)
        proxy.drop_next("PUT")
        lease.update(step=1)
        assert proxy.counts["dropped"] == 2 and not lost
        with pytest.raises(RunInUse):  # still held, and renewed: another run is refused
            take(run_dir, {"name": "b"}, stale_s=4, what="run directory")
        lease.release()
    assert "Contents" not in client.list_objects_v2(Bucket="lost-answers")  # released: deleted


def test_a_claimant_rides_out_a_store_that_fails_beyond_its_retries_for_a_moment(s3_server):
    """A run waiting for another's stream preparation asks every half second for as long as that takes: one
    moment of a store failing (503s beyond boto3's own retries) is asked again, not the command's traceback."""
    from flaky_s3 import FlakyS3

    endpoint, client = s3_server
    client.create_bucket(Bucket="busy-store")
    with FlakyS3(endpoint, rate=0.0) as proxy:
        proxy.fail_next("PUT", 4)  # boto3 makes 3 attempts: the first request fails, the next goes through
        lease = take(RunDir("s3://busy-store/runs/smoke", endpoint=proxy.endpoint), {"name": "a"}, stale_s=600,
                     what="run directory")
        assert proxy.counts["slow_down"] == 4 and not lease.lost
        lease.release()


def test_a_claimant_refused_by_the_store_stops_at_once(s3_server, monkeypatch):
    """Refused credentials or a missing bucket are no moment of a busy store: said at once, not after retries."""
    from raydiff.storage import lease as lease_module

    endpoint, _ = s3_server
    asked: list[int] = []

    def refused(self, holder):
        asked.append(1)
        raise OSError("An error occurred (AccessDenied) when calling the PutObject operation: Access Denied")

    monkeypatch.setattr(lease_module._ObjectLease, "take", refused)
    with pytest.raises(StorageFailure, match="^storage s3://refused/runs/.raydiff-leases/.*: taking the lease of run "
                                             "directory s3://refused/runs/smoke failed: access denied"):
        take(RunDir("s3://refused/runs/smoke", endpoint=endpoint), {"name": "a"}, stale_s=600, what="run directory")
    assert len(asked) == 1


def test_a_lease_that_cannot_be_taken_ends_in_one_line_whatever_the_store_raises(s3_server, tmp_path, monkeypatch):
    """The lease lives in run.storage's `.raydiff-leases/`, not in the run folder the room check looked at: a
    storage folder this user may not write raised PermissionError's traceback; boto3's errors (a bucket missing,
    an endpoint that does not answer) are no OSErrors, and raised theirs."""
    import errno

    from raydiff.storage import lease as lease_module

    endpoint, _ = s3_server
    with pytest.raises(StorageFailure, match="taking the lease of run directory s3://no-such-bucket/runs/smoke "
                                             "failed: the bucket does not exist"):
        take(RunDir("s3://no-such-bucket/runs/smoke", endpoint=endpoint), {"name": "a"}, stale_s=600,
             what="run directory")
    monkeypatch.setattr(lease_module, "POLL_S", 0.01)
    with pytest.raises(StorageFailure, match=r"taking the lease of run directory s3://b/runs/smoke failed 5 times "
                                             r"\((EndpointConnectionError|ConnectTimeoutError|ReadTimeoutError)"):
        take(RunDir("s3://b/runs/smoke", endpoint=f"http://127.0.0.1:{free_port()}"), {"name": "a"}, stale_s=600,
             what="run directory")

    def refused(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))
    monkeypatch.setattr(lease_module.Path, "mkdir", refused)  # as root, which may write anywhere
    with pytest.raises(StorageFailure, match=f"^storage {tmp_path}/.raydiff-leases/.*: taking the lease of run "
                                             f"directory {tmp_path}/smoke failed: permission denied"):
        take(RunDir(tmp_path / "smoke"), {"name": "a"}, stale_s=600, what="run directory")


def test_a_holder_whose_s3_lease_was_taken_over_is_told_once_even_before_it_asked_to_be(s3_server):
    """Another run's write replaced the lease (a takeover after renewals that did not get through): the holder's
    next renewal finds it and the lease is lost for good. A callback set after that is called at once, as the
    driver sets its own only once Ray is up: the run must stop writing however early the loss came."""
    endpoint, client = s3_server
    client.create_bucket(Bucket="taken-over")
    run_dir = RunDir("s3://taken-over/runs/smoke", endpoint=endpoint)
    lease = take(run_dir, {"name": "a"}, stale_s=600, what="run directory")  # no heartbeat in the test
    key = lease_of(run_dir).uri.removeprefix("s3://taken-over/")
    client.put_object(Bucket="taken-over", Key=key, Body=json.dumps({"holder": {"name": "b"}, "lease": "b"}))
    lease.update(step=1)  # the renewal is refused: another's write is there
    assert lease.lost
    lost: list[bool] = []
    lease.on_lost = lambda: lost.append(True)
    lease.update(step=2)  # nothing more written, nor told again
    assert lost == [True]
    lease.release()  # leaves the other run's lease alone
    assert json.loads(client.get_object(Bucket="taken-over", Key=key)["Body"].read())["lease"] == "b"


def test_an_s3_lease_released_as_another_run_takes_it_over_is_left_to_the_other(s3_server, monkeypatch):
    """The release deletes the lease only where it is still this holder's version, in one conditional request: a
    takeover's write landing between a look and a delete was deleted with it."""
    endpoint, client = s3_server
    client.create_bucket(Bucket="released-late")
    run_dir = RunDir("s3://released-late/runs/smoke", endpoint=endpoint)
    lease = take(run_dir, {"name": "a"}, stale_s=600, what="run directory")  # no heartbeat in the test
    store = lease._store
    key = lease_of(run_dir).uri.removeprefix("s3://released-late/")
    monkeypatch.setattr(store.objects.client, "head_object", lambda **kwargs: {"ETag": store.version})  # looked
    client.put_object(Bucket="released-late", Key=key, Body=json.dumps({"holder": {"name": "b"}, "lease": "b"}))
    lease.release()  # ... and the other run's write came before the delete
    assert json.loads(client.get_object(Bucket="released-late", Key=key)["Body"].read())["lease"] == "b"


def test_an_s3_lease_renewal_lost_and_unreadable_is_still_the_holders_at_the_next_renewal(s3_server):
    """A renewal applied whose answer was lost, and whose read-back then failed too (the store unreachable for a
    moment): the holder does not know its version. At the next renewal, refused, it reads its own earlier write
    there and holds on; the renewal after that writes again."""
    from flaky_s3 import FlakyS3

    endpoint, client = s3_server
    client.create_bucket(Bucket="lost-renewal")
    with FlakyS3(endpoint, rate=0.0) as proxy:
        run_dir = RunDir("s3://lost-renewal/runs/smoke", endpoint=proxy.endpoint)
        lease = take(run_dir, {"name": "a"}, stale_s=600, what="run directory")  # no heartbeat in the test
        lost: list[bool] = []
        lease.on_lost = lambda: lost.append(True)
        proxy.drop_next("PUT")
        proxy.fail_next("GET", 10)  # the read-back fails, whatever boto3 retries
        lease.update(step=1)  # not an error: the next renewal tries again
        proxy.refusals.clear()  # the store answers again
        lease.update(step=2)
        assert proxy.counts["dropped"] == 1 and proxy.counts["slow_down"] > 1 and not lost
        lease.update(step=3)
        [key] = [entry["Key"] for entry in client.list_objects_v2(Bucket="lost-renewal")["Contents"]]
        assert json.loads(client.get_object(Bucket="lost-renewal", Key=key)["Body"].read())["holder"]["step"] == 3
        lease.release()  # deletes the object only where it is the version the holder last wrote
    assert "Contents" not in client.list_objects_v2(Bucket="lost-renewal") and not lost


class _Clock:
    """The lease's clock and sleep, in the test's hands: a claimant's polls take no real time."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _Store:
    """An object store's one lease object, aged by the test's clock; `down` fails the writes of one holder (its
    network is out, another's is not)."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.body, self.version, self.modified, self.writes, self.down = clock, None, None, 0.0, 0, ""

    def objects(self, place, timeout_s):
        return self

    def _put(self, body: bytes) -> str:
        if self.down and json.loads(body)["lease"] == self.down:
            raise ConnectionError("Connect timeout on endpoint URL")
        self.writes += 1
        self.body, self.version, self.modified = json.loads(body), f"v{self.writes}", self.clock.now
        return self.version

    def create(self, body: bytes) -> str | None:
        return None if self.body is not None else self._put(body)

    def read(self):
        return None if self.body is None else (self.body, self.version, self.clock.now - self.modified)

    def replace(self, body: bytes, version: str) -> str | None:
        return self._put(body) if version == self.version else None

    def delete(self, version: str) -> None:
        if version == self.version:
            self.body = None


@pytest.fixture
def fake_store(monkeypatch):
    from raydiff.storage import lease as lease_module

    clock = _Clock()
    store = _Store(clock)
    monkeypatch.setattr(lease_module, "time", clock)
    monkeypatch.setattr(lease_module, "S3LeaseObject", store.objects)
    return clock, store


def test_a_live_object_lease_is_not_taken_over_before_it_went_unrenewed_for_the_stale_time(fake_store):
    """A claimant that first sees a lease just renewed takes it over only once it has gone unrenewed for
    run.lease_stale_s, not at half of it (its age was counted twice: as the age now and as the time watched)."""
    clock, store = fake_store
    run_dir = RunDir("s3://bucket/runs/smoke")
    holder = take(run_dir, {"name": "a"}, stale_s=60, what="run directory")  # renewed at 0 s, then silent
    clock.now = 0.5
    claimant = take(run_dir, {"name": "b"}, stale_s=60, what="run directory", wait=True)
    assert 60 <= clock.now <= 61 and store.body["holder"] == {"name": "b"}
    claimant.release()
    holder.release()


def test_a_lease_left_by_a_holder_whose_workers_may_still_write_expires_rather_than_being_freed(fake_store, tmp_path):
    """A run stopped at once whose workers have not ended (they may still write): its object lease is no longer
    renewed and not deleted, so another run takes it only once it is stale; a release after it (the end of `hold`)
    deletes nothing. A local lock is freed: the kernel frees it as the process ends anyway."""
    clock, store = fake_store
    run_dir = RunDir("s3://bucket/runs/smoke")
    holder = take(run_dir, {"name": "a"}, stale_s=60, what="run directory")
    assert holder.leave()
    holder.release()
    assert store.body["holder"] == {"name": "a"}  # still there
    claimant = take(run_dir, {"name": "b"}, stale_s=60, what="run directory", wait=True)
    assert 60 <= clock.now <= 61 and store.body["holder"] == {"name": "b"}  # once stale, not at once
    claimant.release()

    local = RunDir(tmp_path / "run")
    assert not take(local, this_process(), stale_s=4, what="run directory").leave()
    with hold(local, this_process(), stale_s=4, what="run directory"):  # free at once
        pass


def test_a_claimant_with_a_shorter_stale_time_waits_for_the_holders_own(fake_store):
    """The holder renews at a quarter of its own run.lease_stale_s: a claimant that judged it by its own shorter one
    took a live lease over (60 s against 4 s), and both drivers wrote to the run."""
    clock, store = fake_store
    run_dir = RunDir("s3://bucket/runs/smoke")
    holder = take(run_dir, {"name": "a"}, stale_s=60, what="run directory")  # renewed at 0 s, then silent
    claimant = take(run_dir, {"name": "b"}, stale_s=4, what="run directory", wait=True)
    assert 60 <= clock.now <= 61 and store.body["holder"] == {"name": "b"}  # not at 4 s
    claimant.release()
    holder.release()


class _RealClock:
    @property
    def now(self) -> float:
        return time.monotonic()


@pytest.mark.parametrize("store_is", ["refusing", "hanging"])
def test_an_object_lease_whose_renewals_do_not_get_through_is_given_up_before_another_run_may_take_it(
        monkeypatch, store_is):
    """A holder that cannot reach the store (its workers may) cannot hear of a takeover: at half of the stale time
    without a renewal confirmed it gives the lease up, and is told as for a takeover, saying for how long. Whether
    its requests fail at once or hang (a renewal is waited for only until then): a claimant may take the lease
    over at the stale time."""
    from raydiff.storage import lease as lease_module

    store = _Store(_RealClock())
    monkeypatch.setattr(lease_module, "S3LeaseObject", store.objects)
    stale_s = 4.0  # renewed every second, given up at 2 s
    lease = take(RunDir("s3://bucket/runs/smoke"), {"name": "a"}, stale_s=stale_s, what="run directory")
    taken = time.monotonic()
    told: list[float | None] = []
    lease.on_lost = lambda: told.append(lease.unrenewed_s)
    deadline = time.monotonic() + 10
    while store.writes < 2 and time.monotonic() < deadline:  # a renewal got through: the half stale time counts
        time.sleep(0.05)                                      # from it
    assert store.writes >= 2 and not lease.lost
    if store_is == "refusing":
        store.down = store.body["lease"]
    else:
        monkeypatch.setattr(store, "replace", lambda body, version: time.sleep(30))
    deadline = time.monotonic() + 10
    while not lease.lost and time.monotonic() < deadline:
        time.sleep(0.05)
    given_up = time.monotonic() - taken
    assert lease.lost and len(told) == 1 and stale_s / 2 <= told[0] < stale_s * 3 / 4, told
    assert given_up < stale_s  # before a claimant may take it, counted from the take
    writes, started = store.writes, time.monotonic()
    lease.update(step=3)  # nothing more written, nor told again, nor waited for behind a renewal that hangs
    assert len(told) == 1
    lease.release()  # leaves the object to go stale: it may be another's by now
    assert store.body is not None and store.writes == writes and time.monotonic() - started < 1


def test_a_lease_is_lost_once_and_says_why_once(fake_store):
    """A renewal refused (another's write) just as the heartbeat gives up: told once, the give-up's reason kept."""
    from raydiff.storage.lease import Lease

    told: list[float | None] = []
    lease = Lease(None, {})  # type: ignore[arg-type]  # lose() reads nothing of the store
    lease.on_lost = lambda: told.append(lease.unrenewed_s)
    lease.lose(unrenewed_s=31.0)
    lease.lose()
    assert told == [31.0] and lease.unrenewed_s == 31.0


def test_a_claimant_that_waited_counts_its_lease_from_the_create_that_took_it(fake_store, monkeypatch):
    """A run that waited for another's lease, whose create then applied with its answer lost: the read-back
    confirms the lease as of that create, not of the first one refused minutes before (it gave the lease up at
    once, unrenewed for as long as it had waited)."""
    clock, store = fake_store
    run_dir = RunDir("s3://bucket/runs/smoke")
    holder = take(run_dir, {"name": "a"}, stale_s=60, what="run directory")
    lost_answer = store.create

    def create(body):
        if clock.now >= 40 and store.body is None:  # the holder has released it: this create applies ...
            lost_answer(body)
            raise ConnectionError("Read timeout on endpoint URL")  # ... and its answer is lost
        return lost_answer(body)
    monkeypatch.setattr(store, "create", create)

    def release_at_40(seconds):  # the claimant's polls pass the time; the holder ends at 40 s
        clock.now += seconds
        if clock.now >= 40 and not holder.lost and store.body and store.body["holder"] == {"name": "a"}:
            holder.release()
    monkeypatch.setattr(clock, "sleep", release_at_40)
    claimant = take(run_dir, {"name": "b"}, stale_s=60, what="run directory", wait=True)
    assert not claimant.lost and claimant._store.confirmed >= 40
    claimant.release()


@pytest.fixture
def gcs_with_preconditions(gcs_server):
    """The emulator ignores ifGenerationMatch; real GCS refuses a write whose precondition fails (412). Teach it."""
    from gcp_storage_emulator import server
    from gcp_storage_emulator.exceptions import NotFound
    from gcp_storage_emulator.handlers import objects

    def guarded(handler, name_of):
        def check(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifGenerationMatch")
            if wanted:
                try:
                    current = storage.get_file_obj(request.params["bucket_name"], name_of(request))["generation"]
                except NotFound:
                    current = "0"
                if str(current) != wanted[0]:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    return None
            return handler(request, response, storage, *args, **kwargs)
        return check

    def upload_name(request):
        return request.query["name"][0] if "name" in request.query else request.data["meta"].get("name")

    patched = []
    for _, handlers in server.HANDLERS:
        for method, handler, name_of in (("POST", objects.insert, upload_name),
                                         ("DELETE", objects.delete, lambda r: r.params["object_id"])):
            if handlers.get(method) is handler:
                handlers[method] = guarded(handler, name_of)
                patched.append((handlers, method, handler))
    yield gcs_server
    for handlers, method, handler in patched:
        handlers[method] = handler


def test_a_gcs_lease_is_renewed_taken_over_when_stale_and_released(gcs_with_preconditions, monkeypatch, tmp_path):
    endpoint, fs = gcs_with_preconditions
    # No credentials: anonymous. A path that is surely not there (the GCS client aborts the process where the
    # file named is a folder, as /nonexistent was on a machine where something had made it one).
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "no-credentials.json"))
    _object_lease_lifecycle("gs://raydiff-gcs/leases/smoke", endpoint)
    assert not fs.get_file_info(__import__("pyarrow.fs").fs.FileSelector("raydiff-gcs/leases", recursive=True,
                                                                        allow_not_found=True))


@pytest.mark.ray
def test_a_live_run_is_neither_moved_nor_joined(cluster, tmp_path):
    """While a run trains, the same command with run.resume=false, from its own local Ray instance or from the
    same cluster, is refused before it changes anything; the live run goes on untouched until it is stopped."""
    live = subprocess.Popen(  # trains until the test stops it, however long the refused commands take
        [sys.executable, "-m", "raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}",
         "--set", "run.name=live", "--set", "train.total_steps=100000", "--set", "debug.step_delay_s=0.1",
         "--set", "train.sample_every=0", "--set", "log.tensorboard=false",
         "--set", "scaling.num_workers=1"],  # one worker leaves the refused commands a core
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
        env=dict(os.environ, RAY_ADDRESS=cluster.address))
    try:
        deadline = time.time() + 180
        while not (tmp_path / "live" / "checkpoint_00000010" / "state.pt").exists():
            assert time.time() < deadline and live.poll() is None, "the live run made no checkpoint"
            time.sleep(0.2)
        for address in ("local", cluster.address):  # its own Ray instance, and the live run's cluster
            second = run_cli("raydiff.train", "--config", "smoke", "--set", f"run.storage={tmp_path}",
                             "--set", "run.name=live", "--set", "run.resume=false", env={"RAY_ADDRESS": address})
            assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
            error = second.stderr.strip().splitlines()[-1]
            assert error.startswith(f"raydiff: error: run directory {tmp_path / 'live'} is in use by another raydiff "
                                    f"run (pid {live.pid} on "), error
            assert "Traceback" not in second.stderr
            assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["live"]
        assert live.poll() is None, "the live run ended before the refusals were checked"
        live.send_signal(signal.SIGTERM)
        output, _ = live.communicate(timeout=300)
    finally:
        if live.poll() is None:
            live.send_signal(signal.SIGKILL)
            live.wait()
    assert live.returncode == 128 + signal.SIGTERM, output[-3000:]
    summary = json.loads((tmp_path / "live" / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] > 10 and summary["restarts"] == 0


def test_the_leases_folder_on_shared_storage_is_as_writable_as_the_storage(tmp_path):
    """Made with its first user's umask (0755), the `.raydiff-leases` folder of a team's shared runs folder refused
    every other user's lease there, though the storage let them write."""
    import stat

    shared, private = tmp_path / "shared", tmp_path / "private"
    shared.mkdir()
    private.mkdir()
    shared.chmod(0o1777)
    private.chmod(0o755)
    for storage in (shared, private):
        with hold(RunDir(storage / "run"), this_process(), stale_s=4, what="run directory"):
            pass
    assert stat.S_IMODE((shared / ".raydiff-leases").stat().st_mode) == 0o1777
    assert stat.S_IMODE((private / ".raydiff-leases").stat().st_mode) & 0o022 == 0  # as the umask makes it


def test_rank_zero_s_own_watch_sees_another_driver_take_the_run_over(s3_server):
    """A driver paused (Ctrl-Z) renews nothing and tells its workers nothing: another driver takes the lease over
    at the stale time, and rank 0, reading the lease itself, is told once, with the new holder; the driver's own
    renewals are not a takeover, nor is a lease released."""
    from raydiff.storage.lease import watch_for_takeover

    endpoint, client = s3_server
    client.create_bucket(Bucket="raydiff-watched")
    run_dir = RunDir("s3://raydiff-watched/runs/smoke", endpoint=endpoint)
    lease = take(run_dir, {"name": "ours", "invocation": "ours"}, stale_s=0.4, what="run directory")
    taken: list[dict] = []
    end = watch_for_takeover(run_dir, "ours", stale_s=0.4, on_taken=taken.append)
    try:
        time.sleep(0.6)  # several looks at the lease while its driver renews it
        lease.release()
        time.sleep(0.3)  # and while there is none
        assert taken == []
        client.put_object(Bucket="raydiff-watched", Key="runs/.raydiff-leases/smoke",
                          Body=json.dumps({"holder": {"host": "elsewhere", "pid": 7, "invocation": "theirs"}}))
        deadline = time.monotonic() + 10
        while not taken and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert [holder["invocation"] for holder in taken] == ["theirs"]  # once
    finally:
        end()
    def watches() -> set[int]:
        return {id(t) for t in threading.enumerate() if t.name == "raydiff-lease-watch"}

    before = watches()
    watch_for_takeover(RunDir("/tmp/local-run"), "ours", stale_s=0.4, on_taken=taken.append)
    assert watches() <= before  # a local lock: nothing to watch
