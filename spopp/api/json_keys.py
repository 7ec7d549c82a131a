"""JSON parsed with every key of an object once: a body with a key twice is refused, not read.

Python's parser keeps the last of two equal keys silently, and other parsers keep the first, so
`{"messages": A, "messages": B}` means B to one reader and A to another. The services' bodies
(services/shell/middleware.py) and the agent endpoint's (runtime/chat_endpoint.py) both parse
with `loads_unique`.
"""

from __future__ import annotations

import json


class RepeatedKey(ValueError):
    """An object of the document has the key `str(self)` twice."""


def _unique(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        raise RepeatedKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return out


def loads_unique(raw: bytes | str) -> object:
    """`json.loads(raw)`, RepeatedKey when an object has a key twice (json's own errors as json raises them)."""
    return json.loads(raw, object_pairs_hook=_unique)
