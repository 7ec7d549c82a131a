"""A service started as a child process (`python -m ...`), awaited until it answers over HTTP and
stopped by its own pid (SIGTERM, then SIGKILL), never by name.

`spopp launch` runs every process of a run this way, each logging to its file in the run folder and
dying with the launcher; tests and benchmarks start a tracker the same way
(tools/tracker_process.py), its output kept in a temporary file.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spopp.machine.lifetime import die_with_parent
from spopp.machine.wait import ProcessExited, WaitTimeout, wait_http


def _start_child(parent: int, with_parent: bool, file_limit: int | None) -> None:
    """Runs in the child, between fork and exec."""
    if file_limit is not None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (file_limit, file_limit))
    if with_parent:
        os.setsid()
        die_with_parent(signal.SIGKILL)
        # A parent killed before the prctl above sends no signal: the child is reparented by now.
        if os.getppid() != parent:
            os._exit(1)


class Child:
    def __init__(
        self,
        name: str,
        args: list[str],
        env: dict[str, str],
        *,
        log_path: Path | None = None,
        with_parent: bool = False,
        file_limit: int | None = None,
        banner: str | None = None,
    ) -> None:
        """Runs `python args...` with `env`. Its output goes to `log_path` (appended, after a line
        naming the command) or, without one, to a temporary file that `output()` reads.
        `with_parent`: the child gets its own session and is SIGKILLed when the thread that
        started it ends, its process dying included (so nothing outlives a killed launcher; leave
        it off where that thread ends before the child should). `file_limit`: the child's
        `ulimit -n`. `banner`: the log's line above this start (default: the arguments after
        `-m module`)."""
        self.name = name
        self.log_path = log_path
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = log_path.open("a", buffering=1)
            said = banner or " ".join(args[2:])
            self._log.write(f"\n===== {said} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        else:
            self._log = tempfile.TemporaryFile("w+")
        parent = os.getpid()
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: _start_child(parent, with_parent, file_limit),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def output(self) -> str:
        """Everything it has written so far."""
        if self.log_path is not None:
            try:
                return self.log_path.read_text(errors="replace")
            except OSError:
                return ""
        # pread, not seek-and-read: the child writes through the same file offset.
        fd = self._log.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def tail(self, lines: int = 20, chars: int = 4000) -> str:
        """The last `lines` lines of its output (at most `chars` characters of them)."""
        return "\n".join(self.output().rstrip("\n").splitlines()[-lines:])[-chars:]

    def wait_http(self, url: str, timeout: float, ok=(200,), request_timeout: float = 2.0) -> None:
        """Wait until `url` answers one of `ok`; ChildFailed if the child exits or time runs out."""
        try:
            wait_http(
                url, timeout, f"{self.name} at {url}", ok=ok, interval=0.2, proc=self.proc,
                request_timeout=request_timeout,
            )  # fmt: skip
        except ProcessExited as exc:
            raise ChildFailed(self, f"exited with code {exc.code} while starting") from None
        except WaitTimeout:
            raise ChildFailed(self, f"did not answer {url} within {timeout:g} s") from None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; answers the exit code. A log file is
        closed; a temporary one stays readable."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.log_path is not None:
            self._log.close()
        return self.poll()

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(30)


class ChildFailed(RuntimeError):
    def __init__(self, child: Child, what: str) -> None:
        self.child = child
        where = f"the last lines of {child.log_path}" if child.log_path else "its last lines"
        super().__init__(f"{child.name} {what}; {where}:\n{child.tail()}")
