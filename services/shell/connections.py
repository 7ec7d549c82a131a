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
"""

from __future__ import annotations

import json
import logging
import resource
import time
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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


@dataclass(frozen=True)
class ServerLimits:
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    idle_timeout: float = 5.0
    max_connections: int = 1000
    # On SIGTERM: requests in flight get this long; the process is gone SHUTDOWN_GRACE s after it.
    shutdown_timeout: float = 10.0


def effective_cap(max_connections: int, soft_file_limit: int | None = None) -> int:
    """`max_connections`, lowered so that the connections and FD_RESERVE fit under the file limit
    (RLIMIT_NOFILE's soft value; `ulimit -n`)."""
    if soft_file_limit is None:
        soft_file_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft_file_limit == resource.RLIM_INFINITY:
        return max_connections
    room = max(soft_file_limit - FD_RESERVE, MIN_CONNECTIONS)
    return max(1, min(max_connections, room))


def _overloaded_reply(cap: int) -> bytes:
    body = json.dumps(
        {
            "detail": {
                "code": "overloaded",
                "message": f"every one of this server's {cap} connections is busy with a request; retry",
                "max_connections": cap,
            }
        }
    ).encode()
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the deadlines and the cap above; `limits` and `cap` are set on a
    subclass per server by `protocol_class`."""

    limits: ServerLimits = ServerLimits()
    cap: int = ServerLimits.max_connections

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._waiting_since: float | None = None  # waiting for a request's headers since (monotonic)
        self._deadline = None  # the armed header or body timer

    # -- connection ---------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        if len(self.connections) >= self.cap and not self._evict_one():
            # Every connection has a request in flight: this one gets a clear answer, not a hang.
            transport.write(_overloaded_reply(self.cap))
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
        self._waiting_since = None
        self._arm(
            self.limits.body_timeout, f"request body not complete within {self.limits.body_timeout:g} s"
        )
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Keep-alive: the next request's headers are due as the first one's were (uvicorn's own
        # idle timer closes a connection that sends nothing sooner, and is cancelled by any byte).
        if not self.transport.is_closing() and not self.pipeline:
            self._await_headers()


def protocol_class(limits: ServerLimits) -> type[BoundedHttpProtocol]:
    """A protocol class for one server: its limits, its cap under this process's file limit."""
    return type(
        "BoundedHttpProtocol",
        (BoundedHttpProtocol,),
        {"limits": limits, "cap": effective_cap(limits.max_connections)},
    )
