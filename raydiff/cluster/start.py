"""Starting or joining Ray, the same way for every command and for the library.

Why one place: every command (train, tune, prepare, evaluate, lr_find, bench) must join the cluster that
RAY_ADDRESS or `ray start` names, or else start a local instance, print one line saying which, and quiet what
Ray prints that a newcomer would read as a failure. A cluster that does not answer, or refuses this client (token
authentication), is one line too: Ray itself retries for minutes and then raises a traceback. A local instance
is its own processes' cluster, whatever other Ray instances run on the machine, and outside the command's process
group, so that a signal to the group stops the command with a final checkpoint, not Ray under it. A run on a cluster
without the dashboard says once what Ray Train then repeats every second or two. Joining a cluster frees what ended
jobs left holding resources that nothing can use (`raydiff.cluster.leftovers`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator

import ray
from ray._common.utils import get_ray_address_file
from ray._private import services
from ray._private.services import canonicalize_bootstrap_address
from ray._private.utils import detect_fate_sharing_support

from raydiff.cluster import ray_temp_dir
from raydiff.cluster.errors import RayUnreachable
from raydiff.cluster.leftovers import remove_groups_of_ended_jobs
from raydiff.cluster.nodes import alive_nodes
from raydiff.cluster.worker_output import NO_STATE_API, drop_worker_lines, filter_worker_output

ANSWER_TIMEOUT_S = 10.0  # how long a cluster's address may take to accept a connection
GCS_PORT_VARIABLE = "RAY_GCS_SERVER_PORT"  # the GCS port of a head that Ray starts (ray._private.ray_constants)


logger = logging.getLogger("raydiff")
_joined_here = False  # whether init_ray() made this process's Ray connection (so that leave_ray() may end it)
_dashboard_url: str | None = None  # the joined cluster's dashboard ("" where it runs none; None: not joined here)
_watching: threading.Event | None = None  # set, it ends the watch on a local instance's temp directory


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS or started on this machine (`ray start`), else start a local one."""
    global _joined_here, _dashboard_url
    if ray.is_initialized():
        return
    existing = check_ray_address()
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        if existing is None:
            dashboard_url = _start_local_instance()
        else:
            with _quiet_address_lookup():
                dashboard_url = ray.init(logging_level=logging.WARNING).dashboard_url
        _joined_here, _dashboard_url = True, dashboard_url or ""
    except ConnectionError as exc:
        refused = "token" in f"{exc} {exc.__cause__}".lower()
        hint = ("it uses token authentication: set RAY_AUTH_MODE=token and its token in RAY_AUTH_TOKEN (or "
                "~/.ray/auth_token)" if refused else str(exc).splitlines()[0])
        raise RayUnreachable(f"could not join the Ray cluster at {existing} ({_named()}): {hint}") from None
    finally:
        # ray.init replaces SIGTERM's handler with one that prints a stack dump and aborts: a command's own
        # (`raydiff.cli`) comes back, one line and its cleanups (a library caller's default is left to Ray).
        if callable(sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)
    resources = ray.cluster_resources()
    what = f"joined the Ray cluster at {existing}" if existing else "started a local Ray instance"
    print(f"[raydiff] {what}: {resources.get('CPU', 0):g} CPU, {resources.get('GPU', 0):g} GPU, "
          f"{len(alive_nodes())} node(s)")
    # After ray.data's import, which sets its loggers' levels (to DEBUG) when it first runs.
    ray.data.DataContext.get_current().enable_progress_bars = os.isatty(2)
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # raydiff prints its own one-line data summary
    logging.getLogger("ray.data._internal.progress").setLevel(logging.ERROR)  # "progress bars disabled"
    filter_worker_output()
    if existing:
        try:
            remove_groups_of_ended_jobs()
        except Exception:  # best effort: Ray's own, unchanged, and a sweep asks again while it runs
            logger.debug("removing the placement groups of ended jobs failed", exc_info=True)


