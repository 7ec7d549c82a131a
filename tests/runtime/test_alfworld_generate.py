"""The ALFWorld game generator (`runtime.envs.alfworld.generate`) and `spopp alfworld generate`.

Everything runs the real alfworld/TextWorld engine, in this thread only (it is not thread-safe).
The sets are generated once per module; the planner-checked ones are kept small, the balance and
determinism checks run on larger sets without the planner.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest

if importlib.util.find_spec("alfworld") is None or importlib.util.find_spec("textworld") is None:
    pytest.skip("needs the alfworld extra: pip install 'spopp[alfworld]'", allow_module_level=True)

from click.testing import CliRunner

from runtime.envs.alfworld.generate import (
    LAYOUTS,
    TASK_TYPES,
    GenerationError,
    generate_games,
    planner_walkthrough,
)
from services.cli import build

REPO = Path(__file__).resolve().parents[2]
KEY_VERBS = {
    "pick_clean_then_place_in_recep": "clean",
    "pick_heat_then_place_in_recep": "heat",
    "pick_cool_then_place_in_recep": "cool",
    "look_at_obj_in_light": "use",
}
# ALFRED's own room kinds per task type (alfworld.gen.constants.GOALS_VALID), in our names.
ROOM_KINDS = {
    "pick_and_place_simple": {"kitchen", "livingroom", "bedroom", "bathroom"},
    "pick_two_obj_and_place": {"kitchen", "livingroom", "bedroom", "bathroom"},
    "look_at_obj_in_light": {"livingroom", "bedroom"},
    "pick_clean_then_place_in_recep": {"kitchen", "bathroom"},
    "pick_heat_then_place_in_recep": {"kitchen"},
    "pick_cool_then_place_in_recep": {"kitchen"},
}


def _trial(root: Path, rel: str) -> Path:
    return root / "json_2.1.1" / rel


def _traj(root: Path, rel: str) -> dict:
    return json.loads((_trial(root, rel) / "traj_data.json").read_text())


def _game(root: Path, rel: str) -> dict:
    return json.loads((_trial(root, rel) / "game.tw-pddl").read_text())


def _declared(problem: str, kind: str) -> int:
    """How many entities of `kind` the problem's :objects section declares."""
    section = problem.split("(:objects", 1)[1].split("(:init", 1)[0]
    return sum(line.strip().endswith(f" - {kind}") for line in section.splitlines())


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """Planner-checked sets: (root, rels) of full-size train games and of trimmed small games."""
    full = tmp_path_factory.mktemp("full")
    small = tmp_path_factory.mktemp("small")
    lines: list[str] = []
    rels_full = generate_games(full, seed=0, per_type=2, split="train", progress=lines.append)
    rels_small = generate_games(
        small, seed=5, per_type=1, split="valid_unseen", max_receptacles=2, max_distractors=0
    )
    return {"full": (full, rels_full), "small": (small, rels_small), "lines": lines}


@pytest.fixture(scope="module")
def unchecked(tmp_path_factory):
    """Larger sets without the planner: 24 train games per type on the seen layouts, 4 valid_unseen."""
    train = tmp_path_factory.mktemp("unchecked_train")
    unseen = tmp_path_factory.mktemp("unchecked_unseen")
    return {
        "train": (train, generate_games(train, seed=1, per_type=24, split="train", check=False)),
        "unseen": (unseen, generate_games(unseen, seed=1, per_type=4, split="valid_unseen", check=False)),
    }


@pytest.fixture(scope="module")
def engine():
    """The bare stack the environment plays: PddlEnv under AlfredDemangler and AlfredInfos."""
    import textworld
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
    from textworld.envs import PddlEnv

    infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
    env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
    yield env
    env.close()


def _play(env, commands: list[str]) -> tuple[bool, int]:
    """(won, steps) after playing `commands` from the reset state, stopping at a win."""
    for i, cmd in enumerate(commands, start=1):
        state, _score, _done = env.step(cmd)
        if state["won"]:
            return True, i
    return False, len(commands)


# -- the games the planner checked -------------------------------------------------------------


