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

Reading checks everything a launcher relies on, including that each task's (alpha0, beta0) is
the Jeffreys prior of its own counts: a hand-edited, inconsistent file is refused with a message
naming the file and the task, rather than silently changing a comparison's starting point.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .evidence import jeffreys_init
from .tracker_api import MAX_PRIOR, MIN_PRIOR

__all__ = ["FORMAT", "PriorFile", "PriorTask", "build_prior", "read_prior", "write_prior"]

FORMAT = "spopp-prior/1"
REQUIRED_KEYS = ("format", "prior_mass", "rollouts", "tasks")
TASK_KEYS = ("task_id", "successes", "rollouts", "alpha0", "beta0")
# The tracker's task id (spopp.tracker_api.Id): checked here so that a prior file never carries a
# task the tracker's PUT /tasks would refuse hours after the episodes were played.
TASK_ID = re.compile(r"^[A-Za-z0-9_.:@/+=-]{1,256}$")
_REL_TOL = 1e-9


@dataclass(frozen=True)
class PriorTask:
    task_id: str
    successes: int
    rollouts: int
    alpha0: float
    beta0: float


@dataclass(frozen=True)
class PriorFile:
    meta: dict  # every top-level key but `tasks` (format, prior_mass, rollouts, model, ...)
    tasks: list[PriorTask]

    @property
    def prior_mass(self) -> float:
        return float(self.meta["prior_mass"])

    def task_bodies(self) -> list[dict]:
        """The tasks as the tracker's `PUT /v1/runs/{run}/tasks` takes them (explicit priors);
        callers send them in chunks of at most `spopp.tracker_api.MAX_TASKS_PER_CALL`."""
        return [{"task_id": t.task_id, "alpha0": t.alpha0, "beta0": t.beta0} for t in self.tasks]

    def to_json(self) -> dict[str, Any]:
        """The file's object: `format` first, the rest of the meta, then the tasks."""
        meta = {k: v for k, v in self.meta.items() if k not in ("format", "tasks")}
        return {
            "format": FORMAT,
            **meta,
            "tasks": [
                {"task_id": t.task_id, "successes": t.successes, "rollouts": t.rollouts,
                 "alpha0": t.alpha0, "beta0": t.beta0}
                for t in self.tasks
            ],
        }  # fmt: skip


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
    tasks = []
    for task_id, rewards in outcomes.items():
        rewards = list(rewards)
        if not rewards:
            raise ValueError(f"build_prior: task {task_id!r} has no outcomes")
        bad = [r for r in rewards if isinstance(r, bool) or not _is_number(r) or not math.isfinite(r)]
        if bad:
            raise ValueError(
                f"build_prior: task {task_id!r} has non-finite or non-numeric rewards {bad[:3]!r}"
            )
        if not isinstance(task_id, str) or not TASK_ID.match(task_id):
            raise ValueError(
                f"build_prior: task id {task_id!r} is not one the tracker accepts ({TASK_ID.pattern})"
            )
        successes = sum(1 for r in rewards if r >= 1.0)
        alpha0, beta0 = jeffreys_init(successes, len(rewards), mass)
        tasks.append(PriorTask(task_id, successes, len(rewards), alpha0, beta0))
    counts = {t.rollouts for t in tasks}
    total = sum(t.rollouts for t in tasks)
    full = {
        "format": FORMAT,
        "prior_mass": mass,
        "rollouts": counts.pop() if len(counts) == 1 else None,
        **{k: v for k, v in meta.items() if k not in ("format", "prior_mass", "tasks")},
        "success_rate": sum(t.successes for t in tasks) / total,
    }
    prior = PriorFile(meta=full, tasks=tasks)
    _check(prior.to_json(), "build_prior")  # what is built can always be written and read back
    return prior


def write_prior(path: str | Path, prior: PriorFile, *, overwrite: bool = True) -> None:
    """Write `prior` to `path` atomically: a temp file beside it, fsync, then rename.

    The whole file is serialized (and checked as `read_prior` would) before anything touches the
    disk, so a bad value (NaN, an inconsistent task) leaves no file and no half-written one; an
    existing file is replaced only at the rename. With overwrite=False an existing `path` is kept
    and FileExistsError raised (the link that publishes the file fails atomically).
    """
    path = Path(path)
    data = prior.to_json()
    _check(data, str(path))
    try:
        text = _dumps(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prior file {path}: cannot be written as JSON: {exc}") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file 0600; the prior is shared data (a compose deployment writes it as
        # one user and its init step, another user, loads it), so it gets an ordinary file's mode.
        os.chmod(tmp, 0o644)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)  # fails if `path` exists, with no window between check and write
            except FileExistsError:
                raise FileExistsError(f"prior file {path} exists (not replaced)") from None
            os.unlink(tmp)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _dumps(data: dict[str, Any]) -> str:
    """The file's text: one top-level key a line, then one task a line (a diff shows which
    tasks changed; 17k tasks stay 17k lines). Raises ValueError for NaN or infinities."""

    def one(x: Any) -> str:
        return json.dumps(x, allow_nan=False, ensure_ascii=False)

    head = [f" {one(k)}: {one(v)}," for k, v in data.items() if k != "tasks"]
    rows = ",\n".join(f"  {one(t)}" for t in data["tasks"])
    return "{\n" + "\n".join(head) + '\n "tasks": [\n' + rows + "\n ]\n}\n"