def _start_local_instance() -> str | None:
    """Start a local Ray instance whose processes name it in RAY_ADDRESS; its dashboard's address ("" or None: none).

    Ray Train's placement-group cleaner (an actor of every run) asks the state API whether the run's controller is
    alive, and the state API, given no address, takes whichever Ray instance it finds on the machine: with a second
    one running (another local run, a test cluster), it can ask that one, take the controller for dead and remove
    the run's workers. With RAY_ADDRESS in the job's environment every worker and actor asks its own cluster. The
    GCS port is chosen here (Ray reads RAY_GCS_SERVER_PORT when it starts a head) so that the address is known
    before the instance starts. Ray's temp directory is checked first and watched while the instance runs
    (`raydiff.cluster.ray_temp_dir`).
    """
    temp = ray_temp_dir.check_before_start()
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    address = f"{ray.util.get_node_ip_address()}:{port}"
    with environment_variable(GCS_PORT_VARIABLE, str(port)), _quiet_token_auth_notice(), _in_sessions_of_their_own():
        try:
            context = ray.init(address="local", logging_level=logging.WARNING,
                               runtime_env={"env_vars": {"RAY_ADDRESS": address}})
        except OSError as exc:
            if "AF_UNIX path length" not in str(exc):
                raise
            raise ray_temp_dir.too_long(temp) from None
    global _watching
    _watching = ray_temp_dir.watch(temp)
    return context.dashboard_url


