"""The evaluator (services/evaluator/) on the tiny model, real sandbox and verifier, real tracker.

In process: the Scorer's metrics are the aggregates of the episodes it returns, an impossible
task scores 0, an evaluation is a function of the weights, unreadable snapshots and over-budget
prompts are refused; the records survive a cut write; holds follow their rules in the learner's
pruning. As processes (`python -m services.cli evaluator run`): the follower scores each k-th
published version once and in order, catches up after a SIGKILL without scoring a version twice,
records pruned or unreadable versions as skipped, and holds exactly what it still needs (and
nothing once its hold has expired). Snapshots are perturbed copies of the tiny model published
under `snapshots/vNNNNNN/` at a real tracker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from procs import cli, running
from service_procs import STEPS_PER_VERSION, evaluator_args, publish, recorded

from runtime.envs.base import Task
from runtime.tasks import generate_arithmetic_tasks, write_jsonl
from services.config.evaluator import EvaluatorSettings
from services.evaluator.scorer import sample_seed
from services.learner.snapshot import prune_snapshots
from spopp.files.snapshots import (
    Hold,
    hold_file,
    list_snapshots,
    read_holds,
    read_manifest,
    remove_hold,
    version_dirname,
    write_hold,
)
from spopp.machine.wait import wait_until
from spopp.settings.base import environ_without_settings
from tools.tiny_model import perturb_weights

N_TASKS, K = 6, 3


def _settings(tasks_file: Path, **kw) -> EvaluatorSettings:
    settings = dict(
        run="r", tasks=tasks_file, samples=K, max_turns=2, max_tokens_per_turn=48, max_total_tokens=600,
        concurrency=8, engine_options={"max_batch": 16},
    )  # fmt: skip
    return EvaluatorSettings(**{**settings, **kw})


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _scores(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(("_s", "seconds"))}


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    tasks = generate_arithmetic_tasks(N_TASKS, seed=123)
    # A task whose answer no response can match: its episodes must all score 0.
    tasks.append(Task(task_id="impossible", prompt=tasks[0].prompt, answer="-987654321"))
    path = tmp_path_factory.mktemp("eval") / "held_out.jsonl"
    write_jsonl(tasks, path)
    return path


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


@pytest.fixture(scope="module")
def scorer(tiny_model, held_out, runner):
    from services.evaluator.scorer import Scorer

    sc = runner.run(Scorer.open(_settings(held_out), tiny_model))
    yield sc
    runner.run(sc.close())


@pytest.fixture(scope="module")
def other_model(tiny_model, tmp_path_factory) -> Path:
    return perturb_weights(tiny_model, tmp_path_factory.mktemp("other") / "v000001", scale=0.3, seed=7)


# -- the scorer, in process --------------------------------------------------------------------


@pytest.mark.process
def test_metrics_are_the_episodes_aggregates(scorer, tiny_model, runner):
    result = runner.run(scorer.score(tiny_model))
    m, rows = result.metrics, result.episodes
    assert len(rows) == (N_TASKS + 1) * (1 + K)
    by_mode = defaultdict(list)
    for r in rows:
        by_mode["greedy" if r["mode"] == "greedy" else "sampled"].append(r)
    assert len(by_mode["greedy"]) == N_TASKS + 1 and len(by_mode["sampled"]) == (N_TASKS + 1) * K
    for mode, eps in by_mode.items():
        assert m[f"eval/{mode}/reward_mean"] == pytest.approx(sum(r["reward"] for r in eps) / len(eps))
        assert m[f"eval/{mode}/success_rate"] == pytest.approx(sum(r["reward"] >= 1 for r in eps) / len(eps))
        assert m[f"eval/{mode}/response_tokens_mean"] == pytest.approx(
            sum(r["response_tokens"] for r in eps) / len(eps)
        )
        assert m[f"eval/{mode}/turns_mean"] == pytest.approx(sum(r["turns"] for r in eps) / len(eps))
    solved = defaultdict(bool)
    for r in by_mode["sampled"]:
        solved[r["task_id"]] |= r["reward"] >= 1
    assert m["eval/sampled/pass_at_k"] == pytest.approx(sum(solved.values()) / (N_TASKS + 1))
    assert m["eval/sampled/k"] == K and m["eval/tasks"] == N_TASKS + 1
    assert all(r["reward"] == 0 for r in rows if r["task_id"] == "impossible")
    # Sampled episodes of one task use different seeds: not all K responses are the same text.
    per_task = defaultdict(set)
    for r in by_mode["sampled"]:
        per_task[r["task_id"]].add(r["response"])
    assert any(len(v) > 1 for v in per_task.values())
    assert len({r["seed"] for r in by_mode["sampled"]}) == (N_TASKS + 1) * K
    assert all(r["seed"] is None for r in by_mode["greedy"])
    assert all(r["reward"] in (0.0, 1.0) for r in rows)  # math-tir scores 0 or 1
    assert 0 < m["eval/sampled/truncated_rate"] <= 1  # 48 tokens a turn cut some samples
    print({k: round(v, 3) for k, v in m.items()})


@pytest.mark.process
def test_an_evaluation_is_a_function_of_the_weights(scorer, tiny_model, other_model, runner):
    first = runner.run(scorer.score(tiny_model))
    second = runner.run(scorer.score(other_model))
    assert second.metrics["eval/load_s"] > 0  # a new snapshot was loaded
    assert [r["response"] for r in first.episodes] != [r["response"] for r in second.episodes]
    again = runner.run(scorer.score(tiny_model))  # back to the base weights
    assert again.metrics["eval/load_s"] > 0
    assert again.episodes == first.episodes  # the same seeds, the same weights: the same episodes
    assert _scores(again.metrics) == _scores(first.metrics)


@pytest.mark.process
def test_an_unreadable_snapshot_is_refused_and_the_next_evaluation_works(
    scorer, tiny_model, other_model, runner, tmp_path
):
    from services.evaluator.scorer import SnapshotUnreadable

    first = runner.run(scorer.score(other_model))
    broken = perturb_weights(tiny_model, tmp_path / "broken", scale=0.3, seed=8)
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    for folder in (tmp_path / "gone", broken):
        with pytest.raises(SnapshotUnreadable, match="could not load the weights"):
            runner.run(scorer.score(folder))
        assert scorer.loaded is None  # whatever is asked next is loaded again
    again = runner.run(scorer.score(other_model))
    assert again.episodes == first.episodes


@pytest.mark.process
def test_prompts_over_the_budget_and_empty_task_files_are_refused(tiny_model, held_out, runner, tmp_path):
    from services.evaluator.scorer import Scorer

    with pytest.raises(ValueError, match="leave no room under max_total_tokens=20"):
        runner.run(Scorer.open(_settings(held_out, max_total_tokens=20), tiny_model))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no tasks"):
        runner.run(Scorer.open(_settings(empty), tiny_model))
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        runner.run(Scorer.open(_settings(held_out), tmp_path))


def test_summaries_count_successes_truncations_and_pass_at_k():
    from services.evaluator.scorer import Episode, pass_at_k, summarize

    def ep(reward: float, finish: str = "answer", tokens: int = 4) -> Episode:
        return Episode([0] * (2 + tokens), [0, 0] + [1] * tokens, [0.0] * (2 + tokens), reward, 1, finish, 2)

    eps = [(0, ep(1.0)), (0, ep(0.0, "max_tokens_per_turn", 8)), (1, ep(0.0)), (1, ep(0.0)), (2, ep(1.0))]
    m = summarize(eps, "x")
    assert m["x/reward_mean"] == pytest.approx(0.4) and m["x/success_rate"] == pytest.approx(0.4)
    assert m["x/truncated_rate"] == pytest.approx(0.2) and m["x/response_tokens_mean"] == pytest.approx(4.8)
    assert pass_at_k(eps) == pytest.approx(2 / 3)  # tasks 0 and 2 solved in some sample, task 1 never
    assert summarize([], "x") == {}


def test_settings_refuse_nothing_to_play_and_bad_holders(held_out):
    from spopp.settings.base import SettingsError

    with pytest.raises(SettingsError, match="nothing to score"):
        EvaluatorSettings.resolve(
            env={}, flags={"run": "r", "tasks": str(held_out), "greedy": False, "samples": "0"}
        )
    with pytest.raises(SettingsError, match="holder"):
        EvaluatorSettings.resolve(env={}, flags={"run": "r", "tasks": str(held_out), "holder": "../x"})
    s = EvaluatorSettings.resolve(env={"SPOPP_RUN": "team:run@1"}, flags={"tasks": str(held_out)})
    assert s.holder_id() == "evaluator-team_run_1"  # a file name, whatever the run is called


@pytest.mark.process
def test_vllm_engine_scores_like_the_transformers_engine(tiny_model, held_out, scorer, other_model, runner):
    """vLLM's async engine, built and driven on the scorer's loop; its greedy episodes agree with
    the transformers engine's on the same snapshots, and it really swaps weights."""
    from services.evaluator.scorer import Scorer

    options = {"max_model_len": 1024, "kv_cache_gib": 1, "seed": 0}
    sc = runner.run(Scorer.open(_settings(held_out, engine="vllm", engine_options=options), tiny_model))
    try:
        seen = {}
        for name, folder in (("base", tiny_model), ("other", other_model)):
            rows = runner.run(sc.score(folder)).episodes
            ref_rows = runner.run(scorer.score(folder)).episodes
            assert len(rows) == len(ref_rows)
            greedy = [r["response"] for r in rows if r["mode"] == "greedy"]
            ref_greedy = [r["response"] for r in ref_rows if r["mode"] == "greedy"]
            # Float summation order differs between the engines and a near-tie may flip a token
            # (then the rest of that episode differs), so most, not all, greedy episodes must be
            # identical; an engine on the wrong weights would agree on almost none.
            same = sum(a == b for a, b in zip(greedy, ref_greedy, strict=True))
            assert same > len(greedy) // 2, (greedy, ref_greedy)
            seen[name] = [r["response"] for r in rows]
        # With the same per-sample seeds, the same weights would give the same sampled responses.
        assert seen["base"] != seen["other"]
    finally:
        runner.run(sc.close())


