"""The map's light copy (tools/map_pack.py): what a resume in a later sitting and the map's numbers
need, and nothing of the weights; refused where it would overwrite something else."""

from __future__ import annotations

import json

import pytest

from tools import map as map_tool
from tools.map_pack import PackError, pack, unpack


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _map_out(out):
    for name in (
        "map.yaml",
        "protocol.json",
        "prior.json",
        "data/train.jsonl",
        "cold-start/model.safetensors",
    ):
        _write(out / name, f"{name}\n")
    done = out / "pilot" / "cells" / "coupling+0-latency0" / "runs" / "spo-s1000"
    _write(done / "run.json", json.dumps({"status": "finished"}))
    for rel in ("launch.yaml", "learner/metrics.jsonl", "eval/evals.jsonl"):
        _write(done / rel, f"{rel}\n")
    # What a light copy leaves out: weights, optimizer states, the tracker's AOF, logs, episodes.
    for rel in ("snapshots/v000008/model.safetensors", "checkpoints/step8/optim.pt",
                "tracker/appendonly.aof", "logs/learner.log", "eval/episodes/v000000.jsonl"):  # fmt: skip
        _write(done / rel, "heavy\n")
    running = out / "cells" / "coupling+0-latency0" / "runs" / "spo-s0"
    _write(running / "run.json", json.dumps({"status": "running"}))
    _write(running / "learner" / "metrics.jsonl", "{}\n")
    return done


def _files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_a_light_copy_holds_finished_runs_without_weights_and_restores_them(tmp_path):
    out, light, again = tmp_path / "map-out", tmp_path / "light", tmp_path / "again"
    _map_out(out)
    copied, runs = pack(out, light)
    run = "pilot/cells/coupling+0-latency0/runs/spo-s1000/"
    assert (copied, runs) == (9, 1)
    assert _files(light) == sorted(
        ["map.yaml", "protocol.json", "prior.json", "data/train.jsonl", "cold-start/model.safetensors"]
        + [run + rel for rel in ("run.json", "launch.yaml", "learner/metrics.jsonl", "eval/evals.jsonl")]
    )
    assert pack(out, light) == (0, 1)  # again: the same files, nothing copied
    assert unpack(light, again) == 9
    assert _files(again) == _files(light)
    assert all((again / f).read_bytes() == (out / f).read_bytes() for f in _files(light))


def test_a_copy_that_would_overwrite_another_version_is_refused_and_writes_nothing(tmp_path):
    out, light = tmp_path / "map-out", tmp_path / "light"
    _map_out(out)
    pack(out, light)
    (out / "prior.json").write_text("another prior\n")
    (light / "extra.txt").write_text("x")
    before = _files(out)
    with pytest.raises(PackError, match="already holds other versions of 1 file"):
        unpack(light, out)
    assert _files(out) == before  # not even extra.txt
    with pytest.raises(PackError, match="no map.yaml"):
        pack(tmp_path / "empty", light)


def test_the_command_line_packs_and_unpacks(tmp_path, capsys):
    out, light = tmp_path / "map-out", tmp_path / "light"
    _map_out(out)
    assert map_tool.main(["--out", str(out), "--pack", str(light)]) == 0
    assert "packed 1 finished run(s)" in capsys.readouterr().out
    assert map_tool.main(["--out", str(tmp_path / "resumed"), "--unpack", str(light)]) == 0
    assert (tmp_path / "resumed" / "cold-start" / "model.safetensors").is_file()
    assert map_tool.main(["--out", str(tmp_path / "x"), "--unpack", str(tmp_path / "nothing")]) == 2
