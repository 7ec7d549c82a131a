"""The one "not now" answer of every service: 503 with a `Retry-After` header.

A client (spopp.machine.retry) reads a 503 as "retry as it is", and waits what the header says. The tracker's
API errors, the probes' 503s and the connection cap's raw reply all give the same header from here,
so a client never sees two waits for one condition.
"""

from __future__ import annotations

import json

RETRY_AFTER_SECONDS = 1
RETRY_HEADERS = {"Retry-After": str(RETRY_AFTER_SECONDS)}


def overloaded_bytes(cap: int) -> bytes:
    """The whole HTTP response written to a connection over the cap, before any request is read
    (no framework is involved yet, so it is raw bytes; it closes the connection)."""
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
        b"retry-after: " + str(RETRY_AFTER_SECONDS).encode() + b"\r\n"
        b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    return head + body
