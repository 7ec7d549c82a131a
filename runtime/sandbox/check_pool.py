"""Checks that may not return, run in worker processes that are killed at their deadline.

An answer check runs math-verify, hence sympy, on text the model wrote. sympy evaluates
`\\boxed{9^{9^{9}}}` in C while holding the GIL: a thread with a time limit cannot stop it, and the
whole process (a replica's event loop, its health route, its SIGTERM handler) stalls with it. So
such checks run in a small pool of child processes (`runtime.sandbox.check_worker`): the caller's thread
waits on a pipe (the GIL is free, the event loop runs), and a check past its deadline has its
worker SIGKILLed and replaced. The verdict of a killed or failed check is a wrong answer with its
reason ("timeout", "memory", "error: ...", "busy", "unavailable").

Costs (`make bench`, BENCHMARKS.md "Answer checks"): a check out of process took no longer than
in-process on this project's CPU machines; a worker's start (its imports, about a second for
math-verify) after a kill, in the background; each worker's resident memory (about 60 MB with
sympy and math-verify loaded).

One pool per process (`shared_pool()`), started on first use and closed at exit; the workers also
end by themselves when the pool's process is gone (end of stdin, or their CPU budget).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

GiB = 1024**3

#: Why a check gave no value: its worker was killed at the deadline, ran out of memory, raised,
#: waited too long for a free worker, or no worker could be started.
REASONS = ("timeout", "memory", "error", "busy", "unavailable")


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    reason: str | None = None  # None: the check ran and returned `value`
    detail: str = ""
    where: str = ""  # a check that raised: file:line it raised from (runtime.faults.site)

    @property
    def ok(self) -> bool:
        return self.reason is None


def _search_path() -> str:
    """This process's module search path, for the worker: a function this process can import (a
    user's reward function from a folder the service put on sys.path) is importable there too."""
    return os.pathsep.join(os.path.abspath(p or ".") for p in sys.path)


