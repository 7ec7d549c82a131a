"""The ALFWorld plug-in on the package's real engine, with games from our generator.

What each bad input gets: a game file that is missing, not JSON, without a field, without a goal
or marked unsolvable -> GameFileError naming the file; a list line that is not
<split>/<folder>/<trial>, a line listed twice, an empty list -> GameFileError naming file and line;
a task without a game or data folder -> GameFileError; bad env_options -> ValueError at start-up.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from scripted import ScriptedEngine

from runtime.agent import run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.envs import env_factory
from runtime.envs.alfworld.engine import Game
from runtime.envs.alfworld.env import AlfworldEnv, parse_action
from runtime.envs.alfworld.games import (
    GAME_FILE,
    TASK_TYPES,
    GameFileError,
    read_game,
    read_task_list,
    task_for_game,
    write_alfworld_tasks,
)
from runtime.envs.alfworld.generate import generate_games
from runtime.episode import Budget
from runtime.tasks import load_tasks

# The step that makes each task type: without it, the rest of the walkthrough never wins.
KEY_VERB = {
    "pick_clean_then_place_in_recep": "clean ",
    "pick_heat_then_place_in_recep": "heat ",
    "pick_cool_then_place_in_recep": "cool ",
    "look_at_obj_in_light": "use ",
}


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    """One game of every task type (planner-checked), their task file, and their walkthroughs."""
    root = tmp_path_factory.mktemp("alfworld")
    rels = generate_games(root, seed=11, per_type=1, split="train")
    tasks = write_alfworld_tasks(root, root / "train_seed11.txt", root / "tasks.jsonl")
    walks = {t.task_id: read_game(root / "json_2.1.1" / t.answer / GAME_FILE).walkthrough for t in tasks}
    return root, rels, load_tasks(root / "tasks.jsonl"), walks


def _play(env: AlfworldEnv, commands) -> tuple[list, object]:
    replies, result = [], None
    for command in commands:
        result = env.step(command)
        replies.append(result)
        if result.done:
            break
    return replies, result


def _without_key_step(task_type: str, walk: list[str]) -> list[str]:
    verb = KEY_VERB.get(task_type)
    if verb is None:  # the placing types: without the final move nothing is placed
        return walk[:-1]
    return [c for c in walk if not c.startswith(verb)]


def test_every_task_type_is_generated_and_the_task_rows_point_at_the_games(games):
    root, rels, tasks, _ = games
    assert sorted(t.meta["task_type"] for t in tasks) == sorted(TASK_TYPES)
    for rel, task in zip(rels, tasks, strict=True):
        assert task.task_id == "alfworld:" + rel.replace("/", ":") and task.answer == rel
        assert task.meta["alfworld_data"] == str(Path(root).resolve())
        assert task.prompt and "UNKNOWN" not in task.prompt


def test_the_planner_wins_every_task_type_through_the_plug_in(games):
    _, _, tasks, walks = games
    env = AlfworldEnv()
    for task in tasks:
        opening = env.reset(task)
        assert opening[-1]["content"].startswith("You are in the middle of a room")
        assert f"Your task is to: {task.prompt}" in opening[-1]["content"]
        replies, last = _play(env, walks[task.task_id])
        assert last.done and last.reward == 1.0 and last.info["finish"] == "won", task.task_id
        assert last.info["steps"] == len(walks[task.task_id]) and last.info["invalid"] == 0
        assert last.info["task_type"] == task.meta["task_type"]
        # Until the win, every reply is the game's observation with the actions it admits now.
        assert all(r.messages[0]["content"].count("Admissible actions: ") == 1 for r in replies[:-1])
    env.close()


def test_the_package_expert_replans_after_a_detour_and_wins(games):
    root, _, tasks, _ = games
    game = Game(expert=True)
    for task in tasks:
        obs = game.start(root / "json_2.1.1" / task.answer / GAME_FILE)
        obs = game.act("look")  # a detour the walkthrough did not plan for
        for _ in range(30):
            if obs.won:
                break
            obs = game.act(obs.expert_plan[0])
        assert obs.won, task.task_id
    game.close()


def test_a_scripted_agent_without_the_key_step_loses_at_the_interaction_limit(games):
    _, _, tasks, walks = games
    env = AlfworldEnv(max_steps=20)
    for task in tasks:
        env.reset(task)
        script = _without_key_step(task.meta["task_type"], walks[task.task_id])
        replies, last = _play(env, script + ["look"] * 20)
        assert last.done and last.reward == 0.0 and last.info["finish"] == "max_steps", task.task_id
        assert last.info["steps"] == 20 and not any(r.done for r in replies[:-1])
    env.close()


def test_the_fiftieth_interaction_ends_the_episode_with_its_finish_reason(games):
    _, _, tasks, _ = games
    env = AlfworldEnv()  # the paper's limit: 50
    env.reset(tasks[0])
    replies, last = _play(env, ["look"] * 60)
    assert len(replies) == 50 and last.done and last.info["finish"] == "max_steps" and last.reward == 0.0
    assert not replies[48].done and replies[48].messages
    with pytest.raises(RuntimeError, match="episode is over"):
        env.step("look")
    env.close()


def test_an_invalid_action_is_answered_as_the_game_answers_it(games):
    _, _, tasks, _ = games
    env = AlfworldEnv(max_steps=5)
    opening = env.reset(tasks[0])
    admissible = opening[-1]["content"].split("Admissible actions: ")[1]
    for bad in ("fly to the moon", "take everything from everywhere", "x" * 300, "   "):
        r = env.step(bad)
        assert (
            not r.done and r.messages[0]["content"] == f"Nothing happens.\n\nAdmissible actions: {admissible}"
        )
    assert r.info["invalid"] == 4 and r.info["steps"] == 4
    env.close()


def test_the_tag_format_takes_the_last_action_and_a_turn_without_one_is_invalid(games):
    _, _, tasks, walks = games
    task = tasks[0]
    env = AlfworldEnv(action_format="tag")
    assert env.stop == ("</action>",) and "<action>" in env.reset(task)[0]["content"]
    r = env.step("I should think about the room first.")
    assert r.info["invalid"] == 1 and r.messages[0]["content"].startswith("Nothing happens.")
    script = [
        f"The plan says so. <action>look</action> no, <action>{c}</action>" for c in walks[task.task_id]
    ]
    _, last = _play(env, script)
    assert last.info["finish"] == "won" and last.info["invalid"] == 1
    env.close()


def test_parse_action_normalizes_as_documented():
    assert parse_action("Go to Desk 1.\nbecause", "line") == "go to desk 1"
    assert parse_action("\n\n  open   drawer 2  \n", "line") == "open drawer 2"
    assert parse_action("", "line") is None
    assert parse_action("<action>Take Apple 1 from Table 1</action>", "tag") == "take apple 1 from table 1"
    assert parse_action("thinking <action>look", "tag") == "look"  # the stop string cut the close tag
    assert parse_action("no tag at all", "tag") is None
    assert parse_action("<action></action>", "tag") is None


def test_a_whole_episode_masks_every_observation_token(games, tiny_model):
    from transformers import AutoTokenizer

    _, _, tasks, walks = games
    tok = AutoTokenizer.from_pretrained(tiny_model)
    task = next(t for t in tasks if t.meta["task_type"] == "pick_two_obj_and_place")
    script = ["go nowhere"] + walks[task.task_id]
    env = AlfworldEnv()
    ep = asyncio.run(
        run_episode(
            ScriptedEngine(tok, [command + "\n" for command in script]),
            env,
            task,
            Budget(50, 32, 8192),
            SamplingConfig(max_tokens=32),
        )
    )
    assert ep.reward == 1.0 and ep.finish_reason == "won" and ep.num_turns == len(script)
    # Exactly the model's turns carry mask 1; the room, the goal and every observation carry 0.
    generated = tok.decode([t for t, m in zip(ep.token_ids, ep.action_mask, strict=True) if m])
    assert generated == "".join(c + "\n" for c in script)
    observed = tok.decode([t for t, m in zip(ep.token_ids, ep.action_mask, strict=True) if not m])
    assert "Nothing happens." in observed and "You are in the middle of a room" in observed
    assert all(lp == 0.0 for lp, m in zip(ep.rollout_logprobs, ep.action_mask, strict=True) if not m)
    assert ep.timings["reset_s"] > 0 and ep.timings["env_s"] >= ep.timings["reset_s"]
    env.close()


def test_the_real_tiny_model_plays_episodes_that_end_by_the_limit(games, tiny_model):
    from runtime.engines.hf import TransformersEngine

    _, _, tasks, _ = games
    engine = TransformersEngine(tiny_model)
    renderer = ChatRenderer(engine.tokenizer)
    make = env_factory("alfworld", {"max_steps": 3})

    async def play():
        sampling = SamplingConfig(max_tokens=16, temperature=1.0, seed=3)
        eps = await asyncio.gather(
            *(run_episode(engine, make(), t, Budget(3, 16, 4096), sampling, renderer) for t in tasks[:3])
        )
        await engine.close()
        return eps

    for ep in asyncio.run(play()):
        # A model that never saw ALFWorld: the episode ends by the interaction limit or a turn budget.
        assert ep.finish_reason in ("max_steps", "max_turns", "max_tokens_per_turn", "won")
        assert len(ep.token_ids) == len(ep.action_mask) == len(ep.rollout_logprobs)
        assert ep.prompt_tokens > 50 and sum(ep.action_mask) >= 1


def test_concurrent_episodes_in_threads_do_not_corrupt_each_other(games):
    """The engine is not thread-safe (module-global parsers, fast-downward's argv): the lock makes it so."""
    _, _, tasks, walks = games
    argv = list(sys.argv)

    def win(task):
        env = AlfworldEnv()
        try:
            env.reset(task)
            return _play(env, walks[task.task_id])[1].reward
        finally:
            env.close()

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(win, t) for t in tasks + tasks))

    assert asyncio.run(all_at_once()) == [1.0] * (2 * len(tasks))
    assert sys.argv == argv


