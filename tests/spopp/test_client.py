"""The client retries connection errors with backoff and raises typed errors."""

import threading
import time

import httpx
import pytest

from spopp.api.client import TrackerClient, TrackerError
from spopp.machine.net import free_port
from tools.tracker_process import TrackerProcess


@pytest.mark.process
def test_client_retries_until_the_tracker_is_up(redis_server, run_name):
    port = free_port()
    started = {}

    def start_later():
        time.sleep(1.0)
        started["proc"] = TrackerProcess(redis_server.url, port=port)

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        with TrackerClient(f"http://127.0.0.1:{port}", retry_seconds=30, backoff=0.1) as c:
            assert c.put_run(run_name, {"recipe": "spo"}).config.recipe == "spo"
    finally:
        thread.join()
        started["proc"].stop()


def test_client_gives_up_when_its_time_bound_is_spent():
    port = free_port()
    t0 = time.monotonic()
    with (
        TrackerClient(f"http://127.0.0.1:{port}", retry_seconds=1.5, backoff=0.05, max_backoff=0.4) as c,
        pytest.raises(httpx.ConnectError),
    ):
        c.get_run("x")
    assert 1.5 <= time.monotonic() - t0 < 3.0  # bounded by time, not by a count of attempts


def test_client_validates_before_sending():
    with TrackerClient("http://127.0.0.1:9") as c:
        with pytest.raises(ValueError):
            c.put_run("r", {"recipe": "nope"})
        with pytest.raises(ValueError):
            c.put_tasks("r", [{"task_id": "t"}])


@pytest.mark.process
def test_error_carries_detail(client, run_name):
    with pytest.raises(TrackerError) as err:
        client.get_task(run_name, "q")
    assert err.value.status == 404 and err.value.code == "unknown_run"
    assert err.value.detail["run"] == run_name


@pytest.mark.process
def test_client_rides_out_a_redis_restart_behind_the_tracker(tmp_path, run_name):
    """While Redis is down the tracker answers 503; the client retries through it and the call
    lands once Redis is back (with its AOF: the run is still there)."""
    from services.tracker.embedded import EmbeddedRedis

    port = free_port()
    redis = EmbeddedRedis(tmp_path, port=port).start()  # main thread: its death signal follows it
    tracker = TrackerProcess(redis.url)
    try:
        with TrackerClient(tracker.url, retry_seconds=60, backoff=0.05, max_backoff=0.5) as c:
            c.put_run(run_name, {"recipe": "spopp"})
            redis.stop()
            with pytest.raises(TrackerError) as down:
                with TrackerClient(tracker.url, retry_seconds=0) as once:
                    once.get_run(run_name)
            assert down.value.status == 503  # what the retrying client sees meanwhile
            got = {}
            caller = threading.Thread(target=lambda: got.setdefault("run", c.get_run(run_name)))
            t0 = time.monotonic()
            caller.start()
            time.sleep(2.0)
            redis = EmbeddedRedis(tmp_path, port=port).start()
            caller.join(30)
            assert got["run"].config.recipe == "spopp" and time.monotonic() - t0 >= 2.0
    finally:
        tracker.stop()
        redis.stop()


def test_export_lines_end_at_newline_only():
    # The tracker escapes non-ASCII in its export today; a raw U+2028 or U+0085 inside a string is
    # still valid JSON and must not split a record (str.splitlines() would).
    from spopp.api.client import _jsonl

    text = '{"a": "x\u2028y"}\n{"a": "p\x85q"}\n\n'
    assert _jsonl(text) == [{"a": "x\u2028y"}, {"a": "p\x85q"}]
