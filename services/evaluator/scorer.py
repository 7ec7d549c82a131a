"""Scoring one model folder on the held-out tasks: the rollout's agent loop and environment.

A `Scorer` owns the held-out tasks and one generation engine, built from the base model; each
`score(folder)` swaps the folder's weights into the engine (when they are not loaded already)
and plays one greedy episode (temperature 0) and `samples` sampled episodes per task, at most
`concurrency` in flight. The episodes are played by `runtime.agent.run_episode`, the function the
rollout replicas use, so a held-out score measures the policy as it acts in training.

Sampled episodes get seeds fixed per (task, sample) and equal at every evaluation, so two points
on the curve differ by their weights, not by sampling noise.

`play(folder, on_episode)` plays the same episodes and hands each to a callback as it ends,
keeping none: `spopp prior` (prior.py) uses it, greedy off, to count the base policy's successes
on the training tasks in constant memory.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from runtime.agent import prompts_over_budget, reserve_env_threads, run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import Engine, SamplingConfig
from runtime.envs import env_factory
from runtime.envs.base import Task, episode_seed
from runtime.episode import Episode, within_context
from runtime.tasks import load_tasks
from services.config.evaluator import ScoreSettings

_SEED_MASK = (1 << 63) - 1


def sample_seed(base: int, task_index: int, sample: int) -> int:
    """The seed of sampled episode `sample` of task `task_index`: the same at every evaluation."""
    return ((base * 1_000_003 + task_index) * 4099 + sample) & _SEED_MASK


class SnapshotUnreadable(RuntimeError):
    """The folder's weights could not be loaded into the engine (missing, partial, misfit)."""


@dataclass(frozen=True)
class Scored:
    metrics: dict[str, float]  # flat keys: eval/greedy/success_rate, eval/sampled/pass_at_k, ...
    episodes: list[dict]  # one row per episode, in play order


@dataclass(frozen=True)
class Job:
    """One episode to play: the task's index, "greedy" or "sample<j>", its seed (None: greedy)."""

    index: int
    mode: str
    seed: int | None
    sampling: SamplingConfig


def summarize(episodes: list[tuple[int, Episode]], prefix: str) -> dict[str, float]:
    """Means over episodes; `episodes` holds (task index, episode). Success is reward >= 1."""
    if not episodes:
        return {}
    n = len(episodes)
    return {
        f"{prefix}/reward_mean": sum(e.reward for _, e in episodes) / n,
        f"{prefix}/success_rate": sum(e.reward >= 1.0 for _, e in episodes) / n,
        f"{prefix}/response_tokens_mean": sum(e.generated_tokens for _, e in episodes) / n,
        f"{prefix}/turns_mean": sum(e.num_turns for _, e in episodes) / n,
        # Cut by a budget: such an episode earned 0 whatever it was about to say.
        f"{prefix}/truncated_rate": sum(e.finish_reason.startswith("max_") for _, e in episodes) / n,
    }


def pass_at_k(episodes: list[tuple[int, Episode]]) -> float:
    """Share of tasks with at least one successful episode among their samples."""
    solved: dict[int, bool] = {}
    for i, e in episodes:
        solved[i] = solved.get(i, False) or e.reward >= 1.0
    return sum(solved.values()) / len(solved)


def load_held_out(s: ScoreSettings) -> list[Task]:
    tasks = load_tasks(s.tasks)
    if s.max_tasks is not None:
        tasks = tasks[: s.max_tasks]
    if not tasks:
        raise ValueError(f"tasks {s.tasks}: no tasks")
    return tasks


