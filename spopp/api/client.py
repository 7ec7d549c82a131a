"""Typed client for the tracker's REST API, sync (`TrackerClient`) and async (`AsyncTrackerClient`).

Each API method is written once in `_Api` and describes its call; the two subclasses only differ
in how they send it. Connection errors and 502/503/504 answers (a tracker or its Redis
restarting) are retried with capped exponential backoff and jitter for up to `retry_seconds`
(five minutes by default; see spopp.machine.retry). That is safe because every state-changing route is
idempotent: dispatch through an idempotency key that the client makes up once per call when the
caller gives none, outcomes by request, consume by update, policy by version.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpx

from spopp.api.tracker_api import (
    ConsumeResult,
    Dispatched,
    LookupResult,
    OutcomeResult,
    Policy,
    PutTasksResult,
    RequestState,
    Run,
    RunConfig,
    TaskPrior,
    TaskState,
    TaskValue,
    WorkerBeat,
    WorkerReleased,
)
from spopp.machine.retry import (
    DEFAULT_RETRY_SECONDS,
    RETRYABLE_ERRORS,
    RETRYABLE_STATUS,
    RetryPolicy,
    retry_after,
)

log = logging.getLogger("spopp.client")


class TrackerError(Exception):
    """An error answer from the tracker: `status`, `code`, `message` and the rest of `detail`."""

    def __init__(self, status: int, detail: Any) -> None:
        if not isinstance(detail, dict):
            detail = {"code": "http_error", "message": str(detail)}
        self.status = status
        self.detail = detail
        self.code = detail.get("code", "http_error")
        super().__init__(f"{status} {self.code}: {detail.get('message', '')}")


class StalePolicy(TrackerError):
    """409 on dispatch: a newer policy is out. `policy_version` and `snapshot` say which."""

    @property
    def policy_version(self) -> int:
        return int(self.detail["policy_version"])

    @property
    def snapshot(self) -> str | None:
        return self.detail.get("snapshot") or None


class RunFinished(TrackerError):
    """409 on dispatch or publish: the run is finished. `policy_version` is its final version."""

    @property
    def policy_version(self) -> int:
        return int(self.detail["policy_version"])


_ERRORS = {"stale_policy": StalePolicy, "run_finished": RunFinished}


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = response.text
    err = TrackerError(response.status_code, detail)
    if err.code in _ERRORS:
        err = _ERRORS[err.code](response.status_code, detail)
    raise err


@dataclass
class _Call:
    method: str
    path: str
    body: Any
    parse: Callable[[Any], Any]


class _Api:
    """The API, written once: each method returns what its transport makes of a `_Call`."""

    _http_class: type = httpx.Client

    def __init__(
        self,
        base_url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retry_seconds: float = DEFAULT_RETRY_SECONDS,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        http: httpx.Client | httpx.AsyncClient | None = None,
    ) -> None:
        """Retry a call for up to `retry_seconds` (0: one attempt), backoff doubling from `backoff`
        seconds up to `max_backoff`. `http`: an httpx client to send through instead of one made
        here (for example FastAPI's TestClient around the tracker's app in this process); it is
        used as given, so `base_url`, `token` and `timeout` are ignored."""
        self.http = http or self._http_class(base_url=base_url, headers=_headers(token), timeout=timeout)
        self.retry = RetryPolicy(retry_seconds, backoff, max(backoff, max_backoff))

    def _do(self, call: _Call) -> Any:  # pragma: no cover - defined by the transports
        raise NotImplementedError

    def put_run(self, run: str, config: RunConfig | dict) -> Any:
        body = RunConfig.model_validate(config).model_dump(mode="json")
        return self._do(_Call("PUT", f"/v1/runs/{run}", body, Run.model_validate))

    def get_run(self, run: str) -> Any:
        return self._do(_Call("GET", f"/v1/runs/{run}", None, Run.model_validate))

    def put_tasks(self, run: str, tasks: Iterable[TaskPrior | dict]) -> Any:
        body = {
            "tasks": [TaskPrior.model_validate(t).model_dump(mode="json", exclude_none=True) for t in tasks]
        }
        return self._do(_Call("PUT", f"/v1/runs/{run}/tasks", body, PutTasksResult.model_validate))

    def get_task(self, run: str, task_id: str) -> Any:
        return self._do(_Call("GET", f"/v1/runs/{run}/tasks/{task_id}", None, TaskState.model_validate))

    def dispatch(
        self,
        run: str,
        worker_id: str,
        policy_version: int,
        max_requests: int = 1,
        idempotency_key: str | None = None,
    ) -> Any:
        body = {
            "worker_id": worker_id,
            "policy_version": policy_version,
            "max_requests": max_requests,
            "idempotency_key": idempotency_key or uuid.uuid4().hex,
        }
        return self._do(_Call("POST", f"/v1/runs/{run}/dispatch", body, Dispatched.model_validate))

    def outcomes(self, run: str, outcomes: Iterable[tuple[str, float]]) -> Any:
        body = {"outcomes": [{"request_id": rid, "reward": float(r)} for rid, r in outcomes]}
        return self._do(_Call("POST", f"/v1/runs/{run}/outcomes", body, _results(OutcomeResult, "results")))

    def renew(self, run: str, request_id: str) -> Any:
        path = f"/v1/runs/{run}/requests/{request_id}/renew"
        return self._do(_Call("POST", path, None, RequestState.model_validate))

    def release(self, run: str, request_id: str) -> Any:
        path = f"/v1/runs/{run}/requests/{request_id}/release"
        return self._do(_Call("POST", path, None, RequestState.model_validate))

    def lookup(self, run: str, request_ids: Iterable[str]) -> Any:
        """What the tracker knows of each request id (RequestInfo, in order)."""
        body = {"request_ids": list(request_ids)}
        parse = lambda data: LookupResult.model_validate(data).requests  # noqa: E731
        return self._do(_Call("POST", f"/v1/runs/{run}/requests/lookup", body, parse))

    def values(self, run: str, task_ids: Iterable[str]) -> Any:
        body = {"task_ids": list(task_ids)}
        return self._do(_Call("POST", f"/v1/runs/{run}/values", body, _results(TaskValue, "values")))

    def consume(self, run: str, update_id: str, items: Iterable[tuple[str, float, float]]) -> Any:
        body = {
            "update_id": update_id,
            "items": [{"task_id": t, "reward": r, "drift": d} for t, r, d in items],
        }
        return self._do(_Call("POST", f"/v1/runs/{run}/consume", body, _results(ConsumeResult, None)))

    def publish(self, run: str, version: int, snapshot: str) -> Any:
        body = {"version": version, "snapshot": snapshot}
        return self._do(_Call("POST", f"/v1/runs/{run}/policy", body, Policy.model_validate))

    def finish(self, run: str, version: int, reason: str | None = None) -> Any:
        """Mark the run finished at `version` (its current one); a repeat is a no-op. Answers the Run."""
        body = {"version": version, **({"reason": reason} if reason is not None else {})}
        return self._do(_Call("POST", f"/v1/runs/{run}/finish", body, Run.model_validate))

    def set_budget(self, run: str, max_updates: int) -> Any:
        """Change the run's max_updates (409 budget_below_version under its policy version)."""
        return self._do(
            _Call("POST", f"/v1/runs/{run}/budget", {"max_updates": max_updates}, Run.model_validate)
        )

    def reopen(self, run: str, version: int) -> Any:
        """Undo the finish at `version` (a budget that grew); a no-op on a running run."""
        return self._do(_Call("POST", f"/v1/runs/{run}/reopen", {"version": version}, Run.model_validate))

    def heartbeat(self, run: str, worker_id: str, trajectories: int, episodes: int) -> Any:
        """The worker's cumulative counts; the tracker keeps the largest it has seen (WorkerBeat)."""
        body = {"trajectories": trajectories, "episodes": episodes}
        return self._do(_Call("POST", f"/v1/runs/{run}/workers/{worker_id}", body, WorkerBeat.model_validate))

    def release_worker(self, run: str, worker_id: str) -> Any:
        """Give back every live lease of `worker_id` (a restarted replica, before its first
        dispatch). Answers WorkerReleased."""
        path = f"/v1/runs/{run}/workers/{worker_id}/release"
        return self._do(_Call("POST", path, None, WorkerReleased.model_validate))

    def policy(self, run: str) -> Any:
        return self._do(_Call("GET", f"/v1/runs/{run}/policy", None, Policy.model_validate))

    def export(self, run: str) -> Any:
        return self._do(_Call("GET", f"/v1/runs/{run}/export", None, _jsonl))


