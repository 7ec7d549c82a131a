"""Where a user's code failed: the exception and the line of the user's file that it came from.

An agent, a reward function, an environment class or a taskset that raises is the user's bug,
and `spopp env check` (runtime/envs/check.py) must point at it. The last frame of a traceback is
often not the user's: a reward function that calls `int("x")` fails inside the standard library,
an agent's bad request fails inside the openai client, a verifiers reward fails in verifiers'
own code. So the frame named is the innermost one outside spopp's own packages, the standard
library and installed packages (the user's folder), followed through the exception's cause and
context; where no such frame exists (the user's code returned normally and a library refused
what it returned), the innermost frame outside spopp. A leaf module: the check worker imports it.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from dataclasses import asdict, dataclass
from functools import cache
from types import TracebackType

# spopp's own packages: a frame here is the machinery that called the user's code.
_OWN = tuple(
    os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), p) + os.sep
    for p in ("runtime", "services", "spopp")
)
MAX_MESSAGE = 300


@cache
def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return tuple(os.path.abspath(r) + os.sep for r in roots)


def _frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(tb)) if tb is not None else []


def _chain(exc: BaseException) -> list[BaseException]:
    """The exception, then what caused it (raise ... from) or was being handled, innermost last."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def site(exc: BaseException) -> str:
    """`file:line` of the user's code that `exc` came from ("" when the traceback is empty)."""
    own, libraries = _OWN, _library_roots()
    fallback = ""
    for e in reversed(_chain(exc)):  # the root cause first: it is nearest to the user's mistake
        for frame in reversed(_frames(e.__traceback__)):
            path = os.path.abspath(frame.filename)
            if path.startswith(own):
                continue
            where = f"{frame.filename}:{frame.lineno}"
            if not path.startswith(libraries) and not frame.filename.startswith("<frozen"):
                return where
            fallback = fallback or where
    return fallback


@dataclass(frozen=True)
class Fault:
    """A user's code that raised (or never returned), as an episode's `info["fault"]` keeps it."""

    source: str  # whose code: "agent pkg.mod:solve", "reward function pkg.mod:score", ...
    type: str
    message: str
    where: str = ""  # file:line of the user's code ("" when unknown)

    @classmethod
    def of(cls, source: str, exc: BaseException) -> Fault:
        return cls(source, type(exc).__name__, str(exc)[:MAX_MESSAGE], site(exc))

    def as_info(self) -> dict:
        return asdict(self)

    @classmethod
    def from_info(cls, info: dict) -> Fault | None:
        raw = info.get("fault") if isinstance(info, dict) else None
        if not isinstance(raw, dict):
            return None
        return cls(**{k: str(raw.get(k, "")) for k in ("source", "type", "message", "where")})

    def __str__(self) -> str:
        at = f" at {self.where}" if self.where else ""
        return f"{self.source}: {self.type}: {self.message}{at}"
