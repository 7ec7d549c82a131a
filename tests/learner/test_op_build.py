"""A learner stuck on a stale DeepSpeed op build lock says so in its log (services/learner/op_build.py)."""

from __future__ import annotations

import logging
import time

from services.learner.op_build import LockWatch, build_locks


def test_a_stale_build_lock_is_named_once_start_up_takes_too_long(tmp_path, caplog):
    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    assert build_locks(tmp_path) == [lock]
    with caplog.at_level(logging.WARNING, logger="spopp.learner"), LockWatch(tmp_path, wait_s=0.05):
        time.sleep(0.5)
    [record] = [r for r in caplog.records if "build waits while" in r.getMessage()]
    assert str(lock) in record.getMessage() and "delete it" in record.getMessage()


def test_no_lock_or_a_quick_start_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="spopp.learner"):
        with LockWatch(tmp_path, wait_s=0.05):  # no lock file at all
            time.sleep(0.3)
        lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
        lock.parent.mkdir(parents=True)
        lock.touch()
        with LockWatch(tmp_path, wait_s=0.5):  # a lock, but start-up is over before the timer
            pass
        time.sleep(0.8)
    assert not [r for r in caplog.records if "build waits while" in r.getMessage()]
