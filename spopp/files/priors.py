"""The prior file: offline prompt values of the training tasks, shared by every run of a comparison.

SPO++'s protocol initializes each training prompt's value from the cold-start (base) policy before
training: `rollouts` sampled episodes per task, then a Jeffreys prior of total mass `prior_mass`,
(alpha0, beta0) = (m(s+1/2)/(n+1), m(n-s+1/2)/(n+1)) for s successes in n episodes
(`spopp.evidence.jeffreys_init`). `spopp prior` plays the episodes and writes the file once;
`spopp launch` (and a compose init step) read it and load the tasks into the tracker, so the runs
being compared start from the very same values. This module is the one reader and writer of that
file; it imports no torch.

Format (one JSON object, `format: "spopp-prior/1"`):

    {"format": "spopp-prior/1", "prior_mass": 8.0, "rollouts": 8, "model": "/abs/model",
     "tasks_file": "/abs/train.jsonl", "env": "toy-calc", "temperature": 1.0, "seed": 0,
     "created": 1.7e9, "seconds": 12.3, "success_rate": 0.41,
     "tasks": [{"task_id": "...", "successes": 3, "rollouts": 8, "alpha0": 3.11, "beta0": 4.88}]}

`rollouts` at the top is the episodes per task when every task has the same count (what
`spopp prior` writes), else null. A success is an episode with reward >= 1: rewards are binary in
our environments, and a partial reward (0 < r < 1) counts as a failure, so that (alpha0, beta0) is
a Jeffreys prior of 0/1 outcomes exactly as the tracker computes it from `outcomes`.

The file is read and written through the pydantic models below (`PriorFile`, `PriorTask`).
Reading checks everything a launcher relies on, including that each task's (alpha0, beta0) is
the Jeffreys prior of its own counts: a hand-edited, inconsistent file is refused with a message
naming the file, the field and the task (`prior file <path>: tasks[3].alpha0: ...`), rather than
silently changing a comparison's starting point. Numbers are strict: "4.8" or true is no number.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from spopp.api.tracker_api import MAX_PRIOR, MIN_PRIOR, TASK_ID, Prior
from spopp.evidence import jeffreys_init
from spopp.files.jsonfile import read_json, to_text, validate, write_text
from spopp.settings.fields import Id

__all__ = ["FORMAT", "PriorFile", "PriorTask", "build_prior", "read_prior", "write_prior"]

FORMAT = "spopp-prior/1"
_REL_TOL = 1e-9
# strict: JSON's 3.0 is no count and "4.8" no number (lax pydantic would take both).
_STRICT = ConfigDict(strict=True, frozen=True)


class PriorTask(BaseModel):
    """One task's row: its base-policy counts and the Jeffreys prior of them."""

    model_config = ConfigDict(**_STRICT, extra="forbid")

    task_id: Id = Field(description="the tracker's task id")
    successes: StrictInt = Field(ge=0, description="episodes with reward >= 1")
    rollouts: StrictInt = Field(ge=1, description="episodes played")
    alpha0: Prior
    beta0: Prior

    @model_validator(mode="after")
    def _counts(self) -> PriorTask:
        if self.successes > self.rollouts:
            raise ValueError(f"successes {self.successes} > rollouts {self.rollouts}")
        return self


class PriorFile(BaseModel):
    """The whole file. Keys besides the four below (model, tasks_file, env, temperature, seed,
    created, seconds, success_rate, ...) are kept as they are, in `meta` and on disk."""

    model_config = ConfigDict(**_STRICT, extra="allow")

    format: Literal["spopp-prior/1"] = Field(description="the file's format and version")
    prior_mass: Prior = Field(description="total Beta mass alpha0 + beta0 of each task")
    rollouts: Annotated[int, Field(ge=1)] | None = Field(
        description="episodes per task when every task has the same count, else null"
    )
    tasks: list[PriorTask] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> PriorFile:
        seen: set[str] = set()
        for i, t in enumerate(self.tasks):
            name = f"tasks[{i}] ({t.task_id!r})"
            if t.task_id in seen:
                raise ValueError(f"duplicate task_id {t.task_id!r} ({name})")
            seen.add(t.task_id)
            if self.rollouts is not None and t.rollouts != self.rollouts:
                raise ValueError(
                    f"{name}: rollouts {t.rollouts} differs from the file's rollouts {self.rollouts}"
                )
            ea, eb = jeffreys_init(t.successes, t.rollouts, self.prior_mass)
            if not (_close(t.alpha0, ea) and _close(t.beta0, eb)):
                raise ValueError(
                    f"{name}: alpha0, beta0 = {t.alpha0!r}, {t.beta0!r} are not the Jeffreys prior of "
                    f"{t.successes}/{t.rollouts} successes with prior_mass {self.prior_mass!r} "
                    f"({ea!r}, {eb!r}); was the file edited?"
                )
        return self

    @property
    def meta(self) -> dict[str, Any]:
        """Every top-level key but `tasks` (format, prior_mass, rollouts, model, ...), in file order."""
        return {"format": self.format, "prior_mass": self.prior_mass, "rollouts": self.rollouts,
                **(self.model_extra or {})}  # fmt: skip

    def task_bodies(self) -> list[dict]:
        """The tasks as the tracker's `PUT /v1/runs/{run}/tasks` takes them (explicit priors);
        callers send them in chunks of at most `spopp.api.tracker_api.MAX_TASKS_PER_CALL`."""
        return [{"task_id": t.task_id, "alpha0": t.alpha0, "beta0": t.beta0} for t in self.tasks]

    def to_json(self) -> dict[str, Any]:
        """The file's object: `format` first, the rest of the meta, then the tasks."""
        return {**self.meta, "tasks": [t.model_dump() for t in self.tasks]}


