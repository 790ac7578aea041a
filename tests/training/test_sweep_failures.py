"""What a sweep shows of Tune's failures, line by line: Tune's own loggers, fed the records they write when a full
disk stops a save or an upload (the traceback in the record or in its text), are quiet and the reason is noted for
the sweep's one line; anything else Tune logs, a bug included, still shows. The whole sweep on a full disk is
tested through the CLI in tests/test_tune.py."""

from __future__ import annotations

import logging
import sys
import traceback

import pytest

from raydiff.training.sweep import telling_tune_failures

FULL = OSError(28, "No space left on device")


def _record(logger: str, message: str, error: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(error), error, error.__traceback__) if error is not None else None
    return logging.LogRecord(logger, logging.WARNING, __file__, 1, message, None, exc_info)


def _text(error: BaseException) -> str:
    try:
        raise error
    except BaseException:
        return "".join(traceback.format_exception(*sys.exc_info()))


@pytest.mark.parametrize("logger, record", [
    ("ray.tune.execution.experiment_state", _record("ray.tune.execution.experiment_state",
                                                    "Experiment state snapshotting failed", FULL)),
    ("ray.train._internal.syncer", _record("ray.train._internal.syncer",
                                           f"Last sync command failed with the following error:\n{_text(FULL)}")),
    ("ray.train._internal.syncer", _record("ray.train._internal.syncer", "The latest sync operation failed with the "
                                           f"following error: {FULL!r}\nRetrying 2 more time(s) after sleeping")),
])
def test_a_full_disk_under_tunes_saves_and_uploads_is_noted_not_shown(logger, record):
    with telling_tune_failures() as told:
        assert not logging.getLogger(logger).filter(record)
    assert told.state_unsaved == "no space left on device"
    assert logging.getLogger(logger).filter(record)  # the filters go with the block


def test_other_failures_tune_logs_still_show():
    with telling_tune_failures() as told:
        assert logging.getLogger("ray.train._internal.syncer").filter(_record(
            "ray.train._internal.syncer", f"Last sync command failed with the following error:\n"
                                          f"{_text(ZeroDivisionError('division by zero'))}"))
        assert logging.getLogger("ray.tune.execution.experiment_state").filter(_record(
            "ray.tune.execution.experiment_state", "Experiment state snapshotting failed", KeyError("batch")))
    assert told.state_unsaved is None
