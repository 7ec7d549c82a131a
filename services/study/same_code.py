"""One code for every run of a comparison (spopp.files.provenance), checked before any run starts rather
than refused at the summary: `spopp ablate`, `spopp map` and `spopp study compare` all ask here."""

from __future__ import annotations

from pathlib import Path

from spopp.files import provenance
from spopp.files.jsonfile import read_model
from spopp.files.records import RunRecord


def check(folders: list[Path], out: Path, policy: str, what: str, planned: bool = True) -> dict:
    """This checkout's code and that of the runs already in `folders` must be one code; answers
    provenance.check's summary (MixedCode under policy "refuse"). This checkout counts only when a
    run is still to come: a finished comparison run again (to redraw its page after a pull) runs
    nothing, and its runs' code is what it is. `planned`: `folders` are every run the comparison
    will have (ablate's); a map's are only those there so far, and it is finished only once its
    map.json is written."""
    found: dict[str, dict | None] = {}
    to_come = not folders or not planned
    for folder in folders:
        try:
            record = read_model(folder / "run.json", RunRecord)
        except (OSError, ValueError):  # no run there yet, or one its launch will name
            to_come = True
            continue
        found[str(folder)] = record.code
        to_come = to_come or record.status != "finished"
    runs = {"this checkout (the runs to come)": provenance.code(exclude=[out])} if to_come else {}
    runs |= found
    return provenance.check(runs, policy, what)
