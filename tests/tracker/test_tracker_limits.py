"""The tracker's bounds on what callers can make it hold: runs per tracker (409 past the cap),
/metrics at a constant number of Redis round trips whatever the number of runs, and /metrics
behind the token where the tracker binds beyond loopback. The app in this process on a Redis of
its own (an empty run set, whatever other tests create)."""

from __future__ import annotations

import contextlib

import pytest
from fastapi.testclient import TestClient

from services.config.tracker import TrackerSettings
from services.tracker.app import create_app
from services.tracker.embedded import EmbeddedRedis

TOKEN = "limits-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis-limits"), appendonly=False) as server:
        yield server.url


@contextlib.contextmanager
def tracker(redis_url, **settings):
    app = create_app(TrackerSettings(redis_url=redis_url, api_token=TOKEN, **settings))
    with TestClient(app, raise_server_exceptions=False) as http:
        yield http


def test_runs_past_the_cap_are_409_and_the_others_answer_as_before(redis_url):
    with tracker(redis_url, max_runs=3) as http:
        for i in range(3):
            assert http.put(f"/v1/runs/cap-{i}", json={"recipe": "spo"}, headers=AUTH).status_code == 201
        r = http.put("/v1/runs/cap-3", json={"recipe": "spo"}, headers=AUTH)
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert detail["code"] == "too_many_runs" and detail["max_runs"] == 3 and "3" in detail["message"]
        assert http.get("/v1/runs/cap-3", headers=AUTH).status_code == 404  # nothing was written
        # An existing run is no new run: the same body is still 200, another body still 409 conflict.
        assert http.put("/v1/runs/cap-0", json={"recipe": "spo"}, headers=AUTH).status_code == 200
        r = http.put("/v1/runs/cap-0", json={"recipe": "spopp"}, headers=AUTH)
        assert r.status_code == 409 and r.json()["detail"]["code"] == "run_conflict"


def test_a_scrape_costs_the_same_round_trips_for_one_run_or_forty(redis_url, monkeypatch):
    """Round trips counted where they happen: each send of packed commands to Redis (a pipeline
    sends all of its commands at once), the health watcher's PINGs left out. Before, a scrape made
    two per run (5,000 runs: 5.8 s and four scrapes slowed other calls 400-fold)."""
    from redis.asyncio.connection import Connection

    sends: list[bytes] = []
    original = Connection.send_packed_command

    # Not round trips of the scrape: the health watcher's PING, and the handshake of a connection
    # the pool opens when the watcher holds the other one (HELLO, AUTH, CLIENT SETINFO, SELECT).
    others = (b"PING", b"HELLO", b"AUTH", b"CLIENT", b"SELECT")

    async def counted(self, command, check_health=True):
        packed = command if isinstance(command, bytes | bytearray) else b"".join(command)
        if not any(word in packed for word in others):
            sends.append(bytes(packed))
        return await original(self, command, check_health)

    def scrape_cost(http) -> int:
        sends.clear()
        r = http.get("/metrics", headers=AUTH)
        assert r.status_code == 200, r.text
        return len(sends)

    with tracker(redis_url, max_runs=100) as http:
        http.put("/v1/runs/scrape-0", json={"recipe": "spo"}, headers=AUTH)
        http.post("/v1/runs/scrape-0/workers/w", json={"trajectories": 1, "episodes": 1}, headers=AUTH)
        monkeypatch.setattr(Connection, "send_packed_command", counted)
        few = scrape_cost(http)
        monkeypatch.setattr(Connection, "send_packed_command", original)
        for i in range(1, 40):
            http.put(f"/v1/runs/scrape-{i}", json={"recipe": "spo"}, headers=AUTH)
        monkeypatch.setattr(Connection, "send_packed_command", counted)
        many = scrape_cost(http)
        text = http.get("/metrics", headers=AUTH).text
    assert few == many <= 3, (few, many)
    # And the scrape still reports every run and the worker.
    assert text.count('spopp_tracker_tasks{run="scrape-') == 40
    assert 'spopp_tracker_worker_trajectories_total{run="scrape-0",worker="w"} 1.0' in text


@pytest.mark.parametrize(
    "host,mode,needs",
    [
        ("127.0.0.1", "auto", False),
        ("0.0.0.0", "auto", True),
        ("10.1.2.3", "auto", True),
        ("127.0.0.1", "on", True),
        ("0.0.0.0", "off", False),
    ],
)
def test_metrics_ask_for_the_token_beyond_loopback(redis_url, host, mode, needs):
    """/metrics names runs and workers: it takes the token where anyone beyond this host could ask
    (auto), or as set; /healthz never does (probes have no token)."""
    with tracker(redis_url, host=host, metrics_auth=mode) as http:
        bare = http.get("/metrics")
        assert bare.status_code == (401 if needs else 200), bare.text
        assert http.get("/metrics", headers=AUTH).status_code == 200
        assert http.get("/healthz").status_code == 200
