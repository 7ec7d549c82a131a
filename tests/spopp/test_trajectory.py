"""The trajectory record refuses what the learner must never train on."""

import math

import pytest
from pydantic import ValidationError

from spopp.api.trajectory import Trajectory

GOOD = dict(
    run="r",
    request_id="r1",
    task_id="t",
    policy_version=3,
    token_ids=[5, 6, 7, 8],
    action_mask=[0, 0, 1, 1],
    rollout_logprobs=[0.0, 0.0, -0.5, -1.25],
    reward=1.0,
    value=0.25,
    advantage=0.75,
    num_turns=1,
    finish_reason="done",
    timings={"total_s": 0.5},
)


def test_good_record_round_trips():
    t = Trajectory(**GOOD)
    assert t.action_tokens == 2
    assert Trajectory.model_validate_json(t.model_dump_json()) == t


@pytest.mark.parametrize(
    "change,needle",
    [
        ({"action_mask": [0, 1, 1]}, "one length"),
        ({"rollout_logprobs": [0.0, 0.0, -0.5]}, "one length"),
        ({"rollout_logprobs": [0.0, 0.0, math.nan, -1.0]}, "finite"),
        ({"rollout_logprobs": [0.0, 0.0, -math.inf, -1.0]}, "finite"),
        ({"rollout_logprobs": [0.0, 0.0, 0.5, -1.0]}, "log-probability"),
        ({"action_mask": [0, 0, 0, 0]}, "no generated token"),
        ({"action_mask": [0, 0, 2, 1]}, "less than or equal to 1"),
        ({"reward": 1.5}, "less than or equal to 1"),
        ({"reward": math.nan}, "finite"),
        ({"token_ids": []}, "at least 1"),
        ({"token_ids": [5, -6, 7, 8]}, "greater than or equal to 0"),
        ({"policy_version": -1}, "greater than or equal to 0"),
        ({"extra": 1}, "Extra inputs"),
    ],
)
def test_bad_records_are_refused_with_a_reason(change, needle):
    with pytest.raises(ValidationError) as err:
        Trajectory(**{**GOOD, **change})
    assert needle in str(err.value)
