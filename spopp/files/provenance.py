"""Provenance: which code and which machine made a run, and whether runs compared share their code.

A comparison (a map's cell, an ablation's report) measures the arms' difference only if nothing
else differs between its runs; a change to the code between two of them is a difference nobody
chose and nobody can see afterwards. So every launch records in run.json

    code     {"commit", "dirty", "dirty_files", "diff_sha256", "lock_sha256", "source" | "why",
              "earlier_launches"}
    machine  {"system", "release", "arch", "cpu", "cores", "cores_usable", "python", "torch", "gpus"}

and the commands that compare runs (`spopp map`, `spopp ablate`, `spopp report`) group them by
their code (`agree`) and refuse a comparison whose runs do not come from one code, or let it
through flagged when told to (`check`, policy "flag"). A code is a commit, the lock's hash and, for
a checkout with uncommitted changes, the hash of their diff: runs launched from one edited checkout
(`make demo` after a local change) share their code and compare; the page names the commit and
says the tree had uncommitted changes, so a published figure from one can be told apart. Runs launched before run.json recorded
the code have none: "not recorded" is a value of its own, equal to itself, so that a comparison
made entirely of such runs still summarizes, and its page says the code was not recorded.

Nothing here may fail a launch: git runs with a timeout, and any failure is recorded as the reason
the commit is unknown. No torch (the launcher must not import it).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
from collections.abc import Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["POLICIES", "MixedCode", "agree", "check", "code", "describe", "label", "machine", "relaunched"]

# The folder that holds the spopp package: the checkout's root in a clone (an editable install);
# elsewhere (a wheel in site-packages, the images' /app) no checkout, and the commit is unknown.
ROOT = Path(__file__).resolve().parents[2]
LOCK = "requirements.lock"
# Where no checkout is (the images copy the sources without .git), whoever builds may say the commit.
COMMIT_ENV = "SPOPP_CODE_COMMIT"
GIT_SECONDS = 10.0
# Changes that do not change what a run executes: prose, and the runs' outputs committed under docs/
# (docs/map/data, docs/results). Untracked files (a run folder in the checkout) never count.
NOT_CODE = (":(exclude)docs", ":(exclude)*.md")
DIRTY_FILES = 20  # the modified files named in run.json, at most

POLICIES = ("refuse", "flag")
NOT_RECORDED = "not recorded"
PREDATES = (
    "not recorded: these runs predate provenance (their run.json names no commit), so which code "
    "made them cannot be checked"
)


class MixedCode(ValueError):
    """Runs to be compared that do not come from one code; the message names them."""


class _GitError(RuntimeError):
    pass


def _git(root: Path, *args: str) -> str:
    # GIT_DIR and friends (set inside a git hook, say) would point git at another repository.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    try:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=GIT_SECONDS,
            env=env, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    except FileNotFoundError:
        raise _GitError("git is not installed") from None
    except subprocess.TimeoutExpired:
        raise _GitError(f"git {args[0]} did not answer within {GIT_SECONDS:g} s") from None
    except OSError as exc:
        raise _GitError(f"git could not run: {exc}") from None
    if done.returncode != 0:
        first = (done.stderr or done.stdout).strip().splitlines()[:1]
        raise _GitError(f"git {args[0]} failed: {first[0] if first else f'exit {done.returncode}'}")
    return done.stdout


def _sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def code(root: Path = ROOT, exclude: Iterable[Path] = ()) -> dict[str, Any]:
    """The code this process runs: the commit of the checkout at `root` (None with the reason, `why`,
    where there is none), whether tracked files differ from it (docs, markdown and the `exclude`d
    folders, e.g. the run's own folder, aside), and the sha256 of its requirements.lock."""
    out: dict[str, Any] = {"commit": None, "dirty": None, "lock_sha256": _sha256(root / LOCK)}
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").strip())
        if top.resolve() != root.resolve():  # e.g. an installed copy inside some other checkout
            raise _GitError(f"{root} is not the root of a git checkout")
        out["commit"] = _git(root, "rev-parse", "--verify", "HEAD").strip()
    except _GitError as exc:
        given = os.environ.get(COMMIT_ENV, "").strip()
        if given:  # what the image's builder said; whether the files changed since is unknown
            return out | {"commit": given, "source": COMMIT_ENV}
        return out | {"why": f"{exc} (no commit to record; set {COMMIT_ENV} where there is no checkout)"}
    mine = []
    for folder in exclude:
        try:
            mine.append(":(exclude,literal)" + Path(folder).resolve().relative_to(root.resolve()).as_posix())
        except ValueError:  # outside the checkout: nothing of it is tracked
            continue
    try:
        status = _git(root, "status", "--porcelain", "--untracked-files=no", "--", ".", *NOT_CODE, *mine)
    except _GitError as exc:
        return out | {"source": "git", "why": f"whether files changed is unknown: {exc}"}
    files = [line[3:] for line in status.splitlines() if line.strip()]  # "XY path" per file
    out |= {"dirty": bool(files), "source": "git"}
    if files:
        out["dirty_files"] = files[:DIRTY_FILES]
        try:  # what the changes are: two launches of one edited tree share it, another edit does not
            diff = _git(root, "diff", "HEAD", "--binary", "--", ".", *NOT_CODE, *mine)
            out["diff_sha256"] = hashlib.sha256(diff.encode()).hexdigest()
        except _GitError as exc:
            out["why"] = f"the uncommitted changes could not be read: {exc}"
    return out


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpu_names() -> list[str] | None:
    """The GPUs' names as nvidia-smi lists them; [] without nvidia-smi, None when it fails."""
    from spopp.machine.gpus import GpuListError, NoNvidiaSmi, run_nvidia_smi

    try:
        out = run_nvidia_smi(["--query-gpu=name", "--format=csv,noheader"], timeout=GIT_SECONDS)
    except NoNvidiaSmi:
        return []
    except GpuListError:
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """The machine a run ran on, no hostname: what its times and numerics depend on. torch's version
    from its installed metadata, without importing it."""
    try:
        torch: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    return {
        "system": platform.system(), "release": platform.release(), "arch": platform.machine(),
        "cpu": _cpu_model(), "cores": os.cpu_count(), "cores_usable": usable,
        "python": platform.python_version(), "torch": torch, "gpus": _gpu_names(),
    }  # fmt: skip


def _brief(c: Mapping[str, Any] | None) -> dict[str, Any]:
    """What identifies a code (and what a page says of it), without the detail."""
    if not c or c.get("recorded") is False:
        return {"recorded": False}
    out = {"recorded": True, **{k: c.get(k) for k in ("commit", "dirty", "lock_sha256")}}
    if c.get("dirty"):
        out["diff_sha256"] = c.get("diff_sha256")
    if c.get("earlier_launches"):
        out["earlier_launches"] = [_brief(e) for e in c["earlier_launches"]]
    return out


def relaunched(before: Mapping[str, Any] | None, now: dict[str, Any], resumed: bool) -> dict[str, Any]:
    """The code a launch records: `now`'s; when it resumes a run whose earlier launches ran other
    code (or recorded none), those are kept in `earlier_launches`, which makes the run's code
    differ from any run made by one code alone."""
    if not resumed:
        return now
    earlier = list((before or {}).get("earlier_launches") or [])
    last = {k: v for k, v in _brief(before).items() if k != "earlier_launches"}  # the last launch's own
    if _identity(last) != _identity(now):
        earlier.append(last)
    return now | {"earlier_launches": earlier} if earlier else now


def _identity(c: Mapping[str, Any] | None) -> tuple:
    """What two runs must share to count as made by the same code (the detail aside)."""
    b = _brief(c)
    if not b["recorded"]:
        return (NOT_RECORDED,)
    return (
        b["commit"],
        b["lock_sha256"],
        b["dirty"],
        # An edited tree whose edit is unknown (no diff recorded) matches nothing, itself included.
        (b.get("diff_sha256") or object()) if b["dirty"] else None,
        tuple(_identity(e) for e in b.get("earlier_launches", [])),
    )


def label(c: Mapping[str, Any] | None) -> str:
    """A code in a few words: `commit 3f5a78e1c2d4 (lock 1a2b3c4d)`, `... + uncommitted changes`,
    `commit unknown`, `not recorded`."""
    b = _brief(c)
    if not b["recorded"]:
        return NOT_RECORDED
    text = f"commit {b['commit'][:12]}" if b["commit"] else "commit unknown"
    if b["dirty"]:
        diff = b.get("diff_sha256")
        text += f" + uncommitted changes (diff {diff[:8]})" if diff else " + uncommitted changes"
    text += f" (lock {b['lock_sha256'][:8]})" if b["lock_sha256"] else " (no requirements.lock)"
    if b.get("earlier_launches"):
        text += "; resumed from a launch on " + ", ".join(label(e) for e in b["earlier_launches"])
    return text


def agree(runs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, Any]:
    """The runs (name → run.json's code, None where not recorded) grouped by their code: each code
    with its number of runs (and their names when there are several codes), and the problem that
    keeps them from being compared as one code (None when there is none)."""
    groups: dict[tuple, tuple[Mapping[str, Any] | None, list[str]]] = {}
    for name, c in runs.items():
        groups.setdefault(_identity(c), (c, []))[1].append(name)
    codes = [
        {**_brief(c), "runs": len(names), **({"names": names} if len(groups) > 1 else {})}
        for c, names in groups.values()
    ]
    problems = []
    if len(groups) > 1:
        problems.append(
            "different code: " + "; ".join(f"{label(c)}: {', '.join(names)}" for c, names in groups.values())
        )
    for c, names in groups.values():
        b = _brief(c)
        if b.get("earlier_launches"):
            problems.append(f"resumed on other code: {', '.join(names)} ({label(c)})")
    return {"codes": codes, "problem": "; ".join(problems) or None, "flagged": False}


def check(runs: Mapping[str, Mapping[str, Any] | None], policy: str, what: str) -> dict[str, Any]:
    """`agree(runs)`; under policy "refuse" MixedCode when the runs do not come from one code
    (naming the runs and their codes), under "flag" the summary is marked `flagged`."""
    if policy not in POLICIES:
        raise ValueError(f"mixed code policy {policy!r}: choose {' or '.join(POLICIES)}")
    summary = agree(runs)
    if summary["problem"] is not None:
        if policy == "refuse":
            raise MixedCode(
                f"{what}: its runs do not come from one code ({summary['problem']}). Compare runs made "
                "by one commit (and one lock, and one set of uncommitted changes), or let them through "
                "flagged: --mixed-code flag (SPOPP_MIXED_CODE=flag)"
            )
        summary["flagged"] = True
    return summary


def merge(summaries: Iterable[Mapping[str, Any] | None]) -> dict[str, Any]:
    """Several summaries (a map's cells) as one: each code with its runs summed. A summary missing
    (a map.json written before cells recorded code) counts as runs not recorded."""
    groups: dict[tuple, dict[str, Any]] = {}
    for s in summaries:
        for entry in (s or {}).get("codes") or [{"recorded": False, "runs": None}]:
            key = _identity(entry)
            g = groups.setdefault(key, {**_brief(entry), "runs": 0})
            g["runs"] = None if entry.get("runs") is None or g["runs"] is None else g["runs"] + entry["runs"]
    return {"codes": list(groups.values())}


def describe(summary: Mapping[str, Any] | None) -> str:
    """The page's sentence on the code of a comparison's runs (from `agree`'s or `merge`'s summary;
    None: a summary written before runs recorded code)."""
    codes = (summary or {}).get("codes") or [{"recorded": False}]
    if all(not c.get("recorded") for c in codes):
        return f"Code: {PREDATES}."

    def runs(c: Mapping[str, Any]) -> str:
        n = c.get("runs")
        return "" if n is None else f" ({n} run{'s' if n != 1 else ''})"

    return "Code: " + "; ".join(label(c) + runs(c) for c in codes) + "."