def _close(x: float, expected: float) -> bool:
    return math.isclose(x, expected, rel_tol=_REL_TOL, abs_tol=0.0)


def build_prior(outcomes: dict[str, list[float]], prior_mass: float, meta: dict) -> PriorFile:
    """The prior of tasks given their base-policy rewards ({task_id: [reward, ...]}, in task order).

    Successes are rewards >= 1 (a partial reward is a failure); each task's (alpha0, beta0) is
    `jeffreys_init(successes, len(rewards), prior_mass)`. `meta` is kept as given, with `format`,
    `prior_mass`, `success_rate` (successes over all episodes) and, unless given, `rollouts` (the
    episodes per task when all tasks have the same count, else None) set here. Raises ValueError
    naming the task for an empty reward list, a non-finite reward or an id the tracker refuses.
    """
    mass = _mass(prior_mass, "build_prior")
    if not outcomes:
        raise ValueError("build_prior: no tasks")
    tasks = [_task(task_id, list(rewards), mass) for task_id, rewards in outcomes.items()]
    counts = {t["rollouts"] for t in tasks}
    total = sum(t["rollouts"] for t in tasks)
    full = {
        "format": FORMAT,
        "prior_mass": mass,
        "rollouts": counts.pop() if len(counts) == 1 else None,
        **{k: v for k, v in meta.items() if k not in ("format", "prior_mass", "tasks")},
        "success_rate": sum(t["successes"] for t in tasks) / total,
        "tasks": tasks,
    }
    return validate(PriorFile, full, "build_prior")  # what is built can always be written and read back


def _task(task_id: Any, rewards: list, mass: float) -> dict[str, Any]:
    """One task's row from its rewards; ValueError naming the task for what gives no prior."""
    if not rewards:
        raise ValueError(f"build_prior: task {task_id!r} has no outcomes")
    bad = [r for r in rewards if isinstance(r, bool) or not _is_number(r) or not math.isfinite(r)]
    if bad:
        raise ValueError(f"build_prior: task {task_id!r} has non-finite or non-numeric rewards {bad[:3]!r}")
    if not isinstance(task_id, str) or not TASK_ID.match(task_id):
        raise ValueError(
            f"build_prior: task id {task_id!r} is not one the tracker accepts ({TASK_ID.pattern})"
        )
    successes = sum(1 for r in rewards if r >= 1.0)
    alpha0, beta0 = jeffreys_init(successes, len(rewards), mass)
    return {
        "task_id": task_id,
        "successes": successes,
        "rollouts": len(rewards),
        "alpha0": alpha0,
        "beta0": beta0,
    }


def write_prior(path: str | Path, prior: PriorFile, *, overwrite: bool = True) -> None:
    """Write `prior` to `path` atomically: a temp file beside it, fsync, then rename.

    The whole file is serialized (and checked as `read_prior` would) before anything touches the
    disk, so a bad value (NaN, an inconsistent task) leaves no file and no half-written one; an
    existing file is replaced only at the rename. With overwrite=False an existing `path` is kept
    and FileExistsError raised (the link that publishes the file fails atomically).
    """
    path = Path(path)
    where = f"prior file {path}"
    data = prior.to_json()
    validate(PriorFile, data, where)  # a model built with model_copy or construct skipped the checks
    text = _dumps(data, where)
    try:
        write_text(path, text, overwrite=overwrite)
    except FileExistsError:
        raise FileExistsError(f"prior file {path} exists (not replaced)") from None


def _dumps(data: dict[str, Any], where: str) -> str:
    """The file's text: one top-level key a line, then one task a line (a diff shows which
    tasks changed; 17k tasks stay 17k lines). Raises ValueError for NaN or infinities."""

    def one(x: Any) -> str:
        return to_text(x, where, indent=None).rstrip("\n")

    head = [f" {one(k)}: {one(v)}," for k, v in data.items() if k != "tasks"]
    rows = ",\n".join(f"  {one(t)}" for t in data["tasks"])
    return "{\n" + "\n".join(head) + '\n "tasks": [\n' + rows + "\n ]\n}\n"


def read_prior(path: str | Path) -> PriorFile:
    """The prior file at `path`, checked; ValueError (FileFormatError) naming the file, the field
    and what is wrong, or FileNotFoundError naming it when it does not exist."""
    path = Path(path)
    where = f"prior file {path}"
    try:
        data = read_json(path, where)
    except FileNotFoundError:
        raise FileNotFoundError(f"prior file {path} does not exist (write it with `spopp prior`)") from None
    return validate(PriorFile, data, where)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _mass(x: Any, where: str) -> float:
    if not _is_number(x) or not math.isfinite(x) or not MIN_PRIOR <= x <= MAX_PRIOR:
        raise ValueError(
            f"{where}: prior_mass must be a finite number in [{MIN_PRIOR}, {MAX_PRIOR}], got {x!r}"
        )
    return float(x)
