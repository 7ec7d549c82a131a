"""`spopp prior`: play the cold-start policy on the training tasks and write the prior file.

Step 3 of SPO++'s protocol: `rollouts` sampled episodes per training task with the base policy,
then a Jeffreys prior of mass `prior_mass` per task (`spopp.files.priors`), written once and loaded by
every run of a comparison. The episodes are the evaluator's (`Scorer`: the agent loop the rollout
replicas use, the same environment and engines, seeds fixed per (task, rollout)), played with
greedy off and `samples = rollouts`, so the same settings give the same prior.

Everything that can be refused is refused before the engine starts (`preflight`): an existing
`out` without `overwrite`, a model folder without config.json, a missing or empty task file, task
ids the tracker would refuse, prompts over the token budget. Only rewards are kept while playing,
so memory does not grow with the number of episodes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from runtime.agent import prompts_over_budget
from runtime.engines.base import Engine
from runtime.envs.base import Task
from runtime.episode import Episode
from services.config.evaluator import ScoreSettings
from services.config.prior import PriorSettings
from spopp.files.priors import PriorFile, build_prior, write_prior

from .scorer import Job, Scorer

log = logging.getLogger("spopp.prior")

PROGRESS_SECONDS = 5.0


class PriorError(ValueError):
    """The settings or their files cannot give a prior; said before any episode is played."""


def score_settings(s: PriorSettings) -> ScoreSettings:
    """The evaluator's view of the prior settings: no greedy episode, `rollouts` sampled ones."""
    return ScoreSettings(
        model=s.model, tasks=s.tasks, max_tasks=s.max_tasks, env=s.env, env_options=s.env_options, engine=s.engine,
        engine_options=s.engine_options, greedy=False, samples=s.rollouts, temperature=s.temperature,
        top_p=s.top_p, max_turns=s.max_turns, max_tokens_per_turn=s.max_tokens_per_turn,
        max_total_tokens=s.max_total_tokens, concurrency=s.concurrency, seed=s.seed,
    )  # fmt: skip


def preflight(s: PriorSettings, tokenizer: object | None = None) -> list[Task]:
    """The training tasks, once everything that would make the prior fail later is checked.

    `tokenizer`: the one the episodes will use (default: the model folder's), for the check that
    every prompt leaves room under max_total_tokens. Raises PriorError with what is wrong.
    """
    _check_out(s)
    if not (Path(s.model) / "config.json").is_file():
        raise PriorError(f"model {s.model} is not a model folder (no config.json)")
    tasks = _training_tasks(s)
    _check_prompts(s, tasks, tokenizer)
    return tasks