class _Worker:
    """One child process and the pipe ends to talk to it, a line at a time."""

    def __init__(self, memory_bytes: int, preload: tuple[str, ...]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.sandbox.check_worker", str(memory_bytes), *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            # Its own session: a terminal's Ctrl-C goes to the service, which stops the pool.
            start_new_session=True,
            env={
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONDONTWRITEBYTECODE": "1",
                "PYTHONPATH": _search_path(),
            },
        )
        self._buffer = b""

    def read_line(self, deadline: float) -> bytes | None:
        """The next line the worker writes, or None at the deadline or when it has died."""
        fd = self.proc.stdout.fileno()
        # poll, not select: a replica may hold more than 1024 descriptors, which select refuses.
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poller.poll(remaining * 1000):
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def send(self, request: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class CheckPool:
    """Up to `size` worker processes; `call()` runs one function in one of them, with a deadline.

    `preload` names modules every worker imports before it is ready (so their import is not part
    of any check's time); `memory_bytes` is each worker's address-space cap.
    """

    def __init__(
        self,
        size: int = 2,
        *,
        memory_bytes: int = 1 * GiB,
        preload: tuple[str, ...] = (),
        start_timeout_s: float = 60.0,
        queue_timeout_s: float = 60.0,
    ):
        if size < 1:
            raise ValueError(f"a check pool needs at least one worker, got size={size}")
        self.size = size
        self.memory_bytes = memory_bytes
        self.preload = tuple(preload)
        self.start_timeout_s = start_timeout_s
        self.queue_timeout_s = queue_timeout_s
        self._idle: list[_Worker] = []
        self._count = 0  # workers alive or starting, idle or busy
        self._cond = threading.Condition()
        self._closed = False
        # Checks that gave no value, by reason; and checks run: read by the services' /metrics.
        self.failures: Counter[str] = Counter()
        self.checks = 0
        self._ids = itertools.count(1)  # request ids: a reply must carry its request's

    def _start_worker(self) -> _Worker | None:
        """A new worker, once it says it is ready; None when it cannot start in time."""
        try:
            worker = _Worker(self.memory_bytes, self.preload)
        except OSError:
            return None
        try:
            ready = worker.read_line(time.monotonic() + self.start_timeout_s) == b"ready"
        except BaseException:
            worker.kill()
            raise
        if not ready:
            worker.kill()
            return None
        return worker

    def _acquire(self) -> _Worker | str:
        """An idle worker (started if the pool has room), or the reason there is none."""
        deadline = time.monotonic() + self.queue_timeout_s
        with self._cond:
            while not self._idle and self._count >= self.size:
                if self._closed:
                    return "unavailable"
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "busy"
                self._cond.wait(remaining)
            if self._closed:
                return "unavailable"
            if self._idle:
                return self._idle.pop()
            self._count += 1  # a slot for the worker started below, outside the lock
        try:
            worker = self._start_worker()
        except BaseException:  # the slot must not leak, whatever stopped the start
            self._release(None)
            raise
        if worker is None:
            self._release(None)
            return "unavailable"
        return worker

    def _release(self, worker: _Worker | None) -> None:
        """Give a worker back to the pool, or (None) free the slot of one that was killed."""
        with self._cond:
            if worker is not None and not self._closed:
                self._idle.append(worker)
            else:
                self._count -= 1
                if worker is not None:
                    worker.kill()
            self._cond.notify()

    def warm(self) -> None:
        """Start a worker in the background if the pool has room: at a service's start, and for the
        slot a kill freed, so that the next check does not pay the start (imports) itself."""

        def start() -> None:
            with self._cond:
                if self._closed or self._count >= self.size:
                    return
                self._count += 1
            worker = None
            try:
                worker = self._start_worker()
            finally:
                self._release(worker)

        threading.Thread(target=start, name="check-pool-replace", daemon=True).start()

    def call(self, fn: str, *args: Any, timeout_s: float) -> Outcome:
        """Run `fn` ("module:attribute", importable in the worker) on JSON-able `args`, at most
        `timeout_s` seconds from the moment a worker takes it; never raises for what `fn` does.

        A worker found dead when the check is handed to it (killed by the kernel while idle) is
        replaced and the check tried once more, so that its death does not cost a right answer."""
        for attempt in (1, 2):
            acquired = self._acquire()
            if isinstance(acquired, str):
                return self._failed(acquired)
            outcome = self._run_on(acquired, fn, args, timeout_s, retry=attempt == 1)
            if outcome is not None:
                return outcome
        return self._failed("unavailable", "two workers in a row had died")

    def _run_on(
        self, worker: _Worker, fn: str, args: tuple, timeout_s: float, *, retry: bool
    ) -> Outcome | None:
        """The check on `worker`, which goes back to the pool only after a well-formed reply to
        this very request; None when it was dead before it started (and `retry` allows another)."""
        released = False

        def drop() -> None:
            nonlocal released
            released = True
            worker.kill()
            self._release(None)
            self.warm()

        try:
            request_id = next(self._ids)
            deadline = time.monotonic() + timeout_s
            if not worker.send({"id": request_id, "fn": fn, "args": list(args), "cpu_s": timeout_s}):
                drop()
                return None if retry else self._failed("unavailable", "the worker had died")
            line = worker.read_line(deadline)
            if line is None:
                try:  # ended by itself (its CPU budget, a crash, a kill while idle) or still at work
                    died = worker.proc.wait(timeout=0.2)
                except subprocess.TimeoutExpired:
                    died = None
                drop()
                if died is None:
                    return self._failed("timeout", f"no verdict within {timeout_s:g} s: worker killed")
                if retry and time.monotonic() < deadline - timeout_s / 2:  # dead on arrival, not mid-check
                    return None
                return self._failed("error", f"the worker exited with {died}")
            try:
                reply = json.loads(line)
                if not isinstance(reply, dict) or reply.get("id") != request_id:
                    raise ValueError("not this request's reply")
            except ValueError as e:  # the worker is out of step: never reused
                drop()
                return self._failed("error", f"unreadable reply: {e}")
            released = True
            self._release(worker)
            if "error" in reply:
                reason = "memory" if reply["error"] == "memory" else "error"
                return self._failed(reason, str(reply["error"]), str(reply.get("where", "")))
            with self._cond:
                self.checks += 1
            return Outcome(value=reply.get("value"))
        finally:
            if not released:  # an exception on the way (a signal, a bug): the worker is not reused
                worker.kill()
                self._release(None)

    def _failed(self, reason: str, detail: str = "", where: str = "") -> Outcome:
        with self._cond:
            self.checks += 1
            self.failures[reason] += 1
        return Outcome(reason=reason, detail=detail, where=where)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            self._cond.notify_all()
        for worker in idle:
            worker.kill()


_shared: CheckPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> CheckPool:
    """The process's pool for answer checks (math-verify and sympy preloaded), made on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CheckPool(size=2, preload=("sympy", "math_verify"))
            atexit.register(_shared.close)
        return _shared