def check_model_folder(folder: str | Path) -> Path:
    """`folder` if it holds a model (config.json), else FileNotFoundError naming it."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"not a model folder (no config.json): {folder}")
    return folder


class Scorer:
    """Held-out tasks + one engine; open it with `await Scorer.open(settings, model)`, inside the
    event loop that will drive it (vLLM's async engine binds to the loop that creates it)."""

    def __init__(self, s: ScoreSettings, engine: Engine, tasks: list[Task], model: Path) -> None:
        self.s = s
        self.engine = engine
        self.tasks = tasks
        self.make_env = env_factory(s.env, s.env_options)
        self.budget = s.budget()
        self.renderer = ChatRenderer(engine.tokenizer)
        self.loaded: Path | None = model.resolve()

    @classmethod
    async def open(
        cls,
        s: ScoreSettings,
        model: str | Path,
        *,
        tasks: list[Task] | None = None,
        engine: Engine | None = None,
    ) -> Scorer:
        """Load the tasks, build the engine on `model` and refuse prompts over the token budget.

        `tasks` replaces the task file's (already loaded by the caller); `engine` replaces the
        engine `s` describes (one already built on `model`, e.g. a test's scripted engine). The
        scorer owns the engine and closes it (when opening fails too).
        """
        from runtime.engines.factory import make_engine

        try:
            tasks = load_held_out(s) if tasks is None else tasks
            model = check_model_folder(model)
        except BaseException:
            if engine is not None:
                await engine.close()
            raise
        # CPU for transformers unless engine_options says {device: cuda:N}; vLLM takes the GPU
        # that CUDA_VISIBLE_DEVICES gives this process. Either way the GPU is not training's.
        if engine is None:
            lora = {"lora_rank": s.lora_rank} if s.lora_rank else {}
            engine = make_engine(s.engine, model, **s.engine_options, **lora)
        try:
            scorer = cls(s, engine, tasks, model)
            budget = within_context(scorer.budget, engine)
            too_long = prompts_over_budget(tasks, scorer.make_env, scorer.renderer, budget)
            if too_long:
                raise ValueError(
                    f"{len(too_long)} held-out task prompts leave no room under max_total_tokens="
                    f"{budget.max_total_tokens}: {', '.join(too_long[:5])}"
                )
        except BaseException:
            await engine.close()
            raise
        return scorer

    async def close(self) -> None:
        await self.engine.close()

    async def load(self, folder: str | Path) -> float:
        """Swap `folder`'s weights in (unless loaded already); answers the seconds it took.

        Raises SnapshotUnreadable when they cannot be loaded; the engine then reloads whatever
        it is asked for next, since a load that failed half way leaves unknown weights."""
        folder = Path(folder).resolve()
        if folder == self.loaded:
            return 0.0
        t0 = time.perf_counter()
        self.loaded = None
        try:
            await self.engine.load_weights(folder)
        except Exception as exc:
            raise SnapshotUnreadable(f"could not load the weights of {folder}: {exc}") from exc
        self.loaded = folder
        return time.perf_counter() - t0

    def jobs(self) -> Iterator[Job]:
        """The episodes of one evaluation in play order: per task, greedy then the samples."""
        s = self.s
        for i in range(len(self.tasks)):
            if s.greedy:
                yield Job(
                    i, "greedy", None, SamplingConfig(max_tokens=s.max_tokens_per_turn, temperature=0.0)
                )
            for j in range(s.samples):
                seed = sample_seed(s.seed or 0, i, j)
                sampling = SamplingConfig(
                    max_tokens=s.max_tokens_per_turn, temperature=s.temperature, top_p=s.top_p, seed=seed
                )
                yield Job(i, f"sample{j}", seed, sampling)

    def job_count(self) -> int:
        return len(self.tasks) * (int(self.s.greedy) + self.s.samples)

    async def play(self, folder: str | Path, on_episode: Callable[[int, Job, Episode], None]) -> float:
        """Load `folder` and play every job, at most `concurrency` in flight, calling
        `on_episode(position, job, episode)` as each ends; keeps nothing itself, so a caller that
        needs only rewards plays a million episodes in constant memory. Answers the load seconds."""
        load_s = await self.load(folder)
        reserve_env_threads(self.s.concurrency)
        pending = enumerate(self.jobs())  # shared: each worker takes the next job in play order

        async def worker() -> None:
            for position, job in pending:
                env = self.make_env()
                try:
                    task = self.tasks[job.index]
                    # The environment's stream: fixed per (seed, task, job), like the sampling seed,
                    # so every evaluation plays each job against the same draws.
                    episode = await run_episode(
                        self.engine, env, task, self.budget, job.sampling, self.renderer,
                        env_seed=episode_seed(self.s.seed or 0, task.task_id, job.mode),
                    )  # fmt: skip
                finally:
                    env.close()
                on_episode(position, job, episode)

        # A TaskGroup: if one episode fails, the others are cancelled before the error leaves, so
        # none of them is still generating when the next evaluation swaps the weights.
        async with asyncio.TaskGroup() as group:
            for _ in range(min(self.s.concurrency, self.job_count())):
                group.create_task(worker())
        return load_s

    async def score(
        self, folder: str | Path, on_episode: Callable[[int, Job, Episode], None] | None = None
    ) -> Scored:
        """Load `folder` and play the held-out episodes; metrics and one row per episode.

        `on_episode(position, job, episode)` is called as each episode ends (progress)."""
        t0 = time.perf_counter()
        played: dict[int, tuple[Job, Episode]] = {}

        def keep(position: int, job: Job, episode: Episode) -> None:
            played[position] = (job, episode)
            if on_episode is not None:
                on_episode(position, job, episode)

        load_s = await self.play(folder, keep)
        s = self.s
        results = [played[p] for p in range(len(played))]
        greedy_eps = [(job.index, ep) for job, ep in results if job.mode == "greedy"]
        sampled_eps = [(job.index, ep) for job, ep in results if job.mode != "greedy"]

        metrics: dict[str, float] = {"eval/tasks": len(self.tasks)}
        metrics.update(summarize(greedy_eps, "eval/greedy"))
        metrics.update(summarize(sampled_eps, "eval/sampled"))
        if sampled_eps:
            metrics["eval/sampled/pass_at_k"] = pass_at_k(sampled_eps)
            metrics["eval/sampled/k"] = s.samples
        # Answers whose check was killed at its deadline or failed (scored as wrong): counted, so
        # that a version scored low for that reason can be told apart.
        metrics["eval/answer_checks_failed"] = sum(bool(ep.info.get("answer_check")) for _, ep in results)
        metrics["eval/load_s"] = load_s
        metrics["eval/seconds"] = time.perf_counter() - t0

        tok = self.engine.tokenizer
        rows = [
            {
                "task_id": self.tasks[job.index].task_id,
                "mode": job.mode,
                "seed": job.seed,
                "reward": ep.reward,
                "finish_reason": ep.finish_reason,
                "turns": ep.num_turns,
                "response_tokens": ep.generated_tokens,
                "response": tok.decode(ep.token_ids[ep.prompt_tokens :], skip_special_tokens=False),
                # The environment's own numbers (toy-calc's drawn delays, latency_s): a record of
                # the episode's draws, which one seed reproduces (tests/tools/test_map_run.py).
                "env": {k: v for k, v in ep.info.items() if isinstance(v, (bool, int, float, str))},
            }
            for job, ep in results
        ]
        return Scored(metrics=metrics, episodes=rows)


async def score_folders(s: ScoreSettings, folders: list[Path]) -> list[dict]:
    """Score model folders one after another, outside training (`spopp evaluator score`).

    Each result is labelled with the folder's manifest version and step (0 and null for a plain
    model folder); its episodes land in `out_dir/scored/<n>-vNNNNNN.jsonl`, n its position.
    Every folder is checked before the engine starts: FileNotFoundError names those that are not
    model folders.
    """
    from spopp.files.snapshots import read_manifest, version_dirname

    missing = [str(f) for f in folders if not (Path(f) / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"not a model folder (no config.json): {', '.join(missing)}")
    labels = []
    for folder in folders:
        if (Path(folder) / "manifest.json").is_file():
            m = read_manifest(folder)
            labels.append((m.version, m.step))
        else:
            labels.append((0, None))
    out = Path(s.out_dir) / "scored"
    out.mkdir(parents=True, exist_ok=True)
    scorer = await Scorer.open(s, s.model or folders[0])
    results = []
    try:
        for n, (folder, (version, step)) in enumerate(zip(folders, labels, strict=True)):
            scored = await scorer.score(folder)
            path = out / f"{n}-{version_dirname(version)}.jsonl"
            with path.open("w", encoding="utf-8") as f:
                for row in scored.episodes:
                    f.write(json.dumps({"policy_version": version, **row}, ensure_ascii=False) + "\n")
            results.append(
                {"snapshot": str(folder), "policy_version": version, "step": step, "episodes": str(path),
                 **scored.metrics}
            )  # fmt: skip
    finally:
        await scorer.close()
    return results
