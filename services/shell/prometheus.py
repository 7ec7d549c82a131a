"""The one way a spopp service renders its Prometheus metrics as text for /metrics.

Every service keeps its own registries (never prometheus_client's global one, so that two
services or a test's apps in one process never share counts); a scrape renders one or several
of them in the format, and with the content type, of the installed prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

CONTENT_TYPE = CONTENT_TYPE_LATEST


def render(registries: CollectorRegistry | Iterable[CollectorRegistry]) -> bytes:
    """The text of every metric of `registries`, in order."""
    if isinstance(registries, CollectorRegistry):
        registries = (registries,)
    return b"".join(generate_latest(r) for r in registries)
