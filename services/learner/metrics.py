"""Prometheus metrics of the learner, served as /metrics beside the trajectory intake (rank 0).

One registry per LearnerMetrics (not prometheus_client's global one), so two learners or a test's
intakes in one process never share counts. The buffer's fill and the policy version are read from
the buffer when scraped rather than mirrored on every change: there is one source of truth.
Counters the training loop moves (updates, tokens, publish and checkpoint times) are updated on
every rank but only rank 0 serves them.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

disable_created_metrics()


class Watched(Protocol):
    """What the gauges read of the intake's buffer (services.learner.ingest.TrajectoryBuffer) at
    every scrape: declared here so that the metrics need not import the intake that imports them."""

    @property
    def accepted(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def version(self) -> int: ...

    def __len__(self) -> int: ...


# Every reason the intake refuses a trajectory for, exported at 0 from the start so that a rate()
# over them has a first sample; and those for which the trainer drops one it had accepted:
# unissued (the tracker never issued its request) and nonfinite (its loss term is not finite).
REFUSAL_REASONS = (
    "unauthorized",
    "too_large",
    "invalid",
    "unknown_run",
    "stale",
    "full",
    "unissued",
    "nonfinite",
)
_SLOW = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class LearnerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # Registration order is the order of the /metrics page: keep these calls in this order.
        self._register_training(r)
        self._register_intake(r)
        self._register_buffer(r)
        self._register_update_stats(r)
        self._register_timings(r)

    def _register_training(self, r: CollectorRegistry) -> None:
        self.updates = Counter("spopp_learner_updates", "updates done", registry=r)
        self.trained_tokens = Counter("spopp_learner_trained_tokens", "action tokens trained on", registry=r)
        self.tokens_per_s = Gauge(
            "spopp_learner_tokens_per_second", "action tokens per second of the last update", registry=r
        )

    def _register_intake(self, r: CollectorRegistry) -> None:
        self.accepted = Counter(
            "spopp_learner_trajectories_accepted",
            "trajectories buffered (a repeated request once)",
            registry=r,
        )
        self.refused = Counter(
            "spopp_learner_trajectories_refused",
            "trajectories refused at the intake or dropped before an update, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.refused.labels(reason)

    def _register_buffer(self, r: CollectorRegistry) -> None:
        # Values come from the buffer at scrape time (`watch`), not from set() calls.
        self.buffer_filled = Gauge(
            "spopp_learner_buffer_trajectories",
            "trajectories accepted for the current policy version (trained or waiting)",
            registry=r,
        )
        self.buffer_pending = Gauge(
            "spopp_learner_buffer_pending", "trajectories waiting for an update", registry=r
        )
        self.buffer_capacity = Gauge(
            "spopp_learner_buffer_capacity", "trajectories accepted per policy version", registry=r
        )
        self.policy_version = Gauge(
            "spopp_learner_policy_version", "policy version the intake accepts", registry=r
        )

    def _register_update_stats(self, r: CollectorRegistry) -> None:
        self.staleness = Histogram(
            "spopp_learner_trajectory_staleness",
            "policy versions between a trained trajectory's dispatch and the version trained",
            registry=r,
            buckets=(0, 1, 2, 3, 4, 8, 16, 64),
        )
        self.clip_fraction = Gauge(
            "spopp_learner_clip_fraction", "share of the last update's tokens where a clip bound", registry=r
        )
        self.entropy = Gauge(
            "spopp_learner_entropy",
            "policy entropy at the last update's action tokens, before it (nats)",
            registry=r,
        )
        self.padding_fraction = Gauge(
            "spopp_learner_padding_fraction",
            "share of the last update's forward tokens that were padding (0 when packed)",
            registry=r,
        )
        self.behaviour_weight = Gauge(
            "spopp_learner_behaviour_weight_mean",
            "mean off-policy weight of the last update's stale tokens (0: none was stale)",
            registry=r,
        )
        self.behaviour_cut = Gauge(
            "spopp_learner_behaviour_cut_fraction",
            "share of the last update's stale tokens whose weight passed behaviour_cap",
            registry=r,
        )

    def _register_timings(self, r: CollectorRegistry) -> None:
        self.publish_seconds = Histogram(
            "spopp_learner_publish_seconds", "snapshot + tracker publish time", registry=r, buckets=_SLOW
        )
        self.checkpoint_seconds = Histogram(
            "spopp_learner_checkpoint_seconds", "checkpoint write time", registry=r, buckets=_SLOW
        )

    def watch(self, buffer: Watched) -> None:
        """Read the buffer's fill and version at every scrape."""
        self.buffer_filled.set_function(lambda: buffer.accepted)
        self.buffer_pending.set_function(lambda: len(buffer))
        self.buffer_capacity.set_function(lambda: buffer.capacity)
        self.policy_version.set_function(lambda: buffer.version)

    def refuse(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def observe_update(self, stats: dict, lags: list[int] = ()) -> None:
        """One update's statistics and its trajectories' staleness (versions behind, each)."""
        self.updates.inc()
        self.trained_tokens.inc(stats["tokens"])
        self.tokens_per_s.set(stats["tokens_per_s"])
        self.clip_fraction.set(stats["clip_fraction"])
        self.entropy.set(stats.get("entropy", 0.0))
        self.padding_fraction.set(stats.get("padding_fraction", 0.0))
        self.behaviour_weight.set(stats.get("behaviour_weight_mean", 0.0))
        self.behaviour_cut.set(stats.get("behaviour_cut_fraction", 0.0))
        for lag in lags:
            self.staleness.observe(lag)
