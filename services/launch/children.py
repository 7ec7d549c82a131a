"""The launcher's child processes: started from one config file each, logged to a file, never orphaned.

Each child runs `python -m services.cli <service> <command> --config <file>` in a session of its
own, so a Ctrl-C at the terminal reaches only the launcher, which then stops the children in
order (replicas before the tracker they report to). A launcher that dies without that chance
(SIGKILL, the OOM killer) takes them with it through the kernel's parent-death signal; each
service's own children (the embedded redis-server, torchrun's ranks, vLLM's engine core) already
die with their parent, so nothing is left holding a port, a folder or a GPU. Children are
stopped by their own pid, never by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from spopp.lifetime import die_with_parent
from spopp.settings import API_TOKEN_ENV, environ_without_settings
from spopp.wait import ProcessExited, WaitTimeout, wait_http


def _die_with_launcher(launcher: int) -> None:  # runs in the child, between fork and exec
    os.setsid()
    die_with_parent(signal.SIGKILL)
    # A launcher killed before the prctl above sends no signal: the child is reparented by now.
    if os.getppid() != launcher:
        os._exit(1)


def child_env(token: str | None, devices: str) -> dict[str, str]:
    """The launcher's environment minus SPOPP_* (each child reads its config file, nothing else),
    plus the shared token and the child's devices."""
    env = environ_without_settings()
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = devices
    if token:
        env[API_TOKEN_ENV] = token
    return env


class Child:
    def __init__(self, name: str, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("a", buffering=1)
        self._log.write(
            f"\n===== spopp launch: {' '.join(args[2:])} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        )
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=functools.partial(_die_with_launcher, os.getpid()),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def tail(self, lines: int = 20, chars: int = 4000) -> str:
        """The last `lines` lines of its log (at most `chars` characters of them)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip("\n").splitlines()[-lines:])[-chars:]

    def wait_http(self, url: str, timeout: float, ok=(200,)) -> None:
        """Wait until `url` answers one of `ok`; ChildFailed if the child exits or time runs out."""
        try:
            wait_http(url, timeout, f"{self.name} at {url}", ok=ok, interval=0.2, proc=self.proc)
        except ProcessExited as exc:
            raise ChildFailed(self, f"exited with code {exc.code} while starting") from None
        except WaitTimeout:
            raise ChildFailed(self, f"did not answer {url} within {timeout:.0f} s") from None

    def stop(self, timeout: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout` seconds; answers the exit code."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
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
        super().__init__(f"{child.name} {what}; the last lines of {child.log_path}:\n{child.tail()}")
