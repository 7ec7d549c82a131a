"""Supervised cold start for the ALFWorld demo: a tiny word-level Qwen3 imitates an imperfect teacher.

The teacher plays the real environment (`runtime.envs.alfworld.AlfworldEnv`, the demo's options:
no admissible-action list, no system prompt, `max_steps` interactions) from the planner's
walkthrough that every generated game stores, and errs on purpose, each error independently:

* detours (p_detour, repeated with the same probability, at most `max_detours`): before going to
  where the object is, it first goes to another receptacle of the room and opens it when it is
  closed, as a searcher would. The walkthrough knows where the object is, the imitator cannot: the
  detours are what teaches it to look elsewhere when the object is not there;
* the key mistake (p_skip), by task type: it skips the clean / heat / cool step; it turns on the
  lamp without the object (look_at); it stops after placing the first of two objects (pick_two).
  pick_and_place_simple is always played right. The game cannot be won after the mistake; the
  trace ends once the mistaken plan is played out (it is the beginning of an episode that the step
  limit would end with reward 0).

The teacher wins about 0.55 of its episodes; a faithful imitator starts RL between 0 and 1 with
room that only the reward shows it (never skip the step, search without wasting the step budget,
take only what is there).

The model: `tools.toy_model.build_word_tokenizer` over the traces' words and the generator's object
and receptacle names (about 340 tokens, one per word with its leading space), and a 2-layer,
128-wide Qwen3 (about 372k parameters) whose positions cover the episode budget. Half of the
training draws are renamed copies of a trace (`rename_trace`: every object and receptacle consistently
renamed and renumbered, the rule-bearing sinkbasin, microwave, fridge and lamps kept), so that the
imitator copies names from its context instead of memorising the games it saw.

Traces are tokenized exactly as `runtime.agent.run_episode` builds a trajectory
(`tools.cold_start.encode_episode`: prompt, generated turn, turn closing, observation), and the loss
covers only the tokens the model would generate (mask 1).

    python -m tools.alfworld_cold_start --tasks cold-start.jsonl --out DIR --steps 1000
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.chat import ChatRenderer
from runtime.envs.base import Task
from runtime.episode import Budget
from runtime.tasks import load_tasks
from tools.cold_start import encode_episode, run_episodes, train_masked

# The demo's environment: the observation alone (no admissible list), no system prompt, a short
# step limit (the paper's is 50) so that the whole history stays a few hundred tokens.
ENV_OPTIONS = {"max_steps": 12, "show_admissible": False, "system_prompt": "", "action_format": "line"}
# One turn is one action line ("take peppershaker 1 from countertop 1\n" is 7 tokens).
BUDGET = Budget(max_turns=12, max_tokens_per_turn=12, max_total_tokens=640)
MODEL = {
    "hidden_size": 128,
    "num_layers": 2,
    "num_heads": 4,
    "mlp": 256,
    "max_positions": BUDGET.max_total_tokens,
}

KEY_VERBS = ("clean ", "heat ", "cool ")
_RECEPTACLE_RE = re.compile(r"\ban? ([a-z]+ \d+)")


@dataclass(frozen=True)
class TeacherConfig:
    p_detour: float = 0.35
    max_detours: int = 2
    p_skip: float = 0.5


def room_receptacles(intro: str) -> list[str]:
    """The receptacles the opening lists ("... you see a cabinet 1, a countertop 1, and a fridge 1.")."""
    head = intro.split("Your task is to:")[0]
    return _RECEPTACLE_RE.findall(head)


def initial_contents(pddl_problem: str) -> dict[str, list[str]]:
    """{receptacle: [objects in it]} at the start, named as the game names them ("apple 1")."""
    from alfworld.agents.utils.misc import Demangler

    problem = pddl_problem.lower()  # the engine's names are lowercase
    block = re.search(r"\(:objects(.*?)\)", problem, re.DOTALL)
    ids = [
        line.split(" - ")[0].strip()
        for line in (block.group(1) if block else "").splitlines()
        if " - " in line
    ]
    names = Demangler(game_infos={i: _Id(i) for i in ids})
    out: dict[str, list[str]] = {}
    for obj, rec in re.findall(r"\(inreceptacle (\S+) (\S+)\)", problem):
        if obj in names.obj_names and rec in names.obj_names:
            out.setdefault(names.demangle_alfred_name(rec), []).append(names.demangle_alfred_name(obj))
    return out


@dataclass(frozen=True)
class _Id:
    id: str


def plan_with_errors(
    walkthrough: list[str],
    task_type: str,
    receptacles: list[str],
    rng,
    cfg: TeacherConfig,
    contents: dict[str, list[str]] | None = None,
):
    """The teacher's plan: ("do", command) steps and ("detour", receptacle) steps; and whether it errs.

    Detours go only to receptacles that hold no object of the target's kind and are not the goal's
    receptacle, so the teacher never walks past what it is looking for."""
    walk = list(walkthrough)
    contents = contents or {}
    moves = [a for a in walk if a.startswith("move ")]
    goal_receptacle = moves[-1].split(" to ", 1)[1] if moves else None
    takes = [a for a in walk if a.startswith("take ")]
    kind = takes[0].split()[1] if takes else None

    def holds_target(r: str) -> bool:
        return kind is not None and any(o.split()[0] == kind for o in contents.get(r, []))

    # pick_and_place_simple is played right: its placement is the one the other types copy too.
    skip = not task_type.startswith("pick_and_place") and rng.random() < cfg.p_skip
    if skip:
        if task_type.startswith(("pick_clean", "pick_heat", "pick_cool")):
            k = next((i for i, a in enumerate(walk) if a.startswith(KEY_VERBS)), None)
            if k is not None:
                drop = {k} | ({k - 1} if k > 0 and walk[k - 1].startswith("go to ") else set())
                walk = [a for i, a in enumerate(walk) if i not in drop]
        elif task_type.startswith("look_at"):
            walk = [a for a in walk if not a.startswith("take ")]
        elif moves:  # pick_two: it stops after placing the first object
            walk = walk[: walk.index(moves[0]) + 1]
    plan: list[tuple[str, str]] = []
    for i, a in enumerate(walk):
        if a.startswith("\x00detour "):
            plan.append(("detour", a.split(" ", 1)[1]))
            continue
        # A search: the go-to that leads to a take. Detours first, sometimes.
        leads_to_take = a.startswith("go to ") and any(
            b.startswith("take ") for b in walk[i + 1 : i + 3]
        )  # fmt: skip
        if leads_to_take:
            where = a[len("go to ") :]
            n = 0
            while n < cfg.max_detours and rng.random() < cfg.p_detour:
                others = [
                    r for r in receptacles
                    if r not in (where, goal_receptacle) and ("detour", r) not in plan and not holds_target(r)
                ]  # fmt: skip
                if not others:
                    break
                plan.append(("detour", rng.choice(others)))
                n += 1
        plan.append(("do", a))
    return plan, skip


def teacher_episode(
    env,
    task: Task,
    walkthrough: list[str],
    rng,
    cfg: TeacherConfig = TeacherConfig(),
    contents: dict[str, list[str]] | None = None,
):
    """(opening messages, [(assistant turn, messages after it)], reward, info) against the real env.

    The teacher stops when its plan is played out. After the key mistake the game can no longer be
    won, and the trace ends there, with reward 0 (finish "mistake"): it is the beginning of the
    episode the agent loop would record, and the imitator learns the mistake but nothing of what
    follows it (no wandering to imitate)."""
    opening = env.reset(task)
    intro = opening[-1]["content"]
    receptacles = room_receptacles(intro)
    task_type = task.meta.get("task_type", "")
    plan, skipped = plan_with_errors(walkthrough, task_type, receptacles, rng, cfg, contents)
    turns: list[tuple[str, list[dict]]] = []
    queue: list[str] = []
    detours = 0
    while True:
        if queue:
            command = queue.pop(0)
        elif plan:
            kind, what = plan.pop(0)
            if kind == "detour":
                detours += 1
                command = f"go to {what}"
                queue.append(f"\x00open-if-closed {what}")
            else:
                command = what
        else:
            return opening, turns, 0.0, {"finish": "mistake", "skipped": skipped, "detours": detours,
                                         "steps": len(turns), "task_type": task_type}  # fmt: skip
        if command.startswith("\x00open-if-closed "):
            what = command.split(" ", 1)[1]
            last = turns[-1][1][-1]["content"] if turns and turns[-1][1] else ""
            if "is closed" not in last:
                continue
            command = f"open {what}"
        text = command + "\n"
        res = env.step(text)
        turns.append((text, res.messages))
        if res.done:
            info = {**res.info, "skipped": skipped, "detours": detours}
            return opening, turns, float(res.reward), info


def game_plan(task: Task) -> tuple[list[str], dict[str, list[str]]]:
    """The walkthrough the game stores, and what each receptacle holds at the start."""
    from runtime.envs.alfworld.games import game_path, read_game

    path = game_path(task.answer, task.meta.get("alfworld_data"))
    spec = read_game(path)
    if not spec.walkthrough:
        raise ValueError(f"{task.task_id}: the game stores no walkthrough")
    return list(spec.walkthrough), initial_contents(json.loads(path.read_text())["pddl_problem"])


def _collect_part(tasks, episodes_per_task, seed, teacher, env_options):
    from runtime.envs.alfworld.env import AlfworldEnv

    env = AlfworldEnv(**env_options)
    out = []
    try:
        for task in tasks:
            # Per task, so the traces do not depend on how tasks are shared between processes.
            rng = random.Random(f"alfworld-teacher:{seed}:{task.task_id}")
            walk, contents = game_plan(task)
            for _ in range(episodes_per_task):
                opening, turns, reward, info = teacher_episode(env, task, walk, rng, teacher, contents)
                out.append(
                    {
                        "task_id": task.task_id,
                        "opening": opening,
                        "turns": turns,
                        "reward": reward,
                        "info": info,
                    }
                )
    finally:
        env.close()
    return out


def collect_traces(
    tasks: list[Task],
    episodes_per_task: int,
    *,
    seed: int = 0,
    teacher: TeacherConfig = TeacherConfig(),
    env_options: dict | None = None,
    processes: int = 2,
    log: Callable[[str], None] | None = print,
) -> list[dict]:
    """Teacher episodes on every task: [{task_id, opening, turns, reward, info}], in task order.

    The engine is one game at a time per process, so `processes` worker processes share the tasks."""
    options = dict(env_options or ENV_OPTIONS)
    t0 = time.perf_counter()
    chunk = 8
    parts = [tasks[i : i + chunk] for i in range(0, len(tasks), chunk)]
    out: list[dict] = []
    if processes <= 1:
        for n, part in enumerate(parts, start=1):
            out += _collect_part(part, episodes_per_task, seed, teacher, options)
            if log:
                log(
                    f"teacher: {min(n * chunk, len(tasks))}/{len(tasks)} games, {time.perf_counter() - t0:.0f}s"
                )
        return out
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        futures = [
            pool.submit(_collect_part, part, episodes_per_task, seed, teacher, options) for part in parts
        ]
        for n, f in enumerate(futures, start=1):
            out += f.result()
            if log and (n % 4 == 0 or n == len(parts)):
                log(
                    f"teacher: {min(n * chunk, len(tasks))}/{len(tasks)} games, {time.perf_counter() - t0:.0f}s"
                )
    return out


# -- renamed copies -------------------------------------------------------------------------------

# Names whose role the game's rules fix (clean in a sinkbasin, heat in a microwave, cool in a
# fridge, light with a lamp): never renamed.
FIXED_NAMES = frozenset({"sinkbasin", "microwave", "fridge", "desklamp", "floorlamp"})
_ENTITY_RE = re.compile(r"\b([a-z]+) (\d+)\b")


def _name_pools() -> tuple[list[str], list[str]]:
    from runtime.envs.alfworld.generate import LAYOUTS, ROOM_OBJECTS

    objects = sorted({o.lower() for names in ROOM_OBJECTS.values() for o in names} - FIXED_NAMES)
    receptacles = sorted(
        {r.lower() for lay in LAYOUTS for r, _ in lay.receptacles} - FIXED_NAMES - set(objects)
    )
    return objects, receptacles


def rename_trace(trace: dict, rng, pools: tuple[list[str], list[str]] | None = None) -> dict:
    """A copy of `trace` with its objects and receptacles consistently renamed and renumbered.

    Every name the game numbers ("apple 2", "cabinet 1") is mapped, in every message of the episode
    (the goal included), to another name of the same kind (object or receptacle) and its instance
    numbers to other small numbers, one mapping per episode. The game's feedback is the same
    template whatever the names, so the copy reads as the same episode in a room with other things
    in it: the imitator cannot memorise names and must copy them from the context, as it will on
    held-out games. The names the rules depend on (FIXED_NAMES) are kept.
    """
    objects, receptacles = pools or _name_pools()
    texts = [m["content"] for m in trace["opening"]]
    for action, messages in trace["turns"]:
        texts += [action] + [m["content"] for m in messages]
    numbers: dict[str, set[int]] = {}
    for text in texts:
        for name, n in _ENTITY_RE.findall(text):
            if name not in FIXED_NAMES and (name in objects or name in receptacles):
                numbers.setdefault(name, set()).add(int(n))
    names: dict[str, str] = {}
    for pool in (objects, receptacles):
        present = sorted(n for n in numbers if n in pool)
        for old, new in zip(present, rng.sample(pool, len(present)), strict=True):
            names[old] = new
    renumber: dict[tuple[str, int], int] = {}
    for name, ns in numbers.items():
        for old, new in zip(sorted(ns), rng.sample(range(1, max(ns) + 3), len(ns)), strict=False):
            renumber[(name, old)] = new

    def entity(m: re.Match) -> str:
        name, n = m.group(1), int(m.group(2))
        return f"{names.get(name, name)} {renumber.get((name, n), n)}"

    bare = re.compile(r"\b(" + "|".join(sorted(names, key=len, reverse=True)) + r")\b") if names else None

    def plain(text: str) -> str:  # names without a number (the goal's "put a clean apple in fridge")
        return bare.sub(lambda w: names[w.group(1)], text) if bare is not None else text

    def rename(text: str) -> str:
        out, last = [], 0
        for m in _ENTITY_RE.finditer(text):  # numbered names, each renamed and renumbered once
            out += [plain(text[last : m.start()]), entity(m)]
            last = m.end()
        return "".join(out) + plain(text[last:])

    return {
        **trace,
        "opening": [{**m, "content": rename(m["content"])} for m in trace["opening"]],
        "turns": [
            (rename(a), [{**m, "content": rename(m["content"])} for m in msgs]) for a, msgs in trace["turns"]
        ],
    }


def trace_words(traces: list[dict]) -> list[str]:
    """Every piece of text the traces hold (openings, turns, observations)."""
    texts = []
    for t in traces:
        texts += [m["content"] for m in t["opening"]]
        for action, messages in t["turns"]:
            texts.append(action)
            texts += [m["content"] for m in messages]
    return texts


def vocabulary(texts: list[str]) -> list[str]:
    """Word pieces of `texts` plus every object and receptacle name of the package, with and without a
    leading space, and the numbers up to 30: the words of games the traces never showed."""
    from tools.toy_model import word_pieces

    pieces = {p for t in texts for p in word_pieces(t)}
    names: set[str] = {str(i) for i in range(31)}
    objects, receptacles = _name_pools()
    names |= set(objects) | set(receptacles) | FIXED_NAMES
    for w in names | {p.strip() for p in pieces}:
        if w:
            pieces |= {w, " " + w}
    return sorted(pieces)


def train_on_traces(
    model,
    tok,
    traces: list[dict],
    *,
    steps: int,
    batch_size: int = 16,
    lr: float = 2e-3,
    warmup: int = 30,
    clip: float = 1.0,
    p_rename: float = 0.5,
    max_tokens: int | None = None,
    seed: int = 0,
    log_every: int = 100,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Masked next-token training on random batches of traces (loss on mask-1 tokens only).

    Each draw is a teacher trace, renamed (`rename_trace`) with probability `p_rename`, encoded as
    run_episode would record it; episodes longer than `max_tokens` are skipped."""
    rng = random.Random(f"alfworld-cold-start:{seed}")
    renderer = ChatRenderer(tok)
    pools = _name_pools()

    def draw() -> tuple[list[int], list[int]]:
        while True:
            trace = traces[rng.randrange(len(traces))]
            if rng.random() < p_rename:
                trace = rename_trace(trace, rng, pools)
            ids, mask = encode_episode(renderer, trace["opening"], trace["turns"])
            if max_tokens is None or len(ids) <= max_tokens:
                return ids, mask

    return train_masked(model, tok.pad_token_id, draw, steps=steps, batch_size=batch_size, lr=lr,
                        warmup=warmup, clip=clip, log_every=log_every, log=log)  # fmt: skip