@pytest.mark.process
def test_score_cli_scores_model_folders_outside_training(tiny_model, held_out, tmp_path):
    """`spopp evaluator score`: one JSON line per folder, labelled with its manifest; a folder
    that is not a model is refused by name before any engine starts."""
    other = perturb_weights(tiny_model, tmp_path / "v000004", scale=0.3, seed=7)
    (other / "manifest.json").write_text(json.dumps({"version": 4, "step": 8}))
    (tmp_path / "e.yaml").write_text(
        f"tasks: {held_out}\nsamples: 1\nmax_turns: 2\nmax_tokens_per_turn: 32\n"
    )
    base = cli("evaluator", "score", "--config", str(tmp_path / "e.yaml"), "--out-dir", str(tmp_path / "out"))
    env = environ_without_settings()
    env.update(OMP_NUM_THREADS="1", SPOPP_EVALUATOR_MAX_TOTAL_TOKENS="600")
    done = subprocess.run(
        [*base, "--snapshot", str(tiny_model), "--snapshot", str(other), "--samples", "2"],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines()]
    assert [(x["snapshot"], x["policy_version"], x["step"]) for x in lines] == [
        (str(tiny_model), 0, None),
        (str(other), 4, 8),
    ]
    assert all(x["eval/sampled/k"] == 2 and x["eval/tasks"] == N_TASKS + 1 for x in lines)
    for x in lines:
        rows = _jsonl(Path(x["episodes"]))
        assert len(rows) == (N_TASKS + 1) * 3
        greedy = [r for r in rows if r["mode"] == "greedy"]
        assert x["eval/greedy/success_rate"] == pytest.approx(
            sum(r["reward"] >= 1 for r in greedy) / len(greedy)
        )
    bad = subprocess.run(
        [*base, "--snapshot", str(tiny_model), "--snapshot", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode != 0 and f"not a model folder (no config.json): {tmp_path}" in bad.stderr
    assert bad.stdout == ""  # refused before scoring anything


# -- records and holds, in process -------------------------------------------------------------


def test_records_cut_a_partial_line_and_refuse_going_back(tmp_path, held_out, caplog):
    from services.evaluator.follow import first_version
    from services.evaluator.records import Records

    rec = Records(tmp_path)
    assert rec.last_version is None
    assert first_version(_settings(held_out, every=2), None) == 0
    assert first_version(_settings(held_out, every=2, at_start=False), None) == 2
    rec.write_scored(0, 0, "/m", {"eval/greedy/success_rate": 0.5}, [{"task_id": "a", "reward": 1.0}])
    rec.write_skipped(2, "pruned: gone")
    with (tmp_path / "evals.jsonl").open("a") as f:
        f.write('{"policy_version": 4, "step": 8, "eval/gre')  # killed during the write
    with caplog.at_level(logging.WARNING, logger="spopp.evaluator"):
        again = Records(tmp_path)
    assert "cutting a partial last line" in caplog.text
    assert [x["policy_version"] for x in again.lines] == [0, 2] and again.last_version == 2
    assert again.last_scored["eval/greedy/success_rate"] == 0.5
    assert first_version(_settings(held_out, every=2), again.last_version) == 4
    assert first_version(_settings(held_out, every=3), again.last_version) == 3
    assert (tmp_path / "evals.jsonl").read_text().endswith("}\n")
    assert _jsonl(tmp_path / "episodes" / "v000000.jsonl") == [
        {"policy_version": 0, "step": 0, "task_id": "a", "reward": 1.0}
    ]
    with pytest.raises(ValueError, match="already handled"):
        again.write_skipped(2, "twice")
    again.write_skipped(4, "pruned")
    assert [x["policy_version"] for x in Records(tmp_path).lines] == [0, 2, 4]


def test_holds_spare_their_versions_until_they_expire(tmp_path, caplog):
    for v in range(1, 9):
        (tmp_path / version_dirname(v)).mkdir()
    now = time.time()
    write_hold(tmp_path, Hold("evaluator-a", from_version=3, every=2, expires_at=now + 100))
    write_hold(tmp_path, Hold("evaluator-old", from_version=1, every=1, expires_at=now - 1))  # expired
    (tmp_path / ".holds" / "garbage.json").write_text("{not json")
    (tmp_path / ".holds" / "impostor.json").write_text(
        json.dumps({"holder": "someone-else", "from_version": 1, "every": 1, "expires_at": now + 100})
    )
    (tmp_path / ".holds" / "negative.json").write_text(
        json.dumps({"holder": "negative", "from_version": -1, "every": 1, "expires_at": now + 100})
    )
    (tmp_path / ".holds" / ".evaluator-b.json.1-2.tmp").write_text("half written")
    with caplog.at_level(logging.WARNING, logger="spopp.files.snapshots"):
        holds = read_holds(tmp_path, now)
        assert [h.holder for h in holds] == ["evaluator-a"]
        deleted = prune_snapshots(tmp_path, keep=2, now=now)
    for name in ("garbage.json", "impostor.json", "negative.json"):
        assert name in caplog.text  # malformed hold files are logged, not obeyed
    # Kept: the newest two (7, 8) and the held ones (4, 6: >= 3 and even).
    assert [v for v, _ in list_snapshots(tmp_path)] == [4, 6, 7, 8]
    assert sorted(p.name for p in deleted) == ["v000001", "v000002", "v000003", "v000005"]
    # Once the hold has expired, pruning takes them as usual.
    prune_snapshots(tmp_path, keep=2, now=now + 100)
    assert [v for v, _ in list_snapshots(tmp_path)] == [7, 8]
    assert remove_hold(tmp_path, "evaluator-a") and not remove_hold(tmp_path, "evaluator-a")
    with pytest.raises(ValueError, match="names a file"):
        Hold("../escape", 0, 1, now)


# -- the follower, as a process ----------------------------------------------------------------


def check_scored(line: dict, out: Path, n_tasks: int = 3, samples: int = 1) -> None:
    """A scored line: its metrics are the aggregates of the episodes file it names."""
    rows = _jsonl(out / "episodes" / f"{version_dirname(line['policy_version'])}.jsonl")
    assert len(rows) == n_tasks * (1 + samples)
    assert {(r["policy_version"], r["step"]) for r in rows} == {(line["policy_version"], line["step"])}
    for mode in ("greedy", "sampled"):
        eps = [r for r in rows if (r["mode"] == "greedy") == (mode == "greedy")]
        assert line[f"eval/{mode}/reward_mean"] == pytest.approx(sum(r["reward"] for r in eps) / len(eps))


@pytest.mark.process
def test_follows_the_clock_and_scores_every_kth_version_once_in_order(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    """No --model, no --snapshots: the base model is the run's base_snapshot and the snapshot
    folder the parent of the policy's snapshot. every=2 up to version 6: 0, 2, 4, 6. No --seed:
    the sampled episodes' seeds come from the run's seed (29), as the other arm of its pair has."""
    run = make_run(base_snapshot=str(tiny_model), seed=29)
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in (1, 2, 3):
        publish(client, run, root, tiny_model, v)
    args, port = evaluator_args(tracker, run, held_out, out, "--every", "2", "--until-version", "6")
    with running(args, tmp_path / "evaluator.log") as proc:
        wait_until(lambda: any(x["policy_version"] == 2 for x in recorded(out)), 60, "version 2", proc=proc)
        for v in (4, 5, 6):
            publish(client, run, root, tiny_model, v)
        assert proc.wait(60) == 0
    lines = recorded(out)
    assert [x["policy_version"] for x in lines] == [0, 2, 4, 6]
    assert not any("skipped" in x for x in lines)
    assert [x["step"] for x in lines] == [0, 4, 8, 12]  # from each manifest; 0 for the base model
    assert [x["snapshot"] for x in lines] == [str(tiny_model)] + [
        str(root / version_dirname(v)) for v in (2, 4, 6)
    ]
    for line in lines:
        check_scored(line, out)
    # Each version's own weights: the greedy episodes differ between versions.
    responses = [
        [r["response"] for r in _jsonl(out / "episodes" / f"{version_dirname(v)}.jsonl")]
        for v in (0, 2, 4, 6)
    ]
    assert len({tuple(r) for r in responses}) == 4
    sampled = [r["seed"] for r in _jsonl(out / "episodes" / "v000000.jsonl") if r["seed"] is not None]
    assert sorted(sampled) == sorted(sample_seed(29, i, 0) for i in range(3))  # 3 tasks, 1 sample
    assert sorted(p.name for p in (out / "episodes").iterdir()) == [
        f"{version_dirname(v)}.jsonl" for v in (0, 2, 4, 6)
    ]
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert not hold_file(root, f"evaluator-{run}").exists()  # a clean exit drops the hold


@pytest.mark.process
@pytest.mark.slow  # an evaluator killed and restarted mid-run
def test_killed_mid_evaluation_then_restarted_catches_up_without_scoring_twice(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in (1, 2):
        publish(client, run, root, tiny_model, v)
    base = ("--model", str(tiny_model), "--snapshots", str(root), "--max-tasks", "7", "--samples", "3")
    args, port = evaluator_args(tracker, run, held_out, out, *base)
    url = f"http://127.0.0.1:{port}"

    def health():
        try:
            return httpx.get(f"{url}/healthz", timeout=5).json()
        except httpx.HTTPError:
            return None

    def versions() -> list[int]:
        return [x["policy_version"] for x in recorded(out)]

    with running(args, tmp_path / "first.log") as proc:
        # Caught up with the clock at version 2, it waits: its metrics say so.
        wait_until(
            lambda: (h := health()) and h["next_version"] == 3 and h["scoring"] is None, 60, "idle", proc=proc
        )
        assert versions() == [0, 1, 2]
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        for line in (
            "spopp_evaluator_versions_scored_total 3.0", "spopp_evaluator_last_scored_version 2.0",
            "spopp_evaluator_policy_version 2.0", "spopp_evaluator_next_version 3.0",
            "spopp_evaluator_evaluation_seconds_count 3.0",
        ):  # fmt: skip
            assert line in metrics, line
        assert "\nspopp_evaluator_versions_skipped_total{" not in metrics  # none skipped: no sample
        # Kill it in the middle of an evaluation: frozen by SIGSTOP once it reports scoring v, it
        # is killed if v has no record yet (else, the rare race lost, it goes on to the next one).
        for v in (3, 4, 5):
            publish(client, run, root, tiny_model, v)
            wait_until(
                lambda v=v: (health() or {}).get("scoring") == v or v in versions(), 60, f"v{v}", proc=proc
            )
            proc.send_signal(signal.SIGSTOP)
            if v not in versions():
                cut = v
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                break
            proc.send_signal(signal.SIGCONT)
        else:
            pytest.fail("never caught an evaluation under way")
    assert versions() == list(range(cut))
    assert hold_file(root, f"evaluator-{run}").exists()  # a killed evaluator leaves its hold behind
    for v in range(cut + 1, 7):
        publish(client, run, root, tiny_model, v)
    args, _ = evaluator_args(tracker, run, held_out, out, *base, "--until-version", "6")
    with running(args, tmp_path / "second.log") as proc:
        assert proc.wait(90) == 0
    lines = recorded(out)
    assert versions() == list(range(7))  # each once, the cut one scored again
    for line in lines:
        check_scored(line, out, n_tasks=7, samples=3)
    assert f"scoring every 1 versions from version {cut}" in (tmp_path / "second.log").read_text()
    # Once more: everything up to 6 is recorded, so it exits without scoring anything.
    with running(args, tmp_path / "third.log") as proc:
        assert proc.wait(60) == 0
    assert recorded(out) == lines
    assert "every version up to 6 is recorded" in (tmp_path / "third.log").read_text()


@pytest.mark.process
def test_a_pruned_or_unreadable_version_is_recorded_as_skipped(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in (1, 2, 3, 4):
        publish(client, run, root, tiny_model, v)
    # The learner prunes 1 and 2 before the evaluator comes up (no hold yet); 3 is damaged.
    assert sorted(p.name for p in prune_snapshots(root, keep=2)) == ["v000001", "v000002"]
    (root / "v000003" / "model.safetensors").write_bytes(b"truncated")
    args, port = evaluator_args(
        tracker, run, held_out, out, "--model", str(tiny_model), "--no-at-start", "--until-version", "4"
    )
    with running(args, tmp_path / "evaluator.log") as proc:
        assert proc.wait(60) == 0
    lines = recorded(out)
    assert [x["policy_version"] for x in lines] == [1, 2, 3, 4]
    for v in (1, 2):
        assert lines[v - 1]["skipped"].startswith(f"pruned: {root / version_dirname(v)} does not exist")
    assert (
        lines[2]["skipped"].startswith("unreadable:") and "could not load the weights" in lines[2]["skipped"]
    )
    assert "skipped" not in lines[3]
    check_scored(lines[3], out)
    log_text = (tmp_path / "evaluator.log").read_text()
    for v in (1, 2, 3):
        assert f"WARNING policy version {v} skipped: " in log_text
    assert sorted(p.name for p in (out / "episodes").iterdir()) == ["v000004.jsonl"]


@pytest.mark.process
def test_its_hold_spares_what_it_still_needs_from_the_learners_pruning(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in range(1, 7):
        publish(client, run, root, tiny_model, v)
    args, _ = evaluator_args(
        tracker, run, held_out, out, "--model", str(tiny_model), "--snapshots", str(root), "--every", "2",
        "--until-version", "6", "--holder", "eval-main",
    )  # fmt: skip
    path = hold_file(root, "eval-main")
    with running(args, tmp_path / "evaluator.log") as proc:
        # The hold goes up before the engine starts, so nothing is scored yet.
        wait_until(path.exists, 60, "the hold file", proc=proc)
        hold = json.loads(path.read_text())
        assert hold["holder"] == "eval-main" and hold["every"] == 2 and hold["from_version"] == 0
        assert time.time() < hold["expires_at"] <= time.time() + 600
        deleted = prune_snapshots(root, keep=1)  # what the learner does after each publish
        assert sorted(p.name for p in deleted) == ["v000001", "v000003", "v000005"]
        assert [v for v, _ in list_snapshots(root)] == [2, 4, 6]
        # It advances: once a version is scored, the hold no longer covers it.
        wait_until(
            lambda: json.loads(path.read_text())["from_version"] >= 4, 60, "the hold to advance", proc=proc
        )
        assert 2 in [x["policy_version"] for x in recorded(out)]
        assert proc.wait(60) == 0
    lines = recorded(out)
    assert [(x["policy_version"], "skipped" in x) for x in lines] == [
        (0, False),
        (2, False),
        (4, False),
        (6, False),
    ]
    assert not path.exists()  # removed on a clean exit: the learner prunes as usual again
    prune_snapshots(root, keep=1)
    assert [v for v, _ in list_snapshots(root)] == [6]


@pytest.mark.process
def test_a_dead_evaluators_hold_expires(tracker, client, make_run, tiny_model, held_out, tmp_path):
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    for v in range(1, 5):
        publish(client, run, root, tiny_model, v)
    args, _ = evaluator_args(
        tracker,
        run,
        held_out,
        out,
        "--model",
        str(tiny_model),
        "--snapshots",
        str(root),
        "--hold-seconds",
        "3",
    )
    path = hold_file(root, f"evaluator-{run}")
    with running(args, tmp_path / "evaluator.log") as proc:
        wait_until(path.exists, 60, "the hold file", proc=proc)
        first = json.loads(path.read_text())
        # Renewed every second while it lives.
        wait_until(
            lambda: json.loads(path.read_text())["expires_at"] > first["expires_at"],
            5,
            "a renewal",
            proc=proc,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    hold = json.loads(path.read_text())
    assert hold["from_version"] <= 2 and hold["expires_at"] - time.time() > 0.5
    # Still held: what it had yet to score stays, what it had scored goes.
    deleted = prune_snapshots(root, keep=1)
    assert [p.name for p in deleted] == [version_dirname(v) for v in range(1, hold["from_version"])]
    assert [v for v, _ in list_snapshots(root)] == list(range(max(1, hold["from_version"]), 5))
    # Expired: ignored (the file stays until its holder returns), and not before its time.
    wait_until(lambda: read_holds(root) == [], hold["expires_at"] - time.time() + 10, "the hold to expire")
    assert time.time() >= hold["expires_at"] and path.exists()
    prune_snapshots(root, keep=1)
    assert [v for v, _ in list_snapshots(root)] == [4]
    assert read_manifest(root / "v000004").step == 4 * STEPS_PER_VERSION


@pytest.mark.process
def test_sigterm_stops_it_cleanly_and_drops_its_hold(
    tracker, client, make_run, tiny_model, held_out, tmp_path
):
    run = make_run()
    root, out = tmp_path / "snapshots", tmp_path / "eval"
    root.mkdir()
    publish(client, run, root, tiny_model, 1)
    args, _ = evaluator_args(
        tracker, run, held_out, out, "--model", str(tiny_model), "--snapshots", str(root)
    )
    path = hold_file(root, f"evaluator-{run}")
    with running(args, tmp_path / "evaluator.log") as proc:
        wait_until(lambda: len(recorded(out)) == 2, 60, "versions 0 and 1", proc=proc)  # then it waits for 2
        wait_until(
            lambda: json.loads(path.read_text())["from_version"] == 2, 10, "the hold to advance", proc=proc
        )
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not path.exists()
    assert "stopped by a signal" in (tmp_path / "evaluator.log").read_text()
    assert [v for v, _ in list_snapshots(root)] == [1]