def test_every_task_type_in_its_room_kinds(checked, unchecked):
    root, rels = checked["full"]
    assert Counter(_traj(root, r)["task_type"] for r in rels) == {tt: 2 for tt in TASK_TYPES}
    for tt in TASK_TYPES:
        kinds = {_traj(root, r)["scene"]["room_kind"] for r in rels if _traj(root, r)["task_type"] == tt}
        assert len(kinds) == min(2, len(ROOM_KINDS[tt])), (tt, kinds)
    # Over a larger draw every task type meets every room kind it can happen in.
    root, rels = unchecked["train"]
    for tt in TASK_TYPES:
        kinds = {_traj(root, r)["scene"]["room_kind"] for r in rels if _traj(root, r)["task_type"] == tt}
        assert kinds == ROOM_KINDS[tt], tt
    assert len(checked["lines"]) == len(TASK_TYPES) + 1 and checked["lines"][-1].startswith("wrote 12 games")


@pytest.mark.process
def test_walkthroughs_win_and_the_key_step_matters(checked, engine):
    for root, rels in (checked["full"], checked["small"]):
        for rel in rels:
            gamefile = str(_trial(root, rel) / "game.tw-pddl")
            game = _game(root, rel)
            task_type = _traj(root, rel)["task_type"]
            walk = game["walkthrough"]
            assert game["solvable"] is True and walk, rel
            engine.load(gamefile)
            state = engine.reset()
            assert not state["won"], f"{rel} is won before any step"
            assert state["extra.gamefile"] == gamefile
            # Without its key step (clean/heat/cool/use, else the last move) the plan does not win.
            verb = KEY_VERBS.get(task_type)
            drop = next(i for i, c in enumerate(walk) if c.split()[0] == verb) if verb else len(walk) - 1
            assert _play(engine, walk[:drop] + walk[drop + 1 :]) == (False, len(walk) - 1), rel
            engine.reset()
            assert _play(engine, walk) == (True, len(walk)), rel


def test_trimmed_games_are_small_and_solvable(checked):
    root, rels = checked["small"]
    assert len(rels) == len(TASK_TYPES)
    for rel in rels:
        traj, game = _traj(root, rel), _game(root, rel)
        needed = 2 if traj["task_type"] == "pick_two_obj_and_place" else 1
        needed += traj["task_type"] == "look_at_obj_in_light"  # the lamp
        problem = game["pddl_problem"]
        assert _declared(problem, "receptacle") <= 2 and _declared(problem, "object") == needed, rel
        assert traj["generator"]["receptacles"] <= 2 and traj["generator"]["objects"] == needed
        assert traj["scene"]["heldout_layout"] is True  # valid_unseen: the held-out layouts
        assert game["walkthrough"] and len(game["walkthrough"]) <= 12
    # The full-size set has more, with distractors and several instances of target classes.
    root, rels = checked["full"]
    sizes = [_traj(root, r)["generator"] for r in rels]
    assert max(s["receptacles"] for s in sizes) > 10 and max(s["objects"] for s in sizes) > 6


def test_game_files_carry_what_the_package_reads(checked):
    from alfworld.agents.utils.misc import add_task_to_grammar
    from alfworld.gen.goal_library import gdict

    for root, rels in (checked["full"], checked["small"]):
        for rel in rels:
            assert not any(s in rel for s in ("movable", "Sliced")), rel
            split, folder, trial = rel.split("/")
            traj, game = _traj(root, rel), _game(root, rel)
            params = traj["pddl_params"]
            assert set(params) == {
                "object_target",
                "parent_target",
                "toggle_target",
                "mrecep_target",
                "object_sliced",
            }
            assert folder == "-".join(
                [traj["task_type"], params["object_target"], "None",
                 params["toggle_target"] or params["parent_target"], str(traj["scene"]["scene_num"])]
            )  # fmt: skip
            assert trial == traj["task_id"] and trial.startswith("trial_G") and len(trial) == 19
            assert traj["generator"]["name"] == "spopp.alfworld.generate"
            goal = traj["turk_annotations"]["anns"][0]["task_desc"]
            assert f"Your task is to: {goal}." in game["grammar"] and "UNKNOWN GOAL" not in game["grammar"]
            assert (_trial(root, rel) / "initial_state.pddl").read_text() == game["pddl_problem"]
            # alfworld-generate's goal text from the same traj_data is one of the same templates.
            templated = add_task_to_grammar("UNKNOWN GOAL", traj)
            fill = {k: params[k + "_target"].lower() for k in ("object", "parent", "toggle", "mrecep")}
            options = {
                t.format(obj=fill["object"], recep=fill["parent"], toggle=fill["toggle"], mrecep="")
                for t in gdict[traj["task_type"]]["templates"]
            }
            assert templated in options and goal in options


