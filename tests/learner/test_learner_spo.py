"""SPO drift: first visit 0, later visits the mean |log pi_prev - log pi_now| over the cached response."""

import math

import pytest

from services.learner.spo import SpoDriftCache
from spopp.api.trajectory import Trajectory


def traj(task, tokens, mask):
    return Trajectory(
        run="r",
        request_id=f"{task}-{tokens[-1]}",
        task_id=task,
        policy_version=0,
        token_ids=tokens,
        action_mask=mask,
        rollout_logprobs=[-0.5 if m else 0.0 for m in mask],
        reward=1.0,
        num_turns=1,
        finish_reason="done",
    )


class Weights:
    """A stand-in policy whose log-prob of token x at position t is -(x + t) * scale."""

    def __init__(self, scale):
        self.scale = scale
        self.calls = 0

    def __call__(self, sequences):
        self.calls += 1
        return [[-(x + t) * self.scale for t, x in enumerate(s[1:], start=1)] for s in sequences]


def test_first_visit_then_drift_on_the_stored_response():
    cache = SpoDriftCache()
    a1 = traj("a", [1, 2, 3, 4], [0, 0, 1, 1])
    assert cache.after_update([a1], Weights(1.0)) == [0.0]
    a2 = traj("a", [1, 5, 6], [0, 1, 1])
    drift = cache.after_update([a2], Weights(1.5))
    # stored response [1,2,3,4], action positions t=2 (token 3) and t=3 (token 4):
    # |-(3+2)*1 - -(3+2)*1.5| = 2.5 and |-(4+3)*1 - -(4+3)*1.5| = 3.5 -> mean 3.0
    assert drift == [pytest.approx(3.0)]
    # The cache now holds a2 with log-probs under scale 1.5; unchanged weights -> no drift.
    assert cache.after_update([traj("a", [1, 9, 9], [0, 1, 1])], Weights(1.5)) == [0.0]


def test_repeat_within_a_batch_has_no_drift_and_one_forward_pass():
    cache = SpoDriftCache()
    cache.after_update([traj("a", [1, 2, 3], [0, 1, 1]), traj("b", [1, 2], [0, 1])], Weights(1.0))
    w = Weights(2.0)
    drifts = cache.after_update(
        [traj("a", [1, 4, 4], [0, 1, 1]), traj("a", [1, 7, 7], [0, 1, 1]), traj("c", [1, 3], [0, 1])], w
    )
    assert drifts[0] > 0 and drifts[1] == 0.0 and drifts[2] == 0.0
    assert w.calls == 1
    assert len(cache) == 3


def test_state_round_trips():
    cache = SpoDriftCache()
    cache.after_update([traj("a", [1, 2, 3], [0, 1, 1])], Weights(1.0))
    other = SpoDriftCache()
    other.restore(cache.state())
    batch = [traj("a", [1, 2, 2], [0, 1, 1])]
    assert other.after_update(batch, Weights(3.0)) == cache.after_update(batch, Weights(3.0))
    assert math.isfinite(other.after_update(batch, Weights(1.0))[0])