def test_env_options_are_checked_at_start_up():
    env_factory("alfworld", {"max_steps": 10, "action_format": "tag"})().close()
    with pytest.raises(ValueError, match="max_steps"):
        env_factory("alfworld", {"max_steps": 0})
    with pytest.raises(ValueError, match="action_format"):
        env_factory("alfworld", {"action_format": "json"})
    with pytest.raises(ValueError, match="bad env_options"):
        env_factory("alfworld", {"max_step": 10})
    with pytest.raises(ValueError, match="workers"):
        env_factory("alfworld", {"workers": -1})
    with pytest.raises(ValueError, match="bad env_options"):
        env_factory("math-tir", {"max_steps": 10})


def _copy_game(root: Path, rel: str, dst: Path, new_rel: str, edit) -> None:
    src = root / "json_2.1.1" / rel
    out = dst / "json_2.1.1" / new_rel
    out.mkdir(parents=True)
    (out / "traj_data.json").write_text((src / "traj_data.json").read_text())
    text = edit((src / GAME_FILE).read_text())
    if text is not None:
        (out / GAME_FILE).write_text(text)


def _edit_json(**changes):
    def edit(text):
        game = json.loads(text)
        game.update(changes)
        return json.dumps(game)

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda text: None, "no such game file"),
        (lambda text: text[:-10], "not valid JSON"),
        (lambda text: "[1, 2]", "expected a JSON object"),
        (_edit_json(pddl_problem=""), "missing or empty 'pddl_problem'"),
        (_edit_json(solvable="yes"), "'solvable' must be true or false"),
        (_edit_json(solvable=False), "marked unsolvable"),
        (_edit_json(walkthrough="go"), "'walkthrough' must be a list"),
        (_edit_json(grammar="{}"), "no goal text"),
    ],
    ids=["missing", "truncated", "not-an-object", "no-problem", "solvable-type", "unsolvable", "walkthrough",
         "no-goal"],
)  # fmt: skip
def test_a_malformed_game_file_gets_an_error_naming_it(games, tmp_path, edit, message):
    root, rels, _, _ = games
    bad = "train/pick_and_place_simple-Bad-None-Desk-1/trial_Gbad"
    _copy_game(Path(root), rels[0], tmp_path, rels[0], lambda text: text)
    _copy_game(Path(root), rels[0], tmp_path, bad, edit)
    (tmp_path / "list.txt").write_text(f"{rels[0]}\n{bad}\n")
    with pytest.raises(GameFileError, match=message) as err:
        write_alfworld_tasks(tmp_path, tmp_path / "list.txt", tmp_path / "tasks.jsonl")
    assert "trial_Gbad" in str(err.value)
    assert not (tmp_path / "tasks.jsonl").exists()  # all or nothing


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "names no game"),
        ("# only a comment\n\n", "names no game"),
        ("train/only-two\n", "line 1: 'train/only-two' is not <split>/<task folder>/<trial>"),
        ("train/a/b\n../etc/passwd\n", "line 2"),
        ("train/a/b\n  train/a/b  # again\n", "line 2: train/a/b is listed twice"),
    ],
)
def test_a_malformed_task_list_gets_an_error_naming_the_line(tmp_path, text, message):
    (tmp_path / "list.txt").write_text(text)
    with pytest.raises(GameFileError, match=message):
        read_task_list(tmp_path / "list.txt")


