"""`--cold-start DIR` of the toy-calc demo and the map: a cold start trained already is checked and
copied in as stage 2 (tests/tools/test_learning.py and tests/tools/test_map_run.py run the real thing with the
session's `learned_model`)."""

from __future__ import annotations

import json

import pytest

from tools.demo import copy_cold_start


def _cold_start(folder, positions: int):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    (folder / "cold_start.json").write_text(json.dumps({"steps": 7}))
    (folder / "model.safetensors").write_bytes(b"weights")
    return folder


def test_a_cold_start_is_copied_once(tmp_path):
    source = _cold_start(tmp_path / "trained", 256)
    target = tmp_path / "out" / "cold-start"
    target.parent.mkdir()
    copy_cold_start(source, target, 128)
    assert (target / "model.safetensors").read_bytes() == b"weights"
    assert not (tmp_path / "out" / "cold-start.copying").exists()
    # A resumed demo keeps what it has: the source is not read again.
    (source / "model.safetensors").write_bytes(b"changed")
    copy_cold_start(source, target, 128)
    assert (target / "model.safetensors").read_bytes() == b"weights"


def test_a_folder_that_is_not_a_cold_start_or_too_short_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="not a cold start"):
        copy_cold_start(tmp_path / "empty", tmp_path / "a", 128)
    short = _cold_start(tmp_path / "short", 128)
    with pytest.raises(SystemExit, match="128 positions, the episodes need 256"):
        copy_cold_start(short, tmp_path / "b", 256)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
