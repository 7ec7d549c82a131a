"""The tiny test model is built once per machine, in the model cache, and copied from there:
`spopp model tiny` copies it (a folder already holding something is refused), `spopp env check`
without a model reads it, and many processes that ask at once get one build. The session's
`tiny_model` fixture is itself the cold build, through the same function (tests/fixtures_model.py).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.tiny_model import cached_tiny_model, tiny_model_folder, tiny_model_key
from spopp.files.model_cache import built_once, models_cache


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_the_key_is_fixed_for_a_seed_and_differs_between_seeds():
    assert tiny_model_key(0) == tiny_model_key(0)
    assert tiny_model_key(0) != tiny_model_key(1)


def test_the_cache_is_the_setting_else_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("SPOPP_MODEL_CACHE", str(tmp_path / "c"))
    assert models_cache() == tmp_path / "c"
    monkeypatch.delenv("SPOPP_MODEL_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models_cache() == tmp_path / "home" / ".cache" / "spopp" / "models"


def test_the_fixture_is_the_cached_model_and_asking_again_builds_nothing(tiny_model, monkeypatch):
    def must_not_build(*_a, **_k):
        raise AssertionError("built again although the cache holds it")

    monkeypatch.setattr("runtime.tiny_model.build_tiny_model", must_not_build)
    assert cached_tiny_model(tiny_model.parent) == tiny_model == tiny_model_folder(tiny_model.parent)


def _build_slowly(target: str, counter: str) -> None:
    def build(folder: Path) -> None:
        with open(counter, "a") as f:  # one line per build
            f.write("built\n")
        folder.mkdir()
        time.sleep(0.3)  # long enough that the other processes arrive while it builds
        (folder / "weights").write_text("w")

    built_once(Path(target), build)


@pytest.mark.process
def test_processes_that_ask_at_once_get_one_build_and_never_half_a_folder(tmp_path):
    target, counter = tmp_path / "cache" / "m", tmp_path / "builds"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build_slowly, args=(str(target), str(counter))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert counter.read_text() == "built\n"
    assert (target / "weights").read_text() == "w"
    # Nothing left aside: the staging folder was renamed into place.
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def test_a_failed_build_leaves_nothing_and_the_next_call_builds(tmp_path):
    def fail(folder: Path) -> None:
        folder.mkdir()
        (folder / "half").write_text("x")
        raise RuntimeError("out of disk")

    target = tmp_path / "cache" / "m"
    with pytest.raises(RuntimeError, match="out of disk"):
        built_once(target, fail)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == [".m.lock"]
    built_once(target, lambda f: (f.mkdir(), (f / "ok").write_text("1")))
    assert (target / "ok").read_text() == "1"


@pytest.mark.process
def test_spopp_model_tiny_copies_the_cached_model_and_refuses_a_full_folder(
    tiny_model, model_cache_env, tmp_path
):
    env = {**os.environ, **model_cache_env}
    out = tmp_path / "models" / "tiny"
    r = subprocess.run([sys.executable, "-m", "services.cli", "model", "tiny", str(out)],
                       env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "building" not in r.stderr  # the cache held it: a copy, not a build
    assert r.stdout.strip() == str(out)
    assert _digest(out) == _digest(tiny_model)
    # A copy, not a link: changing it leaves the cache as it was.
    (out / "config.json").write_text("{}")
    assert _digest(tiny_model)["config.json"] != hashlib.sha256(b"{}").hexdigest()
    again = subprocess.run([sys.executable, "-m", "services.cli", "model", "tiny", str(out)],
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert again.returncode != 0 and "is not empty" in again.stderr
