"""Trajectory intake on rank 0: POST /v1/trajectories into a buffer of the current policy version.

POST /v1/trajectories/batch takes many records in one call (what a busy replica sends: one HTTP
request per episode costs both ends more CPU than the record itself). Its schema and limit checks
hold for the whole call (a 422 names the record's index, nothing is buffered), then each record
is admitted as the single route would and gets that route's status in the answer's `results`.

The learner trains on the *first* trajectories of each policy version, in arrival order: the
buffer accepts `capacity` (B × updates per publish) of them and refuses the rest. A trajectory of
another version is refused with 409 (the rollout counts it as drained), one of another run or
that fails a check with 422; a repeated request_id answers as before and counts once. With
bounded staleness (max_staleness k > 0) the versions within k of the current one are taken, and
the buffer is a queue of at most `capacity` waiting trajectories (see TrajectoryBuffer).

Checks at the door, in this order, and nothing refused is ever buffered: the bearer token (401,
when one is configured; /healthz and /metrics stay open), the body size (413), the record's own
schema (spopp.api.trajectory), then IntakeLimits, what this model and recipe require beyond the wire
schema: token ids inside the vocabulary, a sequence inside the context, an advantage for SPO++.
A 422 names the field. Every answer is counted in the learner's Prometheus metrics.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from services.shell.middleware import BearerAuth, BodyLimit, UniqueJsonKeys, invalid_detail, short_errors
from services.shell.routes import add_service_routes
from spopp import staleness
from spopp.api.trajectory import INTAKE, INTAKE_BATCH, Delivered, Trajectory, TrajectoryBatch

from .metrics import LearnerMetrics

log = logging.getLogger("spopp.learner")

# The refusal code a client reads -> the metric's reason label.
_REASON = {"stale_policy": "stale", "batch_full": "full", "invalid": "invalid", "unknown_run": "unknown_run"}


class Refused(Exception):
    def __init__(self, status: int, code: str, message: str, **context) -> None:
        super().__init__(message)
        self.status, self.detail = status, {"code": code, "message": message, **context}


def invalid(errors: list[dict], at: str = "", total: int | None = None) -> Refused:
    """A 422 in the same shape as a schema error (services.shell.middleware.invalid_detail): the first field in
    the message, the errors listed and counted."""
    detail = invalid_detail([{**e, "field": at + e["field"]} for e in errors], total)
    return Refused(422, detail.pop("code"), detail.pop("message"), **detail)


@dataclass(frozen=True)
class IntakeLimits:
    """What this learner's model and recipe require of a trajectory beyond the wire schema.

    A token id past the embedding would fail (or, on GPU, fault) in the forward pass, long after
    the trajectory was accepted; one past the context trains on positions the model never had.
    SPO++ trains on the advantage frozen at dispatch, so it cannot do without one. None: no limit.
    """

    vocab_size: int | None = None
    max_tokens: int | None = None
    recipe: str | None = None

    @classmethod
    def for_model(cls, model: Any, recipe: str | None = None) -> IntakeLimits:
        """The limits of a Hugging Face causal LM (e.g. `engine.module`): its embedding's rows,
        which may exceed the tokenizer's vocabulary but are what an id indexes, and its context."""
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        try:
            vocab = int(model.get_input_embeddings().num_embeddings)
        except (AttributeError, NotImplementedError):
            vocab = getattr(text, "vocab_size", None)
        return cls(vocab_size=vocab, max_tokens=getattr(text, "max_position_embeddings", None), recipe=recipe)

    def errors(self, t: Trajectory) -> list[dict]:
        out = []
        if self.vocab_size is not None and max(t.token_ids) >= self.vocab_size:
            i = next(i for i, x in enumerate(t.token_ids) if x >= self.vocab_size)
            out.append({
                "field": "token_ids",
                "message": f"token_ids[{i}] = {t.token_ids[i]} is not below the model's vocabulary "
                f"size {self.vocab_size}",
            })  # fmt: skip
        if self.max_tokens is not None and len(t.token_ids) > self.max_tokens:
            out.append({
                "field": "token_ids",
                "message": f"{len(t.token_ids)} tokens exceed the model's context of {self.max_tokens}",
            })  # fmt: skip
        if self.recipe == "spopp" and t.advantage is None:
            out.append({
                "field": "advantage",
                "message": "an SPO++ learner trains on the advantage frozen at dispatch; it is required",
            })  # fmt: skip
        return out

    def check(self, t: Trajectory, at: str = "") -> None:
        """Raise a 422 naming the field (behind `at`, the record's place in a batch)."""
        if errors := self.errors(t):
            raise invalid(errors, at)


