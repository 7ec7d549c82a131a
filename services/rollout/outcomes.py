"""Outcome reports, coalesced: one POST /outcomes carries every report that came while the last one
was on its way.

A replica with many slots finishes episodes in bursts; one call per outcome costs the replica's
event loop (which the engine's output handling shares) and the tracker a request each. Here a
report goes out at once when no call is under way, and the reports that arrive meanwhile leave
together as soon as it returns, so a quiet replica adds no latency and a busy one sends a
fraction of the calls.

The tracker applies a batch whole or not at all (a 409 or 404 names the request ids at fault). A
refused batch is therefore not a lost batch: the named reports fail, and the rest are sent again
at once; a 422 (a malformed report) sends each of them alone, so that one bad report fails only
itself. Resending is safe: a request id is the report's idempotency key, and a repeat of a
landed report answers the same.
"""

from __future__ import annotations

import asyncio

from spopp.client import AsyncTrackerClient, TrackerError
from spopp.tracker_api import OutcomeResult

# Reports per call at most (the tracker takes up to spopp.tracker_api.MAX_BATCH).
MAX_REPORTS_PER_CALL = 256


class OutcomeBatcher:
    def __init__(
        self, tracker: AsyncTrackerClient, run: str, max_per_call: int = MAX_REPORTS_PER_CALL
    ) -> None:
        self.tracker = tracker
        self.run = run
        self.max_per_call = max_per_call
        self._queue: list[tuple[str, float, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self.calls = 0  # POSTs sent (what the tests count)

    async def report(self, request_id: str, reward: float) -> OutcomeResult:
        """The tracker's answer to this outcome (its frozen value and the advantage); raises what the
        tracker or the transport raised for it. Cancelling a report that has not left drops it."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((request_id, reward, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all())
        return await future

    async def _send_all(self) -> None:
        batch: list[tuple[str, float, asyncio.Future]] = []
        try:
            while self._queue:
                batch, self._queue = self._queue[: self.max_per_call], self._queue[self.max_per_call :]
                batch = [item for item in batch if not item[2].done()]  # a cancelled report stays home
                if batch:
                    await self._send(batch)
        except asyncio.CancelledError:  # the loop is shutting down: nobody waits forever
            for _, _, future in batch + self._queue:
                future.cancel()
            self._queue = []
            raise

    async def _send(self, batch: list[tuple[str, float, asyncio.Future]]) -> None:
        self.calls += 1
        try:
            results = await self.tracker.outcomes(self.run, [(rid, reward) for rid, reward, _ in batch])
            for (_, _, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        except TrackerError as exc:
            at_fault = set(exc.detail.get("request_ids") or []) if exc.status in (404, 409) else set()
            if len(batch) > 1 and (at_fault or exc.status == 422):
                for rid, _, future in batch:
                    if rid in at_fault:
                        _fail(future, exc)
                rest = [item for item in batch if item[0] not in at_fault]
                if exc.status == 422:
                    for item in rest:
                        await self._send([item])
                elif rest:
                    await self._send(rest)
                return
            for _, _, future in batch:
                _fail(future, exc)
        except Exception as exc:  # past the retry bound, or the client is closed: every report fails
            for _, _, future in batch:
                _fail(future, exc)


def _fail(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
