"""Trajectory deliveries to the learner, coalesced (services/rollout/coalesce.py): one
POST /v1/trajectories/batch carries every trajectory that finished while the last call was on its
way.

Per call, not per trajectory: the learner's intake is away (unreachable, or 5xx while it starts,
restarts or is busy) → the call is sent again, backing off, for up to the retry bound; the intake
counts a request_id once, so a repeat is safe. A trajectory whose episode stopped waiting (a
shutdown cancelled it) is left out of the next attempt, and a call with nobody left waiting stops.

What the learner answers is per trajectory (`Delivered`: the status the single route would give,
200 accepted, 409 stale or batch full, 422 refused). A refusal of the whole call is narrowed down
rather than spread: 422 (one record the learner will not take) → each is sent alone, so only that
one is refused; 413 (the body is over the learner's limit) → halves. A learner without the batch
route (404/405: an older build) gets single POST /v1/trajectories calls from then on.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import httpx

from spopp.api.trajectory import INTAKE, INTAKE_BATCH, MAX_TRAJECTORIES_PER_CALL, Delivered
from spopp.machine.retry import RETRYABLE_ERRORS, RetryPolicy, retry_after

from .coalesce import Coalescer, settle

log = logging.getLogger("spopp.rollout")

# A call's body at most: well below the learner's default limit (64 MiB), and small enough that
# one call never holds the learner's intake for long. A single larger trajectory still goes alone.
MAX_BYTES_PER_CALL = 4 << 20
_JSON = {"content-type": "application/json"}

Parcel = tuple[str, bytes]  # (request_id, the trajectory's JSON)


class Undelivered(Exception):
    """The learner stayed unreachable (or answered 5xx) past the retry bound."""


class TrajectoryBatcher(Coalescer[Parcel, Delivered]):
    def __init__(
        self,
        learner: httpx.AsyncClient,
        retry: RetryPolicy,
        *,
        max_per_call: int = MAX_TRAJECTORIES_PER_CALL,
        max_bytes: int = MAX_BYTES_PER_CALL,
        linger: float = 0.0,
        on_retry: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(max_per_call, linger)
        self.learner = learner
        self.retry = retry
        self.max_bytes = max_bytes
        self.on_retry = on_retry
        self.batch_route = True

    async def deliver(self, record: dict) -> Delivered:
        """The learner's answer for this trajectory (a JSON-ready Trajectory record); raises
        Undelivered past the retry bound."""
        body = json.dumps(record, separators=(",", ":")).encode()
        return await self.submit((record["request_id"], body))

    def _take(self) -> list[tuple[Parcel, asyncio.Future]]:
        """The oldest trajectories that fit one call: at most max_per_call and max_bytes (the first
        always goes, however large)."""
        size, n = 0, 0
        for (_, body), _ in self._queue[: self.max_per_call]:
            if n and size + len(body) > self.max_bytes:
                break
            size, n = size + len(body) + 1, n + 1
        batch, self._queue = self._queue[:n], self._queue[n:]
        return batch

    async def _send(self, batch: list[tuple[Parcel, asyncio.Future]]) -> None:
        if not self.batch_route:
            for entry in batch:
                await self._send_alone(entry)
            return
        self.calls += 1
        r = await self._post(batch, INTAKE_BATCH, lambda b: b'{"trajectories":[' + b",".join(b) + b"]}")
        if r is None:
            return
        if r.status_code == 200:
            results = [Delivered.model_validate(x) for x in r.json()["results"]]
            for (_, future), result in zip(batch, results, strict=True):
                settle(future, result)
        elif r.status_code in (404, 405):
            log.warning(
                "the learner has no %s (an older build): sending trajectories one by one", INTAKE_BATCH
            )
            self.batch_route = False
            await self._send(batch)
        elif r.status_code == 422 and len(batch) > 1:
            for entry in batch:
                await self._send([entry])
        elif r.status_code == 413 and len(batch) > 1:
            half = len(batch) // 2
            await self._send(batch[:half])
            await self._send(batch[half:])
        else:  # refused as a whole (401, 413 or 422 for one record...): each gets the call's answer
            for (rid, _), future in batch:
                settle(future, _refusal(rid, r))

    async def _send_alone(self, entry: tuple[Parcel, asyncio.Future]) -> None:
        """One trajectory through the single route (a learner without the batch route)."""
        self.calls += 1
        (rid, _), future = entry
        r = await self._post([entry], INTAKE, lambda b: b[0])
        if r is None:
            return
        if r.status_code == 200:
            settle(
                future,
                Delivered(request_id=rid, status=200, accepted=True, position=r.json().get("position")),
            )
        else:
            settle(future, _refusal(rid, r))

    async def _post(self, batch, path: str, body: Callable[[list[bytes]], bytes]) -> httpx.Response | None:
        """POST what is still awaited of `batch` until an answer under 500 comes (None: nobody waits
        any more, or the retry bound is spent and every waiter got Undelivered)."""
        attempts = self.retry.start()
        while True:
            live = [entry for entry in batch if not entry[1].done()]
            if not live:
                return None
            if len(live) < len(batch):  # a waiter left; the answer must line up with what was sent
                await self._send(live)
                return None
            try:
                r = await self.learner.post(path, content=body([b for (_, b), _ in live]), headers=_JSON)
            except RETRYABLE_ERRORS as exc:
                r, why = None, f"{type(exc).__name__}: {exc}"
            else:
                why = f"HTTP {r.status_code}"
            if r is not None and r.status_code < 500:
                return r
            delay = attempts.next_delay(retry_after(r) if r is not None else None)
            if delay is None:
                exc = Undelivered(f"not delivered after {attempts.elapsed:.0f} s: {why}")
                for _, future in live:
                    settle(future, exc=exc)
                return None
            if attempts.count in (1, 10) or attempts.count % 50 == 0:
                log.warning(
                    "learner: %s; retrying %d trajectories (attempt %d)", why, len(live), attempts.count
                )
            self.on_retry()
            await asyncio.sleep(delay)


def _refusal(request_id: str, r: httpx.Response) -> Delivered:
    """A refusal in the single route's shape ({"detail": {"code", "message"}}) as one Delivered."""
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    if isinstance(detail, dict):
        code, message = detail.get("code"), str(detail.get("message", ""))
    else:
        code, message = None, r.text[:500]
    return Delivered(request_id=request_id, status=r.status_code, accepted=False, code=code, message=message)
