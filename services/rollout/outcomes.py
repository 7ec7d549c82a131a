"""Outcome reports, coalesced (services/rollout/coalesce.py): one POST /outcomes carries every
report that came while the last one was on its way.

The tracker applies a batch whole or not at all (a 409 or 404 names the request ids at fault). A
refused batch is therefore not a lost batch: the named reports fail, and the rest are sent again
at once; a 422 (a malformed report) sends each of them alone, so that one bad report fails only
itself. Resending is safe: a request id is the report's idempotency key, and a repeat of a
landed report answers the same.
"""

from __future__ import annotations

import asyncio

from spopp.api.client import AsyncTrackerClient, TrackerError
from spopp.api.tracker_api import OutcomeResult

from .coalesce import Coalescer, settle

# Reports per call at most (the tracker takes up to spopp.api.tracker_api.MAX_BATCH).
MAX_REPORTS_PER_CALL = 256

Report = tuple[str, float]  # (request_id, reward)


class OutcomeBatcher(Coalescer[Report, OutcomeResult]):
    def __init__(
        self,
        tracker: AsyncTrackerClient,
        run: str,
        max_per_call: int = MAX_REPORTS_PER_CALL,
        linger: float = 0.0,
    ) -> None:
        super().__init__(max_per_call, linger)
        self.tracker = tracker
        self.run = run

    async def report(self, request_id: str, reward: float) -> OutcomeResult:
        """The tracker's answer to this outcome (its frozen value and the advantage); raises what the
        tracker or the transport raised for it. Cancelling a report that has not left drops it."""
        return await self.submit((request_id, reward))

    async def _send(self, batch: list[tuple[Report, asyncio.Future]]) -> None:
        self.calls += 1
        try:
            results = await self.tracker.outcomes(self.run, [report for report, _ in batch])
            for (_, future), result in zip(batch, results, strict=True):
                settle(future, result)
        except TrackerError as exc:
            at_fault = set(exc.detail.get("request_ids") or []) if exc.status in (404, 409) else set()
            if len(batch) > 1 and (at_fault or exc.status == 422):
                for (rid, _), future in batch:
                    if rid in at_fault:
                        settle(future, exc=exc)
                rest = [entry for entry in batch if entry[0][0] not in at_fault]
                if exc.status == 422:
                    for entry in rest:
                        await self._send([entry])
                elif rest:
                    await self._send(rest)
                return
            for _, future in batch:
                settle(future, exc=exc)
        except Exception as exc:  # past the retry bound, or the client is closed: every report fails
            for _, future in batch:
                settle(future, exc=exc)
