"""`make demo-alfworld`: the paper's protocol (§5) on generated ALFWorld games, on one CPU.

1. data        ALFWorld games from the generator (`runtime.envs.alfworld.generate`), small rooms:
               training games (the RL tasks), other training-split games for the cold start only,
               and held-out games (valid_seen: seen layouts, games disjoint by content hash)
2. cold start  a tiny word-level Qwen3 trained on imperfect teacher traces
               (tools/alfworld_cold_start.py): the planner's walkthrough with detours and one
               deliberate, task-ending mistake in some episodes
3. prior       `spopp prior --env alfworld`: rollouts per training task with the cold-start
               policy, Jeffreys init with mass 8, one file shared by every run
4. runs        `spopp ablate --arms spo,spopp` (and spopp-trajnorm with --ablate): `spopp launch`
               per arm and seed, `env: alfworld` with the demo's env_options
5. report      `spopp report`: Table 1 (Table 2 with --ablate), report.json and curves.png

The environment is ALFWorld's own engine; the demo's departures from the paper's ALFWorld setting,
so that a CPU can play it: rooms of at most 4 receptacles and 3 distractor objects, at most 12
interactions (the paper: 50), the observation without the admissible-action list, no system prompt,
one action per line (`ENV_OPTIONS` in tools/alfworld_cold_start.py). The whole history stays in
context, as in the paper. Every stage writes into --out and is skipped when its output is there,
so an interrupted demo resumes where it stopped.

    python -m tools.alfworld_demo --out demo-alfworld-out [--seeds 0,1,2] [--ablate] [--quick]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tools import demo, steps
from tools.alfworld_cold_start import BUDGET as EPISODE_BUDGET
from tools.alfworld_cold_start import ENV_OPTIONS

BUDGET = {
    "max_turns": EPISODE_BUDGET.max_turns,
    "max_tokens_per_turn": EPISODE_BUDGET.max_tokens_per_turn,
    "max_total_tokens": EPISODE_BUDGET.max_total_tokens,
}
# Small rooms: short observations, so the whole history of 12 interactions is a few hundred tokens.
GAMES = {"max_receptacles": 4, "max_distractors": 3}

# Games are drawn per task type (6 types): train_per_type * 6 RL tasks, cold_start_per_type * 6
# other training-split games for the teacher, heldout_per_type * 6 held-out games.
FULL = {
    "train_per_type": 8, "cold_start_per_type": 16, "heldout_per_type": 4, "teacher_episodes": 2,
    "cold_start_steps": 1000, "prior_rollouts": 2, "max_updates": 8, "eval_every": 4, "eval_samples": 1,
    "batch_size": 16, "seeds": "0,1",
}  # fmt: skip
QUICK = {
    "train_per_type": 4, "cold_start_per_type": 16, "heldout_per_type": 4, "teacher_episodes": 2,
    "cold_start_steps": 1000, "prior_rollouts": 2, "max_updates": 8, "eval_every": 4, "eval_samples": 1,
    "batch_size": 16, "seeds": "0",
}  # fmt: skip
# The smallest path through every stage, for the end-to-end test.
TINY = {
    "train_per_type": 1, "cold_start_per_type": 1, "heldout_per_type": 1, "teacher_episodes": 1,
    "cold_start_steps": 20, "prior_rollouts": 1, "max_updates": 2, "eval_every": 1, "eval_samples": 1,
    "batch_size": 4, "seeds": "0",
}  # fmt: skip


def base_config(out: Path, size: dict, wandb: bool) -> dict:
    """The launch config every run shares (`tools.demo.base_config` with ALFWorld's env and budget)."""
    config = demo.base_config(out, size, wandb)
    config.update(env="alfworld", env_options=dict(ENV_OPTIONS), progress_seconds=15)
    config["rollout"].update(concurrency=size["batch_size"], **BUDGET)
    # The learning rate was sized on seed 0 of the default cold start (1e-3 collapses the policy in
    # one update).
    config["learner"].update(micro_batch_size=max(1, size["batch_size"] // 2), lr=4e-4)
    # Sampled avg@k at T = 1 on the held-out games.
    config["evaluator"].update(concurrency=32, **BUDGET)
    return config


def _generate(job: tuple[str, str, int, int]) -> list[str]:
    from runtime.envs.alfworld.generate import generate_games

    root, split, seed, per_type = job
    return generate_games(root, seed=seed, per_type=per_type, split=split, **GAMES)


def make_data(folder: Path, size: dict, data_seed: int) -> dict[str, int]:
    """Generate the games (three sets, in parallel processes) and write the task files."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from runtime.envs.alfworld.games import write_alfworld_tasks

    root = folder / "games"
    # The RL training games and the cold start's games are both of the train split, from two seeds,
    # and disjoint (a game the cold start imitated would be one the policy has memorised); the
    # held-out games are valid_seen: the training layouts, games disjoint from train by content hash.
    jobs = {
        "cold-start": (str(root), "train", 2 * data_seed + 1, size["cold_start_per_type"]),
        "train": (str(root), "train", 2 * data_seed, size["train_per_type"]),
        "heldout": (str(root), "valid_seen", data_seed, size["heldout_per_type"]),
    }
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        rels = dict(zip(jobs, pool.map(_generate, jobs.values()), strict=True))
    rels["cold-start"] = [r for r in rels["cold-start"] if r not in set(rels["train"])]
    counts = {}
    for name in ("train", "cold-start", "heldout"):
        listing = folder / f"{name}.txt"
        listing.write_text("".join(r + "\n" for r in rels[name]))
        counts[name] = len(write_alfworld_tasks(root, listing, folder / f"{name}.jsonl"))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = demo.demo_parser(__doc__, "demo-alfworld-out", seeds="0,1; quick 0", quick="the same path, smaller",
                         data_seed="seed of the games and the cold start")  # fmt: skip
    a = p.parse_args(argv)
    size, seeds, out, t0 = demo.begin(a, FULL, QUICK, TINY)
    stages: dict[str, float] = {}
    data = out / "data"

    n_train, n_cold, n_held = (
        6 * size[k] for k in ("train_per_type", "cold_start_per_type", "heldout_per_type")
    )
    steps.say(f"1/5 data: {n_train} training, {n_cold} cold-start and {n_held} held-out ALFWorld games")
    t = time.monotonic()
    if not (data / "heldout.jsonl").is_file():
        data.mkdir(parents=True, exist_ok=True)
        counts = make_data(data, size, a.data_seed)
        steps.say(
            f"   wrote {counts['train']} + {counts['cold-start']} + {counts['heldout']} games under {data / 'games'}"
        )
    stages["data"] = time.monotonic() - t

    steps.say(
        f"2/5 cold start: {size['teacher_episodes']} teacher episodes per game, "
        f"{size['cold_start_steps']} supervised steps"
    )  # fmt: skip
    t = time.monotonic()
    if not (out / "cold-start" / "cold_start.json").is_file():
        steps.run([sys.executable, "-m", "tools.alfworld_cold_start", "--tasks", str(data / "cold-start.jsonl"),
              "--out", str(out / "cold-start"), "--seed", str(a.data_seed),
              "--episodes-per-task", str(size["teacher_episodes"]), "--steps", str(size["cold_start_steps"]),
              "--traces", str(data / "teacher-traces.json"), "--log-every", "100"])  # fmt: skip
    stages["cold start"] = time.monotonic() - t

    steps.say(
        f"3/5 prior: {size['prior_rollouts']} rollouts per training game with the cold-start policy, mass 8"
    )
    t = time.monotonic()
    if not (out / "prior.json").is_file():
        demo.make_prior(out, env="alfworld", rollouts=size["prior_rollouts"], concurrency=32, seed=a.data_seed,
                        budget=BUDGET, extra=(f"--env-options={json.dumps(ENV_OPTIONS)}",))  # fmt: skip
    stages["prior"] = time.monotonic() - t

    t = time.monotonic()
    code = demo.run_and_report(out, base_config(out, size, a.wandb), seeds=seeds, ablate=a.ablate,
                               max_updates=size["max_updates"])  # fmt: skip
    if code != 0:
        return code
    stages["runs and report"] = time.monotonic() - t
    steps.say("stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()))
    demo.finish(out, t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
