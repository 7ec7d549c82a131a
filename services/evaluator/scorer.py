"""Held-out evaluation: the rollout's agent loop and environment, scored on each published policy.

Rank 0 owns an `Evaluator`. Every `eval.every` updates, right after the publish, it queues the new
snapshot; a background thread with its own event loop and generation engine loads the snapshot
and plays one greedy episode (temperature 0) and `samples` sampled episodes per held-out task.
Training does not wait for it: the learner picks up finished evaluations after each update and
logs them beside the training records, at the update they scored. A learner that evaluated in
line would hold every other rank in a collective for the whole evaluation (gloo's timeout is 30
minutes) and would stall the rollouts' consumer.

Sampled episodes get seeds fixed per (task, sample) and equal at every evaluation, so two
points on the curve differ by their weights, not by sampling noise. Per-episode results go to
`log_dir/eval/vNNNNNN.jsonl` for inspection.

Queued snapshots are read after the learner may have published more; the learner passes
`pending_versions()` to the snapshot pruning so a queued snapshot is never deleted before it is
scored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path

from runtime.agent import Budget, Episode, prompts_over_budget, run_episode
from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.envs import env_factory
from runtime.envs.base import Task
from runtime.tasks import load_tasks

from .config import EvalConfig

log = logging.getLogger("spopp.learner.eval")

_SEED_MASK = (1 << 63) - 1


def sample_seed(base: int, task_index: int, sample: int) -> int:
    """The seed of sampled episode `sample` of task `task_index`: the same at every evaluation."""
    return ((base * 1_000_003 + task_index) * 4099 + sample) & _SEED_MASK


@dataclass(frozen=True)
class EvalResult:
    step: int
    version: int
    metrics: dict[str, float]


class EvaluationSkipped(RuntimeError):
    """A newer snapshot took this one's place in the queue before its turn came."""


@dataclass
class _Job:
    step: int
    version: int
    snapshot: Path
    future: Future = field(default_factory=Future)


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


