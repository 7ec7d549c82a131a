"""Reading run folders: `run.json` (arm, seed, status) and the evaluator's `eval/evals.jsonl`,
through their models (`spopp.files.records`). `spopp report` and the studies (services/study) both read
runs this way, and may not import each other, so the reader lives in the library.

A run's curve is its scored evaluation lines in policy-version order, at the chosen metric; the
skipped lines (pruned or unreadable snapshots) are left out and named in a warning. Anything that
would make the tables wrong rather than incomplete (a malformed line, a missing metric, versions
out of order) is an error naming the file and line, so that nobody reads a table built on it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spopp.files.jsonfile import FileFormatError, read_model, validate
from spopp.files.records import EvalRecord, RunRecord

RUN_FILE = "run.json"
EVALS_FILE = Path("eval") / "evals.jsonl"
LEARNER_FILE = Path("learner") / "metrics.jsonl"
# The parts of an update record that together are the learner's time for it.
_UPDATE_PARTS = ("batch_wait_s", "update_seconds", "publish_s", "checkpoint_s")


class RunError(ValueError):
    """A run folder that cannot be read; the message is one line naming the file (and line)."""


@dataclass
class Run:
    dir: Path
    arm: str
    seed: int
    name: str
    status: str | None
    versions: list[int] = field(default_factory=list)
    steps: list[int | None] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    # Seconds from the learner's start to the publication of each scored version (None where the
    # learner's log does not say); `--x time` draws against them.
    seconds: list[float | None] = field(default_factory=list)
    # The code that made the run (run.json's, spopp/files/provenance.py); None: launched before runs recorded it.
    code: dict[str, Any] | None = None

    @property
    def label(self) -> str:
        return f"{self.name} ({self.dir})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "arm": self.arm,
            "seed": self.seed,
            "run": self.name,
            "status": self.status,
            "versions": self.versions,
            "steps": self.steps,
            "rewards": self.rewards,
            "skipped_versions": self.skipped,
            "seconds": self.seconds,
            "code": self.code,
        }


def expand(paths: list[Path]) -> list[Path]:
    """The run folders named by `paths`: each a run folder, or a parent of run folders (one level down).

    A parent lets `spopp report runs/` take every run launched under `runs/`. The same folder named
    twice (directly and through its parent) counts once.
    """
    found: list[Path] = []
    for path in paths:
        if not path.exists():
            raise RunError(f"{path}: no such folder")
        if not path.is_dir():
            raise RunError(f"{path}: not a folder (give a run folder or a folder of run folders)")
        if (path / RUN_FILE).exists():
            found.append(path)
            continue
        children = sorted(p for p in path.iterdir() if p.is_dir() and (p / RUN_FILE).exists())
        if not children:
            raise RunError(f"{path}: no {RUN_FILE} in it nor in any of its subfolders")
        found.extend(children)
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())


def _one_line(message: str) -> str:
    # The report's errors are one line each (a model's several problems are joined).
    return message.replace("\n", "; ")


def _read_run_json(path: Path) -> RunRecord:
    try:
        return read_model(path, RunRecord)
    except OSError as exc:
        raise RunError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except FileFormatError as exc:
        raise RunError(_one_line(str(exc))) from None


def read_run(folder: Path, metric: str, warnings: list[str]) -> Run:
    """One run folder, its curve at `metric`; warnings (skipped versions, a cut last line) are appended."""
    meta = _read_run_json(folder / RUN_FILE)
    run = Run(dir=folder, arm=meta.arm, seed=meta.seed, name=meta.run or folder.name, status=meta.status,
              code=meta.code)  # fmt: skip
    if meta.restarts:
        # Supervision kept the run going; the curve is whole, but a reader should know what it rode out.
        listed = ", ".join(f"{k} {v}" for k, v in sorted(meta.restarts.items()))
        warnings.append(f"run {run.label}: processes restarted by supervision during the run: {listed}")
    path = folder / EVALS_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RunError(f"{path}: no such file (has the run's evaluator scored anything yet?)") from None
    except OSError as exc:
        raise RunError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunError(f"{path}: not UTF-8 text ({exc})") from None
    lines = text.split("\n")
    last = len(lines) - 1  # the text after the final newline: empty unless a write is under way
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError as exc:
            if n - 1 == last:
                # The evaluator appends a line and then its newline; a run being scored right now
                # can show half a line. The evaluator cuts it on restart, so the report skips it.
                warnings.append(f"{path}:{n}: skipped a partial last line (a write under way?)")
                continue
            raise RunError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        _add_line(run, path, n, line, metric)
    if run.skipped:
        listed = ", ".join(str(v) for v in run.skipped)
        warnings.append(f"run {run.label}: skipped versions left out of its curve: {listed}")
    if not run.rewards:
        raise RunError(f"{path}: no scored evaluation points (run {run.name})")
    published = publication_seconds(folder / LEARNER_FILE)
    run.seconds = [published.get(v) for v in run.versions]
    return run


def publication_seconds(path: Path) -> dict[int, float]:
    """{policy version: seconds from the learner's start to its publication}, from the learner's
    metrics.jsonl (version 0 at 0); {} without the file. The start is the first record's time less
    what that update took (its wait for a batch included); a line that does not parse is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    records = []
    for line in lines:
        try:
            record = json.loads(line)
            records.append((float(record["time"]), int(record["policy_version"]), record))
        except (ValueError, KeyError, TypeError):
            continue
    if not records:
        return {}
    first = records[0][2]
    start = records[0][0] - sum(float(first.get(k) or 0.0) for k in _UPDATE_PARTS)
    out = {0: 0.0}
    for when, version, record in records:
        if "publish_s" in record:  # this update published version + 1
            out[version + 1] = when - start
    return out


def _add_line(run: Run, path: Path, n: int, data: Any, metric: str) -> None:
    where = f"{path}:{n}"
    try:
        record = validate(EvalRecord, data, where)
    except FileFormatError as exc:
        raise RunError(_one_line(str(exc))) from None
    line, version = record.model_dump(exclude_unset=True), record.policy_version
    previous = max(run.versions[-1:] + run.skipped[-1:], default=None)
    if previous is not None and version <= previous:
        raise RunError(f"{where}: policy version {version} after {previous}; versions must increase")
    if record.skipped is not None:
        run.skipped.append(version)
        return
    if metric not in line:
        keys = sorted(k for k in line if k.startswith("eval/")) or sorted(line)
        raise RunError(f"{where}: no key {metric!r}; the keys there are: {', '.join(keys)}")
    value = line[metric]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RunError(f"{where}: {metric!r} must be a finite number, got {value!r}")
    run.versions.append(version)
    run.steps.append(record.step)
    run.rewards.append(float(value))


def read_runs(paths: list[Path], metric: str, warnings: list[str]) -> list[Run]:
    """Every run under `paths`; two runs of the same arm and seed are an error naming both folders."""
    runs = [read_run(folder, metric, warnings) for folder in expand(paths)]
    seen: dict[tuple[str, int], Run] = {}
    for run in runs:
        other = seen.setdefault((run.arm, run.seed), run)
        if other is not run:
            raise RunError(
                f"two runs of arm {run.arm!r} with seed {run.seed}: {other.dir} and {run.dir}; "
                "give only one of them"
            )
    for run in runs:
        if run.status not in (None, "finished"):
            warnings.append(f"run {run.label} has status {run.status!r}: its curve may be incomplete")
    return runs