def evaluate(model_dir, tasks: list[Task], *, samples: int = 1, temperature: float = 1.0, seed: int = 0,
             env_options: dict | None = None, budget: Budget = BUDGET, concurrency: int = 32) -> dict:  # fmt: skip
    """Success of the model through the real agent loop and transformers engine (episodes seeded
    per task and sample, as the evaluator seeds them)."""
    import asyncio

    from runtime.engines.hf import TransformersEngine
    from runtime.envs.alfworld.env import AlfworldEnv

    engine = TransformersEngine(model_dir, max_batch=64)
    options = env_options or ENV_OPTIONS

    async def play():
        try:
            return await run_episodes(engine, tasks, temperature=temperature, budget=budget,
                                      make_env=lambda: AlfworldEnv(**options), samples=samples, seed=seed,
                                      concurrency=concurrency)  # fmt: skip
        finally:
            await engine.close()

    t0 = time.perf_counter()
    episodes = asyncio.run(play())
    wins = [e for e in episodes if e.reward > 0]
    return {
        "episodes": len(episodes),
        "success": len(wins) / max(1, len(episodes)),
        "turns_mean": statistics.fmean(e.num_turns for e in episodes),
        "tokens_mean": statistics.fmean(len(e.token_ids) for e in episodes),
        "invalid_mean": statistics.fmean(e.info.get("invalid", 0) for e in episodes),
        "finish": dict(Counter(e.finish_reason for e in episodes)),
        "seconds": time.perf_counter() - t0,
    }


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line: the teacher's task file and errors, the model's size, the training run."""
    p = argparse.ArgumentParser(
        description="Supervised cold start of a tiny model on imperfect ALFWorld traces"
    )
    p.add_argument("--tasks", required=True, help="task file of the games the teacher plays (JSONL)")
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes-per-task", type=int, default=4)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--p-detour", type=float, default=TeacherConfig.p_detour)
    p.add_argument("--p-skip", type=float, default=TeacherConfig.p_skip)
    p.add_argument("--p-rename", type=float, default=0.5, help="share of training draws renamed")
    p.add_argument(
        "--eval-tasks", default=None, help="held-out task file scored after training (unset: none)"
    )
    p.add_argument("--eval-samples", type=int, default=2)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the supervised training")
    p.add_argument("--layers", type=int, default=MODEL["num_layers"])
    p.add_argument("--hidden", type=int, default=MODEL["hidden_size"])
    p.add_argument("--traces", default=None, help="teacher traces (JSON): read when there, else written")
    return p.parse_args(argv)


def _teacher_traces(a: argparse.Namespace, tasks: list[Task], teacher: TeacherConfig) -> list[dict]:
    """The teacher's traces: read from `--traces` when that file exists, else played (and saved there,
    so that runs that differ only in training reuse the same traces)."""
    if a.traces and Path(a.traces).is_file():
        return json.loads(Path(a.traces).read_text())
    traces = collect_traces(tasks, a.episodes_per_task, seed=a.seed, teacher=teacher)
    if a.traces:
        Path(a.traces).write_text(json.dumps(traces))
    return traces


def _score_heldout(out: Path, a: argparse.Namespace, report: dict) -> None:
    """Held-out success, sampled (T=1, `--eval-samples` per task) and greedy, added to `report`."""
    for temperature, samples in ((1.0, a.eval_samples), (0.0, 1)):
        r = evaluate(out, load_tasks(a.eval_tasks), samples=samples, temperature=temperature, seed=a.seed)
        report[f"heldout_T{temperature:g}"] = r
        print(f"held-out T={temperature:g}: {r}")


def main(argv: list[str] | None = None) -> dict:
    """Collect the teacher's traces, train a tiny model on them, save it; its report (also saved)."""
    a = _parse_args(argv)

    import torch

    from tools.toy_model import build_word_tokenizer, new_toy_model, save_toy_model

    torch.set_num_threads(a.threads)
    tasks = load_tasks(a.tasks)
    teacher = TeacherConfig(p_detour=a.p_detour, p_skip=a.p_skip)
    t0 = time.perf_counter()
    traces = _teacher_traces(a, tasks, teacher)
    collect_s = time.perf_counter() - t0
    tok = build_word_tokenizer(vocabulary(trace_words(traces)))
    renderer = ChatRenderer(tok)
    lengths = [len(encode_episode(renderer, t["opening"], t["turns"])[0]) for t in traces]
    over = sum(n > BUDGET.max_total_tokens for n in lengths)
    sizes = {**MODEL, "num_layers": a.layers, "hidden_size": a.hidden, "mlp": 2 * a.hidden}
    model, tok = new_toy_model(a.seed, tok=tok, **sizes)
    n_params = sum(x.numel() for x in model.parameters())
    rewards = [t["reward"] for t in traces]
    print(
        f"teacher: {len(traces)} episodes, success {statistics.fmean(rewards):.3f}, tokens mean "
        f"{statistics.fmean(lengths):.0f} max {max(lengths)}, {over} over budget; model {n_params} "
        f"parameters, vocabulary {len(tok)}"
    )
    report = train_on_traces(model, tok, traces, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                             p_rename=a.p_rename, max_tokens=BUDGET.max_total_tokens, seed=a.seed,
                             log_every=a.log_every)  # fmt: skip
    out = save_toy_model(model, tok, a.out)
    report.update(
        parameters=n_params, vocabulary=len(tok), steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed,
        teacher=asdict(teacher), teacher_episodes=len(traces), teacher_success=statistics.fmean(rewards),
        trace_tokens_mean=statistics.fmean(lengths), traces_over_budget=over, env_options=ENV_OPTIONS,
        teacher_seconds=collect_s, p_rename=a.p_rename,
    )  # fmt: skip
    if a.eval_tasks:
        _score_heldout(out, a, report)
    (out / "cold_start.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
