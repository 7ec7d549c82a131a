"""The bounds every service's HTTP server runs under (services/shell/connections.py, server.py):
deadlines for a request's headers and body, a connection cap that closes the idlest connection or
answers 503, a bounded stop, and error logs that cannot flood. The server here is the one every
service uses (`ThreadedServer`, `serve`) around a small app; the tracker under attack is in
test_hostile_clients."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from procs import held_port

from services.shell.connections import FD_RESERVE, MIN_CONNECTIONS, ServerLimits, effective_cap
from services.shell.logs import RepeatLimit
from services.shell.server import EXIT_OVERRUN, SHUTDOWN_GRACE, ThreadedServer

# Deadlines are checked against wall time on a loaded 2-core machine: a connection must be closed
# no sooner than its deadline and no later than SLACK after it (the timer fires on the server's
# loop, which a busy test machine may delay by a fraction of a second).
SLACK = 1.5


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
def server():
    limits = ServerLimits(header_timeout=1.0, body_timeout=1.0, idle_timeout=0.5, max_connections=4)
    with ThreadedServer(_app(), limits=limits) as s:
        yield s


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    return sock


def _closed_after(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (reads until EOF, discarding any reply)."""
    t0 = time.monotonic()
    while sock.recv(65536):
        pass
    return time.monotonic() - t0


def test_a_connection_that_sends_half_its_headers_is_closed_at_the_header_deadline(server):
    sock = _connect(server.url)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
    waited = _closed_after(sock)
    assert 1.0 - 0.1 <= waited <= 1.0 + SLACK, waited


def test_trickling_bytes_does_not_extend_the_header_deadline(server):
    """One byte every 0.2 s: data arriving resets nothing, so the connection is closed ~1 s after it
    opened, as a silent one is."""
    sock = _connect(server.url)
    t0 = time.monotonic()
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    sock.settimeout(0.2)
    closed_at = None
    for byte in request:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1) == b"":
                closed_at = time.monotonic() - t0
                break
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            closed_at = time.monotonic() - t0
            break
    assert closed_at is not None and closed_at <= 1.0 + SLACK, closed_at


def test_a_body_that_does_not_arrive_is_cut_at_the_body_deadline(server):
    sock = _connect(server.url)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    waited = _closed_after(sock)
    assert 1.0 - 0.1 <= waited <= 1.0 + SLACK, waited


def test_a_keep_alive_connection_gets_requests_until_it_idles(server):
    with httpx.Client(base_url=server.url) as http:
        for _ in range(3):  # one connection, several requests: the header deadline re-arms each time
            assert http.get("/healthz").status_code == 200
            time.sleep(0.3)
        assert http.post("/echo", content=b"y" * 1000).json() == {"bytes": 1000}


def test_at_the_cap_the_connection_idle_longest_makes_room(server):
    """Four connections waiting for headers (the cap): a fifth client still gets its answer, and
    the oldest waiting connection is the one closed."""
    idle = [_connect(server.url) for _ in range(4)]
    time.sleep(0.2)  # all four are open and waiting on the server
    assert httpx.get(server.url + "/healthz", timeout=2).status_code == 200
    idle[0].settimeout(2)
    assert idle[0].recv(1) == b""  # closed by the server, before its header deadline
    for sock in idle[1:]:
        sock.settimeout(0.05)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # still open


def test_when_every_connection_is_busy_a_newcomer_gets_a_clear_503(server):
    busy = []
    for _ in range(4):  # each mid-body: busy with a request, not evictable
        sock = _connect(server.url)
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nxx")
        busy.append(sock)
    time.sleep(0.2)
    resp = httpx.get(server.url + "/healthz", timeout=2)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    detail = resp.json()["detail"]
    assert detail["code"] == "overloaded" and detail["max_connections"] == 4
    # The busy ones are cut at their body deadline; then there is room again.
    for sock in busy:
        _closed_after(sock)
    assert httpx.get(server.url + "/healthz", timeout=2).status_code == 200


@pytest.mark.parametrize(
    ("asked", "files", "cap"),
    [
        (1000, 1 << 20, 1000),  # a container's usual limit: the setting as asked
        (1000, 256, 256 - FD_RESERVE),  # a small `ulimit -n`: the cap leaves the reserve free
        (1000, FD_RESERVE + 2, MIN_CONNECTIONS),  # never below a handful
        (4, 256, 4),
    ],
)
def test_the_cap_fits_under_the_file_limit(asked, files, cap):
    assert effective_cap(asked, files) == cap


def test_a_repeated_error_is_logged_a_few_times_a_minute_with_a_count():
    now = [0.0]
    limit = RepeatLimit(burst=10, window=60.0, clock=lambda: now[0])
    records = [
        logging.LogRecord(
            "asyncio", logging.ERROR, "f", 1, "socket.accept() out of system resource", (), None
        )
    ]

    def passes(msg: str, level=logging.ERROR, name="asyncio") -> bool:
        record = logging.LogRecord(name, level, "f", 1, msg, (), None)
        records.append(record)
        return limit.filter(record)

    passed = sum(passes("socket.accept() out of system resource") for _ in range(1000))
    assert passed == 10
    assert passes("another error")  # a different kind has its own allowance
    assert all(passes("GET /healthz 200", level=logging.INFO, name="uvicorn.access") for _ in range(100))
    now[0] = 61.0
    assert passes("socket.accept() out of system resource")
    assert records[-1].suppressed == 990 and "990 more like this" in records[-1].getMessage()