def _check_out(s: PriorSettings) -> None:
    """The prior file can be written: a file path, not there yet (or --overwrite), a writable folder."""
    out = Path(s.out)
    if out.is_dir():
        raise PriorError(f"out {out} is a directory; give the path of the prior file to write")
    if out.exists() and not s.overwrite:
        raise PriorError(
            f"prior file {out} exists; every run of a comparison must share one prior, so it is not "
            "replaced: pass --overwrite to write a new one, or a different --out"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PriorError(f"cannot create the folder of {out}: {exc}") from None
    if not os.access(out.parent, os.W_OK):
        raise PriorError(f"cannot write in {out.parent}")


def _training_tasks(s: PriorSettings) -> list[Task]:
    """The first max_tasks tasks of the file, each with an id the tracker accepts."""
    from runtime.tasks import load_tasks
    from spopp.api.tracker_api import TASK_ID

    if not Path(s.tasks).is_file():
        raise PriorError(f"tasks file {s.tasks} does not exist")
    try:
        tasks = load_tasks(s.tasks)
    except ValueError as exc:
        raise PriorError(f"tasks file {s.tasks}: {exc}") from None
    if s.max_tasks is not None:
        tasks = tasks[: s.max_tasks]
    if not tasks:
        raise PriorError(f"tasks file {s.tasks} has no tasks")
    bad = [t.task_id for t in tasks if not TASK_ID.match(t.task_id)]
    if bad:
        raise PriorError(
            f"{len(bad)} task ids in {s.tasks} are not ids the tracker accepts ({TASK_ID.pattern}): "
            + ", ".join(repr(x) for x in bad[:5])
        )
    return tasks


def _check_prompts(s: PriorSettings, tasks: list[Task], tokenizer: object | None) -> None:
    """The environment builds, and every prompt leaves room under max_total_tokens."""
    from runtime.chat import ChatRenderer
    from runtime.envs import env_factory

    try:
        make_env = env_factory(s.env, s.env_options)
    except Exception as exc:  # a missing sandbox dependency (math-tir) says what it lacks
        raise PriorError(f"environment {s.env}: {exc}") from None
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(s.model)
        except Exception as exc:
            raise PriorError(f"model {s.model}: cannot load its tokenizer: {exc}") from None
    budget = s.budget()
    too_long = prompts_over_budget(tasks, make_env, ChatRenderer(tokenizer), budget)
    if too_long:
        raise PriorError(
            f"{len(too_long)} training task prompts leave no room under max_total_tokens="
            f"{s.max_total_tokens}: {', '.join(too_long[:5])}"
        )


class Progress:
    """Counts finished episodes; logs a line every `every` seconds (and reports the totals)."""

    def __init__(self, total: int, every: float = PROGRESS_SECONDS, emit: Callable[[str], None] = log.info):
        self.total, self.every, self.emit = total, every, emit
        self.done = self.successes = 0
        self.t0 = self.last = time.monotonic()

    def __call__(self, reward: float) -> None:
        self.done += 1
        self.successes += reward >= 1.0
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            self.emit(self.line(now))

    def line(self, now: float | None = None) -> str:
        elapsed = (now or time.monotonic()) - self.t0
        rate = self.successes / self.done if self.done else 0.0
        return f"prior: {self.done}/{self.total} episodes, success so far {rate:.2f}, {elapsed:.0f} s"


async def play_rollouts(
    s: PriorSettings,
    tasks: list[Task],
    engine: Engine | None = None,
    progress_every: float = PROGRESS_SECONDS,
) -> dict[str, list[float]]:
    """Rewards of `rollouts` sampled episodes per task, {task_id: [reward, ...]} in task order.

    `engine`: one already built on the model (tests' scripted engines); default: the settings'."""
    scorer = await Scorer.open(score_settings(s), s.model, tasks=tasks, engine=engine)
    try:
        rewards: dict[str, list[float]] = {t.task_id: [] for t in tasks}
        progress = Progress(scorer.job_count(), progress_every)

        def collect(_position: int, job: Job, episode: Episode) -> None:
            rewards[tasks[job.index].task_id].append(episode.reward)
            progress(episode.reward)

        await scorer.play(s.model, collect)
    finally:
        await scorer.close()
    return rewards


def run_prior(
    s: PriorSettings, engine: Engine | None = None, progress_every: float = PROGRESS_SECONDS
) -> PriorFile:
    """Check, play, build and write the prior file `s.out`; answers what was written."""
    tasks = preflight(s, tokenizer=engine.tokenizer if engine is not None else None)
    created, t0 = time.time(), time.perf_counter()
    log.info("prior: %d tasks x %d rollouts with %s on %s", len(tasks), s.rollouts, s.model, s.engine)
    rewards = asyncio.run(play_rollouts(s, tasks, engine, progress_every))
    meta = {
        "model": str(Path(s.model).resolve()),
        "tasks_file": str(Path(s.tasks).resolve()),
        "env": s.env,
        "env_options": s.env_options,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "max_turns": s.max_turns,
        "max_tokens_per_turn": s.max_tokens_per_turn,
        "max_total_tokens": s.max_total_tokens,
        "seed": s.seed,
        "created": created,
        "seconds": time.perf_counter() - t0,
    }
    prior = build_prior(rewards, s.prior_mass, meta)
    write_prior(s.out, prior, overwrite=s.overwrite)
    return prior


def summary(prior: PriorFile, path: str | Path) -> str:
    """What `spopp prior` prints at the end."""
    n = prior.meta.get("rollouts")
    tasks = prior.tasks
    episodes = sum(t.rollouts for t in tasks)
    never = sum(t.successes == 0 for t in tasks)
    always = sum(t.successes == t.rollouts for t in tasks)
    per = f"{n} rollouts each" if n is not None else "varying rollouts"
    return (
        f"prior: wrote {Path(path).resolve()}\n"
        f"  tasks {len(tasks)}, {per} ({episodes} episodes), prior_mass {prior.prior_mass:g}\n"
        f"  mean success {prior.meta['success_rate']:.4f}; tasks never solved (0/n) {never}, "
        f"always solved (n/n) {always}\n"
        f"  seconds {prior.meta.get('seconds', 0.0):.1f}"
    )
