"""Playing an episode, whoever plays it: `run_episode` plays any `Playable` (an environment, turn
by turn, or a user's agent through the chat endpoint: runtime/envs/base.py) with the run's seed,
budgets and sampling; `prompts_over_budget` is the start-up check of the openings; and
`reserve_env_threads` gives environments' blocking steps threads to run in.

What an episode is (its budgets, its record) is runtime/episode.py; its token sequence is
runtime/token_sequence.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable
from typing import Any

from .chat import ChatRenderer
from .engines.base import Engine, SamplingConfig
from .envs.base import Playable, Task
from .episode import Budget, Episode, within_context


def reserve_env_threads(episodes: int) -> None:
    """Give the running loop's default executor a thread per concurrent episode (and a few more).

    Environments run in `asyncio.to_thread`, whose default pool has min(32, cores + 4) threads: on
    a 2-core machine six episodes could be inside a tool call at once, whatever the replica's
    `concurrency`, and the rest would queue behind them with the engine idle. Only ever grows it.
    """
    import concurrent.futures

    loop = asyncio.get_running_loop()
    current = getattr(loop, "_spopp_env_threads", 0)
    if episodes + 4 <= max(current, min(32, (os.cpu_count() or 1) + 4)):
        return
    loop.set_default_executor(
        concurrent.futures.ThreadPoolExecutor(max_workers=episodes + 4, thread_name_prefix="spopp-env")
    )
    loop._spopp_env_threads = episodes + 4


def prompts_over_budget(
    tasks: Iterable[Task], make_env: Callable[[], Playable], renderer: ChatRenderer, budget: Budget
) -> list[str]:
    """Tasks whose opening alone fills `budget.max_total_tokens`, as "task_id (N tokens)".

    Such a task can never be answered; callers refuse to start with one rather than spend
    episodes on it.
    """
    out = []
    probe = make_env()
    probe.close()
    if not probe.cheap_reset:
        return out
    for task in tasks:
        env = make_env()
        try:
            opening = env.opening(task)
        finally:
            env.close()
        n = 0 if opening is None else len(renderer.prompt(opening))
        if n >= budget.max_total_tokens:
            out.append(f"{task.task_id} ({n} tokens)")
    return out


async def run_episode(
    engine: Engine,
    env: Playable,
    task: Task,
    budget: Budget,
    sampling: SamplingConfig,
    renderer: ChatRenderer | None = None,
    env_seed: int | None = None,
    endpoint: Any = None,
) -> Episode:
    """One episode of `engine` on `task`, played by `env` (`Playable.play`). `env_seed`
    (`envs.base.episode_seed` of the run's seed and the episode's identity) seeds the episode's
    random draws; None leaves its stream as it is (a fixed one for an environment never seeded).
    `endpoint` is the process's chat endpoint (`runtime.chat_endpoint.Endpoint`; None: the
    process's own), which an agent's episode calls the model through."""
    if env_seed is not None:
        env.seed_episode(env_seed)
    renderer = renderer or ChatRenderer(engine.tokenizer)
    return await env.play(engine, task, within_context(budget, engine), sampling, renderer, endpoint)