@pytest.mark.process
def test_a_stop_that_hangs_is_ended_by_the_watchdog(tmp_path):
    """An app whose shutdown never returns: after SIGTERM the process still exits, with
    EXIT_OVERRUN, once the in-flight allowance and SHUTDOWN_GRACE have passed; and the overrun
    hook ran."""
    marker = tmp_path / "hook-ran"
    script = textwrap.dedent(
        f"""
        import asyncio, contextlib
        from fastapi import FastAPI
        from services.shell import server
        from services.shell.connections import ServerLimits

        @contextlib.asynccontextmanager
        async def lifespan(app):
            print("ready", flush=True)
            yield
            await asyncio.sleep(3600)  # a shutdown that hangs

        server.on_overrun(lambda: open({str(marker)!r}, "w").write("yes"))
        asyncio.run(server.serve(FastAPI(lifespan=lifespan), "127.0.0.1", 0,
                                 limits=ServerLimits(shutdown_timeout=0.5)))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(0.5 + SHUTDOWN_GRACE + 10)
        waited = time.monotonic() - t0
    finally:
        proc.kill()
    assert code == EXIT_OVERRUN
    assert SHUTDOWN_GRACE <= waited <= 0.5 + SHUTDOWN_GRACE + SLACK + 1, waited
    assert marker.read_text() == "yes"


def test_every_serving_service_takes_the_same_http_settings():
    """The tracker, a replica, the learner and the evaluator: the same fields, read the same way."""
    from services.config.evaluator import EvaluatorSettings
    from services.config.learner import LearnerSettings
    from services.config.rollout import RolloutSettings
    from services.config.tracker import TrackerSettings
    from services.shell.http_settings import HttpServerSettings

    for cls in (TrackerSettings, RolloutSettings, LearnerSettings, EvaluatorSettings):
        assert issubclass(cls, HttpServerSettings), cls
    s = TrackerSettings.resolve(env={"SPOPP_TRACKER_HTTP_HEADER_TIMEOUT_SECONDS": "2.5"})
    assert s.server_limits().header_timeout == 2.5
    assert s.server_limits().max_connections == 1000


def test_a_taken_port_is_refused_before_the_service_starts_its_work():
    """serve() binds its port before anything else: a port another process holds is CannotListen
    (exit 3, one line naming the address), and the service's work (a replica's leases, the
    evaluator's hold) never starts."""
    import asyncio
    import inspect

    from services.shell.server import STARTUP_FAILURE, CannotListen, serve

    started = []

    async def work():
        started.append(True)

    with held_port() as port:
        coro = work()
        with pytest.raises(CannotListen) as caught:
            asyncio.run(serve(_app(), "127.0.0.1", port, coro))
    assert caught.value.exit_code == STARTUP_FAILURE
    assert caught.value.format_message() == f"cannot listen on 127.0.0.1:{port}: Address already in use"
    assert started == [] and inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED


def test_a_threaded_server_holds_its_port_from_construction_a_taken_one_is_refused():
    """ThreadedServer binds when it is built: with port 0 the OS picks a port and no other process
    can take it before the server starts (the race a drawn port would have); `url` names it. A
    port the caller gave that another process holds is CannotListen, never a silent other port."""
    from services.shell.server import CannotListen
    from spopp.machine.net import port_free

    server = ThreadedServer(_app())
    port = int(server.url.rsplit(":", 1)[1])
    assert port != 0 and not port_free(port)  # held before start()
    with server:
        assert httpx.get(server.url + "/healthz", timeout=10).json() == {"status": "ok"}
    assert port_free(port)  # and given back at stop()
    with held_port() as taken:
        with pytest.raises(CannotListen, match=f"127.0.0.1:{taken}: Address already in use"):
            ThreadedServer(_app(), port=taken)


@pytest.mark.process
def test_a_tracker_whose_port_or_redis_fails_at_start_exits_3_with_one_clear_error(tmp_path):
    """`spopp tracker serve` on a taken port: exit 3, the address in one line, no traceback, and
    the embedded Redis it had started is stopped. With a Redis that never answers: exit 3 and
    uvicorn's start-up error, without the torn-down loop's traceback of every task."""
    from procs import cli

    from spopp.machine.net import port_free
    from spopp.settings.base import environ_without_settings

    env = {**environ_without_settings(), "OMP_NUM_THREADS": "1", "SPOPP_API_TOKEN": "t" * 16}
    with held_port() as port:
        r = subprocess.run(
            cli("tracker", "serve", "--port", str(port), "--data-dir", str(tmp_path / "t")),
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in out
    assert "Traceback" not in out
    # The embedded Redis had started (its address is logged) and was stopped: its port is free.
    redis_port = int(re.search(r"embedded redis on redis://127.0.0.1:(\d+)/0", out).group(1))
    assert port_free(redis_port)

    r = subprocess.run(
        cli("tracker", "serve", "--port", "0", "--data-dir", str(tmp_path / "u"),
            "--redis-url", "redis://127.0.0.1:1/0", "--redis-wait-seconds", "1"),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 3, out
    assert "redis did not answer within 1 s" in out and "Application startup failed" in out
    assert "Task exception was never retrieved" not in out and "SystemExit" not in out
