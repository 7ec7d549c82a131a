"""Provenance (spopp/files/provenance.py): run.json records the code that made a run, and the commands
that compare runs (`spopp map`, `spopp ablate`, `spopp report`) refuse runs from different code, or
let them through flagged with `--mixed-code flag`; runs recorded before provenance existed are "not
recorded", a value of their own, and their pages say so.

The code is read from real git repositories made here; the comparisons from run folders written
here (run.json and evals.jsonl, as the launcher and the evaluator write them).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from services.study.map import cell_name, summarize
from services.study.render import markdown
from spopp.files import provenance
from spopp.files.provenance import MixedCode, agree, check, code, describe, relaunched

ROOT = Path(__file__).resolve().parents[2]
GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _commit(repo: Path, message: str) -> str:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", message)
    return _git(repo, "rev-parse", "HEAD").strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A checkout with a package, a lock, docs and a committed run folder."""
    root = tmp_path / "checkout"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text("X = 1\n")
    (root / "requirements.lock").write_text("torch==2.13.0\n")
    (root / "docs").mkdir()
    (root / "docs" / "page.md").write_text("prose\n")
    (root / "runs" / "a").mkdir(parents=True)
    (root / "runs" / "a" / "run.json").write_text("{}\n")
    _git(root, "init", "-q")
    _commit(root, "first")
    return root


