"""`spopp env check`: play a few episodes of an environment (or agent) and say whether it keeps the
contract the services rely on.

What is checked, each a row of the table (`Finding`):

* `builds`: the spec resolves and the environment builds with its options (runtime/envs/registry.py);
* `template`: the model's chat template does not rewrite earlier turns when a message is added
  (the incremental rendering of runtime/chat.py refuses such a template mid-episode);
* `prompts`: no task's opening fills the token budget or the model's context;
* `exceptions`: no episode raised, and none ended because the user's code failed (an agent that
  raised or timed out, a taskset's setup or scoring error, a reward function that raised): each
  is listed with its episode, task, exception and the line of the user's file (runtime/faults.py);
* `rewards`: every reward is a finite number in [0, 1], and no reward check or reward function
  failed (killed at its limit, raised, or returned something else: `info["answer_check"]`);
* `ends`: every episode ended within the turn budget (finish `max_turns` means it never would);
* `deterministic`: the first task played twice with one seed gives the same tokens and reward.

Exit 0 only when every row holds.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from ..agent import prompts_over_budget, run_episode
from ..chat import ChatRenderer
from ..engines.base import SamplingConfig
from ..episode import Budget, Episode, within_context
from ..faults import Fault
from .base import Task, episode_seed


@dataclass
class Finding:
    check: str
    ok: bool
    detail: str = ""


@dataclass
class Report:
    spec: str
    findings: list[Finding] = field(default_factory=list)
    episodes: list[tuple[str, Episode]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def add(self, check: str, ok: bool, detail: str = "") -> None:
        self.findings.append(Finding(check, ok, detail))

    def table(self) -> str:
        width = max(len(f.check) for f in self.findings)
        lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
        for f in self.findings:
            lines.append(f"{f.check:<{width}}  {'ok' if f.ok else 'FAIL':<6}  {f.detail}")
        verdict = "the contract holds" if self.ok else "the contract does NOT hold"
        return "\n".join([f"environment {self.spec}: {verdict}", *lines])


def probe_tasks(n: int) -> list[Task]:
    """Tasks for an environment checked without a task file: small arithmetic questions."""
    return [Task(f"check-{i}", f"What is {i + 2} + {i + 3}?", str(2 * i + 5)) for i in range(n)]


def _template_rewrites(renderer: ChatRenderer) -> str | None:
    try:
        renderer.continuation([{"role": "user", "content": "probe"}])
        renderer.continuation([{"role": "tool", "content": "probe"}])
    except ValueError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a template that refuses a role is a finding, not a crash
        return f"{type(e).__name__}: {e}"
    return None


async def _play(engine, make_env, task, budget, sampling, seed) -> Episode:
    env = make_env()
    try:
        return await run_episode(
            engine, env, task, budget, sampling, env_seed=episode_seed(seed, task.task_id, "check")
        )
    finally:
        env.close()


async def check_environment(
    spec: str,
    options: dict,
    engine,
    tasks: Sequence[Task],
    episodes: int,
    budget: Budget,
    seed: int = 0,
) -> Report:
    from . import env_factory

    report = Report(spec)
    try:
        make_env = env_factory(spec, options)
    except Exception as e:  # noqa: BLE001 - any failure to build is the finding
        report.add("builds", False, str(e))
        return report
    probe = make_env()
    report.add("builds", True, type(probe).__name__)
    probe.close()
    renderer = ChatRenderer(engine.tokenizer)
    rewrites = _template_rewrites(renderer)
    report.add("template", rewrites is None, rewrites or "earlier turns stay as they were")
    budget = within_context(budget, engine)
    _check_prompts(report, tasks, make_env, renderer, budget)
    sampling = SamplingConfig(max_tokens=budget.max_tokens_per_turn, seed=seed)
    play = partial(_play, engine, make_env, budget=budget, seed=seed)
    first = await _play_episodes(report, play, tasks, episodes, sampling)
    _check_rewards(report)
    _check_ends(report, budget)
    if first is not None:
        await _check_deterministic(report, play, tasks[0], first, sampling)
    return report


def _check_prompts(report: Report, tasks: Sequence[Task], make_env, renderer, budget: Budget) -> None:
    try:
        too_long = prompts_over_budget(tasks, make_env, renderer, budget)
        probe = make_env()
        probe.close()
        fine = (
            f"every opening under {budget.max_total_tokens} tokens" if probe.cheap_reset
            else f"not probed: {type(probe).__name__} writes its own openings (budget {budget.max_total_tokens} tokens)"
        )  # fmt: skip
        report.add("prompts", not too_long, ", ".join(too_long[:3]) or fine)
    except Exception as e:  # noqa: BLE001
        report.add("prompts", False, f"opening a task raised {type(e).__name__}: {e}")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


async def _play_episodes(
    report: Report, play, tasks: Sequence[Task], episodes: int, sampling: SamplingConfig
) -> Episode | None:
    """Play `episodes` episodes into the report, with the `exceptions` row; episode 0, for the replay.

    The row fails on an episode that raised (an environment class's bug) and on one that ended
    because the user's code failed without stopping the loop: an agent that raised or ran out of
    time, a taskset's setup or scoring error, a reward function that raised (`info["fault"]`).
    Each earns 0 in a run, so only this row can tell a broken agent from one that is never right."""
    failures: dict[str, list[str]] = {}  # what failed -> the episodes it failed, in order
    first: Episode | None = None
    for i in range(episodes):
        task = tasks[i % len(tasks)]
        try:
            ep = await play(task, sampling=replace(sampling, seed=sampling.seed + i))
        except Exception as e:  # noqa: BLE001 - listed with its episode
            failures.setdefault(str(Fault.of("the environment", e)), []).append(
                f"episode {i} ({task.task_id})"
            )
            continue
        fault = Fault.from_info(ep.info)
        if fault is not None:
            failures.setdefault(str(fault), []).append(f"episode {i} ({task.task_id})")
        report.episodes.append((task.task_id, ep))
        first = ep if i == 0 else first
    failed = sum(len(where) for where in failures.values())
    report.add(
        "exceptions", not failures,
        f"{_plural(failed, 'episode')} of {episodes} failed: " + "; ".join(
            f"{', '.join(where[:2])}{f' and {len(where) - 2} more' if len(where) > 2 else ''}: {what}"
            for what, where in list(failures.items())[:3]
        ) if failures else f"{_plural(episodes, 'episode')} played",
    )  # fmt: skip
    return first


def _check_rewards(report: Report) -> None:
    # A reward outside [0, 1] (or NaN, or no number) was scored 0 by the agent loop, which says why in
    # info["answer_check"], as does a reward function or answer check that failed; one that raised
    # is named with its exception (info["fault"]).
    checks: Counter[str] = Counter()
    for _, ep in report.episodes:
        if ep.info.get("answer_check"):
            fault = Fault.from_info(ep.info)
            why = str(ep.info["answer_check"])
            checks[f"{why} ({fault})" if fault is not None else why] += 1
    detail = "; ".join(f"{_plural(n, 'check')} failed: {why}" for why, n in checks.items())
    rewards = [ep.reward for _, ep in report.episodes]
    mean = f"mean {sum(rewards) / len(rewards):.3f} over {len(rewards)}" if rewards else "no episode ended"
    report.add("rewards", not checks, detail or f"all in [0, 1], {mean}")


def _check_ends(report: Report, budget: Budget) -> None:
    endless = [tid for tid, ep in report.episodes if ep.finish_reason == "max_turns"]
    finishes = Counter(ep.finish_reason for _, ep in report.episodes)
    report.add(
        "ends", not endless,
        f"{len(endless)} episodes hit max_turns={budget.max_turns}: {', '.join(endless[:3])}" if endless
        else ", ".join(f"{k} {v}" for k, v in sorted(finishes.items())),
    )  # fmt: skip


async def _check_deterministic(
    report: Report, play, task: Task, a: Episode, sampling: SamplingConfig
) -> None:
    # `a` is episode 0: `task` played with `sampling` (seed + 0); play it once more with that seed.
    try:
        b = await play(task, sampling=sampling)
        same = a.token_ids == b.token_ids and a.reward == b.reward
        report.add(
            "deterministic", same,
            "one seed, the same tokens and reward" if same
            else f"task {task.task_id}: two plays with one seed differ ({len(a.token_ids)} vs "
            f"{len(b.token_ids)} tokens, rewards {a.reward} vs {b.reward})",
        )  # fmt: skip
    except Exception as e:  # noqa: BLE001
        report.add("deterministic", False, f"replay raised {type(e).__name__}: {e}")


def run_check(
    spec: str,
    options: dict,
    model: Path,
    tasks: Sequence[Task],
    episodes: int,
    budget: Budget,
    seed: int = 0,
) -> Report:
    """`check_environment` on the transformers engine with `model`, in this process."""
    from ..engines.hf import TransformersEngine

    engine = TransformersEngine(model)

    async def main() -> Report:
        try:
            return await check_environment(spec, options, engine, tasks, episodes, budget, seed)
        finally:
            await engine.close()

    return asyncio.run(main())
