"""Coalesced calls: what is submitted while a call is on its way leaves together in the next one.

A replica with many slots finishes episodes in bursts, and one HTTP call per episode costs the
replica's event loop (which the engine's output handling shares) and the receiving service a
request each. Here the first item goes out at once when no call is under way, and the items that
arrive meanwhile leave together as soon as it returns: a quiet replica adds no latency, a busy one
sends a fraction of the calls. Each item still gets its own answer (or exception) through its
future. Subclasses say how a batch is sent (`_send`) and how big one may be (`_take`).

`linger` makes a call wait that long for company before it leaves (unless it is full already):
where items come one at a time, spaced wider than a call takes, coalescing alone sends one call
per item, and a few milliseconds of waiting, which nothing on the generation path feels, share
them out.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    def __init__(self, max_per_call: int, linger: float = 0.0) -> None:
        if max_per_call < 1:
            raise ValueError(f"max_per_call must be at least 1, got {max_per_call}")
        if linger < 0:
            raise ValueError(f"linger must be at least 0, got {linger}")
        self.max_per_call = max_per_call
        self.linger = linger
        self._queue: list[tuple[Item, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self.calls = 0  # batches sent (what the tests count)

    async def submit(self, item: Item) -> Result:
        """The answer for `item`; raises what its call raised for it. Cancelling an item that has
        not left drops it."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all())
        return await future

    def _take(self) -> list[tuple[Item, asyncio.Future]]:
        """The next batch off the queue (the oldest first)."""
        batch, self._queue = self._queue[: self.max_per_call], self._queue[self.max_per_call :]
        return batch

    async def _send_all(self) -> None:
        batch: list[tuple[Item, asyncio.Future]] = []
        try:
            while self._queue:
                if self.linger and len(self._queue) < self.max_per_call:
                    await asyncio.sleep(self.linger)
                batch = [entry for entry in self._take() if not entry[1].done()]  # cancelled: stays home
                if not batch:
                    continue
                try:
                    await self._send(batch)
                except Exception as exc:  # noqa: BLE001 - an unforeseen failure: no waiter may hang
                    for _, future in batch:
                        settle(future, exc=exc)
        except asyncio.CancelledError:  # the loop is shutting down: nobody waits forever
            for _, future in batch + self._queue:
                future.cancel()
            self._queue = []
            raise

    async def _send(self, batch: list[tuple[Item, asyncio.Future]]) -> None:
        """Send `batch`, settling every future in it (a result or an exception each)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop sending: items still queued or on their way fail with CancelledError."""
        if self._sender is not None and not self._sender.done():
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)


def settle(future: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
    """Set a future's outcome unless its waiter gave up on it already."""
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