def test_the_package_loader_finds_every_game(checked):
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv
    from alfworld.info import ALFRED_PDDL_PATH, ALFRED_TWL2_PATH

    for root, rels in (checked["full"], checked["small"]):
        split = rels[0].split("/")[0]
        config = {
            "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6],
                    "domain_randomization": False, "expert_type": "planner"},
            "dataset": {"data_path": str(root / "json_2.1.1" / split), "num_train_games": -1,
                        "eval_id_data_path": str(root / "json_2.1.1" / split), "num_eval_games": -1},
            "logic": {"domain": ALFRED_PDDL_PATH, "grammar": ALFRED_TWL2_PATH},
            "general": {"training_method": "dagger"},
            "dagger": {"training": {"max_nb_steps_per_episode": 5}},
        }  # fmt: skip
        loader = AlfredTWEnv(config, train_eval="train")
        assert sorted(loader.game_files) == sorted(str(_trial(root, r) / "game.tw-pddl") for r in rels)


def test_planner_walkthrough_replans_a_written_game(checked):
    root, rels = checked["small"]
    rel = rels[0]
    assert planner_walkthrough(_trial(root, rel) / "game.tw-pddl") == _game(root, rel)["walkthrough"]


# -- layouts, splits, determinism ----------------------------------------------------------------


def test_layouts_are_balanced(unchecked):
    root, rels = unchecked["train"]
    seen = [lay for lay in LAYOUTS if not lay.heldout]
    for tt in TASK_TYPES:
        used = Counter(_traj(root, r)["scene"]["layout"] for r in rels if _traj(root, r)["task_type"] == tt)
        feasible = {lay.name for lay in seen if lay.room in ROOM_KINDS[tt]}
        assert set(used) == feasible, tt
        assert max(used.values()) - min(used.values()) <= 1, (tt, used)
    for rel in rels:
        game = _game(root, rel)
        assert game["walkthrough"] is None and game["solvable"] is True


def test_seen_and_unseen_layouts_are_disjoint(unchecked):
    seen = {lay.name for lay in LAYOUTS if not lay.heldout}
    unseen = {lay.name for lay in LAYOUTS if lay.heldout}
    assert seen and unseen and not seen & unseen
    rooms = {lay.room for lay in LAYOUTS}
    assert rooms == {"kitchen", "livingroom", "bedroom", "bathroom"}
    for room in rooms:
        variants = [lay for lay in LAYOUTS if lay.room == room]
        assert (
            len(variants) >= 4
            and sum(lay.heldout for lay in variants) >= 1
            and len(variants) - sum(lay.heldout for lay in variants) >= 3
        )
    train_root, train_rels = unchecked["train"]
    unseen_root, unseen_rels = unchecked["unseen"]
    assert {_traj(train_root, r)["scene"]["layout"] for r in train_rels} <= seen
    assert {_traj(unseen_root, r)["scene"]["layout"] for r in unseen_rels} == unseen
    assert all(r.startswith("valid_unseen/") for r in unseen_rels)


def test_train_and_valid_share_no_game(tmp_path):
    train = generate_games(tmp_path / "a", seed=2, per_type=6, split="train", layouts="all", check=False)
    valid = generate_games(tmp_path / "b", seed=2, per_type=6, split="valid_seen", layouts="all", check=False)
    trials = lambda rels: {r.rsplit("/", 1)[1] for r in rels}  # noqa: E731
    assert len(trials(train)) == len(train) == 36 and len(trials(valid)) == 36
    assert not trials(train) & trials(valid)