def _results(model, key: str | None) -> Callable[[Any], list]:
    def parse(data: Any) -> list:
        return [model.model_validate(x) for x in (data[key] if key else data)]

    return parse


def _jsonl(text: str) -> list[dict]:
    import json

    # "\n" alone ends a record: str.splitlines() also cuts at U+2028 and U+0085, which JSON may hold raw
    return [json.loads(line) for line in text.split("\n") if line.strip()]


def _headers(token: str | None) -> dict:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _decode(call: _Call, response: httpx.Response) -> Any:
    _raise_for(response)
    return call.parse(response.text if call.parse is _jsonl else response.json())


def _wait_before_retry(call: _Call, attempts, error: Exception | None, response: httpx.Response | None):
    """Seconds to wait before retrying `call`, or None to give up (the time bound is spent)."""
    delay = attempts.next_delay(retry_after(response) if response is not None else None)
    why = f"{type(error).__name__}: {error}" if error is not None else f"HTTP {response.status_code}"
    if delay is None:
        log.error(
            "tracker %s %s: %s; giving up after %d attempts in %.0f s",
            call.method, call.path, why, attempts.count, attempts.elapsed,
        )  # fmt: skip
    elif attempts.count in (1, 10) or attempts.count % 50 == 0:  # a line now and then, not per try
        log.warning(
            "tracker %s %s: %s; retrying (attempt %d, %.0f s so far)",
            call.method, call.path, why, attempts.count, attempts.elapsed,
        )  # fmt: skip
    return delay


class TrackerClient(_Api):
    """Blocking client."""

    _http_class = httpx.Client

    def _do(self, call: _Call) -> Any:
        attempts = self.retry.start()
        while True:
            try:
                response = self.http.request(call.method, call.path, json=call.body)
            except RETRYABLE_ERRORS as exc:
                if (delay := _wait_before_retry(call, attempts, exc, None)) is None:
                    raise
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    return _decode(call, response)
                if (delay := _wait_before_retry(call, attempts, None, response)) is None:
                    return _decode(call, response)  # raises the last answer's error
            time.sleep(delay)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> TrackerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTrackerClient(_Api):
    """The same API for asyncio: every method returns an awaitable."""

    _http_class = httpx.AsyncClient

    async def _do(self, call: _Call) -> Any:
        attempts = self.retry.start()
        while True:
            try:
                response = await self.http.request(call.method, call.path, json=call.body)
            except RETRYABLE_ERRORS as exc:
                if (delay := _wait_before_retry(call, attempts, exc, None)) is None:
                    raise
            else:
                if response.status_code not in RETRYABLE_STATUS:
                    return _decode(call, response)
                if (delay := _wait_before_retry(call, attempts, None, response)) is None:
                    return _decode(call, response)  # raises the last answer's error
            await asyncio.sleep(delay)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncTrackerClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()
