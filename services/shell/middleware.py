"""ASGI middleware shared by the services: body-size limits (413) and a budget of body bytes in
flight (503), bearer-token auth (401), JSON objects with a repeated key refused (400); and the short
form of a validation error's reply.

Bodies are read by the routes, never ahead of them: the body limit and the repeated-key check sit
on the `receive` the route reads its body through, so a request that a route answers without its
body (a health probe, a wrong token, an unknown path) has none of its body read or held, whatever
it sends. Serving an app (uvicorn beside a service's loop, or in a thread) is
services/shell/server.py's."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets

from starlette.requests import ClientDisconnect

from spopp.api.json_keys import RepeatedKey, loads_unique

from .overload import RETRY_AFTER_SECONDS

log = logging.getLogger("spopp.http")

# The routes that speak OpenAI's API (runtime.chat_endpoint, on a replica whose episodes an agent
# drives): what refuses a request to them before the route runs (the server's header checks, the
# body limit) answers in OpenAI's error shape, which the `openai` client reads, as the route does.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/models"})


def header(scope, name: bytes, default: bytes | None = None) -> bytes | None:
    """A request header's first value, as Starlette (and so FastAPI's routes) reads it. The server
    refuses a request that carries Content-Type, Content-Length, Authorization or Host twice
    (connections.SINGLE_HEADERS, 400); this keeps the middleware and the routes on one value
    where an app is called without that server (TestClient)."""
    return next((value for key, value in scope["headers"] if key == name), default)


def error_body(path: str, status: int, detail: dict) -> dict:
    """A refusal's body: the API's {"detail": {code, message, ...}}, or on OPENAI_PATHS OpenAI's
    {"error": {message, type, param, code}}."""
    if path in OPENAI_PATHS:
        kind = "invalid_request_error" if status < 500 else "server_error"
        return {"error": {"message": detail["message"], "type": kind, "param": None, "code": detail["code"]}}
    return {"detail": detail}


async def send_error(send, status: int, detail: dict, headers: list | None = None, path: str = "") -> None:
    """Answer from inside a middleware with the API's error body (`error_body` of `path`)."""
    body = json.dumps(error_body(path, status, detail)).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """One request's `send` as a middleware that may answer it itself sees it: whether the app's
    response has begun, and, once the middleware has answered, the app's own sends dropped (the
    app still runs to its end: it was told the client left)."""

    def __init__(self, send) -> None:
        self._send = send
        self.started = False
        self.refused = False

    async def send(self, message) -> None:
        if self.refused:
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)

    async def refuse(self, status: int, detail: dict, path: str, headers: list | None = None) -> None:
        """Answer `status` unless a response is under way (then only the app's is cut off)."""
        if not self.started:
            self.started = True
            await send_error(self._send, status, detail, headers, path)
        self.refused = True


DISCONNECT = {"type": "http.disconnect"}
# The scope's key where BodyLimit says it stopped a route's body (413, or 503: the budget below was
# spent), for a route that tells a refusal of its own from the client leaving.
BODY_REFUSED = "spopp.body_refused"

# What a service holds at most of request bodies at once, across all its requests: this many
# bodies at the limit, and never less than IN_FLIGHT_FLOOR_BYTES (many small bodies at once). A
# body counts from its first byte read until its request is answered (what the route built from
# it lives that long), so the bound covers the route's copies too, whose size follows the body's.
# Before it, the limit held per request only: connections x limit was 8 GB at the default caps,
# and 400 bodies of 8 MiB took a replica from 2.0 to 3.7 GB.
IN_FLIGHT_BODIES = 4
IN_FLIGHT_FLOOR_BYTES = 64 * 1024 * 1024


def default_in_flight(max_bytes: int) -> int:
    return max(IN_FLIGHT_FLOOR_BYTES, IN_FLIGHT_BODIES * max_bytes)


