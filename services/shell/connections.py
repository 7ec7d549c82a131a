"""uvicorn's HTTP/1.1 protocol with the bounds uvicorn lacks: a deadline for a request's headers
and for its body, and a cap on open connections that never lets the process run out of files.

uvicorn (0.54) closes an idle keep-alive connection after `timeout_keep_alive`, but a connection
that sends nothing, or half a request, or one byte a second, is held until the client goes: 300
of them under a 256-file limit once made every route of the tracker time out, and asyncio's accept
loop then logged 'Too many open files' thousands of times a second. Here:

- **headers**: a request's headers must be complete within `header_timeout` of the connection's
  opening (or of the previous response on a keep-alive connection); data arriving does not reset
  it, so a client that trickles bytes is closed as one that sends none.
- **body**: once the headers are in, the body must be complete within `body_timeout`; the app
  sees a disconnect if it is not.
- **connections**: at most `max_connections` open. A new connection beyond the cap closes the
  connection that has waited longest for its headers or its next request (it holds a file and no
  work, and its client can reconnect); when every connection is busy with a request, the newcomer
  is answered 503 with `Retry-After` and closed. The cap is kept below the process's file limit
  (`effective_cap`), so accepting a connection never fails for want of a descriptor.
- **header bounds**: a request's head (request line and headers) may take `max_header_bytes`
  bytes and `max_headers` headers; past either it is answered 431 and the connection closed. The
  bytes are counted as they are handed to the parser, before the head is complete, so nothing past
  the bound is buffered: httptools and uvicorn join a header's (or the URL's) pieces by repeated
  concatenation, whose cost grew with the square of the header (a 64 MB header cost the tracker
  4.9 CPU-s, 50 connections of 12 MB took it from 74 to 784 MB, 100,000 headers got 200). A
  chunked body's trailers are headers too, and bounded alike.
- **one value where one is read**: a request with `Content-Type`, `Content-Length`,
  `Authorization` or `Host` twice is answered 400 before any app runs. Each reader picked its own:
  the repeated-key check read the last Content-Type, FastAPI the first, so a body of
  `{"alpha0": 1, "alpha0": 2}` sent as JSON and as text passed the check and was stored.
- **access log**: off unless `access_log_per_minute` > 0; then at most that many request lines a
  minute, each path cut short (`logs.AccessLog`).
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .logs import AccessLog
from .middleware import error_body
from .overload import overloaded_bytes

log = logging.getLogger("spopp.http")

# asyncio accepts up to the listen backlog's count of connections in one go before any of them
# reaches `connection_made` (where the cap is enforced), so the backlog is also the burst by which
# open sockets can pass the cap.
ACCEPT_BURST = 64
# Descriptors the process keeps for everything but its HTTP clients: stdio, logs, its Redis pool
# (the tracker's is capped at 64, `services/tracker/app.py`), children's pipes, the listening
# socket, imported libraries' files; plus one accept burst.
FD_RESERVE = 128 + ACCEPT_BURST
MIN_CONNECTIONS = 8
# Seconds a refused request's connection is read (and what comes dropped) before it is closed.
LINGER = 1.0


@dataclass(frozen=True)
class ServerLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_connections: int = 1000
    # On SIGTERM: requests in flight get this long; the process is gone SHUTDOWN_GRACE s after it.
    shutdown_timeout: float = 10.0
    # A request's head: its headers at most, and its bytes at most (request line, headers and
    # their line ends). Node's and http.client's numbers: 100 headers; 16 KiB is Node's default
    # head size, four times what any spopp client sends (a token, a JSON content type, a host).
    max_headers: int = 100
    max_header_bytes: int = 16 * 1024
    # Request lines logged a minute at most; 0: none (uvicorn's access log off).
    access_log_per_minute: int = 0


def effective_cap(max_connections: int, soft_file_limit: int | None = None) -> int:
    """`max_connections`, lowered so that the connections and FD_RESERVE fit under the file limit
    (RLIMIT_NOFILE's soft value; `ulimit -n`)."""
    if soft_file_limit is None:
        soft_file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_file_limit == resource.RLIM_INFINITY:
        return max_connections
    room = max(soft_file_limit - FD_RESERVE, MIN_CONNECTIONS)
    return max(1, min(max_connections, room))


# Headers of which a request may carry one: two would let two readers see two values (the
# middleware and the route, the auth check and a proxy). RFC 9110 allows none of these twice (a
# list-valued header may repeat; these are not lists), and RFC 9112 asks a 400 for two Hosts.
SINGLE_HEADERS = frozenset({b"content-type", b"content-length", b"authorization", b"host"})


class _Refusal(Exception):
    """Raised from a parser callback to stop parsing: the request is answered `status` and the
    connection closed (httptools hands it back as the __context__ of its callback error)."""

    def __init__(self, status: int, detail: dict) -> None:
        super().__init__(detail["code"])
        self.status, self.detail = status, detail


def _refusal_reply(status: int, detail: dict, path: str = "") -> bytes:
    """The whole reply to a refused request; in OpenAI's error shape on the routes that speak its
    API (middleware.OPENAI_PATHS: a replica's chat routes, whose clients read no other)."""
    body = json.dumps(error_body(path, status, detail)).encode()
    phrase = {400: b"Bad Request", 431: b"Request Header Fields Too Large"}[status]
    head = (
        b"HTTP/1.1 " + str(status).encode() + b" " + phrase + b"\r\ncontent-type: application/json\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


def _too_large(limits: ServerLimits, what: str) -> _Refusal:
    message = (
        f"{what}: a request may carry {limits.max_headers} headers and {limits.max_header_bytes} bytes of "
        "request line and headers"
    )
    detail = {
        "code": "headers_too_large",
        "message": message,
        "max_headers": limits.max_headers,
        "max_header_bytes": limits.max_header_bytes,
    }
    return _Refusal(431, detail)


def _repeated(name: str) -> _Refusal:
    message = f"header {name!r} appears more than once; send it once"
    return _Refusal(400, {"code": "duplicate_header", "message": message, "header": name})


def _invalid(exc: httptools.HttpParserError) -> _Refusal:
    # llhttp's reasons are fixed texts of its own ("Invalid header value char"), never the input.
    reason = str(exc)[:100]
    if reason == "Duplicate Content-Length":  # llhttp stops before handing over the second one
        return _repeated("content-length")
    return _Refusal(400, {"code": "invalid_http", "message": f"not a valid HTTP/1.1 request: {reason}"})


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the deadlines, the cap and the header bounds above; `limits`, `cap`
    and `access` are set on a subclass per server by `protocol_class`."""

    limits: ServerLimits = ServerLimits()
    cap: int = ServerLimits.max_connections
    access: AccessLog | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since: float | None = None  # waiting for a request's headers since (monotonic)
        self._deadline = None  # the armed header or body timer
        # The head being read: bytes fed to the parser since the last request ended (or the
        # connection opened), headers handed over, and which of SINGLE_HEADERS were seen.
        self._in_head = True
        self._head_bytes = 0
        self._header_count = 0
        self._singles: set[bytes] = set()
        self._refused = False
        # uvicorn logs a request line whenever its logger has a handler, and the root one has: the
        # line goes through this server's AccessLog when it has one, and nowhere otherwise.
        self.access_log = self.access is not None
        if self.access is not None:
            self.access_logger = self.access

    # -- connection ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.cap and not self._evict_one():
            # Every connection has a request in flight: this one gets a clear answer, not a hang.
            transport.write(overloaded_bytes(self.cap))
            transport.close()
            log.warning("connection refused with 503: %d connections, all busy", len(self.connections))
            return
        super().connection_made(transport)
        self._await_headers()

    def connection_lost(self, exc) -> None:
        self._disarm()
        if self.transport is None:  # refused in connection_made: uvicorn never saw it
            return
        super().connection_lost(exc)

    def _evict_one(self) -> bool:
        """Close the connection that has waited longest for a request; False when none waits."""
        waiting = [c for c in self.connections if getattr(c, "_waiting_since", None) is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._waiting_since)
        oldest._close("evicted at the connection cap")
        return True

    def _close(self, why: str) -> None:
        self._disarm()
        self._waiting_since = None
        # Counted out now, not when the loop gets round to connection_lost: the connection that
        # evicted this one must find the room it made.
        self.connections.discard(self)
        if not self.transport.is_closing():
            log.debug("closing connection from %s: %s", self.client, why)
            self.transport.close()

    # -- header bounds ------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        """Feed the parser, counting what goes in while a request's head is read: once the head
        has taken `max_header_bytes` without ending, the request is answered 431 and nothing more
        of it is parsed or kept. A head that ends inside a read is exact; a pipelined request's
        head that begins inside the read that ended the request before it is counted from the
        next read on (so at most one read, 256 KiB, more; no client of ours pipelines)."""
        if self._refused:
            return  # answered and closing: the rest of the connection is dropped unread
        if not self._in_head:
            self._feed(data)
            return
        room = self.limits.max_header_bytes - self._head_bytes
        head, rest = (data, b"") if len(data) <= room else (memoryview(data)[:room], memoryview(data)[room:])
        self._head_bytes += len(head)
        self._feed(head)
        if self._refused or self.transport.is_closing():
            return
        if self._in_head and self._head_bytes >= self.limits.max_header_bytes:
            # The bound is reached and the head has not ended: one more byte at least would pass it.
            self._refuse(_too_large(self.limits, "request headers (or trailers) too large"))
        elif rest:
            self._feed(rest)

    def _feed(self, data) -> None:
        """uvicorn's data_received (0.54), with the refusals answered as the API's JSON errors."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            self._refuse(cause if isinstance(cause, _Refusal) else _invalid(exc))

    def _refuse(self, refusal: _Refusal) -> None:
        self._refused = True
        log.warning("request refused with %d: %s", refusal.status, refusal.detail["code"])
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if cycle.response_started or not cycle.more_body:
                # A reply is under way, or this is a pipelined request behind one still answered:
                # no refusal is written into it; the connection ends, which cuts that reply short
                # (a client that pipelines a bad request loses the reply before it; none of ours
                # pipelines).
                self._close(f"refused with {refusal.status} behind a request in flight")
                return
            # The refused request is in the app, its body not over (trailers, a bad chunk): the app
            # is told the client left (its reply goes nowhere) and the client gets the refusal.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.write(_refusal_reply(refusal.status, refusal.detail, self._path()))
        # A lingering close: the reply, then our end shut (the client reads the reply and EOF),
        # while what the client is still sending is read and dropped for up to LINGER seconds.
        # Closed at once, with its bytes unread, the socket would answer them with a reset, and
        # a client still sending (a 64 MB header) would see that instead of the reply.
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._arm(LINGER, "refused request, lingering close over")
        self._waiting_since = 0.0  # the first to go when the connection cap needs room

    def _path(self) -> str:
        """The path of the request being read, as far as its URL has come (uvicorn gathers it in
        `self.url` before the headers); "" when there is none yet."""
        url = getattr(self, "url", b"") or b""
        return bytes(url).split(b"?", 1)[0].decode("latin-1")

    def on_message_begin(self) -> None:
        self._header_count = 0
        self._singles = set()
        super().on_message_begin()

    def on_chunk_header(self) -> None:
        # A chunked body's chunk begins. The last one (size 0) is followed by trailers, headers that
        # httptools joins as it does the head's: counted as a head until data comes (on_body).
        self._in_head, self._head_bytes = True, 0

    def on_body(self, body: bytes) -> None:
        self._in_head = False
        super().on_body(body)

    def on_header(self, name: bytes, value: bytes) -> None:
        # Called once per header (or trailer), with its whole name and value (within
        # max_header_bytes); trailers count with the request's headers.
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            raise _too_large(self.limits, "too many request headers")
        lower = name.lower()
        if lower in SINGLE_HEADERS:
            if lower in self._singles:
                raise _repeated(lower.decode("latin-1"))
            self._singles.add(lower)
        super().on_header(name, value)

    # -- deadlines ----------------------------------------------------------------------------
    def _arm(self, seconds: float, why: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._close, why)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _await_headers(self) -> None:
        self._waiting_since = time.monotonic()
        self._arm(
            self.limits.header_timeout, f"no complete request headers within {self.limits.header_timeout:g} s"
        )

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._waiting_since = None
        self._arm(
            self.limits.body_timeout, f"request body not complete within {self.limits.body_timeout:g} s"
        )
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head, self._head_bytes = True, 0  # what follows is the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Keep-alive: the next request's headers are due as the first one's were (uvicorn's own
        # idle timer closes a connection that sends nothing sooner, and is cancelled by any byte).
        if not self.transport.is_closing() and not self.pipeline:
            self._await_headers()


def protocol_class(limits: ServerLimits) -> type[BoundedHttpProtocol]:
    """A protocol class for one server: its limits, its cap under this process's file limit, its
    access log (None: off)."""
    access = AccessLog(limits.access_log_per_minute) if limits.access_log_per_minute > 0 else None
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {"limits": limits, "cap": effective_cap(limits.max_connections), "access": access},
    )
