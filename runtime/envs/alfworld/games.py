"""ALFWorld game files on disk, and the task rows that point at them.

The package's own layout (what `alfworld-download` unpacks under `$ALFWORLD_DATA`, and what our
generator writes) is `json_2.1.1/<split>/<task folder>/<trial>/` holding `game.tw-pddl` (a JSON
object: `pddl_domain`, `grammar` with the goal text filled in, `pddl_problem`, `solvable`,
`walkthrough`) and `traj_data.json`. A task set is a list file of `<split>/<folder>/<trial>` lines
(the paper's 128 tasks are one such list); `write_alfworld_tasks` turns it into the JSONL that every
spopp service loads with `runtime.tasks.load_tasks`:

    {"task_id": "alfworld:<rel with ':' for '/'>", "prompt": <the game's goal text>, "answer": "<rel>",
     "task_type": ..., "alfworld_data": <root, unless the tasks are written portable>}

The `answer` is the game itself (the game, not a string, decides the reward). A row without
`alfworld_data` is resolved against `$ALFWORLD_DATA` where it runs, so one task file serves
machines that keep the data in different places (a container's volume, a laptop).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..base import Task

__all__ = [
    "DATA_DIR",
    "GAME_FILE",
    "GameFileError",
    "GameSpec",
    "TASK_TYPES",
    "data_root",
    "game_path",
    "read_game",
    "read_task_list",
    "task_for_game",
    "write_alfworld_tasks",
]

DATA_DIR = "json_2.1.1"
GAME_FILE = "game.tw-pddl"
# Ids carry no "/" (they are path segments of the tracker's API): the game's path with ":" between
# its parts, which no ALFWorld folder name contains. The answer keeps the path itself.
TASK_ID_PREFIX = "alfworld:"
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS = ("train", "valid_seen", "valid_unseen", "valid_train")
_GOAL_RE = re.compile(r'"rhs"\s*:\s*"Your task is to: (.*?)"')


class GameFileError(ValueError):
    """A game file, list file or task row that cannot be played; the message names the file."""


@dataclass(frozen=True)
class GameSpec:
    """What the engine needs from one `game.tw-pddl`, checked."""

    path: Path
    goal: str
    solvable: bool
    walkthrough: list[str] | None


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The folder holding `json_2.1.1/`: `explicit`, else `$ALFWORLD_DATA`."""
    root = explicit if explicit not in (None, "") else os.environ.get("ALFWORLD_DATA")
    if not root:
        raise GameFileError(
            "no ALFWorld data folder: give it (alfworld_data in the task row, or --data) or set ALFWORLD_DATA"
        )
    return Path(root).expanduser()


def _check_rel(rel: str, where: str) -> str:
    rel = rel.strip().strip("/")
    parts = PurePosixPath(rel).parts
    if len(parts) != 3 or any(p in ("", ".", "..") for p in parts) or "\\" in rel:
        raise GameFileError(f"{where}: {rel!r} is not <split>/<task folder>/<trial>")
    return rel


def game_path(rel: str, root: str | os.PathLike | None = None) -> Path:
    """`<root>/json_2.1.1/<rel>/game.tw-pddl` for the trial `rel` (`<split>/<folder>/<trial>`)."""
    return data_root(root) / DATA_DIR / _check_rel(rel, "game") / GAME_FILE


def read_game(path: str | os.PathLike) -> GameSpec:
    """Load and check a `game.tw-pddl`: a clear error for a missing file, bad JSON or a missing field."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GameFileError(f"{path}: no such game file") from None
    except OSError as e:
        raise GameFileError(f"{path}: cannot read: {e.strerror}") from None
    try:
        game = json.loads(raw)
    except json.JSONDecodeError as e:
        raise GameFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(game, dict):
        raise GameFileError(f"{path}: expected a JSON object, got {type(game).__name__}")
    for key in ("pddl_domain", "grammar", "pddl_problem"):
        if not isinstance(game.get(key), str) or not game[key].strip():
            raise GameFileError(f"{path}: missing or empty {key!r}")
    solvable = game.get("solvable")
    if not isinstance(solvable, bool):
        # The package's loader skips such games; we refuse them by name instead of dropping them.
        raise GameFileError(f"{path}: 'solvable' must be true or false")
    walkthrough = game.get("walkthrough")
    if walkthrough is not None and (
        not isinstance(walkthrough, list) or not all(isinstance(c, str) for c in walkthrough)
    ):
        raise GameFileError(f"{path}: 'walkthrough' must be a list of commands or null")
    m = _GOAL_RE.search(game["grammar"])
    if m is None or m.group(1).strip() in ("", "UNKNOWN GOAL."):
        raise GameFileError(f'{path}: the grammar has no goal text ("Your task is to: ...")')
    return GameSpec(
        path=path, goal=m.group(1).strip().rstrip("."), solvable=solvable, walkthrough=walkthrough
    )


def read_task_list(list_file: str | os.PathLike) -> list[str]:
    """The trials a list file names, one `<split>/<folder>/<trial>` a line ('#' starts a comment)."""
    list_file = Path(list_file)
    try:
        lines = list_file.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise GameFileError(f"{list_file}: cannot read the task list: {e.strerror}") from None
    rels: list[str] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        rel = _check_rel(text, f"{list_file}, line {lineno}")
        if rel in seen:
            raise GameFileError(
                f"{list_file}, line {lineno}: {rel} is listed twice (first at line {seen[rel]})"
            )
        seen[rel] = lineno
        rels.append(rel)
    if not rels:
        raise GameFileError(f"{list_file}: the task list names no game")
    return rels


def _task_type(rel: str, trial_dir: Path) -> str:
    """From traj_data.json when it is there, else the folder name (`<task_type>-<Obj>-...`)."""
    traj = trial_dir / "traj_data.json"
    if traj.is_file():
        try:
            task_type = json.loads(traj.read_text(encoding="utf-8")).get("task_type")
        except (json.JSONDecodeError, AttributeError):
            raise GameFileError(f"{traj}: not a JSON object") from None
        if isinstance(task_type, str) and task_type:
            return task_type
    folder = PurePosixPath(rel).parts[1]
    for task_type in TASK_TYPES:
        if folder.startswith(task_type + "-"):
            return task_type
    raise GameFileError(f"{trial_dir}: no task_type in traj_data.json and none in the folder name")


def task_for_game(rel: str, root: str | os.PathLike | None = None, *, portable: bool = False) -> Task:
    """The task row of one trial, checked: the game loads as a file, is solvable and has a goal."""
    path = game_path(rel, root)
    spec = read_game(path)
    if not spec.solvable:
        raise GameFileError(f"{path}: the game is marked unsolvable")
    meta = {"task_type": _task_type(rel, path.parent)}
    if not portable:
        meta["alfworld_data"] = str(data_root(root).resolve())
    return Task(
        task_id=TASK_ID_PREFIX + _check_rel(rel, "game").replace("/", ":"),
        prompt=spec.goal,
        answer=rel,
        meta=meta,
    )


def write_alfworld_tasks(
    root: str | os.PathLike | None,
    list_file: str | os.PathLike,
    out: str | os.PathLike,
    *,
    portable: bool = False,
) -> list[Task]:
    """Check every game the list names and write their task rows to `out` (JSONL); all or nothing."""
    from ...tasks import write_jsonl

    tasks = [task_for_game(rel, root, portable=portable) for rel in read_task_list(list_file)]
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    write_jsonl(tasks, tmp)
    tmp.replace(out)
    return tasks
