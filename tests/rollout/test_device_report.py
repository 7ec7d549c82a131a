"""Each service says which device it computes on: a replica's and the evaluator's /healthz carry
their engine's `device`, the learner's /healthz its DeepSpeed engine's, and each start-up log line
names it (the learner's also its process group). Here, without a GPU, all of them say `cpu`; the
GPU tier (tests/gpu/test_launch_gpu.py) checks that a launched run on a GPU says `cuda` in each.

The replica and the evaluator are checked in this process with the real transformers engine on the
tiny model; the learner builds its real DeepSpeed engine in this process too, but DeepSpeed's CPU
backend runs its extension builder (ninja) as it starts, so that test is in the process tier.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi.testclient import TestClient
from learner_worker import dist_env_restored
from records import run_record

from runtime.engines.hf import TransformersEngine
from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks
from runtime.tasks import write_jsonl


def test_a_replica_says_its_engine_is_on_the_cpu(tiny_model):
    from services.config.rollout import RolloutSettings
    from services.rollout.serve import health_app
    from services.rollout.worker import Worker

    async def scenario() -> dict:
        engine = TransformersEngine(tiny_model)
        # Nothing is contacted before run(): the URLs only have to parse, the run's record is made here.
        s = RolloutSettings(model=tiny_model, tracker="http://127.0.0.1:9", learner="http://127.0.0.1:9",
                            run="device", env="toy-calc")  # fmt: skip
        worker = Worker(s, run_record("device"), engine, ToyCalcEnv, {})
        try:
            with TestClient(health_app(worker)) as http:
                return http.get("/healthz").json()
        finally:
            await worker.close()
            await engine.close()

    assert engine_device(asyncio.run(scenario())) == "cpu"


def test_the_evaluator_says_its_engine_is_on_the_cpu_once_it_is_up(tiny_model, tmp_path):
    from services.config.evaluator import EvaluatorSettings
    from services.evaluator.follow import Follower, health_app
    from services.evaluator.scorer import Scorer

    tasks = tmp_path / "heldout.jsonl"
    write_jsonl(generate_toy_calc_tasks(2, seed=0, split="heldout"), tasks)
    s = EvaluatorSettings(run="device", tasks=tasks, env="toy-calc", out_dir=tmp_path / "eval",
                          tracker="http://127.0.0.1:9", max_total_tokens=128)  # fmt: skip

    async def scenario() -> tuple[dict, dict]:
        follower = Follower(s)
        try:
            with TestClient(health_app(follower)) as http:
                before = http.get("/healthz").json()
                follower.scorer = await Scorer.open(s, tiny_model)  # what run() does once the run is known
                return before, http.get("/healthz").json()
        finally:
            await follower.close()

    before, after = asyncio.run(scenario())
    assert "device" in before and before["device"] is None  # no engine yet: nothing to claim
    assert engine_device(after) == "cpu"


_dist_env = pytest.fixture(autouse=True)(dist_env_restored)


@pytest.mark.process
def test_the_learner_says_it_trains_on_the_cpu_with_gloo(tiny_model, tmp_path, tracker, make_run, caplog):
    import httpx

    from services.config.learner import LearnerSettings
    from services.learner.trainer import Learner

    run = make_run()
    cfg = LearnerSettings(
        run=run, tracker=tracker.url, model=tiny_model, port=0, batch_size=2, mini_batches=1,
        micro_batch_size=2, snapshots=tmp_path / "snapshots", checkpoints=tmp_path / "ckpt",
        log_dir=tmp_path / "logs",
    )  # fmt: skip
    learner = Learner(cfg)
    try:
        with caplog.at_level(logging.INFO, logger="spopp.learner"):
            url = learner.serve()
        body = httpx.get(url + "/healthz", timeout=10).json()
    finally:
        learner.close()
        if hasattr(learner.engine, "destroy"):
            learner.engine.destroy()
    assert engine_device(body) == "cpu"
    assert "training on cpu, 1 rank(s), process group gloo" in caplog.text


def engine_device(health: dict) -> str:
    """The `device` of a /healthz body, which every service but the tracker has."""
    assert "device" in health, health
    return health["device"]
