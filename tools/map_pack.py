"""A map's light copy: what its numbers and a resume need, without the weights.

A map takes longer than one sitting on 2 cores, and a run folder is about 18 MB, almost all of it
snapshots, checkpoints and the tracker's AOF. `pack` copies, in the same layout, what the
summary reads (each finished run's run.json, learner/metrics.jsonl, eval/evals.jsonl and its
launch.yaml) and what a resume needs to find the same starting point (map.yaml, protocol.json,
prior.json, the tasks and the cold-start model); runs that did not finish are left out, as a
resume starts them again. `unpack` puts a light copy back into the map's output folder, where
`python -m tools.map --out` resumes from it: the launcher finds each copied run finished, and the
cold start and prior are not made again.

    python -m tools.map --out map-out --pack docs/map/data
    python -m tools.map --out map-out --unpack docs/map/data
"""

from __future__ import annotations

import filecmp
import json
import shutil
from pathlib import Path

TOP = ("map.yaml", "protocol.json", "prior.json", "data", "cold-start")
PER_RUN = ("run.json", "launch.yaml", "learner/metrics.jsonl", "eval/evals.jsonl")


class PackError(RuntimeError):
    pass


def _finished(run_json: Path) -> bool:
    try:
        return json.loads(run_json.read_text()).get("status") == "finished"
    except (OSError, ValueError):
        return False


def light_files(out: Path) -> list[Path]:
    """The files of `out` a light copy holds, relative to `out`."""
    files: list[Path] = []
    for name in TOP:
        path = out / name
        if path.is_file():
            files.append(Path(name))
        elif path.is_dir():
            files += sorted(p.relative_to(out) for p in path.rglob("*") if p.is_file())
    for run_json in sorted(out.glob("**/runs/*/run.json")):
        if _finished(run_json):
            run = run_json.parent
            files += [(run / rel).relative_to(out) for rel in PER_RUN if (run / rel).is_file()]
    return files


def _copy(files: list[Path], src: Path, dest: Path) -> int:
    """Copy `files` from `src` to `dest`; a file already at `dest` must be the same (PackError)."""
    clash = [f for f in files if (dest / f).is_file() and not filecmp.cmp(src / f, dest / f, shallow=False)]
    if clash:
        raise PackError(
            f"{dest} already holds other versions of {len(clash)} file(s), e.g. {clash[0]}: "
            "copy into an empty folder, or remove those files"
        )
    copied = 0
    for f in files:
        if (dest / f).is_file():
            continue
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src / f, dest / f)
        copied += 1
    return copied


def pack(out: Path, dest: Path) -> tuple[int, int]:
    """(files copied, finished runs) from the map's `out` into the light copy `dest`."""
    if not (out / "map.yaml").is_file():
        raise PackError(f"{out} holds no map (no map.yaml)")
    files = light_files(out)
    return _copy(files, out, dest), sum(1 for f in files if f.name == "run.json")


def unpack(src: Path, out: Path) -> int:
    """Files copied from the light copy `src` back into the map's `out`."""
    if not (src / "map.yaml").is_file():
        raise PackError(f"{src} is not a map's light copy (no map.yaml)")
    files = sorted(p.relative_to(src) for p in src.rglob("*") if p.is_file())
    return _copy(files, src, out)
