"""`spopp prior` (services/evaluator/prior.py): the cold-start policy's offline prompt values.

A scripted policy, whose answer is a function of the task and the episode's seed, fixes exactly
how many of each task's rollouts succeed; the prior file must hold those counts and the closed-form
Jeffreys prior m(s+1/2)/(n+1), m(n-s+1/2)/(n+1), read back through `read_prior`, in the form the
tracker's PUT /tasks takes, and be the same file for the same settings. Refusals (an existing
file, a folder that is not a model, a missing or empty task file, prompts over the budget) come
before any engine is built. One real run of `python -m services.cli prior` on the untrained toy
model (toy-calc, 8 tasks x 2 rollouts) checks the command end to end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from runtime.engines.base import Engine, Generation, SamplingConfig
from runtime.envs.toy_calc import generate_toy_calc_tasks, write_toy_calc_tasks
from services.config.prior import PriorSettings
from services.evaluator.scorer import sample_seed
from spopp.api.tracker_api import PutTasks
from spopp.files.priors import read_prior
from spopp.settings.base import SettingsError, environ_without_settings

N_TASKS, ROLLOUTS, MASS, SEED = 10, 8, 8.0, 5
EPISODE = dict(env="toy-calc", max_turns=2, max_tokens_per_turn=16, max_total_tokens=64)


@pytest.fixture(scope="module")
def toy_model(tmp_path_factory) -> Path:
    from tools.toy_model import build_toy_model

    return build_toy_model(tmp_path_factory.mktemp("toy") / "model")


@pytest.fixture(scope="module")
def train_file(tmp_path_factory) -> Path:
    train, _ = write_toy_calc_tasks(tmp_path_factory.mktemp("tasks"), seed=3, n_train=N_TASKS, n_heldout=2)
    return train


def _wins(i: int) -> int:
    """Successes wanted for task i: every count from 0/8 to 8/8 occurs."""
    return (i * 5) % (ROLLOUTS + 1)


class ScriptedPolicy(Engine):
    """Answers a toy-calc prompt in one turn: right when the table says (task, seed) wins, else off
    by one. The table is keyed by the seeds the scorer promises (`sample_seed(seed, task, rollout)`),
    so a change of seeds or of the sampling settings fails loudly rather than shifting counts."""

    def __init__(self, tokenizer, wins: dict[tuple[str, int], bool], temperature: float) -> None:
        self.tokenizer = tokenizer
        self.wins = wins
        self.temperature = temperature
        self.calls: list[tuple[str, int]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        assert sampling.temperature == self.temperature and sampling.seed is not None
        prompt = self.tokenizer.decode(prompt_ids)
        expr = re.fullmatch(r"<\|user\|>([0-9*+]+)<\|end\|><\|assistant\|>", prompt).group(1)
        self.calls.append((expr, sampling.seed))
        value = eval(expr, {"__builtins__": {}})  # noqa: S307 - digits, * and + from our own generator
        text = f"<ans>{value if self.wins[expr, sampling.seed] else value + 1}</ans>"
        await asyncio.sleep(0)  # let the other episodes in flight interleave
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return Generation(ids, [-0.5] * len(ids), "stop", text)

    async def load_weights(self, snapshot_dir) -> None:
        raise AssertionError("the prior plays the base policy only")

    async def close(self) -> None:
        pass


def _scripted(toy_model: Path, seed: int = SEED, temperature: float = 1.0) -> ScriptedPolicy:
    from transformers import AutoTokenizer

    tasks = generate_toy_calc_tasks(N_TASKS, 3, "train")
    wins = {
        (t.prompt, sample_seed(seed, i, j)): j < _wins(i)
        for i, t in enumerate(tasks)
        for j in range(ROLLOUTS)
    }  # fmt: skip
    return ScriptedPolicy(AutoTokenizer.from_pretrained(toy_model), wins, temperature)


def _settings(toy_model: Path, train_file: Path, out: Path, **kw) -> PriorSettings:
    base = dict(model=toy_model, tasks=train_file, out=out, rollouts=ROLLOUTS, prior_mass=MASS, seed=SEED,
                concurrency=4, **EPISODE)  # fmt: skip
    return PriorSettings(**{**base, **kw})


def _without_times(path: Path) -> dict:
    data = json.loads(path.read_text())
    assert data.pop("created") > 0 and data.pop("seconds") >= 0
    return data


# -- the prior, on a scripted policy ----------------------------------------------------------------


def test_prior_of_a_scripted_policy_is_the_closed_form(toy_model, train_file, tmp_path, caplog):
    from services.evaluator.prior import run_prior

    engine = _scripted(toy_model)
    out = tmp_path / "prior.json"
    with caplog.at_level(logging.INFO, logger="spopp.prior"):
        prior = run_prior(_settings(toy_model, train_file, out), engine=engine, progress_every=0.0)
    tasks = generate_toy_calc_tasks(N_TASKS, 3, "train")
    # Every (task, rollout) played once, with its own seed.
    assert len(engine.calls) == N_TASKS * ROLLOUTS == len(set(engine.calls))
    back = read_prior(out)
    assert back == prior
    assert [t.task_id for t in back.tasks] == [t.task_id for t in tasks]  # the task file's order
    assert {_wins(i) for i in range(N_TASKS)} >= {0, ROLLOUTS}  # 0/n and n/n both occur
    for i, t in enumerate(back.tasks):
        s, n = _wins(i), ROLLOUTS
        assert (t.successes, t.rollouts) == (s, n)
        assert t.alpha0 == pytest.approx(MASS * (s + 0.5) / (n + 1), rel=1e-12)
        assert t.beta0 == pytest.approx(MASS * (n - s + 0.5) / (n + 1), rel=1e-12)
    meta = back.meta
    assert meta["format"] == "spopp-prior/1" and meta["prior_mass"] == MASS and meta["rollouts"] == ROLLOUTS
    assert meta["model"] == str(toy_model.resolve()) and meta["tasks_file"] == str(train_file.resolve())
    assert (meta["env"], meta["temperature"], meta["seed"]) == ("toy-calc", 1.0, SEED)
    wins = sum(_wins(i) for i in range(N_TASKS))
    assert meta["success_rate"] == pytest.approx(wins / (N_TASKS * ROLLOUTS))
    bodies = back.task_bodies()
    assert bodies[0] == {
        "task_id": tasks[0].task_id,
        "alpha0": back.tasks[0].alpha0,
        "beta0": back.tasks[0].beta0,
    }
    PutTasks.model_validate({"tasks": bodies})  # the tracker's PUT /v1/runs/{run}/tasks body
    # Progress while playing, on the log.
    lines = [r.getMessage() for r in caplog.records if r.name == "spopp.prior"]
    assert any(re.fullmatch(rf"prior: {N_TASKS * ROLLOUTS}/{N_TASKS * ROLLOUTS} episodes, success so far "
                            r"0\.\d\d, \d+ s", x) for x in lines), lines  # fmt: skip


def test_the_same_settings_give_the_same_file(toy_model, train_file, tmp_path):
    from services.evaluator.prior import run_prior

    for name in ("a.json", "b.json"):
        run_prior(_settings(toy_model, train_file, tmp_path / name), engine=_scripted(toy_model))
    assert _without_times(tmp_path / "a.json") == _without_times(tmp_path / "b.json")
    # Another seed base: other seeds, so the scripted policy (keyed by seed) would not know them.
    with pytest.raises(ExceptionGroup) as info:
        run_prior(
            _settings(toy_model, train_file, tmp_path / "c.json", seed=SEED + 1), engine=_scripted(toy_model)
        )
    assert info.group_contains(KeyError)
    assert not (tmp_path / "c.json").exists()


def test_max_tasks_and_overwrite(toy_model, train_file, tmp_path):
    from services.evaluator.prior import PriorError, run_prior

    out = tmp_path / "prior.json"
    run_prior(_settings(toy_model, train_file, out, max_tasks=3), engine=_scripted(toy_model))
    assert [t.successes for t in read_prior(out).tasks] == [_wins(0), _wins(1), _wins(2)]
    with pytest.raises(PriorError, match="exists"):
        run_prior(_settings(toy_model, train_file, out), engine=_scripted(toy_model))
    run_prior(_settings(toy_model, train_file, out, overwrite=True), engine=_scripted(toy_model))
    assert len(read_prior(out).tasks) == N_TASKS


def test_settings_bounds_and_environment():
    base = {"model": "m", "tasks": "t.jsonl", "out": "p.json"}
    s = PriorSettings.resolve(env={"SPOPP_PRIOR_ROLLOUTS": "4"}, flags=base)
    assert (s.rollouts, s.prior_mass, s.overwrite, s.env, s.engine) == (
        4,
        8.0,
        False,
        "math-tir",
        "transformers",
    )
    for bad in ({"rollouts": "0"}, {"rollouts": "1025"}, {"prior_mass": "0"}, {"prior_mass": "2e6"},
                {"temperature": "0"}, {"env": "chess"}):  # fmt: skip
        with pytest.raises(SettingsError):
            PriorSettings.resolve(env={}, flags={**base, **bad})
    with pytest.raises(SettingsError, match="below the tracker's"):
        PriorSettings.resolve(env={}, flags={**base, "prior_mass": "1e-5", "rollouts": "16"})
    with pytest.raises(SettingsError, match="out is required"):
        PriorSettings.resolve(env={}, flags={"model": "m", "tasks": "t.jsonl"})
    with pytest.raises(SettingsError, match="unknown environment variable"):
        PriorSettings.resolve(env={"SPOPP_PRIOR_ROLOUTS": "4"}, flags=base)


# -- refusals, before any engine -------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """Building an engine fails the test: refusals must come first."""
    import runtime.engines.factory

    def refuse(*_a, **_k):
        raise AssertionError("an engine was built before the settings were refused")

    monkeypatch.setattr(runtime.engines.factory, "make_engine", refuse)


def _invoke(*args: str):
    from services.evaluator.cli import prior_command

    env = {k: None for k in os.environ if k.startswith("SPOPP_")}
    return CliRunner().invoke(prior_command, list(args), env=env)


def test_refusals_come_before_the_engine(no_engine, toy_model, train_file, tmp_path):
    common = ["--env", "toy-calc", "--tasks", str(train_file), "--model", str(toy_model)]
    taken = tmp_path / "taken.json"
    taken.write_text("{}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad_ids = tmp_path / "bad.jsonl"
    bad_ids.write_text(json.dumps({"task_id": "has space", "prompt": "1*2+3", "answer": "5"}) + "\n")
    cases = [
        ([*common, "--out", str(taken)], "prior file .*taken.json exists; every run of a comparison must share"),
        ([*common, "--out", str(tmp_path)], "is a directory"),
        ([*common, "--model", str(tmp_path), "--out", str(tmp_path / "p.json")], "is not a model folder"),
        ([*common, "--tasks", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "p.json")], "does not exist"),
        ([*common, "--tasks", str(empty), "--out", str(tmp_path / "p.json")], "has no tasks"),
        ([*common, "--tasks", str(bad_ids), "--out", str(tmp_path / "p.json")], "not ids the tracker accepts"),
        ([*common, "--max-total-tokens", "12", "--out", str(tmp_path / "p.json")],
         "10 training task prompts leave no room under max_total_tokens=12"),
    ]  # fmt: skip
    for args, message in cases:
        result = _invoke(*args)
        assert result.exit_code == 1, (args, result.output)
        assert re.search(message, result.output), (message, result.output)
    assert taken.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "empty.jsonl", "taken.json"]


def test_cli_in_process_on_the_toy_model(toy_model, train_file, tmp_path):
    out = tmp_path / "prior.json"
    result = _invoke("--model", str(toy_model), "--tasks", str(train_file), "--out", str(out), "--rollouts", "2",
                     "--max-tasks", "4", "--env", "toy-calc", "--max-turns", "2", "--max-tokens-per-turn", "16",
                     "--max-total-tokens", "64", "--engine-options", "{max_batch: 8}")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (
        f"prior: wrote {out.resolve()}" in result.output
        and "tasks 4, 2 rollouts each (8 episodes)" in result.output
    )
    prior = read_prior(out)
    assert len(prior.tasks) == 4 and all(t.alpha0 + t.beta0 == pytest.approx(MASS) for t in prior.tasks)


# -- the real command, as a process -----------------------------------------------------------------


@pytest.mark.process
def test_prior_command_as_a_process(toy_model, train_file, tmp_path):
    """`python -m services.cli prior` on the untrained toy model: 8 tasks x 2 rollouts."""
    env = environ_without_settings()
    env.update(OMP_NUM_THREADS="1", SPOPP_PRIOR_ENV="toy-calc")
    out = tmp_path / "prior.json"
    (tmp_path / "p.yaml").write_text(
        f"model: {toy_model}\ntasks: {train_file}\nrollouts: 2\nmax_tasks: 8\nmax_turns: 2\n"
        "max_tokens_per_turn: 16\nmax_total_tokens: 64\nengine_options: {max_batch: 16}\n"
    )
    base = [sys.executable, "-m", "services.cli", "prior", "--config", str(tmp_path / "p.yaml")]
    t0 = time.perf_counter()
    done = subprocess.run([*base, "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    print(f"spopp prior (8 tasks x 2 rollouts): {time.perf_counter() - t0:.1f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tasks 8, 2 rollouts each (16 episodes), prior_mass 8" in done.stdout
    data = json.loads(out.read_text())
    assert data["format"] == "spopp-prior/1" and data["env"] == "toy-calc" and data["rollouts"] == 2
    ids = [t.task_id for t in generate_toy_calc_tasks(N_TASKS, 3, "train")][:8]
    assert [t["task_id"] for t in data["tasks"]] == ids
    for t in data["tasks"]:
        assert t["rollouts"] == 2 and t["alpha0"] + t["beta0"] == pytest.approx(data["prior_mass"])
    assert read_prior(out).prior_mass == 8.0
    before = out.read_bytes()

    # An existing prior is not replaced without --overwrite; a folder that is not a model is refused.
    done = subprocess.run([*base, "--out", str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "exists" in done.stderr and "--overwrite" in done.stderr, done.stderr
    assert out.read_bytes() == before
    other = tmp_path / "other.json"
    done = subprocess.run([*base, "--out", str(other), "--model", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode != 0 and "not a model folder (no config.json)" in done.stderr, done.stderr
    assert not other.exists()
