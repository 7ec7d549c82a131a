"""Start `spopp tracker serve` as a child process and wait until it is ready.

Used by the tests and the benchmarks, and handy in users' scripts: the tracker runs as a real
process speaking real HTTP. It is stopped by its own pid, never by name.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from spopp.net import free_port
from spopp.settings import environ_without_settings
from spopp.wait import ProcessExited, WaitTimeout, wait_http


class TrackerProcess:
    def __init__(
        self,
        redis_url: str | None,
        data_dir: Path | None = None,
        env: dict | None = None,
        port: int | None = None,
        timeout: float = 30.0,
        args: tuple[str, ...] = ("--log-level", "warning"),
        file_limit: int | None = None,
    ) -> None:
        """`args`: more flags of `spopp tracker serve`; `file_limit`: the child's `ulimit -n`."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            sys.executable,
            "-m",
            "services.cli",
            "tracker",
            "serve",
            "--port",
            str(self.port),
            *args,
        ]
        # A password in the URL (an EmbeddedRedis's) goes to the child in a 0600 file, not in its
        # command line, where process lists would show it.
        self._password_file: str | None = None
        if redis_url:
            redis_url, password = _split_password(redis_url)
            if password is not None:
                fd, self._password_file = tempfile.mkstemp(prefix="spopp-redis-", suffix=".password")
                with os.fdopen(fd, "w") as f:
                    f.write(password)
                env = {**(env or {}), "SPOPP_TRACKER_REDIS_PASSWORD_FILE": self._password_file}
            argv += ["--redis-url", redis_url]
        if data_dir:
            argv += ["--data-dir", str(data_dir)]
        # Only what the caller passes configures the child, not SPOPP_* left in our environment.
        full_env = environ_without_settings()
        full_env.update(env or {})
        self.log = tempfile.TemporaryFile("w+")
        limit = None if file_limit is None else (lambda: _limit_files(file_limit))
        self.proc = subprocess.Popen(
            argv, env=full_env, stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=limit
        )
        try:
            self._wait_ready(timeout)
        finally:
            # The tracker reads the password once, at start-up: the file need not outlive that.
            if self._password_file is not None:
                os.unlink(self._password_file)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def _wait_ready(self, timeout: float) -> None:
        try:
            wait_http(
                self.url + "/readyz", timeout, "the tracker to be ready", request_timeout=1, proc=self.proc
            )
        except ProcessExited:
            raise RuntimeError(
                f"tracker exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            ) from None
        except WaitTimeout:
            self.kill()
            raise RuntimeError(
                f"tracker did not become ready within {timeout} s:\n{self.output()[-3000:]}"
            ) from None

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(15)


def _limit_files(n: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def _split_password(url: str) -> tuple[str, str | None]:
    """(the URL without its password, the password or None)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url, None
    host = parts.hostname or ""
    netloc = (
        (f"{parts.username}@" if parts.username else "") + host + (f":{parts.port}" if parts.port else "")
    )
    return urlunsplit(parts._replace(netloc=netloc)), unquote(parts.password)
