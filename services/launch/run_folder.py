"""A launch's run folder: run.json (what the run is, its identity and status), launch.yaml, each
child's config, and the tracker's evidence exported at the end.

A second launch on the same folder resumes: the run's identity (recipe, seed, model, tasks, prior,
run config) must not have changed. run.json is always written validated, so that the record on
disk is one that reads back.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from services.config.launch import LaunchSettings
from services.launch.process_plan import ProcessPlan
from spopp.api.client import TrackerClient
from spopp.files import provenance
from spopp.files.jsonfile import read_model, write_text
from spopp.files.records import RunRecord

from .progress import last_line


class RunFolderError(RuntimeError):
    """The folder cannot hold this launch (another run, an unreadable record)."""


def _read_record(path: Path) -> RunRecord | None:
    try:
        return read_model(path, RunRecord)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunFolderError(
            f"{exc}\n(the run folder's record is unreadable: move the folder aside to start over)"
        ) from None


def _write_record(path: Path, record: RunRecord) -> None:
    write_text(path, record.to_text(str(path)))


def child_settings(p: ProcessPlan) -> dict[str, Any]:
    """Every child's settings by its name (tracker, learner, rollout-N, evaluator)."""
    out: dict[str, Any] = {"tracker": p.tracker, "learner": p.learner}
    for r in p.rollouts:
        out[r.worker_id] = r
    if p.evaluator is not None:
        out["evaluator"] = p.evaluator
    return out


class RunFolder:
    """The folder of the launch `s`; `record` is its run.json, once read or written."""

    def __init__(self, s: LaunchSettings) -> None:
        self.s = s
        self.record: RunRecord | None = None
        self.launched = time.time()

    def resume(self, p: ProcessPlan) -> RunRecord | None:
        """The record of the run the folder holds (None: a new folder); RunFolderError when it
        is another run."""
        record = _read_record(p.run_dir / "run.json")
        if record is not None:
            mine, theirs = p.identity(), record.identity
            changed = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if changed:
                diff = "; ".join(
                    f"{k}: {theirs.get(k)!r} in the folder, {mine.get(k)!r} now" for k in changed
                )
                raise RunFolderError(
                    f"{p.run_dir} holds another run ({diff}). A launch on an existing folder resumes its "
                    "run and cannot change what defines it: use another run_dir"
                )
        self.record = record
        return record

    def finished_updates(self, p: ProcessPlan) -> int:
        line = last_line(p.run_dir / "learner" / "metrics.jsonl")
        return int(line.get("step", 0)) if line else 0

    def write(self, p: ProcessPlan, metrics_url: str) -> None:
        """launch.yaml (secrets left out), each child's config, and run.json: running, with the code
        and the machine of this launch (spopp/files/provenance.py; a resume on other code keeps the earlier
        launch's in `code.earlier_launches`)."""
        from runtime.envs import resolved_env_options

        p.run_dir.mkdir(parents=True, exist_ok=True)
        (p.run_dir / "launch.yaml").write_text(
            yaml.safe_dump({k: v for k, v in self.s.model_dump(mode="json").items() if k != "api_token"},
                           sort_keys=False)
        )  # fmt: skip
        for name, settings in child_settings(p).items():
            settings.to_file(p.run_dir / "config" / f"{name}.yaml")
        now = time.time()
        self.launched = now  # this launch's start: set_status adds what it ran to running_s
        old = self.record
        self.record = RunRecord.model_validate({
            **(old.model_dump(exclude_unset=True) if old else {}),
            "run": self.s.run, "arm": p.arm(), "recipe": self.s.recipe,
            "normalization": p.learner.normalization, "seed": self.s.seed, "max_updates": self.s.max_updates,
            "final_version": p.final_version, "identity": p.identity(), "status": "running",
            "env": self.s.env, "env_options": resolved_env_options(self.s.env, self.s.env_options),
            "started": old.started if old and old.started is not None else now,
            "launches": (old.launches if old else 0) + 1, "metrics_url": metrics_url,
            "replicas": len(p.rollouts),
            "code": provenance.relaunched(old.code if old else None, provenance.code(exclude=[p.run_dir]),
                                          resumed=old is not None),
            "machine": provenance.machine(),
            **({"protocol": self.s.protocol} if self.s.protocol else {}),
        })  # fmt: skip
        _write_record(p.run_dir / "run.json", self.record)

    def set_status(self, p: ProcessPlan, status: str) -> None:
        now = time.time()
        update: dict[str, Any] = {"status": status, "updates_done": self.finished_updates(p)}
        # A resumed run's wall time is its launches' time, not first start to last finish: a study
        # stopped overnight and resumed would otherwise count the night.
        update["running_s"] = (self.record.running_s or 0.0) + max(0.0, now - self.launched)
        if status == "finished":
            update["finished"] = now
        self.update(p, **update)

    def update(self, p: ProcessPlan, **changes: Any) -> None:
        """run.json with `changes`, validated again (model_copy would not): the record on disk is
        always one that reads back."""
        self.record = RunRecord.model_validate({**self.record.model_dump(exclude_unset=True), **changes})
        _write_record(p.run_dir / "run.json", self.record)

    def export(self, p: ProcessPlan, client: TrackerClient) -> None:
        """The tracker's per-task evidence, and its run counts and per-worker counts in run.json
        (what a reader checks a run against once its tracker is gone: every dispatch ended as one
        outcome, release, expiry or lease still in flight)."""
        rows = client.export(self.s.run)
        run = client.get_run(self.s.run)
        tmp = p.run_dir / "export.jsonl.tmp"
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, p.run_dir / "export.jsonl")
        self.update(
            p,
            tracker_counts=run.counts.model_dump(mode="json"),
            workers={k: v.model_dump(mode="json") for k, v in run.workers.items()},
        )