def read_prior(path: str | Path) -> PriorFile:
    """The prior file at `path`, checked; ValueError naming the file and what is wrong, or
    FileNotFoundError naming it when it does not exist."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"prior file {path} does not exist (write it with `spopp prior`)") from None
    except IsADirectoryError:
        raise ValueError(f"prior file {path} is a directory") from None
    except UnicodeDecodeError:
        raise ValueError(f"prior file {path}: not UTF-8 text") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except ValueError as exc:
        raise ValueError(f"prior file {path}: not JSON: {exc}") from None
    return _check(data, f"prior file {path}")


# -- checks -------------------------------------------------------------------------------------


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _mass(x: Any, where: str) -> float:
    if not _is_number(x) or not math.isfinite(x) or not MIN_PRIOR <= x <= MAX_PRIOR:
        raise ValueError(
            f"{where}: prior_mass must be a finite number in [{MIN_PRIOR}, {MAX_PRIOR}], got {x!r}"
        )
    return float(x)


def _check(data: Any, where: str) -> PriorFile:
    """Validate a prior file's object; the PriorFile it describes, or ValueError(`where`: what)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(data).__name__}")
    if "format" not in data:
        raise ValueError(f'{where}: missing "format" (expected {FORMAT!r}); is this a prior file?')
    if data["format"] != FORMAT:
        raise ValueError(f"{where}: format {data['format']!r} is not {FORMAT!r}")
    missing = [k for k in REQUIRED_KEYS if k not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)}")
    mass = _mass(data["prior_mass"], where)
    rollouts = data["rollouts"]
    if rollouts is not None and not (_is_int(rollouts) and rollouts >= 1):
        raise ValueError(f"{where}: rollouts must be an integer >= 1 or null, got {rollouts!r}")
    rows = data["tasks"]
    if not isinstance(rows, list):
        raise ValueError(f"{where}: tasks must be a list, got {type(rows).__name__}")
    if not rows:
        raise ValueError(f"{where}: no tasks")
    seen: set[str] = set()
    tasks = []
    for i, row in enumerate(rows):
        tasks.append(_check_task(row, i, mass, rollouts, seen, where))
    meta = {k: v for k, v in data.items() if k != "tasks"}
    return PriorFile(meta=meta, tasks=tasks)


def _check_task(row: Any, i: int, mass: float, rollouts: int | None, seen: set[str], where: str) -> PriorTask:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: tasks[{i}] is not an object")
    missing = [k for k in TASK_KEYS if k not in row]
    task_id = row.get("task_id")
    name = f"tasks[{i}] ({task_id!r})" if isinstance(task_id, str) else f"tasks[{i}]"
    if missing:
        raise ValueError(f"{where}: {name} is missing key(s) {', '.join(missing)}")
    extra = sorted(set(row) - set(TASK_KEYS))
    if extra:
        raise ValueError(f"{where}: {name} has unknown key(s) {', '.join(extra)}")
    if not isinstance(task_id, str) or not TASK_ID.match(task_id):
        raise ValueError(f"{where}: {name}: task_id must be an id the tracker accepts ({TASK_ID.pattern})")
    if task_id in seen:
        raise ValueError(f"{where}: duplicate task_id {task_id!r} (tasks[{i}])")
    seen.add(task_id)
    s, n = row["successes"], row["rollouts"]
    if not (_is_int(s) and _is_int(n)) or n < 1 or s < 0:
        raise ValueError(
            f"{where}: {name}: successes and rollouts must be integers >= 0 and >= 1, got {s!r}, {n!r}"
        )
    if s > n:
        raise ValueError(f"{where}: {name}: successes {s} > rollouts {n}")
    if rollouts is not None and n != rollouts:
        raise ValueError(f"{where}: {name}: rollouts {n} differs from the file's rollouts {rollouts}")
    a, b = row["alpha0"], row["beta0"]
    for key, x in (("alpha0", a), ("beta0", b)):
        if not _is_number(x) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"{where}: {name}: {key} must be a finite number > 0, got {x!r}")
        if not MIN_PRIOR <= x <= MAX_PRIOR:
            raise ValueError(
                f"{where}: {name}: {key}={x!r} is outside the tracker's [{MIN_PRIOR}, {MAX_PRIOR}]"
            )
    ea, eb = jeffreys_init(s, n, mass)
    if not (
        math.isclose(a, ea, rel_tol=_REL_TOL, abs_tol=0.0)
        and math.isclose(b, eb, rel_tol=_REL_TOL, abs_tol=0.0)
    ):
        raise ValueError(
            f"{where}: {name}: alpha0, beta0 = {a!r}, {b!r} are not the Jeffreys prior of {s}/{n} "
            f"successes with prior_mass {mass!r} ({ea!r}, {eb!r}); was the file edited?"
        )
    return PriorTask(task_id, s, n, float(a), float(b))


def _fsync_dir(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
