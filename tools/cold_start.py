"""Supervised cold start for the CPU demo: the toy model imitates an imperfect toy-calc teacher.

The teacher plays the real environment (`runtime.envs.toy_calc.ToyCalcEnv`) and errs on purpose,
each independently: it skips the tool and guesses (p_skip = 0.3, a rough estimate that is almost
never exact), miscopies one digit of the expression into the tool call (p_expr = 0.25), or miscopies
one digit of the tool's result into its answer (p_result = 0.25). Its success rate is
0.7 * 0.75 * 0.75 ~ 0.39, so a faithful imitator starts RL well between 0 and 1, with room that
only the reward can show it (always call the tool, copy exactly), and its failures are shorter on
average than its successes (a guess is 6-7 tokens, a tool episode about 20).

Traces are tokenized exactly as `runtime.agent.run_episode` builds a trajectory (the same
ChatRenderer pieces: prompt, generated turn, turn closing, tool continuation), and the loss covers
only the tokens the model would generate (mask 1), never the prompt, tool output or markers.
Training tasks come fresh from the train split every step; evaluation uses the held-out split
through the real agent loop and transformers engine.

    python -m tools.cold_start --out DIR --seed 0 --steps 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace

from runtime.agent import run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.envs.base import Environment, Task
from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks, make_task, sample_operands
from runtime.episode import Budget
from services.evaluator.scorer import sample_seed

BUDGET = Budget(max_turns=3, max_tokens_per_turn=32, max_total_tokens=128)


@dataclass(frozen=True)
class TeacherConfig:
    p_skip: float = 0.3
    p_expr: float = 0.25
    p_result: float = 0.25


def _miscopy_digit(text: str, rng: random.Random) -> str:
    """`text` with one digit replaced by another (never creating a leading zero)."""
    spots = [i for i, ch in enumerate(text) if ch.isdigit()]
    i = rng.choice(spots)
    leading = i == 0 or not text[i - 1].isdigit()
    choices = [d for d in "0123456789" if d != text[i] and not (leading and d == "0")]
    return text[:i] + rng.choice(choices) + text[i + 1 :]


def teacher_episode(task: Task, rng: random.Random, cfg: TeacherConfig = TeacherConfig()):
    """(opening messages, [(assistant turn, tool messages after it)], reward) against the real env."""
    env = ToyCalcEnv()
    opening = env.reset(task)
    turns: list[tuple[str, list[dict]]] = []
    if rng.random() < cfg.p_skip:
        a, b, c = (int(x) for x in task.prompt.replace("*", "+").split("+"))
        guess = round(a, -2) * b + c  # a rough mental estimate
        action = f"<ans>{guess}</ans>"
    else:
        expr = task.prompt
        if rng.random() < cfg.p_expr:
            expr = _miscopy_digit(expr, rng)
        call = f"<code>print({expr})</code>"
        res = env.step(call)
        turns.append((call, res.messages))
        value = res.messages[0]["content"].removeprefix("<out>").removesuffix("</out>")
        if rng.random() < cfg.p_result:
            value = _miscopy_digit(value, rng)
        action = f"<ans>{value}</ans>"
    res = env.step(action)
    assert res.done
    turns.append((action, []))
    return opening, turns, res.reward


def encode_episode(renderer: ChatRenderer, opening: list[dict], turns) -> tuple[list[int], list[int]]:
    """(token ids, action mask) as run_episode would record this conversation."""
    ids = renderer.prompt(opening)
    mask = [0] * len(ids)
    for text, messages in turns:
        gen = renderer.encode(text)
        ids += gen
        mask += [1] * len(gen)
        more = renderer.close_turn(gen) + (renderer.continuation(messages) if messages else [])
        ids += more
        mask += [0] * len(more)
    return ids, mask


def train_masked(
    model,
    pad: int,
    draw: Callable[[], tuple[list[int], list[int]]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    clip: float = 1.0,
    log_every: int = 100,
    log: Callable[[str], None] | None = print,
) -> dict:
    """Masked next-token training of `model` in place on batches of `draw()` (token ids, action mask):
    AdamW, linear warm-up then cosine to zero, the loss on mask-1 tokens only. Returns {loss, seconds}."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)

    def schedule(s: int) -> float:  # linear warm-up, then cosine to zero
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    # Batches go where the model is: the GPU tier trains the cold start on CUDA (seconds, not a minute).
    device = next(model.parameters()).device
    model.train()
    t0 = time.perf_counter()
    loss_v = float("nan")
    for step in range(1, steps + 1):
        seqs = [draw() for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in seqs)
        ids = torch.full((batch_size, width), pad, dtype=torch.long)
        att = torch.zeros((batch_size, width), dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        for i, (s, m) in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            att[i, : len(s)] = 1
            labels[i, : len(s)] = torch.where(torch.tensor(m) == 1, torch.tensor(s), -100)
        ids, att, labels = ids.to(device), att.to(device), labels.to(device)
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        sched.step()
        loss_v = float(loss.detach())
        if log and (step % log_every == 0 or step == steps):
            log(
                f"step {step}/{steps}  loss {loss_v:.4f}  lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - t0:.1f}s"
            )
    model.eval()
    return {"loss": loss_v, "seconds": time.perf_counter() - t0}


def train_cold_start(
    model,
    tok,
    *,
    steps: int = 1000,
    batch_size: int = 64,
    lr: float = 1e-3,
    warmup: int = 50,
    clip: float = 1.0,
    seed: int = 0,
    teacher: TeacherConfig = TeacherConfig(),
    log_every: int = 100,
    log=print,
) -> dict:
    """Train `model` in place; returns {loss, teacher_success, seconds}."""
    rng = random.Random(f"cold-start:{seed}")
    renderer = ChatRenderer(tok)
    rewards: list[float] = []

    def draw() -> tuple[list[int], list[int]]:
        opening, turns, reward = teacher_episode(make_task(*sample_operands(rng, "train")), rng, teacher)
        rewards.append(reward)
        return encode_episode(renderer, opening, turns)

    report = train_masked(model, tok.pad_token_id, draw, steps=steps, batch_size=batch_size, lr=lr,
                          warmup=warmup, clip=clip, log_every=log_every, log=log)  # fmt: skip
    return {
        "loss": report["loss"],
        "teacher_success": statistics.fmean(rewards) if rewards else float("nan"),
        "seconds": report["seconds"],
    }


# -- evaluation through the real agent loop ---------------------------------------------------


async def run_episodes(
    engine,
    tasks: list[Task],
    *,
    temperature: float = 1.0,
    budget: Budget = BUDGET,
    make_env: Callable[[], Environment] = ToyCalcEnv,
    samples: int = 1,
    seed: int | None = None,
    concurrency: int | None = None,
):
    """`samples` episodes of each task through the real agent loop. With `seed`, episode j of task
    i samples with the evaluator's seed for (i, j), so a score does not depend on what the engine
    batched it with; without, from the engine's shared stream."""
    renderer = ChatRenderer(engine.tokenizer)
    sampling = SamplingConfig(max_tokens=budget.max_tokens_per_turn, temperature=temperature)
    gate = asyncio.Semaphore(concurrency or len(tasks) * samples or 1)

    async def one(i: int, j: int, task: Task):
        episode_sampling = sampling if seed is None else replace(sampling, seed=sample_seed(seed, i, j))
        async with gate:
            env = make_env()
            try:
                return await run_episode(engine, env, task, budget, episode_sampling, renderer)
            finally:
                env.close()

    return await asyncio.gather(*(one(i, j, t) for i, t in enumerate(tasks) for j in range(samples)))


def summarize(episodes) -> dict:
    wins = [e for e in episodes if e.reward > 0]
    losses = [e for e in episodes if e.reward <= 0]

    def mean_len(eps) -> float:
        return statistics.fmean(e.generated_tokens for e in eps) if eps else float("nan")

    return {
        "episodes": len(episodes),
        "success": len(wins) / max(1, len(episodes)),
        "gen_tokens_success": mean_len(wins),
        "gen_tokens_failure": mean_len(losses),
        "tool_rate": statistics.fmean(e.info.get("tool_calls", 0) > 0 for e in episodes) if episodes else 0.0,
        "finish": dict(Counter(e.finish_reason for e in episodes)),
    }


def evaluate(
    engine, tasks: list[Task], *, temperature: float = 1.0, seed: int | None = None, **episodes
) -> dict:
    """Held-out success through run_episode (`episodes`: the rest of run_episodes' arguments)."""
    t0 = time.perf_counter()
    played = asyncio.run(run_episodes(engine, tasks, temperature=temperature, seed=seed, **episodes))
    out = summarize(played)
    out["seconds"] = time.perf_counter() - t0
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        description="Supervised cold start of the toy model on imperfect teacher traces"
    )
    p.add_argument("--out", required=True, help="model folder to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--p-skip", type=float, default=0.3)
    p.add_argument("--p-expr", type=float, default=0.25)
    p.add_argument("--p-result", type=float, default=0.25)
    p.add_argument(
        "--eval-tasks", type=int, default=128, help="held-out tasks scored after training (0: none)"
    )
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument(
        "--max-positions", type=int, default=128,
        help="the model's context (RoPE: no learned table, so a longer one changes nothing below 128)",
    )  # fmt: skip
    a = p.parse_args(argv)

    import torch

    from runtime.engines.hf import TransformersEngine
    from tools.toy_model import new_toy_model, save_toy_model

    torch.set_num_threads(1)  # one thread is the fastest for a model this small
    torch.manual_seed(a.seed)
    model, tok = new_toy_model(a.seed, max_positions=a.max_positions)
    n_params = sum(x.numel() for x in model.parameters())
    print(f"toy model: {n_params} parameters, vocabulary {len(tok)}")
    teacher = TeacherConfig(a.p_skip, a.p_expr, a.p_result)
    report = train_cold_start(
        model, tok, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, seed=a.seed,
        teacher=teacher, log_every=a.log_every,
    )  # fmt: skip
    out = save_toy_model(model, tok, a.out)
    print(
        f"trained in {report['seconds']:.1f}s, teacher success {report['teacher_success']:.3f}; wrote {out}"
    )
    report.update(parameters=n_params, steps=a.steps, batch_size=a.batch_size, lr=a.lr, seed=a.seed)
    if a.eval_tasks:
        engine = TransformersEngine(out, max_batch=64)
        tasks = generate_toy_calc_tasks(a.eval_tasks, seed=a.seed, split="heldout")
        for temp in (1.0, 0.0):
            r = evaluate(engine, tasks, temperature=temp, seed=a.seed)
            report[f"heldout_T{temp:g}"] = r
            print(
                f"held-out T={temp:g}: success {r['success']:.3f} ({r['episodes']} tasks), tool rate "
                f"{r['tool_rate']:.2f}, generated tokens success {r['gen_tokens_success']:.1f} / "
                f"failure {r['gen_tokens_failure']:.1f}, finish {r['finish']}, {r['seconds']:.1f}s"
            )
        asyncio.run(engine.close())
    (out / "cold_start.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
