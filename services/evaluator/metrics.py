"""Prometheus metrics of the evaluator (its own registry, served at /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()


class EvaluatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.policy_version = Gauge(
            "spopp_evaluator_policy_version", "the run's policy version at the tracker, last read", registry=r
        )
        self.last_scored_version = Gauge(
            "spopp_evaluator_last_scored_version", "newest policy version scored (-1: none yet)", registry=r
        )
        self.last_scored_version.set(-1)
        self.next_version = Gauge("spopp_evaluator_next_version", "next policy version to score", registry=r)
        self.scored = Counter(
            "spopp_evaluator_versions_scored", "policy versions scored by this process", registry=r
        )
        self.skipped = Counter(
            "spopp_evaluator_versions_skipped",
            "policy versions that could not be scored (pruned, unreadable) by this process",
            ["reason"],
            registry=r,
        )
        self.answer_checks_failed = Counter(
            "spopp_evaluator_answer_checks_failed",
            "held-out answers whose check was killed at its deadline or failed, scored as wrong",
            registry=r,
        )
        self.greedy_success = Gauge(
            "spopp_evaluator_greedy_success_rate",
            "greedy success rate of the last scored version",
            registry=r,
        )
        self.greedy_reward = Gauge(
            "spopp_evaluator_greedy_reward_mean", "greedy mean reward of the last scored version", registry=r
        )
        self.sampled_success = Gauge(
            "spopp_evaluator_sampled_success_rate", "sampled success rate (avg@k) of the last scored version",
            registry=r,
        )  # fmt: skip
        self.sampled_pass_at_k = Gauge(
            "spopp_evaluator_sampled_pass_at_k", "pass@k of the last scored version", registry=r
        )
        self.seconds = Histogram(
            "spopp_evaluator_evaluation_seconds",
            "seconds per evaluation (weight load and episodes)",
            registry=r,
            buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1200, 3600, 7200),
        )

    def observe_scored(self, version: int, metrics: dict) -> None:
        self.scored.inc()
        self.last_scored_version.set(version)
        self.show_last(metrics)
        self.seconds.observe(metrics.get("eval/seconds", 0.0))
        self.answer_checks_failed.inc(metrics.get("eval/answer_checks_failed", 0))

    def show_last(self, metrics: dict) -> None:
        """The gauges of the last scored version (also from the records, after a restart)."""
        for gauge, key in (
            (self.greedy_success, "eval/greedy/success_rate"),
            (self.greedy_reward, "eval/greedy/reward_mean"),
            (self.sampled_success, "eval/sampled/success_rate"),
            (self.sampled_pass_at_k, "eval/sampled/pass_at_k"),
        ):
            if key in metrics:
                gauge.set(metrics[key])

    def observe_skipped(self, reason: str) -> None:
        self.skipped.labels(reason.split(":", 1)[0]).inc()
