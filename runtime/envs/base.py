"""The environment interface: `reset(task) -> messages`, `step(action) -> StepResult`.

Messages are chat messages ({"role", "content"}) that the agent loop renders with the model's
chat template; everything an environment returns is masked out of the loss. Environments are
synchronous (the agent loop runs them in a worker thread) and hold the state of one episode.

Randomness. An environment that draws at random (toy-calc's latency and time-neutral waits) draws
only from `self.rng`, a `random.Random` that `seed_episode(seed)` sets before the episode's
`reset`; the seed comes from `episode_seed(run_seed, *identity)`, so that one run seed and one
episode identity give one stream in every process and on every machine. Callers: the rollout
replica (identity: the task and the tracker's request id), the evaluator (the task and the job).

Playing. Services play every episode through one contract, `Playable.play`: an `Environment` plays
its episode here, turn by turn (generate, `step`, extend the sequence); an agent's episode
(runtime/envs/agent.py) is played by the user's code through the chat endpoint. Which one is the
class's: nothing asks which kind it holds.
"""

from __future__ import annotations

import asyncio
import random
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from typing import Any

# The environments' seed of one episode's stream lives beside the engine's sampling seed (spopp.compare.streams:
# one module holds every stream of a run that is not the method's); environments import it from here.
from spopp.compare.streams import episode_seed

from ..chat import ChatRenderer
from ..engines.base import Engine, SamplingConfig
from ..episode import Budget, Episode, reward_verdict
from ..token_sequence import TokenSequence

__all__ = ["UNSEEDED", "Environment", "Playable", "StepResult", "Task", "episode_seed"]


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str
    answer: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    messages: list[dict]  # what the environment says next (tool output, observation); may be empty
    done: bool
    reward: float = 0.0  # read when done; in [0, 1]
    info: dict[str, Any] = field(default_factory=dict)


# The stream of an episode nobody seeded (tools, tests, `prompts_over_budget`'s probes): fixed, so
# that even those are reproducible, never OS entropy.
UNSEEDED = episode_seed(0, "unseeded")


class Playable(ABC):
    """What a service plays one episode of: `await playable.play(engine, task, ...)` answers the
    Episode. An `Environment` plays it turn by turn; an agent's episode (runtime/envs/agent.py) is
    played by the agent. Built once per episode and closed after it."""

    name: str = "base"
    # Whether services may open every task at start-up to find openings that fill the budget
    # (`runtime.agent.prompts_over_budget`). False where an opening costs real time (an ALFWorld
    # game loads in about 0.5 s) or is not ours (an agent writes its own); an episode whose opening
    # fills the budget still ends at once with reward 0 and finish "max_total_tokens".
    cheap_reset: bool = True
    # Whether the episode's model calls come in through the replica's chat routes (an agent's):
    # the replica serves those routes only then.
    calls_over_chat: bool = False

    # The episode's random stream (see the module's docstring); built on first use, so that
    # subclasses need not call a base __init__.
    _rng: random.Random | None = None

    @property
    def rng(self) -> random.Random:
        if self._rng is None:
            self._rng = random.Random(UNSEEDED)
        return self._rng

    @classmethod
    def prepare(cls, options: dict[str, Any]) -> None:
        """Check, once at start-up and before any episode is built, what the machine must have for
        this environment with these options (a sandbox, a package, a data folder); raise naming what
        is missing. Bad options need no check here: building one with them is the check."""

    def seed_episode(self, seed: int) -> None:
        """Draw the next episode's randomness from `seed` (`episode_seed(...)`); call before play."""
        self._rng = random.Random(seed)

    @abstractmethod
    async def play(
        self, engine: Engine, task: Task, budget: Budget, sampling: SamplingConfig, renderer: ChatRenderer,
        endpoint: Any = None,
    ) -> Episode:  # fmt: skip
        """Play one episode of `task` with `engine` within `budget` (already within the engine's
        context); `endpoint` is the process's chat endpoint, for episodes whose calls come over chat."""

    def opening(self, task: Task) -> list[dict] | None:
        """The episode's opening messages, for a look at the prompt (`spopp model render`); None
        where the opening is not ours to know (an agent writes its own, call by call)."""
        return None

    def close(self) -> None:
        """Free what the episode holds (sandbox folders, games)."""