@pytest.mark.process  # git
def test_code_is_the_commit_the_lock_and_whether_tracked_code_changed(repo, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    head = _git(repo, "rev-parse", "HEAD").strip()
    lock = hashlib.sha256((repo / "requirements.lock").read_bytes()).hexdigest()
    assert code(repo) == {"commit": head, "dirty": False, "lock_sha256": lock, "source": "git"}
    # Untracked files (a new run folder), prose, docs and the run's own folder do not make it dirty.
    (repo / "runs" / "b").mkdir()
    (repo / "runs" / "b" / "run.json").write_text("{}\n")
    (repo / "docs" / "page.md").write_text("edited prose\n")
    (repo / "runs" / "a" / "run.json").write_text('{"status": "running"}\n')
    assert code(repo, exclude=[repo / "runs" / "a"])["dirty"] is False
    assert code(repo)["dirty_files"] == ["runs/a/run.json"]  # not excluded, it counts
    # A change to tracked code does, and is named.
    (repo / "pkg" / "mod.py").write_text("X = 2\n")
    dirty = code(repo, exclude=[repo / "runs" / "a"])
    assert dirty["dirty"] is True and dirty["dirty_files"] == ["pkg/mod.py"] and dirty["commit"] == head
    # The edit itself is hashed: read again, the same; another edit, another hash.
    assert code(repo, exclude=[repo / "runs" / "a"])["diff_sha256"] == dirty["diff_sha256"]
    (repo / "pkg" / "mod.py").write_text("X = 3\n")
    assert code(repo, exclude=[repo / "runs" / "a"])["diff_sha256"] != dirty["diff_sha256"]
    # Committed: a new commit, clean again; a new lock, a new hash.
    (repo / "requirements.lock").write_text("torch==2.14.0\n")
    second = _commit(repo, "second")
    now = code(repo)
    assert now["commit"] == second != head and now["dirty"] is False and now["lock_sha256"] != lock


@pytest.mark.process  # git
def test_outside_a_checkout_the_commit_is_null_with_why_or_the_one_given(tmp_path, repo, monkeypatch):
    monkeypatch.delenv(provenance.COMMIT_ENV, raising=False)
    bare = tmp_path / "app"  # like the images' /app: the sources without .git
    bare.mkdir()
    (bare / "requirements.lock").write_text("x\n")
    got = code(bare)
    assert got["commit"] is None and got["dirty"] is None and "why" in got
    assert got["lock_sha256"] == hashlib.sha256(b"x\n").hexdigest()
    # A package folder inside a checkout (an installed copy in a venv) is not that checkout.
    inner = code(repo / "pkg")
    assert inner["commit"] is None and "is not the root of a git checkout" in inner["why"]
    assert inner["lock_sha256"] is None
    monkeypatch.setenv(provenance.COMMIT_ENV, "abc123")
    assert code(bare) | {} == {"commit": "abc123", "dirty": None, "lock_sha256": got["lock_sha256"],
                               "source": provenance.COMMIT_ENV}  # fmt: skip
    assert code(repo)["source"] == "git"  # a checkout's own commit wins over the variable


def _code(commit: str, dirty: bool = False, diff: str | None = None) -> dict:
    extra = {"diff_sha256": diff * 64} if diff else {}
    return {"commit": commit * 40, "dirty": dirty, "lock_sha256": "f" * 64, "source": "git", **extra}


def test_runs_of_one_clean_commit_agree_and_others_are_refused_by_name():
    a, b = _code("a"), _code("b")
    same = check({"spo-s0": a, "spopp-s0": dict(a, dirty_files=[])}, "refuse", "x")
    assert same["problem"] is None and same["flagged"] is False and same["codes"][0]["runs"] == 2
    assert describe(same) == f"Code: commit {'a' * 12} (lock ffffffff) (2 runs)."
    with pytest.raises(MixedCode) as exc:
        check({"spo-s0": a, "spopp-s0": b}, "refuse", "cell c")
    message = str(exc.value)
    assert message.startswith("cell c: its runs do not come from one code")
    assert f"commit {'a' * 12} (lock ffffffff): spo-s0" in message
    assert f"commit {'b' * 12} (lock ffffffff): spopp-s0" in message and "--mixed-code flag" in message
    # Another lock under the same commit is other code too; so are other uncommitted changes, or
    # changes whose diff is unknown. One edited tree's runs share their code, and the page says so.
    with pytest.raises(MixedCode, match="different code"):
        check({"r1": a, "r2": dict(a, lock_sha256="0" * 64)}, "refuse", "x")
    with pytest.raises(MixedCode, match="different code"):
        check({"r1": _code("a", True, "1"), "r2": _code("a", True, "2")}, "refuse", "x")
    with pytest.raises(MixedCode, match="different code"):
        check({"r1": _code("a", dirty=True), "r2": _code("a", dirty=True)}, "refuse", "x")
    edited = check({"r1": _code("a", True, "1"), "r2": _code("a", True, "1")}, "refuse", "x")
    assert edited["problem"] is None
    assert (
        describe(edited)
        == f"Code: commit {'a' * 12} + uncommitted changes (diff 11111111) (lock ffffffff) (2 runs)."
    )
    # Flagged instead: the summary names each code's runs.
    flagged = check({"spo-s0": a, "spopp-s0": b}, "flag", "x")
    assert flagged["flagged"] is True and "different code" in flagged["problem"]
    assert [c["names"] for c in flagged["codes"]] == [["spo-s0"], ["spopp-s0"]]
    with pytest.raises(ValueError, match="choose refuse or flag"):
        check({}, "ignore", "x")


def test_not_recorded_is_a_value_of_its_own():
    old = agree({"r1": None, "r2": None})
    assert old == {"codes": [{"recorded": False, "runs": 2}], "problem": None, "flagged": False}
    assert "predate provenance" in describe(old) and "cannot be checked" in describe(old)
    with pytest.raises(
        MixedCode, match=f"not recorded: r2; .*commit {'a' * 12}|commit {'a' * 12}.*not recorded: r2"
    ):
        check({"r1": _code("a"), "r2": None}, "refuse", "x")


def test_a_run_resumed_on_other_code_is_its_own_code():
    a, b = _code("a"), _code("b")
    assert relaunched(None, a, resumed=False) == a
    assert relaunched(a, dict(a), resumed=True) == a  # the same code: nothing to keep
    moved = relaunched(a, b, resumed=True)
    assert moved["commit"] == "b" * 40 and moved["earlier_launches"] == [
        {"recorded": True, "commit": "a" * 40, "dirty": False, "lock_sha256": "f" * 64}
    ]
    assert relaunched(moved, b, resumed=True)["earlier_launches"] == moved["earlier_launches"]  # kept
    assert relaunched(None, b, resumed=True)["earlier_launches"] == [{"recorded": False}]  # pre-provenance
    with pytest.raises(MixedCode, match="resumed on other code: r1"):
        check({"r1": moved, "r2": b}, "refuse", "x")


# -- the map and the report over run folders ---------------------------------------------------------
def _run(folder: Path, arm: str, seed: int, rewards: list[float], code_: dict | None) -> None:
    (folder / "eval").mkdir(parents=True)
    record = {"run": folder.name, "arm": arm, "seed": seed, "status": "finished"}
    if code_ is not None:
        record["code"] = code_
    (folder / "run.json").write_text(json.dumps(record))
    (folder / "eval" / "evals.jsonl").write_text(
        "".join(json.dumps({"policy_version": 2 * i, "eval/sampled/reward_mean": r}) + "\n" for i, r in enumerate(rewards))
    )  # fmt: skip


def _cell(root: Path, codes: dict[tuple[str, int], dict | None]) -> str:
    cell = cell_name(1.0, 0.0)
    for (arm, seed), c in codes.items():
        _run(
            root / "cells" / cell / "runs" / f"{arm}-s{seed}",
            arm,
            seed,
            [0.1, 0.2 + 0.1 * (arm == "spopp")],
            c,
        )
    return cell


def test_a_map_cell_of_runs_from_different_code_is_refused_or_flagged(tmp_path):
    a, b = _code("a"), _code("b")
    cell = _cell(tmp_path, {("spo", 0): a, ("spopp", 0): a, ("spo", 1): a, ("spopp", 1): b})
    grid = ([1.0], [0.0], ["spo", "spopp"], {cell: [0, 1]})
    with pytest.raises(MixedCode) as exc:
        summarize(tmp_path, *grid)
    assert f"cell {cell}" in str(exc.value) and f"commit {'b' * 12} (lock ffffffff): spopp-s1" in str(
        exc.value
    )
    result = summarize(tmp_path, *grid, mixed_code="flag")
    [c] = result["cells"]
    assert c["code"]["flagged"] is True and {e["runs"] for e in c["code"]["codes"]} == {3, 1}
    md = markdown(result)
    assert (
        f"Code: commit {'a' * 12} (lock ffffffff) (3 runs); commit {'b' * 12} (lock ffffffff) (1 run)." in md
    )
    assert f"**Mixed code, let through by `--mixed-code flag`:** {cell}: different code" in md


def test_a_map_of_one_commit_names_it_and_one_of_unrecorded_runs_says_so(tmp_path):
    a = _code("a")
    cell = _cell(tmp_path / "one", {("spo", 0): a, ("spopp", 0): a})
    result = summarize(tmp_path / "one", [1.0], [0.0], ["spo", "spopp"], {cell: [0]})
    assert result["cells"][0]["code"]["problem"] is None
    assert f"Code: commit {'a' * 12} (lock ffffffff) (2 runs)." in markdown(result)
    cell = _cell(tmp_path / "old", {("spo", 0): None, ("spopp", 0): None})
    result = summarize(tmp_path / "old", [1.0], [0.0], ["spo", "spopp"], {cell: [0]})
    assert result["cells"][0]["code"] == {
        "codes": [{"recorded": False, "runs": 2}],
        "problem": None,
        "flagged": False,
    }
    assert "Code: not recorded: these runs predate provenance" in markdown(result)
    # A map.json written before cells recorded their code renders the same sentence.
    del result["cells"][0]["code"]
    assert "Code: not recorded: these runs predate provenance" in markdown(result)


def test_the_committed_map_and_reports_say_their_runs_code_was_not_recorded():
    page = (ROOT / "docs" / "map" / "map.md").read_text()
    assert "Code: not recorded: these runs predate provenance" in page
    result = json.loads((ROOT / "docs" / "map" / "map.json").read_text())
    assert all(c["code"]["codes"][0]["recorded"] is False for c in result["cells"])
    results = (ROOT / "docs" / "results.md").read_text()
    assert results.count("Code: not recorded: these runs predate provenance") == 3  # 2 reports and the map


def test_the_report_refuses_runs_from_different_code_or_flags_them(tmp_path):
    from services.report.cli import command

    a, b = _code("a"), _code("b")
    _run(tmp_path / "runs" / "spo-s0", "spo", 0, [0.1, 0.2], a)
    _run(tmp_path / "runs" / "spopp-s0", "spopp", 0, [0.1, 0.3], b)
    r = CliRunner().invoke(command, [str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    assert r.exit_code == 1 and "spopp report: its runs do not come from one code" in r.output
    assert f"commit {'b' * 12} (lock ffffffff): spopp-s0" in r.output and not (tmp_path / "out").exists()
    env = {"SPOPP_MIXED_CODE": "flag"}  # the setting, as the variable
    r = CliRunner().invoke(command, [str(tmp_path / "runs"), "--out", str(tmp_path / "out")], env=env)
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["code"]["flagged"] is True and [run["code"]["commit"] for run in report["runs"]] == [
        "a" * 40, "b" * 40,
    ]  # fmt: skip
    md = (tmp_path / "out" / "report.md").read_text()
    assert "**Mixed code, let through by `--mixed-code flag`:** different code" in md
    # One commit: named, nothing flagged.
    _run(tmp_path / "same" / "spo-s0", "spo", 0, [0.1, 0.2], a)
    _run(tmp_path / "same" / "spopp-s0", "spopp", 0, [0.1, 0.3], a)
    r = CliRunner().invoke(command, [str(tmp_path / "same"), "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.output)["code"]["flagged"] is False
    assert "Mixed code" not in CliRunner().invoke(command, [str(tmp_path / "same")]).output


@pytest.mark.process  # git, on this checkout
@pytest.mark.parametrize("command", ["map", "ablate"])
def test_map_and_ablate_refuse_before_any_run_when_a_run_in_out_is_other_code(tmp_path, command):
    from services.study.cli import ablate_command, map_command

    config = tmp_path / "base.yaml"
    config.write_text("model: m\ntasks: t.jsonl\nenv: toy-calc\n")
    out = tmp_path / "out"
    folder = (
        out / "cells" / cell_name(0.0, 0.0) / "runs" / "spo-s0"
        if command == "map"
        else out / "runs" / "spo-s0"
    )
    _run(folder, "spo", 0, [0.1], _code("0"))
    args = [str(config), "--out", str(out), "--seeds", "0", "--arms", "spo,spopp"]
    if command == "map":
        args += ["--coupling", "0", "--latency", "0"]
    r = CliRunner().invoke(map_command if command == "map" else ablate_command, args)
    assert r.exit_code == 1, r.output
    assert f"spopp {command} --out {out}: its runs do not come from one code" in r.output
    assert f"commit {'0' * 12} (lock ffffffff): {folder}" in r.output and "this checkout" in r.output
    assert not (out / "protocol.json").exists() and not (out / "runs" / "spopp-s0").exists()  # nothing ran


@pytest.mark.process  # git
def test_a_finished_comparison_is_not_refused_for_this_checkouts_code(tmp_path):
    """Run again after a pull, a comparison whose runs are all finished runs nothing: only its runs'
    code counts, so one code elsewhere passes, and two codes are still refused."""
    from services.study.cli import _check_code

    out = tmp_path / "out"
    spo, spopp = out / "runs" / "spo-s0", out / "runs" / "spopp-s0"
    _run(spo, "spo", 0, [0.1], _code("0"))
    _run(spopp, "spopp", 0, [0.2], _code("0"))
    _check_code([spo, spopp], out, "refuse", "x")  # commit 000… is not this checkout's: no matter
    record = json.loads((spopp / "run.json").read_text())
    (spopp / "run.json").write_text(json.dumps({**record, "code": _code("1")}))
    with pytest.raises(click.ClickException, match="different code"):
        _check_code([spo, spopp], out, "refuse", "x")
    (spopp / "run.json").write_text(json.dumps({**record, "status": "stopped"}))  # one to resume
    with pytest.raises(click.ClickException, match="this checkout"):
        _check_code([spo, spopp], out, "refuse", "x")  # now this checkout's code counts
    # A map's folders are only those so far: until its map.json exists, this checkout counts.
    (spopp / "run.json").write_text(json.dumps(record))
    with pytest.raises(click.ClickException, match="this checkout"):
        _check_code([spo, spopp], out, "refuse", "x", planned=False)


@pytest.mark.process  # git
def test_by_default_the_code_is_this_checkouts_and_its_lock_is_found():
    """The default root is the folder that holds the spopp package, wherever the module sits in
    it: the checkout's lock is hashed, and the commit is the checkout's HEAD."""
    root = ROOT
    assert provenance.ROOT == root
    got = provenance.code()
    assert got["lock_sha256"] == hashlib.sha256((root / "requirements.lock").read_bytes()).hexdigest()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
    assert got["commit"] == head.stdout.strip()
