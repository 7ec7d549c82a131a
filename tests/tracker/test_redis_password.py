"""Redis behind a password (issue 36, finding 8): anyone on the host reaches a Redis port, and the
tracker's whole state is there, so the embedded Redis asks for a password it makes itself, and a
tracker on another Redis reads the password from a file, never from its command line."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import pytest
import redis.asyncio as aioredis
import redis.exceptions
from procs import cli

from services.tracker.embedded import EmbeddedRedis
from spopp.api.client import TrackerClient
from spopp.machine.net import free_port
from spopp.settings.base import environ_without_settings
from tools.tracker_process import TrackerProcess


async def _ping(url: str, password: str | None = None):
    client = aioredis.Redis.from_url(url, password=password, socket_timeout=5)
    try:
        return await client.ping()
    finally:
        await client.aclose()


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_the_embedded_redis_asks_for_the_password_it_made(tmp_path):
    with EmbeddedRedis(tmp_path, appendonly=False) as server:
        password = (tmp_path / "redis.password").read_text().strip()
        assert len(password) >= 40 and server.password == password
        # Only the owner may read it, or the config file that hands it to redis-server.
        assert _mode(tmp_path / "redis.password") == 0o600 and _mode(tmp_path / "redis.conf") == 0o600
        assert password not in open(f"/proc/{server.proc.pid}/cmdline").read()
        assert password not in server.address
        with pytest.raises(redis.exceptions.AuthenticationError):
            asyncio.run(_ping(server.address))  # no password: refused
        with pytest.raises(redis.exceptions.AuthenticationError):
            asyncio.run(_ping(server.address, "not-it"))
        assert asyncio.run(_ping(server.url)) is True
        port = server.port
    # A restart on the same folder (the supervisor's, or the next tracker's) keeps the password.
    with EmbeddedRedis(tmp_path, port=port, appendonly=False) as again:
        assert again.password == password and asyncio.run(_ping(again.address, password)) is True


@pytest.mark.process
def test_a_tracker_reads_the_password_from_its_file_and_stops_at_once_without_it(tmp_path, run_name):
    with EmbeddedRedis(tmp_path / "redis", appendonly=False) as server:
        password_file = tmp_path / "redis" / "redis.password"
        tracker = TrackerProcess(
            server.address, env={"SPOPP_TRACKER_REDIS_PASSWORD_FILE": str(password_file)}
        )
        try:
            with TrackerClient(tracker.url) as c:
                assert c.put_run(run_name, {"recipe": "spo"}).policy_version == 0
            assert server.password not in open(f"/proc/{tracker.proc.pid}/cmdline").read()
        finally:
            tracker.stop()
        # Given a URL with the password in it (an EmbeddedRedis's), TrackerProcess hands the
        # password over in a file that is gone once the tracker has started.
        tracker = TrackerProcess(server.url)
        try:
            assert server.password not in open(f"/proc/{tracker.proc.pid}/cmdline").read()
            assert tracker._password_file is not None and not os.path.exists(tracker._password_file)
            with TrackerClient(tracker.url) as c:
                assert c.get_run(run_name).run == run_name
        finally:
            tracker.stop()
        # Without the password the tracker does not wait out redis_wait_seconds (30 s): it stops
        # at once (start-up failure, exit 3), saying that Redis refused it; a password file that is
        # not there is named, not ignored.
        for env, says in (
            ({}, "redis refused this tracker"),
            ({"SPOPP_TRACKER_REDIS_PASSWORD_FILE": str(tmp_path / "none")}, "redis_password_file"),
        ):
            t0 = time.monotonic()
            out = subprocess.run(
                cli("tracker", "serve", "--port", str(free_port()), "--redis-url", server.address),
                env={**environ_without_settings(), **env}, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert out.returncode == 3 and says in out.stdout + out.stderr, out.stderr[-2000:]
            assert time.monotonic() - t0 < 20


@pytest.mark.process
def test_the_tracker_never_logs_its_embedded_password(tmp_path, run_name):
    tracker = TrackerProcess(None, data_dir=tmp_path / "data", args=("--log-level", "info"))
    try:
        with TrackerClient(tracker.url) as c:
            c.put_run(run_name, {"recipe": "spo"})
    finally:
        tracker.stop()
    password = (tmp_path / "data" / "redis.password").read_text().strip()
    out = tracker.output()
    assert "embedded redis on redis://127.0.0.1:" in out and password not in out
