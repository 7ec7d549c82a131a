"""Free TCP ports for the services and their tests: one picker, used everywhere.

An OS-chosen free port (`bind(0)`) lies in the ephemeral range, where any process's next outgoing
connection may take it before the child that was given it binds it; with several processes
starting at once that happens. So ports are drawn at random *below* the ephemeral range, where
only a listener can take one, and checked by binding. `SPOPP_PORT_RANGE=LO-HI` narrows the draw:
the test suite gives each pytest-xdist worker its own range, so that two workers never draw the
same port (tests/conftest.py).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Container
from pathlib import Path

PORT_RANGE_ENV = "SPOPP_PORT_RANGE"
_LOWEST = 10_000  # below this lie the well-known services' ports
_rng = random.SystemRandom()  # not the seeded `random`: forked workers must not draw alike


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listener could bind `port` on `host` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def port_range() -> tuple[int, int]:
    """Where `free_port` draws from: `SPOPP_PORT_RANGE` when set, else below the ephemeral range."""
    spec = os.environ.get(PORT_RANGE_ENV, "").strip()
    if spec:
        try:
            lo, hi = (int(x) for x in spec.split("-"))
        except ValueError:
            raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: expected LO-HI, e.g. 20000-24999") from None
        if not 1024 <= lo < hi <= 65535:
            raise ValueError(f"{PORT_RANGE_ENV}={spec!r}: need 1024 <= LO < HI <= 65535")
        return lo, hi
    return _LOWEST, ephemeral_range()[0] - 1


def free_port(host: str = "127.0.0.1", taken: Container[int] = ()) -> int:
    """A port on `host` that was free a moment ago and is not in `taken` (ports already handed
    to processes that have not bound them yet)."""
    lo, hi = port_range()
    if hi - lo >= 100:
        for _ in range(500):
            port = _rng.randint(lo, hi)
            if port not in taken and port_free(port, host):
                return port
        if PORT_RANGE_ENV in os.environ:
            raise RuntimeError(f"no free port in {PORT_RANGE_ENV}={lo}-{hi} after 500 draws")
    # A machine whose ephemeral range starts low: let the OS choose.
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port
