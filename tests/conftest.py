"""Fixtures that start real things: a redis-server on a free port and tracker processes over HTTP."""

from __future__ import annotations

import os
import uuid

import pytest
from fixtures_model import model_limits, perturbed_model, reference, tiny_model  # noqa: F401  (session fixtures)

from services.tracker.embedded import EmbeddedRedis
from services.tracker.launcher import TrackerProcess
from spopp.client import TrackerClient

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


@pytest.fixture(scope="session")
def tracker(redis_server):
    proc = TrackerProcess(redis_server.url)
    yield proc
    proc.stop()


@pytest.fixture
def client(tracker):
    with TrackerClient(tracker.url) as c:
        yield c


@pytest.fixture
def run_name():
    return "t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def make_run(client, run_name):
    """A fresh run with tasks; answers its name. Runs are namespaced, so tests do not collide."""

    def make(recipe="spopp", tasks=None, **config):
        client.put_run(run_name, {"recipe": recipe, **config})
        if tasks:
            client.put_tasks(run_name, tasks)
        return run_name

    return make
