"""The multi-turn agent loop: one episode of an engine against an environment.

The trajectory is one flat token sequence. Tokens the engine generated carry mask 1 and the
engine's own log-probs; everything else (prompt, observations, tool output, the template's
turn markers) carries mask 0. Budgets: turns, tokens per turn, total tokens; an episode cut by
a budget gets reward 0 and says which budget cut it, unless the environment had already settled
its reward (a step's info `decided_reward`: toy-calc's padded turns, which only lengthen an
episode whose outcome is known), which a cut then keeps.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from .chat import ChatRenderer
from .engines.base import Engine, SamplingConfig
from .envs.base import Environment, Task, reward_verdict


@dataclass(frozen=True)
class Budget:
    max_turns: int = 8
    max_tokens_per_turn: int = 1024
    max_total_tokens: int = 4096

    def __post_init__(self) -> None:
        if min(self.max_turns, self.max_tokens_per_turn, self.max_total_tokens) < 1:
            raise ValueError(f"every budget must be >= 1, got {self}")


@dataclass
class Episode:
    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    reward: float
    num_turns: int
    finish_reason: str
    prompt_tokens: int
    info: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    # Per token, the policy version that generated it (None: the engine does not say; tokens
    # the engine did not generate carry the version of the last generation before them).
    token_versions: list[int | None] = field(default_factory=list)
    # Where each segment starts in token_ids: [0] for one sequence; an agent that rewrote its
    # history between calls has more (runtime.agent_session), each trained apart.
    segment_starts: list[int] = field(default_factory=lambda: [0])

    @property
    def generated_tokens(self) -> int:
        return sum(self.action_mask)


class _Sequence:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int | None] = []
        self._version: int | None = None

    def add(self, ids: list[int], logprobs: list[float] | None = None, version: int | None = None) -> None:
        if logprobs is not None:
            self._version = version
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [self._version] * len(ids)


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


def within_context(budget: Budget, engine: Engine) -> Budget:
    """`budget` with max_total_tokens at most the engine's context: an episode that outgrew the
    context would have its next turn refused, so it ends as max_total_tokens with what it has."""
    context = getattr(engine, "context_tokens", None)  # engines of tests may not say
    if context is not None and context < budget.max_total_tokens:
        return replace(budget, max_total_tokens=context)
    return budget


def prompts_over_budget(
    tasks: Iterable[Task], make_env: Callable[[], Environment], renderer: ChatRenderer, budget: Budget
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
            n = len(renderer.prompt(env.reset(task)))
        finally:
            env.close()
        if n >= budget.max_total_tokens:
            out.append(f"{task.task_id} ({n} tokens)")
    return out


@dataclass
class _Progress:
    """What an episode has gathered so far; each turn of the loop updates it in place."""

    seq: _Sequence
    env_s: float
    gen_s: float = 0.0
    # Reward stays 0 unless the environment ends the episode: a cut answer earns nothing.
    reward: float = 0.0
    finish: str = "max_turns"
    turns: int = 0
    info: dict = field(default_factory=dict)


async def _play_turn(
    engine: Engine,
    env: Environment,
    renderer: ChatRenderer,
    budget: Budget,
    sampling: SamplingConfig,
    stop: tuple[str, ...],
    progress: _Progress,
) -> bool:
    """One turn: generate, step the environment, extend the sequence. False once the episode ends."""
    seq = progress.seq
    room = budget.max_total_tokens - len(seq.ids)
    if room < 1:
        progress.finish = "max_total_tokens"
        return False
    per_turn = min(budget.max_tokens_per_turn, room)
    s = time.perf_counter()
    gen = await engine.generate(seq.ids, replace(sampling, max_tokens=per_turn, stop=stop))
    progress.gen_s += time.perf_counter() - s
    progress.turns += 1
    seq.add(gen.token_ids, gen.logprobs, gen.version)
    if gen.finish_reason == "length":
        cut_by_turn = per_turn == budget.max_tokens_per_turn
        progress.finish = "max_tokens_per_turn" if cut_by_turn else "max_total_tokens"
        return False
    s = time.perf_counter()
    text = engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    result = await asyncio.to_thread(env.step, text)
    progress.env_s += time.perf_counter() - s
    progress.info = result.info
    if result.done:
        progress.reward, why = reward_verdict(result.reward)
        progress.finish = str(result.info.get("finish", "done"))
        if why is not None:  # a reward outside [0, 1] scores 0, saying why (as a failed check)
            progress.info = {**result.info, "answer_check": why}
        seq.add(renderer.close_turn(gen.token_ids))
        return False
    # A reward the environment has settled survives a budget that cuts the episode afterwards.
    progress.reward = float(result.info.get("decided_reward", 0.0))
    more = renderer.close_turn(gen.token_ids) + renderer.continuation(result.messages)
    if len(seq.ids) + len(more) >= budget.max_total_tokens:
        progress.finish = "max_total_tokens"
        return False
    seq.add(more)
    return True


async def run_episode(
    engine: Engine,
    env: Environment,
    task: Task,
    budget: Budget,
    sampling: SamplingConfig,
    renderer: ChatRenderer | None = None,
    env_seed: int | None = None,
    endpoint=None,
) -> Episode:
    """One episode of `engine` against `env` on `task`. `env_seed` (`envs.base.episode_seed` of the
    run's seed and the episode's identity) seeds the environment's random draws for this episode;
    None leaves the environment's stream as it is (a fixed one for an environment never seeded).

    An environment an agent drives (`Environment.driven_by_agent`: runtime/envs/agent.py) is played
    by its agent through the chat endpoint `endpoint` (`runtime.chat_endpoint.Endpoint`; None: the
    process's), with the same budgets and sampling."""
    if env.driven_by_agent:
        from .envs.agent import run_agent_episode

        return await run_agent_episode(engine, env, task, budget, sampling, renderer, endpoint=endpoint)
    renderer = renderer or ChatRenderer(engine.tokenizer)
    budget = within_context(budget, engine)
    if env_seed is not None:
        env.seed_episode(env_seed)
    t0 = time.perf_counter()
    # A reset may load a game (ALFWorld: about 0.5 s): off the event loop, like every step.
    opening = await asyncio.to_thread(env.reset, task)
    reset_s = time.perf_counter() - t0
    progress = _Progress(seq=_Sequence(), env_s=reset_s)
    seq = progress.seq
    seq.add(renderer.prompt(opening))
    prompt_tokens = len(seq.ids)
    # The engine stops at the caller's stop strings and at the environment's.
    stop = tuple(dict.fromkeys(sampling.stop + env.stop))
    while progress.turns < budget.max_turns:
        if not await _play_turn(engine, env, renderer, budget, sampling, stop, progress):
            break
    return Episode(
        token_ids=seq.ids,
        action_mask=seq.mask,
        rollout_logprobs=seq.logprobs,
        reward=progress.reward,
        num_turns=progress.turns,
        finish_reason=progress.finish,
        prompt_tokens=prompt_tokens,
        info=progress.info,
        token_versions=seq.versions,
        timings={
            "generate_s": progress.gen_s,
            "env_s": progress.env_s,
            "reset_s": reset_s,
            "total_s": time.perf_counter() - t0,
        },
    )
