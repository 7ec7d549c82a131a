"""The run-wide field types, one definition each.

A run's recipe, seed, name, bearer token and staleness bound are taken by several entry points
(the tracker's API, `spopp init`, the launcher, the learner, the evaluator, every client). Each
declares its field with the alias here, so a bound cannot differ between two of them: a seed the
launcher accepts is one the tracker accepts, a token a client sends is one the tracker would take.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

# An id the tracker keys on (runs, tasks, studies, updates). Every id is also a path segment
# (/v1/runs/{run}/tasks/{task_id}): no "/", and not "." or ".." (a client or proxy resolves those as
# a path step, so an id "a/b" could be created but never read back).
MAX_ID_CHARS = 256
ID_CHARS = "A-Za-z0-9_.:@+=-"
ID_PATTERN = rf"^[{ID_CHARS}]+$"
# A worker's id names a replica in logs and metrics labels: shorter than a task's.
MAX_WORKER_ID_CHARS = 128


def _not_a_path_step(value: str) -> str:
    if value in (".", ".."):
        raise ValueError(f"{value!r} is a path step, not an id")
    return value


Id = Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN), AfterValidator(_not_a_path_step)
]
RunId = Id
WorkerId = Annotated[
    str,
    Field(min_length=1, max_length=MAX_WORKER_ID_CHARS, pattern=ID_PATTERN),
    AfterValidator(_not_a_path_step),
]

Recipe = Literal["spopp", "spo"]

# Below 2^63: the tracker's Lua keys and vLLM's and torch's generators all take a signed 64-bit seed.
Seed = Annotated[int, Field(ge=0, lt=2**63)]

# The tracker refuses a shorter token, so no client's token may be shorter either; the upper bound
# keeps a header inside every server's header limit.
MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096
ApiToken = Annotated[str, Field(min_length=MIN_TOKEN_CHARS, max_length=MAX_TOKEN_CHARS)]

# Policy versions a trajectory may lag the learner: a bound, not a target.
MAX_STALENESS = 64
MaxStaleness = Annotated[int, Field(ge=0, le=MAX_STALENESS)]
