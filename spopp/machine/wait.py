"""Waiting until something is ready: a process's HTTP port, a file, a count. One helper for the
launcher, the tracker's launcher, `spopp init`, tools and tests.

`wait_until` polls a predicate at a fixed interval (readiness is cheap to ask, and a fixed
interval keeps a test's wait close to the moment things are ready) until it answers something
truthy, and answers that. A wait that times out names what it waited for; with `proc`, a process
that exits first ends the wait at once (no point waiting out the timeout for a dead server).
`wait_until_async` is the same inside an event loop (the services' own waits: a replica for its
learner), with a predicate that may be a coroutine function.
Retrying calls to a service that may be restarting is spopp.machine.retry's, not this.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Protocol, TypeVar

import httpx

T = TypeVar("T")


class Polled(Protocol):
    def poll(self) -> int | None: ...


class WaitTimeout(TimeoutError):
    """The wait ran out of time; the message names what it waited for."""


class ProcessExited(RuntimeError):
    """The process the wait depends on exited first."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def wait_until(
    predicate: Callable[[], T],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    proc: Polled | None = None,
    on_wait: Callable[[], Any] | None = None,
) -> T:
    """Call `predicate` until it answers something truthy, and answer it. `on_wait()` runs once,
    after the first miss (to say what the caller waits for). Raises WaitTimeout after `timeout`
    seconds, ProcessExited when `proc` exits first."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        got = predicate()
        if got:
            return got
        if proc is not None and (code := proc.poll()) is not None:
            raise ProcessExited(f"the process exited with code {code} while waiting for {what}", code)
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        if on_wait is not None and not said:
            on_wait()
            said = True
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]],
    timeout: float,
    what: str,
    *,
    interval: float = 0.1,
    on_wait: Callable[[], Any] | None = None,
) -> T:
    """`wait_until` for a coroutine: awaits `predicate()` when it answers an awaitable, sleeps with
    asyncio between calls (the loop serves meanwhile). Raises WaitTimeout after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        got = predicate()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
        if on_wait is not None and not said:
            on_wait()
            said = True
        await asyncio.sleep(interval)


def http_answer(url: str, ok: Collection[int] | None = (200,), timeout: float = 2.0) -> httpx.Response | None:
    """GET `url`: the response when its status is in `ok` (None: any status), else None; None
    too when nothing answers."""
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    return response if ok is None or response.status_code in ok else None


def wait_http(
    url: str,
    timeout: float,
    what: str | None = None,
    *,
    ok: Collection[int] | None = (200,),
    interval: float = 0.1,
    request_timeout: float = 2.0,
    proc: Polled | None = None,
    on_wait: Callable[[], Any] | None = None,
) -> httpx.Response:
    """Wait until GET `url` answers a status in `ok` (None: any answer at all); answers the
    response. Errors as `wait_until`'s; `what` defaults to the URL and the statuses."""
    if what is None:
        statuses = "anything" if ok is None else " or ".join(map(str, ok))
        what = f"{url} to answer {statuses}"
    return wait_until(
        lambda: http_answer(url, ok, request_timeout), timeout, what,
        interval=interval, proc=proc, on_wait=on_wait,
    )  # fmt: skip
