"""`make demo-real`'s summary (tools/demo_real.py): the held-out curve with its standard errors and
the costs, read from a run folder's own files; and its launch config, checked by the launcher's own
settings. The whole demo runs 45 minutes and is not part of the suite; its wiring ran end to end
with --tiny (docs/models.md)."""

from __future__ import annotations

import json
import math

import pytest

from services.config.launch import LaunchSettings
from services.rollout.metrics import RolloutMetrics
from tools import demo_real


def _episodes(folder, version, rewards_by_task):
    folder.mkdir(parents=True, exist_ok=True)
    rows = [
        {"policy_version": version, "task_id": task, "mode": f"sample{i}", "reward": r}
        for task, rewards in rewards_by_task.items()
        for i, r in enumerate(rewards)
    ]
    (folder / f"v{version:06d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_curve_has_task_level_standard_errors(tmp_path):
    eps = tmp_path / "eval" / "episodes"
    _episodes(eps, 0, {"a": [1.0], "b": [0.0], "c": [0.0], "d": [1.0]})
    # Two samples per task: the s.e. is over the 4 task means, not the 8 episodes.
    _episodes(eps, 4, {"a": [1.0, 1.0], "b": [1.0, 0.0], "c": [1.0, 1.0], "d": [0.0, 0.0]})
    # A committed run's episodes are gzipped (docs/results/demo-real): read alike.
    import gzip

    with gzip.open(eps / "v000008.jsonl.gz", "wt") as f:
        f.write(json.dumps({"policy_version": 8, "task_id": "a", "reward": 1.0}) + "\n")
    first, second, third = demo_real.curve(tmp_path)
    assert (third["version"], third["success"], third["tasks"]) == (8, 1.0, 1)
    assert (first["version"], first["success"], first["tasks"]) == (0, 0.5, 4)
    # One sample per task: sqrt(p (1 - p) / (n - 1)) with the sample s.d. (n - 1 in the variance).
    assert first["se"] == pytest.approx(math.sqrt(0.25 * 4 / 3 / 4))
    means = [1.0, 0.5, 1.0, 0.0]
    m = sum(means) / 4
    assert second["success"] == pytest.approx(m)
    assert second["se"] == pytest.approx(math.sqrt(sum((x - m) ** 2 for x in means) / 3 / 4))


def test_the_summary_reads_the_costs_and_the_rise(tmp_path):
    _episodes(tmp_path / "eval" / "episodes", 0, {str(i): [float(i < 40)] for i in range(100)})
    _episodes(tmp_path / "eval" / "episodes", 8, {str(i): [float(i < 60)] for i in range(100)})
    (tmp_path / "learner").mkdir()
    rows = [{"step": s, "time": 100.0 + 50 * s, "update_seconds": 40.0, "sequence_tokens_per_s": 90.0,
             "tokens_per_s": 9.0} for s in range(1, 4)]  # fmt: skip
    (tmp_path / "learner" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "logs").mkdir()
    metrics = RolloutMetrics()
    (tmp_path / "logs" / "rollout-0.log").write_text(
        f"x INFO replica rollout-0 generated {metrics.summary()}\n"
    )
    summary, lines = demo_real.summarize(tmp_path)
    c = summary["costs"]
    assert (c["updates"], c["update_seconds"], c["learner_tokens_per_s"]) == (3, 50.0, 90.0)
    assert c["rollout_tokens_per_s"] == [0.0]  # the replica's own line, read back
    se = math.hypot(math.sqrt(0.24 / 99), math.sqrt(0.24 / 99))
    assert summary["rise"]["delta"] == pytest.approx(0.2) and summary["rise"]["se"] == pytest.approx(se)
    assert any("rise v0 -> v8: +0.200" in line for line in lines)


def test_the_replicas_closing_line_counts_its_episodes():
    class Ep:
        finish_reason, info = "answer", {}

        def __init__(self, n, seconds):
            self.generated_tokens, self.timings = n, {"total_s": seconds, "generate_s": seconds}

    metrics = RolloutMetrics()
    metrics.observe_episode(Ep(30, 2.0))
    metrics.observe_episode(Ep(10, 1.0))
    line = metrics.summary()
    assert line.startswith("2 episodes, 40 generated tokens in ")
    seconds = float(line.split(" in ")[1].split()[0])
    assert seconds >= 2 - 0.5  # from the first episode's start, rounded to whole seconds
    rate = float(line.rsplit("(", 1)[1].split()[0])
    assert rate == pytest.approx(40 / max(seconds, 1e-9), rel=0.5)


def test_a_model_answer_with_a_unicode_line_separator_is_one_record(tmp_path):
    # The evaluator writes episodes with ensure_ascii=False, so U+2028 and U+0085 in a model's text
    # stay raw; str.splitlines() would cut the record there (it did, on the H200 run).
    eps = tmp_path / "eval" / "episodes"
    eps.mkdir(parents=True)
    rows = [
        {"policy_version": 0, "task_id": "a", "reward": 1.0, "response": "x\u2028y\x85z"},
        {"policy_version": 0, "task_id": "b", "reward": 0.0, "response": "plain"},
    ]
    (eps / "v000000.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert "\u2028" in (eps / "v000000.jsonl").read_text()  # raw, as the evaluator leaves it
    (point,) = demo_real.curve(tmp_path)
    assert (point["tasks"], point["success"]) == (2, 0.5)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_launch_config_is_one_the_launcher_accepts(tmp_path, device):
    config = demo_real.launch_config(tmp_path, tmp_path / "model", demo_real.FULL, "spopp", device)
    s = LaunchSettings.model_validate(config)
    assert s.learner.lora_rank == demo_real.LORA_RANK and s.env_options == demo_real.ENV_OPTIONS
    assert s.evaluator.samples == 1 and not s.evaluator.greedy
    assert (s.rollout.engine, s.gpus.learner) == (("vllm", []) if device == "cpu" else ("transformers", [0]))
    if device == "cuda":  # the evaluator's 64 episodes in flight decode as one batch on the GPU
        assert s.evaluator.engine_options == {"device": "cuda", "max_batch": 64}
        assert s.rollout.engine_options == {"device": "cuda"}
    # One sample on each of N_HELDOUT tasks: the s.e. is at most 2 points whatever the success rate.
    assert math.sqrt(0.25 / demo_real.N_HELDOUT) <= 0.02