class Environment(Playable):
    """One episode at a time, played turn by turn: `reset` opens it, each model turn is `step`ped.
    `stop` lists strings that end a model turn (e.g. a code block's end)."""

    stop: tuple[str, ...] = ()

    @abstractmethod
    def reset(self, task: Task) -> list[dict]:
        """Start an episode: the opening messages (system prompt, the task)."""

    @abstractmethod
    def step(self, action: str) -> StepResult:
        """Take the model's turn (decoded text) and answer."""

    def opening(self, task: Task) -> list[dict] | None:
        return self.reset(task)

    async def play(
        self, engine: Engine, task: Task, budget: Budget, sampling: SamplingConfig, renderer: ChatRenderer,
        endpoint: Any = None,
    ) -> Episode:  # fmt: skip
        """The turn loop: generate, step, extend the sequence, until the environment ends the episode
        or a budget cuts it. An episode cut by a budget gets reward 0 and says which budget cut it,
        unless the environment had already settled its reward (a step's info `decided_reward`:
        toy-calc's padded turns, which only lengthen an episode whose outcome is known)."""
        t0 = time.perf_counter()
        # A reset may load a game (ALFWorld: about 0.5 s): off the event loop, like every step.
        opening = await asyncio.to_thread(self.reset, task)
        reset_s = time.perf_counter() - t0
        progress = _Progress(seq=TokenSequence(), env_s=reset_s)
        seq = progress.seq
        seq.add(renderer.prompt(opening))
        prompt_tokens = len(seq.ids)
        # The engine stops at the caller's stop strings and at the environment's.
        turn = _Turn(
            engine,
            self,
            renderer,
            budget,
            replace(sampling, stop=tuple(dict.fromkeys(sampling.stop + self.stop))),
        )
        while progress.turns < budget.max_turns:
            if not await turn.play(progress):
                break
        return Episode(
            token_ids=seq.ids, action_mask=seq.mask, rollout_logprobs=seq.logprobs, reward=progress.reward,
            num_turns=progress.turns, finish_reason=progress.finish, prompt_tokens=prompt_tokens,
            info=progress.info, token_versions=seq.versions,
            timings={"generate_s": progress.gen_s, "env_s": progress.env_s, "reset_s": reset_s,
                     "total_s": time.perf_counter() - t0},
        )  # fmt: skip


@dataclass
class _Progress:
    """What an episode has gathered so far; each turn of the loop updates it in place."""

    seq: TokenSequence
    env_s: float
    gen_s: float = 0.0
    # Reward stays 0 unless the environment ends the episode: a cut answer earns nothing.
    reward: float = 0.0
    finish: str = "max_turns"
    turns: int = 0
    info: dict = field(default_factory=dict)


@dataclass
class _Turn:
    """One turn of an environment's episode, with what every turn of it shares."""

    engine: Engine
    env: Environment
    renderer: ChatRenderer
    budget: Budget
    sampling: SamplingConfig  # the environment's stop strings added

    async def play(self, progress: _Progress) -> bool:
        """Generate, step the environment, extend the sequence. False once the episode ends."""
        seq, budget = progress.seq, self.budget
        room = budget.max_total_tokens - len(seq.ids)
        if room < 1:
            progress.finish = "max_total_tokens"
            return False
        per_turn = min(budget.max_tokens_per_turn, room)
        s = time.perf_counter()
        gen = await self.engine.generate(seq.ids, replace(self.sampling, max_tokens=per_turn))
        progress.gen_s += time.perf_counter() - s
        progress.turns += 1
        seq.add(gen.token_ids, gen.logprobs, gen.version)
        if gen.finish_reason == "length":
            cut_by_turn = per_turn == budget.max_tokens_per_turn
            progress.finish = "max_tokens_per_turn" if cut_by_turn else "max_total_tokens"
            return False
        s = time.perf_counter()
        text = self.engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        result = await asyncio.to_thread(self.env.step, text)
        progress.env_s += time.perf_counter() - s
        progress.info = result.info
        if result.done:
            progress.reward, why = reward_verdict(result.reward)
            progress.finish = str(result.info.get("finish", "done"))
            if why is not None:  # a reward outside [0, 1] scores 0, saying why (as a failed check)
                progress.info = {**result.info, "answer_check": why}
            seq.add(self.renderer.close_turn(gen.token_ids))
            return False
        # A reward the environment has settled survives a budget that cuts the episode afterwards.
        progress.reward = float(result.info.get("decided_reward", 0.0))
        more = self.renderer.close_turn(gen.token_ids) + self.renderer.continuation(result.messages)
        if len(seq.ids) + len(more) >= budget.max_total_tokens:
            progress.finish = "max_total_tokens"
            return False
        seq.add(more)
        return True
