"""`spopp init`, the deployments' init step, against a real tracker process: it creates the run and
loads the prior; a second init changes nothing; a conflicting recipe or prior is refused."""

from __future__ import annotations

import subprocess

import pytest
from procs import cli

from runtime.envs.toy_calc import write_toy_calc_tasks
from runtime.tasks import load_tasks
from spopp.files.priors import build_prior, write_prior
from spopp.settings.base import environ_without_settings

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)


def _init(tracker_url: str, *args: str) -> subprocess.CompletedProcess:
    env = environ_without_settings()
    return subprocess.run(
        cli("init", "--tracker", tracker_url, *args), capture_output=True, text=True, timeout=120, env=env
    )


def test_init_creates_the_run_loads_the_prior_and_a_second_init_changes_nothing(
    tracker, client, run_name, tmp_path
):
    train, _ = write_toy_calc_tasks(tmp_path / "data", seed=0, n_train=12, n_heldout=4)
    ids = [t.task_id for t in load_tasks(train)]
    prior = build_prior({t: [float(i % 3 == 0)] * 4 for i, t in enumerate(ids)}, 8.0, {})
    write_prior(tmp_path / "prior.json", prior)
    args = ["--run", run_name, "--recipe", "spopp", "--base-snapshot", "/models/base", "--tasks", str(train),
            "--prior", str(tmp_path / "prior.json"), "--run-config", "{retention: 0.9, lease_seconds: 60}"]  # fmt: skip

    first = _init(tracker.url, *args)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "tasks 12 created, 0 unchanged" in first.stdout
    run = client.get_run(run_name)
    assert run.config.recipe == "spopp" and run.config.retention == 0.9 and run.snapshot == "/models/base"
    assert run.counts.tasks == 12
    values = {v.task_id: v for v in client.values(run_name, ids)}
    for t in prior.tasks:  # the prior file's alpha0 and beta0, as given
        assert values[t.task_id].alpha == t.alpha0 and values[t.task_id].beta == t.beta0
    before = client.export(run_name)

    second = _init(tracker.url, *args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "tasks 0 created, 12 unchanged" in second.stdout and "is finished" not in second.stdout
    assert client.export(run_name) == before and client.get_run(run_name).policy_version == 0

    # A finished run: init still succeeds (nothing to create) and says there is nothing to train.
    client.finish(run_name, 0)
    finished = _init(tracker.url, *args)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert (
        f"run {run_name} is finished (version 0," in finished.stdout and "nothing to train" in finished.stdout
    )
    assert client.export(run_name) == before

    # The budget was not given at creation: any later init takes the run as it is.
    other_recipe = _init(tracker.url, *[("spo" if a == "spopp" else a) for a in args])
    assert other_recipe.returncode == 1 and "with another config" in other_recipe.stderr

    write_prior(tmp_path / "prior.json", build_prior({t: [1.0] for t in ids}, 8.0, {}), overwrite=True)
    other_prior = _init(tracker.url, *args)
    assert other_prior.returncode == 1 and "another prior" in other_prior.stderr
    assert client.export(run_name) == before  # nothing half applied


def test_init_fixes_the_budget_at_creation_and_refuses_another_naming_both(
    tracker, client, run_name, tmp_path
):
    """The compose failure this prevents: a stack created with 30 updates, then `up --scale` from an
    env file saying 6: init refuses (and so does the learner) instead of finishing at version 6."""
    train, _ = write_toy_calc_tasks(tmp_path / "data", seed=2, n_train=4, n_heldout=2)
    args = ["--run", run_name, "--recipe", "spopp", "--base-snapshot", "/m", "--tasks", str(train)]
    first = _init(tracker.url, *args, "--max-updates", "30")
    assert first.returncode == 0, first.stderr
    assert client.get_run(run_name).config.max_updates == 30
    assert _init(tracker.url, *args, "--max-updates", "30").returncode == 0  # the same: nothing changes
    before = client.export(run_name)
    for asked in ("6", "40"):  # init never grows a budget either: launch or POST /budget does
        r = _init(tracker.url, *args, "--max-updates", asked)
        assert (
            r.returncode == 1
            and f"is 30 updates, fixed at its creation; this asks for {asked}" in r.stderr
            and "budget of run" in r.stderr
        )
    assert client.get_run(run_name).config.max_updates == 30 and client.export(run_name) == before
    r = _init(tracker.url, *args, "--run-config", "{max_updates: 6}")
    assert r.returncode == 1 and "run_config.max_updates: give it as its own setting" in r.stderr


def test_init_refuses_bad_input_before_touching_the_tracker(tracker, client, run_name, tmp_path):
    train, _ = write_toy_calc_tasks(tmp_path / "data", seed=1, n_train=4, n_heldout=2)
    base = ["--run", run_name, "--recipe", "spopp", "--base-snapshot", "/m", "--tasks", str(train)]
    cases = {
        "does not exist": ["--tasks", str(tmp_path / "none.jsonl")],
        "run_config.recipe: give it as its own setting": ["--run-config", "{recipe: spo}"],
        "run_config: retention": ["--run-config", "{retention: 2}"],
        "names 1 tasks that are not in": ["--prior", str(tmp_path / "stray.json")],
    }
    write_prior(tmp_path / "stray.json", build_prior({"stray": [1.0]}, 8.0, {}))
    for expect, extra in cases.items():
        r = _init(tracker.url, *base, *extra)
        assert r.returncode == 1 and expect in r.stderr, (expect, r.stderr)
    r = _init("http://127.0.0.1:9", *base, "--wait-seconds", "2")
    assert r.returncode == 1 and "was not ready within 2 s" in r.stderr
    assert client.put_run(run_name, {"recipe": "spo"}).policy_version == 0  # the name was never taken