class Evaluator:
    """Scores snapshots on held-out tasks in a background thread (rank 0 only)."""

    def __init__(self, cfg: EvalConfig, base_model: str | Path, out_dir: str | Path) -> None:
        self.cfg = cfg
        tasks = load_tasks(cfg.tasks)
        if cfg.max_tasks is not None:
            tasks = tasks[: cfg.max_tasks]
        if not tasks:
            raise ValueError(f"eval.tasks {cfg.tasks}: no tasks")
        self.tasks: list[Task] = tasks
        self.base_model = Path(base_model)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.make_env = env_factory(cfg.env)
        self.budget = Budget(cfg.max_turns, cfg.max_tokens_per_turn, cfg.max_total_tokens)
        # Submitted jobs in order, until collected. One evaluation runs at a time (the engine holds
        # one set of weights) and at most one waits: a newer submission takes the waiting one's
        # place, so a slow evaluation never piles up snapshots on disk or falls ever further behind.
        self._jobs: list[_Job] = []
        self._waiting: _Job | None = None
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        self._worker: Future | None = None
        self.running_step: int | None = None  # the update whose snapshot is being scored now
        self._thread = threading.Thread(target=self._loop.run_forever, name="spopp-eval", daemon=True)
        self._thread.start()
        try:
            # Built on the evaluation loop: vLLM's AsyncLLM binds to the loop that creates it.
            self.engine = self._call(self._build())
            self.renderer = ChatRenderer(self.engine.tokenizer)
            too_long = prompts_over_budget(self.tasks, self.make_env, self.renderer, self.budget)
            if too_long:
                raise ValueError(
                    f"{len(too_long)} held-out task prompts leave no room under eval.max_total_tokens="
                    f"{self.budget.max_total_tokens}: {', '.join(too_long[:5])}"
                )
        except BaseException:
            self.close()
            raise
        self.loaded: Path = self.base_model
        self._worker = asyncio.run_coroutine_threadsafe(self._work(), self._loop)
        log.info(
            "evaluation: %d held-out tasks, greedy=%s, %d samples each, engine %s",
            len(self.tasks),
            cfg.greedy,
            cfg.samples,
            cfg.engine,
        )

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _build(self):
        import torch

        from runtime.engines.factory import make_engine

        options = dict(self.cfg.engine_options)
        if torch.cuda.is_available():
            # Beside rank 0's training on its GPU: the transformers engine's own default is the CPU,
            # vLLM's is 90% of the GPU, which DeepSpeed already holds in part.
            if self.cfg.engine == "transformers":
                options.setdefault("device", f"cuda:{torch.cuda.current_device()}")
            else:
                options.setdefault("gpu_memory_utilization", 0.25)
        return make_engine(self.cfg.engine, self.base_model, **options)

    # -- the learner's side --------------------------------------------------------------------
    def submit(self, step: int, version: int, snapshot: str | Path) -> Future:
        """Queue an evaluation of `snapshot` (policy `version`, after update `step`); answers a
        future of its EvalResult (EvaluationSkipped if a newer submission replaced it)."""
        job = _Job(step, version, Path(snapshot))
        with self._lock:
            replaced, self._waiting = self._waiting, job
            self._jobs.append(job)
        if replaced is not None:
            replaced.future.set_exception(EvaluationSkipped(f"replaced by policy version {version}"))
        self._loop.call_soon_threadsafe(self._wake.set)
        return job.future

    def pending_versions(self) -> set[int]:
        """Versions submitted and not yet finished: their snapshots must stay on disk."""
        with self._lock:
            return {job.version for job in self._jobs if not job.future.done()}

    def collect(self, wait: bool = False, timeout: float | None = None) -> list[EvalResult]:
        """Finished evaluations in submission order; with `wait`, all of them, waiting at most
        `timeout` seconds in all (the rest stay queued). A failed one is logged with its
        traceback and dropped, a skipped one with a warning: evaluation never stops training."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            jobs = list(self._jobs)
        results = []
        for job in jobs:
            if wait:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                futures_wait([job.future], timeout=left)
            if not job.future.done():
                break  # keep the order: a later one is reported after an earlier one
            try:
                results.append(job.future.result())
            except EvaluationSkipped as why:
                log.warning(
                    "evaluation of policy version %d (update %d) skipped: %s", job.version, job.step, why
                )
            except Exception:
                log.exception("evaluation of policy version %d (update %d) failed", job.version, job.step)
            with self._lock:
                self._jobs.remove(job)
        return results

    # -- the evaluation thread -----------------------------------------------------------------
    async def _work(self) -> None:
        """The only consumer: takes the waiting job, runs it to the end, and so on."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._lock:
                job, self._waiting = self._waiting, None
            if job is None or job.future.done():
                continue
            self.running_step = job.step
            try:
                result = await self._evaluate(job.step, job.version, job.snapshot)
            except asyncio.CancelledError:
                job.future.cancel()
                raise
            except Exception as exc:
                if not job.future.done():  # close() may have cancelled it meanwhile
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(result)
            finally:
                self.running_step = None

    async def _evaluate(self, step: int, version: int, snapshot: Path) -> EvalResult:
        t0 = time.perf_counter()
        if snapshot != self.loaded:
            self.loaded = None  # a load that fails half way leaves unknown weights: reload next time
            await self.engine.load_weights(snapshot)
            self.loaded = snapshot
        load_s = time.perf_counter() - t0
        cfg = self.cfg
        gate = asyncio.Semaphore(cfg.concurrency)
        budget_tokens = cfg.max_tokens_per_turn

        async def play(index: int, sampling: SamplingConfig) -> tuple[int, Episode]:
            async with gate:
                env = self.make_env()
                try:
                    return index, await run_episode(
                        self.engine, env, self.tasks[index], self.budget, sampling, self.renderer
                    )
                finally:
                    env.close()

        jobs: list[tuple[str, asyncio.Task]] = []
        # A TaskGroup: if one episode fails, the others are cancelled before the error leaves, so
        # none of them is still generating when the next evaluation swaps the weights.
        async with asyncio.TaskGroup() as group:
            for i in range(len(self.tasks)):
                if cfg.greedy:
                    greedy = SamplingConfig(max_tokens=budget_tokens, temperature=0.0)
                    jobs.append(("greedy", group.create_task(play(i, greedy))))
                for j in range(cfg.samples):
                    sampled = SamplingConfig(
                        max_tokens=budget_tokens,
                        temperature=cfg.temperature,
                        top_p=cfg.top_p,
                        seed=sample_seed(cfg.seed, i, j),
                    )
                    jobs.append((f"sample{j}", group.create_task(play(i, sampled))))
        done = [task.result() for _, task in jobs]
        greedy_eps = [ep for (mode, _), ep in zip(jobs, done, strict=True) if mode == "greedy"]
        sampled_eps = [ep for (mode, _), ep in zip(jobs, done, strict=True) if mode != "greedy"]

        metrics: dict[str, float] = {"eval/policy_version": version, "eval/tasks": len(self.tasks)}
        metrics.update(summarize(greedy_eps, "eval/greedy"))
        metrics.update(summarize(sampled_eps, "eval/sampled"))
        if sampled_eps:
            metrics["eval/sampled/pass_at_k"] = pass_at_k(sampled_eps)
            metrics["eval/sampled/k"] = cfg.samples
        metrics["eval/load_s"] = load_s
        metrics["eval/seconds"] = time.perf_counter() - t0
        self._write_episodes(version, step, jobs, done)
        return EvalResult(step=step, version=version, metrics=metrics)

    def _write_episodes(self, version: int, step: int, jobs, done) -> None:
        tok = self.engine.tokenizer
        path = self.out_dir / f"v{version:06d}.jsonl"
        with path.open("w", encoding="utf-8") as f:
            for (mode, _), (i, ep) in zip(jobs, done, strict=True):
                row = {
                    "step": step,
                    "policy_version": version,
                    "task_id": self.tasks[i].task_id,
                    "mode": mode,
                    "reward": ep.reward,
                    "finish_reason": ep.finish_reason,
                    "turns": ep.num_turns,
                    "response_tokens": ep.generated_tokens,
                    "response": tok.decode(ep.token_ids[ep.prompt_tokens :], skip_special_tokens=False),
                }
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    def close(self) -> None:
        """Stop the evaluation thread: the running evaluation is cancelled, queued ones are
        dropped (collect(wait=True) first to keep them), the engine and the loop are closed."""
        if not self._loop.is_running():
            return
        if self._worker is not None:
            self._worker.cancel()
        with self._lock:
            jobs, self._jobs, self._waiting = self._jobs, [], None
        for job in jobs:
            job.future.cancel()
        if getattr(self, "engine", None) is not None:
            try:
                self._call(self.engine.close(), timeout=60)
            except Exception:  # closing is best effort: the process is ending
                log.warning("evaluation engine did not close cleanly", exc_info=True)
            self.engine = None
        try:  # threads of env.step still running would otherwise hold up the interpreter's exit
            self._call(self._loop.shutdown_default_executor(), timeout=30)
        except Exception:
            log.warning("evaluation threads did not stop within 30 s", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


def snapshot_version(folder: str | Path) -> int:
    """The policy version a snapshot's manifest names; 0 for a plain model folder (the base)."""
    manifest = Path(folder) / "manifest.json"
    if manifest.is_file():
        return int(json.loads(manifest.read_text())["version"])
    return 0


def evaluate_folders(
    cfg: EvalConfig, base_model: str | Path, folders: list[Path], out_dir: Path
) -> list[EvalResult]:
    """Score model folders one after another, outside training (`spopp learner eval`).

    Each is labelled with its manifest's version; the episodes land in `out_dir/vNNNNNN.jsonl`.
    """
    missing = [str(f) for f in folders if not (Path(f) / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"not a model folder (no config.json): {', '.join(missing)}")
    ev = Evaluator(cfg, base_model, out_dir)
    results = []
    try:
        for folder in folders:
            version = snapshot_version(folder)
            results.append(ev.submit(version, version, Path(folder).resolve()).result())  # errors raise here
            ev.collect()
    finally:
        ev.close()
    return results