def test_same_arguments_same_bytes_and_ids(tmp_path):
    kwargs = dict(seed=7, per_type=2, split="train", max_receptacles=3, max_distractors=2)
    a = generate_games(tmp_path / "a", **kwargs)
    b = generate_games(tmp_path / "b", **kwargs)
    assert a == b and len(a) == 12 and len(set(a)) == 12
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert (tmp_path / "a" / "train_seed7.txt").read_text() == "".join(r + "\n" for r in a)
    # Fewer games per type: the first ones of the larger set, in the same order.
    fewer = generate_games(tmp_path / "c", **{**kwargs, "per_type": 1}, check=False)
    assert fewer == a[::2]
    # Another seed, other games.
    other = generate_games(tmp_path / "d", **{**kwargs, "seed": 8}, check=False)
    assert not set(other) & set(a)


def test_bad_arguments_write_nothing(tmp_path):
    out = tmp_path / "out"
    for kwargs, match in [
        (dict(per_type=-1), "per_type"),
        (dict(per_type=0), "per_type"),
        (dict(split="test"), "unknown split"),
        (dict(layouts="some"), "unknown layouts"),
        (dict(max_receptacles=1), "max_receptacles"),
        (dict(max_distractors=-1), "max_distractors"),
        (dict(seed=-3), "seed"),
    ]:
        args = {"seed": 0, "per_type": 1, "split": "train", "check": False, **kwargs}
        with pytest.raises(GenerationError, match=match):
            generate_games(out, **args)
    assert not out.exists()


@pytest.mark.process
def test_generation_leaves_alfworlds_import_side_effects_out(tmp_path, checked):
    """Generating imports no alfworld module; the planner's import puts $ALFWORLD_DATA and the
    cache folder back as they were (here: unset, absent)."""
    root, rels = checked["small"]
    script = textwrap.dedent(
        f"""
        import os, sys
        from pathlib import Path
        from runtime.envs.alfworld.generate import generate_games, planner_walkthrough
        generate_games({str(tmp_path / "g")!r}, seed=0, per_type=1, split="train", check=False)
        assert not [m for m in sys.modules if m.split(".")[0] == "alfworld"], "alfworld imported"
        assert planner_walkthrough({str(_trial(root, rels[0]) / "game.tw-pddl")!r})
        assert "alfworld" in sys.modules
        assert "ALFWORLD_DATA" not in os.environ, os.environ["ALFWORLD_DATA"]
        assert not (Path.home() / ".cache" / "alfworld").exists()
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "ALFWORLD_DATA"}
    env.update(HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


# -- the command line ----------------------------------------------------------------------------


def _spopp(*args):
    return CliRunner().invoke(build(), [str(a) for a in args], prog_name="spopp")


def test_cli_generates_a_listed_set(tmp_path):
    out = tmp_path / "data"
    result = _spopp("alfworld", "generate", "--out", out, "--seed", 3, "--per-type", 1, "--split", "valid_seen",
                    "--max-receptacles", 3, "--max-distractors", 1)  # fmt: skip
    assert result.exit_code == 0, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == len(TASK_TYPES) + 1 and lines[0].startswith("pick_and_place_simple: 1 games in ")
    assert lines[-1].startswith("wrote 6 games (valid_seen, seen layouts, plan-checked)")
    assert str(out / "valid_seen_seed3.txt") in lines[-1]
    rels = (out / "valid_seen_seed3.txt").read_text().split()
    assert len(rels) == 6 and all((_trial(out, r) / "game.tw-pddl").is_file() for r in rels)
    assert all(_game(out, r)["walkthrough"] for r in rels)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--per-type", "-2"], "Error: per_type must be an integer >= 1, got -2"),
        (
            ["--split", "test"],
            "Error: unknown --split 'test'; expected one of train, valid_seen, valid_unseen",
        ),
        (["--layouts", "most"], "Error: unknown --layouts 'most'; expected one of all, seen, unseen"),
        (["--max-receptacles", "1"], "Error: max_receptacles must be >= 2"),
        ([], "exists and is not a folder"),
    ],
)
def test_cli_refuses_bad_input_in_one_line(tmp_path, args, message):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    out = a_file if not args else tmp_path / "data"
    before = sorted(tmp_path.rglob("*"))
    result = _spopp("alfworld", "generate", "--out", out, "--no-check", *args)
    assert result.exit_code != 0
    assert len(result.output.strip().splitlines()) == 1 and message in result.output, result.output
    assert sorted(tmp_path.rglob("*")) == before and a_file.read_text() == "not a folder"