class BodyBudget:
    """Bytes of request bodies held at once by one app (one event loop: no lock needed)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.held = 0

    def take(self, n: int) -> bool:
        if self.held + n > self.max_bytes:
            return False
        self.held += n
        return True

    def give(self, n: int) -> None:
        self.held -= n


class BodyLimit:
    """A body of at most `max_bytes` per request (413), and of at most `in_flight_bytes` across the
    requests in flight (503 with Retry-After: the budget frees as requests are answered).

    A declared length over the limit is refused before the app runs. Otherwise nothing is read
    here: the app's `receive` counts what the route reads as it reads it (a chunked body, or one
    whose declared length lies, is refused at the byte that passes the limit), so a route that
    takes no body reads none, and a body is read only once the route has accepted the request
    (its token checked first). A route told to stop reading (the limit, the budget) sees the
    client leave (`http.disconnect`; Starlette raises ClientDisconnect) and its answer is dropped;
    a client that does leave mid-body is not an error of ours: logged at debug, not as a traceback.
    """

    def __init__(self, app, max_bytes: int, in_flight_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.budget = BodyBudget(
            in_flight_bytes if in_flight_bytes is not None else default_in_flight(max_bytes)
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        declared = header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await send_error(send, 413, self._too_large(), path=path)
        guard = _Guard(send)
        seen = held = 0

        async def counted():
            nonlocal seen, held
            if guard.refused:
                return DISCONNECT
            message = await receive()
            if message["type"] != "http.request":
                return message
            n = len(message.get("body", b""))
            seen += n
            if seen > self.max_bytes:
                scope[BODY_REFUSED] = 413
                await guard.refuse(413, self._too_large(), path)
                return DISCONNECT
            if n and not self.budget.take(n):
                scope[BODY_REFUSED] = 503
                await guard.refuse(
                    503, self._busy(), path, [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())]
                )
                return DISCONNECT
            held += n
            return message

        try:
            await self.app(scope, counted, guard.send)
        except ClientDisconnect:
            # Refused above, or the client left (or its body missed its deadline): no one to answer.
            log.debug("%s %s: the client left before its body was read", scope.get("method"), path[:200])
        except Exception:
            if not guard.refused:
                raise
            # The app's own reaction to a body it was refused (FastAPI turns the disconnect into a
            # 400 of its own, which is dropped): the refusal is the answer.
            log.debug(
                "%s %s: the app's end after its body was refused",
                scope.get("method"),
                path[:200],
                exc_info=True,
            )
        finally:
            self.budget.give(held)

    def _too_large(self) -> dict:
        message = f"request body exceeds {self.max_bytes} bytes"
        return {"code": "body_too_large", "message": message, "max_bytes": self.max_bytes}

    def _busy(self) -> dict:
        message = (
            f"this server holds {self.budget.max_bytes} bytes of request bodies at most at once, and "
            "requests in flight hold them; retry"
        )
        return {"code": "bodies_in_flight", "message": message, "max_bytes_in_flight": self.budget.max_bytes}


class BearerAuth:
    """Every /v1 route needs `Authorization: Bearer <token>` when a token is configured, and so do
    the exact paths in `also` (the tracker's /metrics where it binds beyond loopback).

    A middleware rather than a route dependency so that auth is decided before the body is
    parsed: a caller without the token learns nothing from validation errors.
    """

    def __init__(self, app, token: str | None, also: tuple[str, ...] = ()) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.also = frozenset(also)

    async def __call__(self, scope, receive, send):
        if self.token is None or scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not scope["path"].startswith("/v1/") and scope["path"] not in self.also:
            return await self.app(scope, receive, send)
        scheme, _, given = header(scope, b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and secrets.compare_digest(given, self.token):
            return await self.app(scope, receive, send)
        detail = {"code": "unauthorized", "message": "missing or wrong bearer token"}
        await send_error(send, 401, detail, [(b"www-authenticate", b"Bearer")], scope["path"])


# A validation error's reply lists this many errors and counts the rest: a list of 10,000 bad items
# once answered a 13.5 MB 422 naming every one, and no reply echoes what was sent.
MAX_ERRORS_SHOWN = 5
MAX_ERROR_MESSAGE_CHARS = 200
# A location names keys the caller chose (an unknown field, a key of a dict field): a field name is
# cut too, or a 1 MB key would come back twice per error (in `field` and in `message`).
MAX_FIELD_CHARS = 128


def field_name(loc) -> str:
    """A pydantic error's location as the API names fields: "tasks.3.reward", or "body"; cut at
    MAX_FIELD_CHARS. A JSON decode error's location is the body (pydantic gives its offset)."""
    parts = [str(p) for p in loc if p != "body"]
    if len(loc) == 2 and loc[0] == "body" and isinstance(loc[1], int):
        parts = []  # ("body", offset): the body itself, not an item of a list
    name = ".".join(parts) or "body"
    return name if len(name) <= MAX_FIELD_CHARS else name[: MAX_FIELD_CHARS - 3] + "..."


def short_errors(errors: list[dict]) -> tuple[list[dict], int]:
    """(the first MAX_ERRORS_SHOWN of pydantic's errors as {field, message, type}, how many there
    were); messages cut at MAX_ERROR_MESSAGE_CHARS, field names at MAX_FIELD_CHARS, inputs never
    included."""
    shown = [
        {"field": field_name(e["loc"]), "message": str(e["msg"])[:MAX_ERROR_MESSAGE_CHARS], "type": e["type"]}
        for e in errors[:MAX_ERRORS_SHOWN]
    ]
    return shown, len(errors)


def invalid_detail(errors: list[dict], total: int | None = None) -> dict:
    """The 422 body's detail of every service: {"code": "invalid", "message": "<first field>:
    <its message>", "errors": [{field, message, ...}], "error_count"}; `errors` already short
    (short_errors), `total` how many there were (default: those given)."""
    first = errors[0] if errors else {"field": "body", "message": "invalid request"}
    return {
        "code": "invalid",
        "message": f"{first['field']}: {first['message']}",
        "errors": errors or [first],
        "error_count": len(errors) if total is None else total,
    }


def repeated_key(body: bytes) -> str | None:
    """The first key that some object of this JSON document has twice; None when there is none or
    the body is no JSON at all (the app's own parser answers that)."""
    try:
        loads_unique(body)
    except RepeatedKey as exc:
        return str(exc)
    # Malformed JSON, bad UTF-8, an integer past Python's 4300 digits, arrays nested past the
    # recursion limit ('[' * 100_000 fits any body limit): not this check's to answer; the app's
    # own parser refuses the same body (FastAPI: 422 or 400). RecursionError once escaped here: 500.
    except (ValueError, RecursionError):
        return None
    return None


class UniqueJsonKeys:
    """Refuse (400) a JSON body in which an object has the same key twice.

    Python's json module, and so FastAPI and pydantic, keep the last of repeated keys silently:
    `{"reward": 1, "reward": 0}` would be read as 0 by us and as 1 by a parser that keeps the
    first. Sits inside BodyLimit and BearerAuth, on the route's `receive`: the body is checked
    once the route has read all of it (an authorised body of bounded size), before the route
    parses it; a route that reads no body has nothing checked (nor read). The check parses the
    body once more than the app does (object_pairs_hook runs per object, linear in the body),
    off the event loop when the body is large.
    """

    METHODS = frozenset({"POST", "PUT", "PATCH"})
    # Bodies parsed on the loop at most (a millisecond or so); larger ones in a worker thread.
    ON_LOOP_BYTES = 64 * 1024

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in self.METHODS:
            return await self.app(scope, receive, send)
        ctype = header(scope, b"content-type", b"").split(b";")[0].strip().lower()
        # FastAPI parses a body as JSON when it says so, or when it gives no content type at all.
        if ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            return await self.app(scope, receive, send)
        guard = _Guard(send)
        chunks: list[bytes] = []

        async def checked():
            if guard.refused:
                return DISCONNECT
            message = await receive()
            if message["type"] != "http.request":
                return message
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return message
            body = b"".join(chunks)
            chunks.clear()
            key = (
                repeated_key(body)
                if len(body) <= self.ON_LOOP_BYTES
                else await asyncio.to_thread(repeated_key, body)
            )
            if key is None:
                return message
            detail = {
                "code": "duplicate_key",
                "message": f"JSON key {key[:64]!r} appears twice in one object",
            }
            await guard.refuse(400, detail, scope.get("path", ""))
            return DISCONNECT

        try:
            await self.app(scope, checked, guard.send)
        except Exception:
            if not guard.refused:
                raise
            log.debug(
                "%s: the app's end after its body was refused", scope.get("path", "")[:200], exc_info=True
            )