def test_a_missing_list_or_data_folder_is_named(tmp_path, monkeypatch):
    with pytest.raises(GameFileError, match="cannot read the task list"):
        read_task_list(tmp_path / "nope.txt")
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(GameFileError, match="set ALFWORLD_DATA"):
        task_for_game("train/a/b")


def test_portable_rows_resolve_against_alfworld_data_where_they_run(games, tmp_path, monkeypatch):
    root, _, tasks, walks = games
    rows = write_alfworld_tasks(root, Path(root) / "train_seed11.txt", tmp_path / "t.jsonl", portable=True)
    assert all("alfworld_data" not in t.meta for t in rows)
    task = load_tasks(tmp_path / "t.jsonl")[0]
    env = AlfworldEnv()
    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    with pytest.raises(GameFileError, match="ALFWORLD_DATA"):
        env.reset(task)
    monkeypatch.setenv("ALFWORLD_DATA", str(root))
    env.reset(task)
    assert _play(env, walks[task.task_id])[1].reward == 1.0
    env.close()


def test_the_tasks_command_writes_checked_rows_or_nothing(games, tmp_path):
    from click.testing import CliRunner

    from runtime.envs.alfworld.cli import group

    root, rels, _, _ = games
    out = tmp_path / "tasks.jsonl"
    r = CliRunner().invoke(group, ["tasks", "--data", str(root), "--list", str(Path(root) / "train_seed11.txt"),
                                   "--out", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"6 tasks -> {out} (") and [t.answer for t in load_tasks(out)] == rels
    (tmp_path / "bad.txt").write_text(f"{rels[0]}\ntrain/no-such/game\n")
    out2 = tmp_path / "tasks2.jsonl"
    r = CliRunner().invoke(group, ["tasks", "--data", str(root), "--list", str(tmp_path / "bad.txt"),
                                   "--out", str(out2)])  # fmt: skip
    assert r.exit_code == 1 and "no such game file" in r.output and r.output.count("\n") == 1
    assert not out2.exists()


@pytest.mark.process
def test_a_pool_of_engine_workers_plays_games_in_other_processes(games):
    import os

    from runtime.envs.alfworld.engine import engine_pool

    _, _, tasks, walks = games
    pool = engine_pool(2)
    assert len(set(pool.pids())) == 2 and os.getpid() not in pool.pids()
    argv = list(sys.argv)

    def win(task):
        env = AlfworldEnv(workers=2)
        try:
            env.reset(task)
            return _play(env, walks[task.task_id])[1].info["finish"]
        finally:
            env.close()

    async def all_at_once():
        return await asyncio.gather(*(asyncio.to_thread(win, t) for t in tasks))

    assert asyncio.run(all_at_once()) == ["won"] * len(tasks)
    assert sys.argv == argv and all(w.games == 0 for w in pool._workers)  # every game given back


@pytest.mark.process
def test_a_dead_engine_worker_fails_its_games_and_is_replaced(games):
    import os
    import signal

    from runtime.envs.alfworld.engine import EngineError, engine_pool

    _, _, tasks, walks = games
    pool = engine_pool(1)
    env = AlfworldEnv(workers=1)
    env.reset(tasks[0])
    dead = pool.pids()[0]
    os.kill(dead, signal.SIGKILL)
    with pytest.raises(EngineError, match=f"engine worker 0 \\(pid {dead}\\) died"):
        env.step(walks[tasks[0].task_id][0])
    env.close()
    fresh = AlfworldEnv(workers=1)
    fresh.reset(tasks[0])
    assert _play(fresh, walks[tasks[0].task_id])[1].reward == 1.0 and pool.pids()[0] != dead
    fresh.close()
