"""State lives in Redis: a tracker killed with SIGKILL, or restarted on its embedded Redis, goes on."""

import re
import socket

import pytest

from spopp.api.client import TrackerClient
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _state(c: TrackerClient, run: str) -> tuple:
    r = c.get_run(run)
    return r.model_dump(), c.export(run), c.policy(run).model_dump()


def _workload(c: TrackerClient, run: str) -> list:
    c.put_run(run, {"recipe": "spopp", "seed": 9})
    c.put_tasks(run, [{"task_id": f"q{i}", "outcomes": [i % 2, 1, 0, 0]} for i in range(20)])
    d = c.dispatch(run, "w", 0, 12)
    c.outcomes(run, [(r.request_id, float(i % 3 == 0)) for i, r in enumerate(d.requests[:8])])
    c.publish(run, 1, "s1")
    return d.requests[8:]


def test_sigkilled_tracker_restarts_on_same_redis_with_identical_state(redis_server, run_name):
    first = TrackerProcess(redis_server.url)
    with TrackerClient(first.url) as c:
        pending = _workload(c, run_name)
        before = _state(c, run_name)
    first.kill()
    second = TrackerProcess(redis_server.url)
    try:
        with TrackerClient(second.url) as c:
            assert _state(c, run_name) == before
            # Leases taken before the crash are still live and can be reported.
            res = c.outcomes(run_name, [(r.request_id, 1.0) for r in pending])
            assert [x.request_id for x in res] == [r.request_id for r in pending]
            nxt = c.dispatch(run_name, "w", 1, 4).requests
            assert len(nxt) == 4 and all(r.policy_version == 1 for r in nxt)
    finally:
        second.stop()


def test_two_trackers_on_one_redis_answer_alike(redis_server, tracker, run_name):
    other = TrackerProcess(redis_server.url)
    try:
        with TrackerClient(tracker.url) as a, TrackerClient(other.url) as b:
            _workload(a, run_name)
            assert _state(a, run_name) == _state(b, run_name)
            d = b.dispatch(run_name, "w", 1, 2).requests
            a.outcomes(run_name, [(d[0].request_id, 1.0)])
            assert _state(a, run_name) == _state(b, run_name)
    finally:
        other.stop()


def test_embedded_redis_keeps_state_across_tracker_restart(tmp_path, run_name):
    """The real CLI with no --redis-url: an embedded redis-server with AOF under --data-dir."""
    data = tmp_path / "data"
    first = TrackerProcess(None, data_dir=data)
    try:
        with TrackerClient(first.url) as c:
            _workload(c, run_name)
            before = _state(c, run_name)
    finally:
        first.stop()
    assert (data / "redis.log").exists()
    assert first.proc.returncode == 0
    second = TrackerProcess(None, data_dir=data)
    try:
        with TrackerClient(second.url) as c:
            assert _state(c, run_name) == before
    finally:
        second.stop()
    # The tracker stops the Redis it started: nothing answers on that address any more.
    port = int(re.search(r"embedded redis on redis://127\.0\.0\.1:(\d+)", second.output()).group(1))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_tracker_waits_for_redis_that_starts_late(tmp_path, run_name):
    """In compose the tracker may come up before Redis: it retries until Redis answers."""
    import threading
    import time

    from services.tracker.embedded import EmbeddedRedis, redis_password
    from spopp.machine.net import free_port

    port = free_port()
    got = {}
    # The password the Redis below will ask for, made before it starts (it keeps one per folder).
    redis_password(tmp_path)
    env = {"SPOPP_TRACKER_REDIS_PASSWORD_FILE": str(tmp_path / "redis.password")}
    # The tracker's launcher blocks until ready, so it waits in a thread; Redis starts here, in
    # the main thread, because its death signal follows the thread that started it.
    waiter = threading.Thread(
        target=lambda: got.setdefault("proc", TrackerProcess(f"redis://127.0.0.1:{port}/0", env=env))
    )
    waiter.start()
    time.sleep(1.5)
    with EmbeddedRedis(tmp_path, port=port, appendonly=False):
        waiter.join()
        proc = got["proc"]
        try:
            with TrackerClient(proc.url) as c:
                assert c.put_run(run_name, {"recipe": "spopp"}).policy_version == 0
        finally:
            proc.stop()
