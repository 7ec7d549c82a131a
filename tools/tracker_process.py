"""Start `spopp tracker serve` as a child process and wait until it is ready.

A test and benchmark helper (kept out of the product by the import contracts): the tracker runs as
a real process speaking real HTTP. It is stopped by its own pid, never by name. `spopp launch` starts
its tracker through its own plan, not through this.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from services.shell.child import Child, ChildFailed
from spopp.machine.net import free_port
from spopp.settings.base import environ_without_settings


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
        """`args`: more flags of `spopp tracker serve`; `file_limit`: the child's `ulimit -n`.
        A tracker that exits or does not answer /readyz within `timeout` raises ChildFailed
        (a RuntimeError) with its last lines, and is killed."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = ["-m", "services.cli", "tracker", "serve", "--port", str(self.port), *args]
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
        # Not tied to the starting thread's life: tests start trackers from threads that end first.
        self.child = Child("tracker", argv, full_env, file_limit=file_limit)
        self.proc = self.child.proc
        try:
            self.child.wait_http(self.url + "/readyz", timeout, request_timeout=1.0)
        except ChildFailed:
            self.kill()
            raise
        finally:
            # The tracker reads the password once, at start-up: the file need not outlive that.
            if self._password_file is not None:
                os.unlink(self._password_file)

    def output(self) -> str:
        return self.child.output()

    def stop(self, timeout: float = 15.0) -> None:
        self.child.stop(timeout)

    def kill(self) -> None:
        self.child.kill()


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
