"""ASGI middleware shared by the services: body-size limits (413), bearer-token auth (401), JSON
objects with a repeated key refused (400); and the short form of a validation error's reply.

Serving an app (uvicorn beside a service's loop, or in a thread) is services/shell/server.py's."""

from __future__ import annotations

import json
import secrets


def header(scope, name: bytes, default: bytes | None = None) -> bytes | None:
    """A request header's first value, as Starlette (and so FastAPI's routes) reads it. The server
    refuses a request that carries Content-Type, Content-Length, Authorization or Host twice
    (connections.SINGLE_HEADERS, 400); this keeps the middleware and the routes on one value
    where an app is called without that server (TestClient)."""
    return next((value for key, value in scope["headers"] if key == name), default)


async def send_error(send, status: int, detail: dict, headers: list | None = None) -> None:
    """Answer from inside a middleware with the API's error body {"detail": {...}}."""
    body = json.dumps({"detail": detail}).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def read_body(receive, max_bytes: int | None = None):
    """(the request's body, a `receive` that replays what was read and then goes on); the body is
    None once it passes `max_bytes`. For middlewares that must see a body before the app does."""
    messages, chunks, seen = [], [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        chunks.append(chunk)
        seen += len(chunk)
        if max_bytes is not None and seen > max_bytes:
            return None, None
        if not message.get("more_body", False):
            break

    async def replay():
        return messages.pop(0) if messages else await receive()

    return b"".join(chunks), replay


class BodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = header(scope, b"content-length")
        if declared is not None:
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # A chunked body has no length up front: read it (up to the limit) before the app does,
        # then replay it, so that an oversized one is refused before anything is parsed.
        body, replay = await read_body(receive, self.max_bytes)
        if body is None:
            return await self._refuse(send)
        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        message = f"request body exceeds {self.max_bytes} bytes"
        await send_error(
            send, 413, {"code": "body_too_large", "message": message, "max_bytes": self.max_bytes}
        )


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
        await send_error(send, 401, detail, [(b"www-authenticate", b"Bearer")])


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


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _RepeatedKey(key)
    return out


def repeated_key(body: bytes) -> str | None:
    """The first key that some object of this JSON document has twice; None when there is none or
    the body is no JSON at all (the app's own parser answers that)."""
    try:
        json.loads(body, object_pairs_hook=_unique_keys)
    except _RepeatedKey as exc:
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
    first. Sits inside BodyLimit and BearerAuth: only an authorised body of bounded size is read
    here, once more than the app reads it (object_pairs_hook runs per object, linear in the body).
    """

    METHODS = frozenset({"POST", "PUT", "PATCH"})

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in self.METHODS:
            return await self.app(scope, receive, send)
        ctype = header(scope, b"content-type", b"").split(b";")[0].strip().lower()
        # FastAPI parses a body as JSON when it says so, or when it gives no content type at all.
        if ctype and not (ctype == b"application/json" or ctype.endswith(b"+json")):
            return await self.app(scope, receive, send)
        body, replay = await read_body(receive)  # bounded by BodyLimit, outside this one
        key = repeated_key(body)
        if key is not None:
            message = f"JSON key {key[:64]!r} appears twice in one object"
            return await send_error(send, 400, {"code": "duplicate_key", "message": message})
        await self.app(scope, replay, send)
