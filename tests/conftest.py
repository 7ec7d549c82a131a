"""Fixtures that start real things: a redis-server on a free port and tracker processes over HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

from services.tracker.embedded import EmbeddedRedis, free_port
from spopp.client import TrackerClient

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis"), appendonly=False) as server:
        yield server


class TrackerProcess:
    """`spopp tracker serve` in a subprocess; stopped by its own pid, never by name."""

    def __init__(self, redis_url: str | None, data_dir: Path | None = None, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "spopp.cli", "tracker", "serve", "--port", str(self.port),
                "--log-level", "warning"]
        if redis_url:
            args += ["--redis-url", redis_url]
        if data_dir:
            args += ["--data-dir", str(data_dir)]
        full_env = {**os.environ, **(env or {})}
        full_env.pop("SPOPP_API_TOKEN", None) if not env or "SPOPP_API_TOKEN" not in env else None
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tracker-{self.port}.log", "w+")
        self.proc = subprocess.Popen(args, env=full_env, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"tracker exited with {self.proc.returncode}:\n{self.log.read()[-3000:]}")
            try:
                if httpx.get(self.url + "/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError("tracker did not become ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(15)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)


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
