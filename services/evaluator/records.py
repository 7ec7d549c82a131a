"""The evaluator's records under `out_dir`, and what a restart reads back from them.

    evals.jsonl              one line per policy version handled, in version order:
                             {"policy_version", "step", "snapshot", "time", "eval/...": ...} when
                             scored, {"policy_version", "skipped": "<reason>", "time"} when not
    episodes/v000040.jsonl   the episodes of a scored version, one row each
    tb/                      TensorBoard scalars, global step = policy version

A version's episodes file is written first (temporary name, fsync, rename), then its line is
appended, flushed and fsynced: a version has been handled exactly when its line is whole. A
restart continues after the last line; a version killed mid-evaluation has no line and is scored
again (its episodes file is replaced). A partial last line, from a kill during the write, is cut.
Each line is read and written through `spopp.files.records.EvalRecord`, so a bad line is refused with its
file, line number and field.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from spopp.files.jsonfile import FileFormatError, validate
from spopp.files.records import EvalRecord
from spopp.files.snapshots import version_dirname

log = logging.getLogger("spopp.evaluator")


class Records:
    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.episodes_dir = self.out_dir / "episodes"
        self.episodes_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "evals.jsonl"
        self.lines: list[dict[str, Any]] = self._read()

    def _read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]
        if len(whole) < len(data):
            log.warning(
                "%s: cutting a partial last line (%d bytes) left by an interrupted write",
                self.path,
                len(data) - len(whole),
            )
            with self.path.open("r+b") as f:
                f.truncate(len(whole))
                os.fsync(f.fileno())
        lines = []
        for n, raw in enumerate(whole.decode("utf-8").splitlines(), 1):
            record = self._check_line(raw, n)
            version = record.policy_version
            if lines and version <= lines[-1]["policy_version"]:
                raise ValueError(
                    f"{self.path}:{n}: policy version {version} after {lines[-1]['policy_version']}; "
                    "records must increase"
                )
            lines.append(record.model_dump(exclude_unset=True))
        return lines

    def _check_line(self, raw: str, n: int) -> EvalRecord:
        where = f"{self.path}:{n}"
        try:
            # json.loads, not jsonfile.parse_json: the evaluator has always written a NaN score as NaN.
            return validate(EvalRecord, json.loads(raw), where)
        except json.JSONDecodeError as exc:
            message = f"{where}: not JSON: {exc}"
        except FileFormatError as exc:
            message = str(exc)
        raise ValueError(f"{message}\nnot an evaluation record; fix or move the file to go on")

    @property
    def last_version(self) -> int | None:
        """The newest version recorded (scored or skipped), None before the first."""
        return self.lines[-1]["policy_version"] if self.lines else None

    @property
    def last_scored(self) -> dict[str, Any] | None:
        return next((x for x in reversed(self.lines) if "skipped" not in x), None)

    def episodes_path(self, version: int) -> Path:
        return self.episodes_dir / f"{version_dirname(version)}.jsonl"

    def write_scored(
        self, version: int, step: int | None, snapshot: str | Path, metrics: dict, episodes: list[dict]
    ) -> dict[str, Any]:
        path = self.episodes_path(version)
        tmp = path.with_name(path.name + ".tmp")
        with tmp.open("w", encoding="utf-8") as f:
            for row in episodes:
                f.write(
                    json.dumps({"policy_version": version, "step": step, **row}, ensure_ascii=False) + "\n"
                )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        line = {
            "policy_version": version,
            "step": step,
            "snapshot": str(snapshot),
            "time": time.time(),
            **metrics,
        }
        self._append(line)
        return line

    def write_skipped(self, version: int, reason: str) -> dict[str, Any]:
        line = {"policy_version": version, "skipped": reason, "time": time.time()}
        self._append(line)
        return line

    def _append(self, line: dict[str, Any]) -> None:
        if self.lines and line["policy_version"] <= self.lines[-1]["policy_version"]:
            raise ValueError(
                f"policy version {line['policy_version']} is already handled "
                f"(last record: {self.lines[-1]['policy_version']})"
            )
        text = EvalRecord.model_validate(line).to_line()
        with self.path.open("a", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        self.lines.append(line)
