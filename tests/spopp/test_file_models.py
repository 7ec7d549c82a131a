"""The files the system keeps, read and written through their models (spopp.files.jsonfile and the models
beside each file's owner): a file in today's format loads and is written back byte for byte; a
missing field, a wrong type and broken JSON are refused with `<file>: <field>: <what>`; a value
JSON cannot hold leaves the old file whole and no temporary file behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from services.evaluator.records import Records
from spopp.files.jsonfile import FileFormatError, read_model, write_text
from spopp.files.priors import read_prior, write_prior
from spopp.files.records import EvalRecord, RunRecord
from spopp.files.runs import RunError, read_run
from spopp.files.snapshots import MANIFEST, Manifest, read_manifest, write_manifest

# Each file as the code before the models wrote it (format, key order, indentation).
PRIOR = """{
 "format": "spopp-prior/1",
 "prior_mass": 8.0,
 "rollouts": 2,
 "model": "/abs/model",
 "tasks_file": "/abs/train.jsonl",
 "env": "toy-calc",
 "temperature": 1.0,
 "seed": 0,
 "created": 1700000000.0,
 "seconds": 1.5,
 "success_rate": 0.25,
 "tasks": [
  {"task_id": "q-a", "successes": 1, "rollouts": 2, "alpha0": 4.0, "beta0": 4.0},
  {"task_id": "q:b.1", "successes": 0, "rollouts": 2, "alpha0": 1.3333333333333333, "beta0": 6.666666666666667}
 ]
}
"""
SHA = "ab" * 32
MANIFEST_TEXT = (
    json.dumps(
        {
            "version": 7,
            "step": 14,
            "files": {"model.safetensors": {"sha256": SHA, "bytes": 123}},
            "base_model": "/abs/model",
            "created_at": "2026-11-25T09:13:20.123456+00:00",
        },
        indent=2,
    )
    + "\n"
)
RUN_JSON = json.dumps(
    {
        "run": "spopp-s0", "arm": "spopp", "recipe": "spopp", "normalization": "token", "seed": 0,
        "max_updates": 4, "final_version": 4,
        "identity": {"run": "spopp-s0", "recipe": "spopp", "seed": 0, "run_config": {"retention": 0.875}},
        "status": "finished", "started": 1700000000.5, "launches": 2, "updates_done": 4,
        "finished": 1700000100.25,
    },
    indent=2,
) + "\n"  # fmt: skip
EVAL_LINES = [
    {"policy_version": 0, "step": 0, "snapshot": "/abs/model", "time": 1700000000.0,
     "eval/sampled/reward_mean": 0.25, "eval/greedy/reward_mean": 0.5},
    {"policy_version": 2, "skipped": "pruned: /abs/snapshots/v000002 is gone", "time": 1700000001.0},
    {"policy_version": 4, "step": 4, "snapshot": "/abs/snapshots/v000004", "time": 1700000002.0,
     "eval/sampled/reward_mean": 0.5, "eval/greedy/reward_mean": 0.75},
]  # fmt: skip


# -- today's files load, and are written back as they were -----------------------------------------
def test_a_prior_file_in_todays_format_loads_and_is_written_back_the_same(tmp_path):
    path = tmp_path / "prior.json"
    path.write_text(PRIOR)
    prior = read_prior(path)
    assert [t.task_id for t in prior.tasks] == ["q-a", "q:b.1"] and prior.prior_mass == 8.0
    assert prior.meta["model"] == "/abs/model" and prior.meta["rollouts"] == 2
    write_prior(tmp_path / "again.json", prior)
    assert (tmp_path / "again.json").read_text() == PRIOR


def test_a_manifest_in_todays_format_loads_and_is_written_back_the_same(tmp_path):
    (tmp_path / MANIFEST).write_text(MANIFEST_TEXT)
    m = read_manifest(tmp_path)
    assert (m.version, m.step, m.files["model.safetensors"].bytes) == (7, 14, 123)
    out = tmp_path / "out"
    out.mkdir()
    write_manifest(out, m)
    assert (out / MANIFEST).read_text() == MANIFEST_TEXT


def test_a_hand_made_manifest_with_version_and_step_only_loads(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"version": 4, "step": 8}))
    assert read_manifest(tmp_path) == Manifest(version=4, step=8)


def test_a_run_json_in_todays_format_loads_and_is_written_back_the_same(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(RUN_JSON)
    record = read_model(path, RunRecord)
    assert (record.arm, record.seed, record.status, record.launches) == ("spopp", 0, "finished", 2)
    assert record.to_text(str(path)) == RUN_JSON
    # An older launcher's file: no final_version, no updates_done, a key this one does not know.
    old = {k: v for k, v in json.loads(RUN_JSON).items() if k not in ("final_version", "updates_done")}
    path.write_text(json.dumps({**old, "note": "kept"}, indent=2) + "\n")
    record = read_model(path, RunRecord)
    assert record.final_version is None and record.model_extra == {"note": "kept"}
    assert json.loads(record.to_text(str(path))) == {**old, "note": "kept"}
    # A launcher's file from before the budget was named max_updates: read, and written back renamed.
    before = {("updates" if k == "max_updates" else k): v for k, v in json.loads(RUN_JSON).items()}
    path.write_text(json.dumps(before, indent=2) + "\n")
    record = read_model(path, RunRecord)
    assert record.max_updates == 4 and not record.model_extra
    assert record.to_text(str(path)) == RUN_JSON


def test_every_committed_run_json_loads_with_its_budget():
    # Records written before the rename carry "updates": they stay as committed, and still load.
    root = Path(__file__).resolve().parents[2]
    paths = sorted((root / "docs").rglob("run.json"))
    assert paths
    for path in paths:
        raw = json.loads(path.read_text())
        record = read_model(path, RunRecord)
        assert record.max_updates == raw.get("max_updates", raw.get("updates")), path
        assert "updates" not in (record.model_extra or {}), path


def test_evals_lines_in_todays_format_load_for_the_evaluator_and_the_report(tmp_path):
    (tmp_path / "eval").mkdir()
    text = "".join(json.dumps(line) + "\n" for line in EVAL_LINES)
    (tmp_path / "eval" / "evals.jsonl").write_text(text)
    records = Records(tmp_path / "eval")
    assert records.lines == EVAL_LINES and records.last_version == 4
    assert [EvalRecord.model_validate(line).to_line() for line in EVAL_LINES] == text.splitlines(
        keepends=True
    )
    (tmp_path / "run.json").write_text(RUN_JSON)
    run = read_run(tmp_path, "eval/sampled/reward_mean", warnings := [])
    assert (run.versions, run.rewards, run.skipped, run.steps) == ([0, 4], [0.25, 0.5], [2], [0, 4])
    assert warnings and "skipped versions" in warnings[0]


# -- bad files name the file and the field -----------------------------------------------------------
def _prior_data() -> dict:
    return json.loads(PRIOR)


def _drop(data: dict, key: str) -> dict:
    data.pop(key)
    return data


BAD = {
    # kind: (file name, reader, missing field, wrong type, the fields named)
    "prior": (
        "prior.json",
        read_prior,
        lambda: _drop(_prior_data(), "prior_mass"),
        lambda: {**_prior_data(), "rollouts": "two"},
        ("prior_mass: missing", "rollouts: Input should be a valid integer"),
    ),
    "manifest": (
        MANIFEST,
        lambda path: read_manifest(path.parent),
        lambda: _drop(json.loads(MANIFEST_TEXT), "version"),
        lambda: {
            **json.loads(MANIFEST_TEXT),
            "files": {"model.safetensors": {"sha256": SHA, "bytes": "123"}},
        },
        ("version: missing", "files.model.safetensors.bytes: Input should be a valid integer"),
    ),
    "run.json": (
        "run.json",
        lambda path: read_model(path, RunRecord),
        lambda: _drop(json.loads(RUN_JSON), "arm"),
        lambda: {**json.loads(RUN_JSON), "seed": "zero"},
        ("arm: missing", "seed: Input should be a valid integer"),
    ),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_missing_field_wrong_type_and_broken_json_name_the_file_and_the_field(tmp_path, kind):
    name, read, missing, wrong, (missing_msg, wrong_msg) = BAD[kind]
    path = tmp_path / name
    for content, expect in ((missing(), missing_msg), (wrong(), wrong_msg), ("{broken", "not JSON")):
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(FileFormatError) as info:
            read(path)
        assert f"{path}: {expect}" in str(info.value), str(info.value)


def test_a_bad_evals_line_names_the_file_the_line_and_the_field(tmp_path):
    path = tmp_path / "evals.jsonl"
    for line, expect in (
        ({"step": 0, "time": 1.0}, ":1: policy_version: missing"),
        ({"policy_version": "4", "time": 1.0}, ":1: policy_version: Input should be a valid integer"),
        ('{"policy_version": 4,', ":1: not JSON"),
    ):
        path.write_text((line if isinstance(line, str) else json.dumps(line)) + "\n")
        with pytest.raises(ValueError) as info:
            Records(tmp_path)
        assert f"{path}{expect}" in str(info.value), str(info.value)
        (tmp_path / "run.json").write_text(RUN_JSON)
        path_in_run = tmp_path / "eval" / "evals.jsonl"
        path_in_run.parent.mkdir(exist_ok=True)
        path_in_run.write_text(path.read_text() + json.dumps(EVAL_LINES[0]) + "\n")
        with pytest.raises(RunError, match=f"{path_in_run}:1: "):
            read_run(tmp_path, "eval/sampled/reward_mean", [])


# -- nothing half-written ----------------------------------------------------------------------------
def test_a_value_json_cannot_hold_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "run.json"
    write_text(path, RUN_JSON)
    bad = RunRecord.model_validate({**json.loads(RUN_JSON), "finished": math.nan})
    with pytest.raises(ValueError, match="cannot be written as JSON"):
        write_text(path, bad.to_text(str(path)))
    assert path.read_text() == RUN_JSON
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file left
    with pytest.raises(FileExistsError):
        write_text(path, "{}\n", overwrite=False)
    assert path.read_text() == RUN_JSON and (path.stat().st_mode & 0o777) == 0o644


def test_a_missing_file_is_file_not_found(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        read_model(tmp_path / "run.json", RunRecord)
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path)