class TrajectoryBuffer:
    """Thread-safe: the HTTP server adds, the training loop takes.

    With max_staleness k = 0 (the paper's protocol) it takes the first `capacity` trajectories of
    the current version and refuses the rest (409 batch_full) until the next version: what would
    arrive later could only be dropped at the swap. With k > 0 it is a queue of at most `capacity`
    waiting trajectories whose versions lie within k of the current one: what arrives while an
    update runs waits for the next, and at a swap only those now more than k versions old go.
    Request ids are remembered for every version in the window, so a delivery retried after its
    trajectory was trained on answers as before and is never trained on twice.
    """

    def __init__(self, run: str, capacity: int, version: int = 0, max_staleness: int = 0) -> None:
        self.run = run
        self.capacity = capacity
        self.version = version
        self.max_staleness = max_staleness
        self._items: list[Trajectory] = []
        # request_id -> (its policy version, its position in the stream of the version it came in)
        self._seen: dict[str, tuple[int, int]] = {}
        self._count = 0  # accepted since the current version began (k > 0: plus those carried over)
        self._taken = 0
        self._cond = threading.Condition()
        self.refused = {"stale": 0, "full": 0}

    def check_run(self, t: Trajectory) -> None:
        if t.run != self.run:
            raise Refused(422, "unknown_run", f"this learner trains run {self.run!r}", run=t.run)

    def _stale(self, t: Trajectory) -> Refused:
        k = self.max_staleness
        return Refused(
            409,
            "stale_policy",
            f"trajectory of policy version {t.policy_version}; this learner takes "
            f"{staleness.describe(self.version, k)} (max_staleness {k})",
            policy_version=self.version,
        )

    def _full(self) -> bool:
        if self.max_staleness == 0:
            return self._count >= self.capacity
        return len(self._items) >= self.capacity

    def admit(self, t: Trajectory) -> tuple[int, bool]:
        """Queue `t`: (its position in this version's stream, whether it is new) or Refused."""
        self.check_run(t)
        with self._cond:
            if not staleness.trainable(t.policy_version, self.version, self.max_staleness):
                self.refused["stale"] += 1
                raise self._stale(t)
            if t.request_id in self._seen:
                return self._seen[t.request_id][1], False
            if self._full():
                self.refused["full"] += 1
                raise Refused(
                    409, "batch_full", "this version's batches are complete", policy_version=self.version
                )
            self._items.append(t)
            self._seen[t.request_id] = (t.policy_version, self._count)
            self._count += 1
            self._cond.notify_all()
            return self._seen[t.request_id][1], True

    def add(self, t: Trajectory) -> int:
        """Queue `t`; answers its position in this version's stream or raises Refused."""
        return self.admit(t)[0]

    def take(self, n: int, timeout: float | None = None) -> list[Trajectory] | None:
        """The next n trajectories of the window, in arrival order (None on timeout)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._items) >= n, timeout):
                return None
            out, self._items = self._items[:n], self._items[n:]
            self._taken += n
            return out

    def putback(self, items: list[Trajectory]) -> None:
        """Return taken trajectories to the front, in their order (a batch screened short)."""
        with self._cond:
            self._items = list(items) + self._items
            self._taken -= len(items)
            self._cond.notify_all()

    def forget(self, request_ids) -> None:
        """Drop trajectories found untrainable after their intake: their places in this version's
        batches go to later arrivals."""
        with self._cond:
            gone = set(request_ids)
            self._items = [t for t in self._items if t.request_id not in gone]
            for rid in gone:
                if self._seen.pop(rid, None) is not None:
                    self._count -= 1

    def advance(self, version: int) -> None:
        """A new policy version is out: what is now more than max_staleness versions old goes."""
        with self._cond:
            self.version = version
            floor = staleness.oldest_trainable(version, self.max_staleness)
            self._items = [t for t in self._items if t.policy_version >= floor]
            self._seen = {rid: vp for rid, vp in self._seen.items() if vp[0] >= floor}
            self._count, self._taken = len(self._items), 0
            self._cond.notify_all()

    def state(self) -> dict:
        """What a checkpoint keeps: the window's trajectories not yet trained on, and its ids."""
        with self._cond:
            return {
                "version": self.version,
                "pending": [t.model_dump(mode="json") for t in self._items],
                "seen": {rid: list(vp) for rid, vp in self._seen.items()},
                "count": self._count,
                "taken": self._taken,
            }

    def restore(self, state: dict) -> dict[str, str]:
        """Take up a checkpoint's state(). Its waiting trajectories pass today's schema again: a
        checkpoint written before a check existed may hold one the intake now refuses (log-probs
        of -1e308, infinite in float32, once were taken), and training on it would stop the
        learner again at every restart. Such a trajectory is dropped, its place freed for a later
        arrival; answers the dropped ones, {request_id: why}."""
        with self._cond:
            self.version = state["version"]
            self._items, dropped = [], {}
            for x in state["pending"]:
                try:
                    self._items.append(Trajectory.model_validate(x))
                except ValidationError as err:
                    first = err.errors()[0]
                    where = ".".join(map(str, first["loc"]))
                    dropped[str(x.get("request_id"))] = f"{where}: {first['msg']}"
            # A checkpoint written before the window existed keeps {request_id: position}, all of
            # its own version.
            self._seen = {
                rid: (int(vp[0]), int(vp[1])) if isinstance(vp, list) else (self.version, int(vp))
                for rid, vp in state["seen"].items()
            }
            self._count = int(state.get("count", len(self._seen)))
            for rid in dropped:
                if self._seen.pop(rid, None) is not None:
                    self._count -= 1
            self._taken = state["taken"]
            self._cond.notify_all()
            return dropped

    @property
    def accepted(self) -> int:
        """Trajectories accepted for the current version, trained on or waiting (k = 0: <= capacity)."""
        with self._cond:
            return self._count

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class _CountDoorRefusals:
    """Counts the intake's 400, 401 and 413: middlewares answer those before any handler could."""

    _REASON = {400: "invalid", 401: "unauthorized", 413: "too_large"}

    def __init__(self, app, metrics: LearnerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in (INTAKE, INTAKE_BATCH):
            return await self.app(scope, receive, send)

        async def watch(message):
            if message["type"] == "http.response.start" and message["status"] in self._REASON:
                self.metrics.refuse(self._REASON[message["status"]])
            await send(message)

        await self.app(scope, receive, watch)


def _admit(buffer: TrajectoryBuffer, metrics: LearnerMetrics, t: Trajectory) -> int:
    """Buffer `t` and return its position; a repeated request_id is counted as accepted once."""
    position, new = buffer.admit(t)
    if new:
        metrics.accepted.inc()
    return position


def _check_batch(buffer: TrajectoryBuffer, limits: IntakeLimits, batch: TrajectoryBatch) -> None:
    """Raise the first record's refusal that is the sender's fault, naming the record's index."""
    # Every check that is the sender's fault first, for every record: a 422 leaves nothing
    # buffered. What remains (stale, full) depends on when each record came, not on it.
    for i, t in enumerate(batch.trajectories):
        try:
            buffer.check_run(t)
        except Refused as exc:
            exc.detail.update(index=i, request_id=t.request_id)
            raise
        limits.check(t, at=f"trajectories.{i}.")


def _deliver(buffer: TrajectoryBuffer, metrics: LearnerMetrics, t: Trajectory) -> Delivered:
    """Admit one record of a checked batch; a refusal (stale, full) is that record's own answer."""
    try:
        return Delivered(
            request_id=t.request_id, status=200, accepted=True, position=_admit(buffer, metrics, t)
        )
    except Refused as exc:
        metrics.refuse(_REASON.get(exc.detail["code"], exc.detail["code"]))
        return Delivered(
            request_id=t.request_id,
            status=exc.status,
            accepted=False,
            code=exc.detail["code"],
            message=exc.detail["message"],
        )


def _add_intake_routes(
    app: FastAPI, buffer: TrajectoryBuffer, limits: IntakeLimits, metrics: LearnerMetrics
) -> None:
    """POST /v1/trajectories (one record) and /v1/trajectories/batch (many, answered one by one)."""

    @app.post(INTAKE)
    def post(t: Trajectory) -> dict:
        limits.check(t)
        return {"accepted": True, "policy_version": buffer.version, "position": _admit(buffer, metrics, t)}

    @app.post(INTAKE_BATCH)
    def post_batch(batch: TrajectoryBatch) -> dict:
        _check_batch(buffer, limits, batch)
        results = [_deliver(buffer, metrics, t) for t in batch.trajectories]
        return {
            "policy_version": buffer.version,
            "results": [r.model_dump(exclude_none=True) for r in results],
        }


def _add_refusal_handlers(app: FastAPI, metrics: LearnerMetrics) -> None:
    """Answer refusals and schema errors alike ({"detail": {code, message, ...}}), counting each."""

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        metrics.refuse(_REASON.get(exc.detail["code"], exc.detail["code"]))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def schema(request: Request, exc: RequestValidationError) -> JSONResponse:
        shown, total = short_errors(exc.errors())
        return await refused(request, invalid(shown, total=total))


def ingest_app(
    buffer: TrajectoryBuffer,
    max_body_bytes: int,
    *,
    token: str | None = None,
    limits: IntakeLimits | None = None,
    metrics: LearnerMetrics | None = None,
    device: str | None = None,
) -> FastAPI:
    """The intake app; `token` None leaves it open, `limits` None checks the schema only.
    `device`: where the learner trains (cpu, cuda:0), shown by /healthz."""
    if token is None:
        # spopp launch always gives the learner a token (the user's or the run's): this one was
        # started on its own, and whoever reaches the port may post trajectories it trains on.
        log.warning(
            "no api_token (SPOPP_API_TOKEN) is set: the intake (POST /v1/trajectories) is open to anyone who reaches it"
        )
    limits = limits or IntakeLimits()
    metrics = metrics or LearnerMetrics()
    metrics.watch(buffer)
    app = FastAPI(title="spopp learner")
    _add_intake_routes(app, buffer, limits, metrics)
    add_service_routes(
        app,
        health=lambda: {
            "status": "ok",
            "policy_version": buffer.version,
            "buffered": len(buffer),
            "device": device,
        },
        metrics=metrics.registry,
    )
    _add_refusal_handlers(app, metrics)
    # Added innermost first: auth is decided before the body is read, and counted outside both;
    # repeated JSON keys are looked for in an authorised body of bounded size only.
    app.add_middleware(UniqueJsonKeys)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    app.add_middleware(BearerAuth, token=token)
    app.add_middleware(_CountDoorRefusals, metrics=metrics)
    return app
