"""The map's protocol, fixed before its main runs: how many seeds each cell gets, and which.

Two rules:

- **pilot** (`make map`): SPO and SPO++ run first in every cell on the pilot's seeds, which no main
  run reuses (the design aims at their difference; the steps between them are not sized). From
  the pilot's paired SPO++ − SPO differences, each cell's sample s.d. s gives the seeds
  n = max(n_min, ceil((s / target)^2)) that would bring the main runs' standard error to the target
  if s held. When the budget (priced by the pilot's mean run time) cannot pay for every cell's n,
  the largest common cap c that fits is applied (n = min(n, c), never under n_min), what is left is
  given a seed at a time to the capped cells wanting most, and the capped cells are named: the
  table says that their target was out of reach rather than the map adding seeds until it looks
  right.
- **fixed**: the given seeds in every cell (`spopp map --seeds`).

Either way the decision is written to `<out>/protocol.json` before the first main run starts and a
resumed map reads it back instead of deciding again, so a cell's n never depends on its own main
results: no optional stopping. The protocol also names the tests the summary will make (`tests`:
per cell, the correction for the number of cells, and the pooled test over them), so that they are
fixed before the main results too; a protocol written before it named them has no `tests`, and the
page calls those tests exploratory. The main seeds are `first_seed`, `first_seed + 1`, ... in each cell.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

PROTOCOL = "protocol.json"

# The tests the map's summary makes (summary.across_cells), named in every protocol so that a
# reader can tell the tests planned before the main runs from tests chosen after them.
PLANNED_TESTS = {
    "per_cell": "each paired difference: its 95 % t interval, the two-sided paired t test (t_p) and the "
    "two-sided exact sign test (sign_p)",
    "multiplicity": "Holm's step-down adjustment of t_p over the map's cells, one family per comparison "
    "(SPO++ − SPO, and each step of the chain) (holm_p)",
    "pooled": "per comparison, Fisher's combination of the cells' t_p, -2 sum ln p against chi-square with "
    "2k degrees of freedom: the null of no difference in any cell (pooled)",
}


def wanted(sd: float | None, target: float, n_min: int) -> int:
    """Seeds a cell wants for a standard error of `target` if its s.d. holds: max(n_min,
    ceil((sd / target)^2)); n_min when the s.d. is 0."""
    if sd is None:
        raise ValueError("a cell's pilot has no standard deviation: the pilot needs two seeds or more")
    return max(n_min, math.ceil((sd / target) ** 2 - 1e-9))


def fit(want: dict[str, int], capacity: float, n_min: int) -> dict[str, int]:
    """Each cell's n within `capacity` seeds in all (inf: no budget): every cell its wanted n when
    they fit; else the largest common cap c >= n_min with sum(min(want, c)) <= capacity, then what is
    left one seed at a time to the capped cells wanting most (then by name). Every cell gets at least
    n_min, even over the capacity."""
    if sum(want.values()) <= capacity:
        return dict(want)
    c = n_min
    while sum(min(w, c + 1) for w in want.values()) <= capacity:
        c += 1
    n = {cell: min(w, c) for cell, w in want.items()}
    left = capacity - sum(n.values())
    for cell in sorted((k for k in n if n[k] < want[k]), key=lambda k: (-want[k], k)):
        if left < 1:
            break
        n[cell] += 1
        left -= 1
    return n


def decide(
    pilot: dict[str, float | None],
    pilot_seeds: list[int],
    target: float,
    n_min: int,
    first_seed: int,
    capacity: float,
    run_seconds: float | None,
    budget_s: float | None,
) -> dict[str, Any]:
    """The pilot rule's protocol from each cell's pilot s.d. (`pilot`: cell → s.d.)."""
    want = {cell: wanted(sd, target, n_min) for cell, sd in pilot.items()}
    n = fit(want, capacity, n_min)
    seeds = {cell: list(range(first_seed, first_seed + k)) for cell, k in n.items()}
    if clash := sorted(set(pilot_seeds) & {s for ss in seeds.values() for s in ss}):
        raise ValueError(
            f"main seeds {clash} are also pilot seeds: start the main seeds past them (--first-seed)"
        )
    return {
        "rule": "pilot", "target_se": target, "n_min": n_min, "pilot_seeds": pilot_seeds,
        "pilot_sd": pilot, "wanted": want, "seeds": seeds, "capped": sorted(c for c in n if n[c] < want[c]),
        "run_seconds": run_seconds, "budget_minutes": None if budget_s is None else budget_s / 60,
        "capacity_seeds": None if math.isinf(capacity) else capacity, "tests": dict(PLANNED_TESTS), "decided": _now(),
    }  # fmt: skip


def fixed(cells: list[str], seeds: list[int], target: float) -> dict[str, Any]:
    """The fixed rule's protocol: the same seeds in every cell."""
    return {
        "rule": "fixed", "target_se": target, "n_min": len(seeds), "pilot_seeds": [], "pilot_sd": {},
        "wanted": {}, "seeds": {cell: list(seeds) for cell in cells}, "capped": [], "run_seconds": None,
        "budget_minutes": None, "capacity_seeds": None, "tests": dict(PLANNED_TESTS), "decided": _now(),
    }  # fmt: skip


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read(out: Path) -> dict[str, Any] | None:
    """The protocol a map decided earlier (None before it has decided)."""
    path = out / PROTOCOL
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ValueError(
            f"{path} is not JSON ({exc}); it fixes the map's seeds: restore it, or start over in a new folder"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("seeds"), dict) or "grid" not in data:
        raise ValueError(f"{path} is not a map protocol (no grid or seeds); start over in a new folder")
    return data


def write(out: Path, protocol: dict[str, Any]) -> None:
    # Atomic: a map stopped while writing keeps no half a protocol.
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (PROTOCOL + ".tmp")
    tmp.write_text(json.dumps(protocol, indent=1) + "\n")
    tmp.replace(out / PROTOCOL)