def warn_without_dashboard() -> None:
    """A run on a cluster that init_ray() joined and that runs no dashboard: Ray Train's placement-group cleaner,
    an actor of every run, asks the dashboard's state API whether the run's controller still lives, fails, and says
    so every second or two for the whole run. Said once here, with what it costs and the fix; its lines are left
    out. (A sweep refuses such a cluster: `raydiff.training.sweep`.)"""
    if _dashboard_url != "":
        return
    print("[raydiff] warning: this Ray cluster runs no dashboard, whose state API Ray Train uses to watch the run's "
          "controller: a driver killed outright can leave the run's CPUs/GPUs reserved until the cluster stops; "
          "start Ray with the dashboard (the default of `ray start --head`, with 'ray[default]' installed)")
    drop_worker_lines(NO_STATE_API)


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """While active, this process's environment variable `name` is `value` (for a setting Ray reads from the
    environment when it starts something); what it was, or its absence, comes back after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


@contextlib.contextmanager
def _in_sessions_of_their_own() -> Iterator[None]:
    """While active, the processes Ray starts (a local instance's GCS, raylet, dashboard; the workers follow their
    raylet) start in sessions of their own, out of the command's process group.

    Why: `timeout`, `kill -TERM -PGID` and schedulers that signal a command's whole process group stopped the
    instance with the command, which then could not write its final checkpoint and waited a minute for a GCS that
    was gone. Ray already keeps the terminal's Ctrl-C from them (they block SIGINT), and they still end with the
    command: the kernel ends each when its parent does (Ray's fate-sharing, PR_SET_PDEATHSIG), which is why this
    is done only where Ray uses it (Linux); elsewhere Ray's reaper finds them by their process group. A Ray whose
    process starter has another name starts them as it always did.
    """
    popen = getattr(services, "ConsolePopen", None)  # what start_ray_process calls
    if popen is None or not (sys.platform.startswith("linux") and detect_fate_sharing_support()):
        yield
        return

    class InASessionOfItsOwn(popen):  # type: ignore[misc, valid-type]  # Ray's Popen, as Ray defines it
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **{**kwargs, "start_new_session": True})

    services.ConsolePopen = InASessionOfItsOwn  # type: ignore[misc]
    try:
        yield
    finally:
        services.ConsolePopen = popen  # type: ignore[misc]


@contextlib.contextmanager
def _quiet_token_auth_notice() -> Iterator[None]:
    """A new local instance turns Ray's token authentication on (where RAY_AUTH_MODE is unset) and warns that it
    did, with a timestamp and how to turn it off: the first line a newcomer reads, and advice raydiff does not give
    (docs/training.md#which-ray: the token stays on). Only that notice is dropped; what Ray does, and its other
    warnings about authentication, are unchanged."""
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")

    def other(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")

    auth_log.addFilter(other)
    try:
        yield
    finally:
        auth_log.removeFilter(other)


def leave_ray() -> None:
    """End the Ray connection that init_ray() made, if any (a command's last step). Ray's own exit hook would do it
    too, after half a second's wait for worker output that a command has printed by then."""
    global _joined_here, _dashboard_url
    if _watching is not None:
        _watching.set()
    if _joined_here:
        _joined_here, _dashboard_url = False, None
        ray.shutdown()


def check_ray_address() -> str | None:
    """The address of the cluster that ray.init() will join (RAY_ADDRESS, else a local `ray start`), checked to
    answer (Ray itself would retry for minutes); None where ray.init() starts a local instance."""
    # Checked before Ray's lookup, which logs its own traceback for an address without a host, and takes any text
    # after the last ':' for the port.
    address = os.environ.get("RAY_ADDRESS", "")
    if address not in ("", "auto", "local"):
        _check_address_form(address, address)
    try:
        with _quiet_address_lookup():
            existing = canonicalize_bootstrap_address(None)  # type: ignore[arg-type]  # Ray's hint says str
    except ValueError as exc:
        raise _malformed(str(exc), address) from None
    except ConnectionError:  # RAY_ADDRESS=auto, and no cluster on this machine
        raise RayUnreachable(f"{_named()}: no running Ray cluster found on this machine; start one (`ray start "
                             f"--head`), or unset RAY_ADDRESS to start a local Ray instance") from None
    if existing is None:
        return None
    _check_address_form(existing, address)  # what a `ray start` left in its file
    host, _, port = existing.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=ANSWER_TIMEOUT_S).close()
    except OSError as exc:
        # Without RAY_ADDRESS the address is the one the last `ray start` wrote: a head stopped other than by
        # `ray stop` leaves it behind, and every command would try that cluster again.
        forget = ("unset RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else
                  f"remove {get_ray_address_file(None)} (`ray stop` does)")
        raise RayUnreachable(f"no Ray cluster answers at {existing} ({_named()}): {exc.strerror or exc}; start "
                             f"one there (`ray start --head`), or {forget} to start a local Ray instance") from None
    return existing


def _check_address_form(address: str, given: str) -> None:
    """Refuse `address` unless it is host:port with a port that can be one; one without ':' is left to Ray, whose
    message says so. `given`: RAY_ADDRESS's value ("" where `ray start`'s file gave the address)."""
    if "://" in address:
        raise _malformed("a URL, not host:port", given)
    host, colon, port = address.rpartition(":")
    if not colon:
        return
    if not host.strip("[]"):
        raise _malformed(f"no host before ':{port}'", given)
    if not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise _malformed(f"port {port!r} is not a number from 1 to 65535", given)


def _malformed(problem: str, given: str) -> RayUnreachable:
    """The one line for an address that is not a cluster's, whatever found it malformed (Ray or raydiff)."""
    dashboard = "; an http:// address is a dashboard's, for `ray job submit`" if "http" in given else ""
    return RayUnreachable(f"{_named()}: {problem}; expected the cluster's host:port, auto or local{dashboard}")


@contextlib.contextmanager
def _quiet_address_lookup() -> Iterator[None]:
    """Without RAY_ADDRESS, Ray warns "Found multiple active Ray instances" wherever it looks the cluster up while
    other instances run on the machine: raydiff's own line says which cluster it joined, or why it could not."""
    services_log = logging.getLogger("ray._private.services")
    level = services_log.level
    services_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        services_log.setLevel(level)


def _named() -> str:
    """Where the address to join comes from, as the user set it."""
    address = os.environ.get("RAY_ADDRESS")
    return f"RAY_ADDRESS={address}" if address else f"left by `ray start` in {get_ray_address_file(None)}"
