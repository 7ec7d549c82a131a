"""The client retries connection errors with backoff and raises typed errors."""

import threading
import time

import httpx
import pytest

from services.tracker.launcher import TrackerProcess
from spopp.client import TrackerClient, TrackerError
from spopp.net import free_port


def test_client_retries_until_the_tracker_is_up(redis_server, run_name):
    port = free_port()
    started = {}

    def start_later():
        time.sleep(1.0)
        started["proc"] = TrackerProcess(redis_server.url, port=port)

    thread = threading.Thread(target=start_later)
    thread.start()
    try:
        with TrackerClient(f"http://127.0.0.1:{port}", retries=8, backoff=0.1) as c:
            assert c.put_run(run_name, {"recipe": "spo"}).config.recipe == "spo"
    finally:
        thread.join()
        started["proc"].stop()


def test_client_gives_up_after_its_retries():
    port = free_port()
    t0 = time.monotonic()
    with (
        TrackerClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.05) as c,
        pytest.raises(httpx.ConnectError),
    ):
        c.get_run("x")
    assert time.monotonic() - t0 >= 0.05 + 0.1


def test_client_validates_before_sending():
    with TrackerClient("http://127.0.0.1:9") as c:
        with pytest.raises(ValueError):
            c.put_run("r", {"recipe": "nope"})
        with pytest.raises(ValueError):
            c.put_tasks("r", [{"task_id": "t"}])


def test_error_carries_detail(client, run_name):
    with pytest.raises(TrackerError) as err:
        client.get_task(run_name, "q")
    assert err.value.status == 404 and err.value.code == "unknown_run"
    assert err.value.detail["run"] == run_name
