"""Trajectory intake on rank 0: POST /v1/trajectories into a buffer of the current policy version.

The learner trains on the *first* trajectories of each policy version, in arrival order: the
buffer accepts `capacity` (B × updates per publish) of them and refuses the rest. A trajectory of
another version is refused with 409 (the rollout counts it as drained), one of another run or
that fails the schema with 422; a repeated request_id answers as before and counts once.
"""

from __future__ import annotations

import threading

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from spopp.asgi import BodyLimit
from spopp.trajectory import Trajectory


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str, **context) -> None:
        super().__init__(message)
        self.status, self.detail = status, {"code": code, "message": message, **context}


class TrajectoryBuffer:
    """Thread-safe: the HTTP server adds, the training loop takes."""

    def __init__(self, run: str, capacity: int, version: int = 0) -> None:
        self.run = run
        self.capacity = capacity
        self.version = version
        self._items: list[Trajectory] = []
        self._seen: dict[str, int] = {}  # request_id -> position in this version's stream
        self._taken = 0
        self._cond = threading.Condition()
        self.refused = {"stale": 0, "full": 0}

    def add(self, t: Trajectory) -> int:
        """Queue `t`; answers its position in this version's stream or raises Refused."""
        if t.run != self.run:
            raise Refused(422, "unknown_run", f"this learner trains run {self.run!r}", run=t.run)
        with self._cond:
            if t.policy_version != self.version:
                self.refused["stale"] += 1
                raise Refused(
                    409, "stale_policy", "trajectory of another policy version", policy_version=self.version
                )
            if t.request_id in self._seen:
                return self._seen[t.request_id]
            if len(self._seen) >= self.capacity:
                self.refused["full"] += 1
                raise Refused(
                    409, "batch_full", "this version's batches are complete", policy_version=self.version
                )
            self._items.append(t)
            self._seen[t.request_id] = len(self._seen)
            self._cond.notify_all()
            return self._seen[t.request_id]

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory] | None:
        """The next n trajectories of the current version, in arrival order (None on timeout)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._items) >= n, timeout):
                return None
            out, self._items = self._items[:n], self._items[n:]
            self._taken += n
            return out

    def advance(self, version: int) -> None:
        """A new policy version is out: what was left of the old one is dropped."""
        with self._cond:
            self.version = version
            self._items, self._seen, self._taken = [], {}, 0

    def state(self) -> dict:
        """What a checkpoint keeps: the current version's trajectories not yet trained on."""
        with self._cond:
            return {
                "version": self.version,
                "pending": [t.model_dump(mode="json") for t in self._items],
                "seen": dict(self._seen),
                "taken": self._taken,
            }

    def restore(self, state: dict) -> None:
        with self._cond:
            self.version = state["version"]
            self._items = [Trajectory.model_validate(x) for x in state["pending"]]
            self._seen = dict(state["seen"])
            self._taken = state["taken"]
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


def ingest_app(buffer: TrajectoryBuffer, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="spopp learner")

    @app.post("/v1/trajectories")
    def post(t: Trajectory) -> dict:
        position = buffer.add(t)
        return {"accepted": True, "policy_version": buffer.version, "position": position}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "policy_version": buffer.version, "buffered": len(buffer)}

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {"field": ".".join(str(p) for p in e["loc"] if p != "body"), "message": e["msg"]}
            for e in exc.errors()
        ]
        first = errors[0] if errors else {"field": "body", "message": "invalid trajectory"}
        detail = {"code": "invalid", "message": f"{first['field']}: {first['message']}", "errors": errors}
        return JSONResponse({"detail": detail}, status_code=422)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app
