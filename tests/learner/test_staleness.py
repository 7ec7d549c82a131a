"""Bounded staleness (max_staleness k): the learner's window, the off-policy loss, the stale marks.

The loss is checked in closed form on three tokens whose behaviour weights u = exp(old - rollout)
are 1, 3 and 1.5 (cap 2): decoupled keeps 1 and 1.5 and drops 3; tis truncates 3 to 2. With no
stale token (k = 0) the loss is the rollout-corrected one bit for bit, checked against the
token-loop reference of tests/loss_reference.py.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from loss_reference import random_batch, reference

from services.learner.batch import collate
from services.learner.ingest import Refused, TrajectoryBuffer, ingest_app
from services.learner.update import staleness_stats
from services.shell.server import ThreadedServer
from spopp import staleness
from spopp.api.trajectory import Trajectory
from spopp.loss import policy_loss

F64 = torch.float64


def traj(i: int, version: int = 0, **change) -> Trajectory:
    body = dict(
        run="r", request_id=f"q{i}", task_id=f"t{i % 5}", policy_version=version, token_ids=[1, 2, 3, 4],
        action_mask=[0, 0, 1, 1], rollout_logprobs=[0.0, 0.0, -0.5, -0.25], reward=1.0, value=0.5,
        advantage=0.5, num_turns=1, finish_reason="done",
    )  # fmt: skip
    return Trajectory(**{**body, **change})


# -- the loss, in closed form -------------------------------------------------------------------
def three_tokens():
    """One trajectory, three action tokens, ratio 1 (logp = old), advantage 1; u = 1, 3, 1.5."""
    old = torch.full((1, 3), -1.0, dtype=F64)
    rollout = old - torch.tensor([[0.0, math.log(3.0), math.log(1.5)]], dtype=F64)
    logp = old.clone().requires_grad_(True)
    return logp, old, torch.ones((1, 3), dtype=F64), torch.ones((1, 3), dtype=torch.bool), rollout


@pytest.mark.parametrize(
    "off_policy,weights", [("decoupled", [1.0, 0.0, 1.5]), ("tis", [1.0, 2.0, 1.5])], ids=["decoupled", "tis"]
)
def test_stale_tokens_get_the_chosen_correction_in_closed_form(off_policy, weights):
    logp, old, adv, mask, rollout = three_tokens()
    stale = torch.ones((1, 3), dtype=torch.bool)
    loss, st = policy_loss(
        logp, old, adv, mask, rollout_logp=rollout, is_cap=1.25, dual_clip=None,
        stale=stale, off_policy=off_policy, behaviour_cap=2.0,
    )  # fmt: skip
    # At ratio 1 no clip binds: loss = -sum(w) / 3, and d loss / d logp_t = -w_t / 3.
    assert float(loss.detach()) == pytest.approx(-sum(weights) / 3, abs=1e-12)
    loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([-w / 3 for w in weights], abs=1e-12)
    assert st["stale_tokens"] == 3.0
    assert st["behaviour_weight_mean"] == pytest.approx(sum(weights) / 3)
    assert st["behaviour_weight_max"] == pytest.approx(max(weights))
    assert st["behaviour_cut_fraction"] == pytest.approx(1 / 3)  # u = 3 > 2: dropped or truncated
    assert st["is_capped_fraction"] == 0.0  # the rollout cap (1.25) is not what stale tokens get


def test_current_tokens_keep_the_rollout_cap_beside_stale_ones():
    logp, old, adv, mask, rollout = three_tokens()
    stale = torch.tensor([[False, True, True]])
    loss, st = policy_loss(
        logp, old, adv, mask, rollout_logp=rollout, is_cap=1.25, dual_clip=None,
        stale=stale, off_policy="decoupled", behaviour_cap=2.0,
    )  # fmt: skip
    # Token 0 is current: min(1, 1.25) = 1. Tokens 1 and 2 are stale: 0 (u = 3 > 2) and 1.5.
    assert float(loss) == pytest.approx(-(1.0 + 0.0 + 1.5) / 3, abs=1e-12)
    assert st["stale_tokens"] == 2.0 and st["behaviour_cut_fraction"] == pytest.approx(0.5)
    fresh, _ = policy_loss(logp, old, adv, mask, rollout_logp=rollout, is_cap=1.25, dual_clip=None)
    assert float(fresh) == pytest.approx(-(1.0 + 1.25 + 1.25) / 3, abs=1e-12)


def test_decoupled_clips_around_the_proximal_policy_not_the_behaviour_one():
    """A stale token whose new ratio to the proximal policy is 1.5 is clipped at 1.28 (A > 0),
    however far the behaviour policy was: the trust region is the learner's."""
    old = torch.tensor([[-1.0]], dtype=F64)
    logp = (old + math.log(1.5)).requires_grad_(True)
    rollout = old - math.log(1.8)  # u = 1.8 < cap: kept at 1.8
    loss, st = policy_loss(
        logp, old, torch.ones_like(old), torch.ones((1, 1), dtype=torch.bool), rollout_logp=rollout,
        stale=torch.ones((1, 1), dtype=torch.bool), off_policy="decoupled", behaviour_cap=2.0,
    )  # fmt: skip
    assert float(loss) == pytest.approx(-1.8 * 1.28)
    assert st["clip_fraction"] == 1.0
    loss.backward()
    assert float(logp.grad) == 0.0  # clipped: no gradient


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("off_policy", ["decoupled", "tis"])
def test_no_stale_token_is_exactly_todays_loss(seed, off_policy):
    """k = 0: nothing is stale, and whichever correction is chosen the loss and its gradient are
    those of the rollout-corrected loss, bit for bit, and match the token-loop reference."""
    logp, old, adv, mask, rollout = random_batch(seed)
    kw = dict(rollout_logp=rollout, clip_low=0.2, clip_high=0.28, dual_clip=2.0, is_cap=2.0)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    today, st_today = policy_loss(a, old, adv, mask, **kw)
    none_stale, st = policy_loss(
        b, old, adv, mask, **kw, stale=torch.zeros_like(mask), off_policy=off_policy, behaviour_cap=1.01
    )
    assert torch.equal(today.detach(), none_stale.detach())
    today.backward(), none_stale.backward()
    assert torch.equal(a.grad, b.grad)
    assert st["stale_tokens"] == 0.0 and {k: st[k] for k in st_today} == st_today
    want, _ = reference(
        logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), rollout.tolist(),
        0.2, 0.28, 2.0, 2.0, float(mask.sum()),
    )  # fmt: skip
    assert float(today) == pytest.approx(want, rel=1e-12)


def test_off_policy_arguments_are_checked():
    logp, old, adv, mask, rollout = three_tokens()
    with pytest.raises(ValueError, match="off_policy must be one of decoupled, tis"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, stale=mask, off_policy="vtrace")
    with pytest.raises(ValueError, match="stale tokens need rollout_logp"):
        policy_loss(logp, old, adv, mask, stale=mask)
    with pytest.raises(ValueError, match="behaviour_cap must be finite"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, behaviour_cap=float("nan"))
    with pytest.raises(ValueError, match="stale has shape"):
        policy_loss(logp, old, adv, mask, rollout_logp=rollout, stale=torch.ones((1, 2), dtype=torch.bool))


# -- stale marks at collation ------------------------------------------------------------------
def test_collate_marks_tokens_older_than_the_trained_version():
    mixed = traj(0, version=3, token_versions=[3, 3, 3, 4])  # a swap to v4 before the last token
    old = traj(1, version=3)
    assert collate([mixed, old], [1.0, 1.0]).stale is None  # no version given: nothing stale
    assert collate([mixed, old], [1.0, 1.0], version=3).stale is None  # all current
    b = collate([mixed, old], [1.0, 1.0], version=4)
    # Column t scores token t+1; only action tokens (positions 2, 3) can be stale.
    assert b.stale.tolist() == [[False, True, False], [False, True, True]]


def test_token_versions_are_checked_at_the_door():
    with pytest.raises(ValueError, match="token_versions has 3 entries for 4 token_ids"):
        traj(0, version=2, token_versions=[2, 2, 2])
    with pytest.raises(ValueError, match=r"token_versions\[1\] = 1 is older than the dispatch"):
        traj(0, version=2, token_versions=[2, 1, 2, 2])


# -- the learner's window ----------------------------------------------------------------------
def test_window_takes_versions_within_k_and_refuses_older_with_the_window_named():
    buf = TrajectoryBuffer("r", capacity=4, version=5, max_staleness=2)
    for i, v in enumerate((5, 4, 3)):
        buf.add(traj(i, version=v))
    with pytest.raises(Refused) as old:
        buf.add(traj(9, version=2))
    assert old.value.status == 409 and old.value.detail == {
        "code": "stale_policy",
        "message": "trajectory of policy version 2; this learner takes versions 3..5 (max_staleness 2)",
        "policy_version": 5,
    }
    with pytest.raises(Refused, match="policy version 6"):
        buf.add(traj(10, version=6))  # from a version not yet published: a broken sender
    assert buf.refused == {"stale": 2, "full": 0} and len(buf) == 3


def test_window_queues_during_an_update_and_keeps_what_stays_within_k_at_a_swap():
    buf = TrajectoryBuffer("r", capacity=2, version=0, max_staleness=1)
    buf.add(traj(0)), buf.add(traj(1))
    assert [t.request_id for t in buf.take(2)] == ["q0", "q1"]  # the update runs on them...
    buf.add(traj(2)), buf.add(traj(3))  # ...while later episodes queue for the next one
    with pytest.raises(Refused, match="complete"):
        buf.add(traj(4))  # a bounded queue: capacity trajectories wait at most
    buf.advance(1)  # version 0 is now 1 behind: still within k = 1
    assert len(buf) == 2 and buf.accepted == 2
    assert buf.add(traj(1)) == 1 and len(buf) == 2  # trained before the swap: answered as before, not again
    buf.advance(2)  # now 2 behind: gone, and so are their ids
    assert len(buf) == 0
    with pytest.raises(Refused, match="stale_policy|policy version 0"):
        buf.add(traj(1))


def test_k0_window_is_todays_per_version_rule():
    buf = TrajectoryBuffer("r", capacity=2, version=0)
    buf.add(traj(0)), buf.add(traj(1))
    buf.take(2)
    with pytest.raises(Refused, match="complete"):
        buf.add(traj(2))  # k = 0: the version's first B only, even while the update runs
    buf.advance(1)
    with pytest.raises(Refused, match="takes version 1 "):
        buf.add(traj(3, version=0))


def test_window_survives_a_checkpoint_and_reads_the_old_format():
    buf = TrajectoryBuffer("r", capacity=4, version=3, max_staleness=1)
    buf.add(traj(0, version=2)), buf.add(traj(1, version=3))
    buf.take(1)
    again = TrajectoryBuffer("r", capacity=4, max_staleness=1)
    again.restore(buf.state())
    assert [t.request_id for t in again.take(1)] == ["q1"]
    assert again.add(traj(0, version=2)) == 0  # the id trained before the checkpoint: once
    assert len(again) == 0
    old = {"version": 3, "pending": [], "seen": {"q7": 0}, "taken": 1}
    again.restore(old)
    assert again.add(traj(7, version=3)) == 0 and len(again) == 0


def test_intake_answers_stale_within_k_with_200_and_counts_the_old_as_stale():
    buf = TrajectoryBuffer("r", capacity=8, version=2, max_staleness=1)
    with ThreadedServer(ingest_app(buf, max_body_bytes=64 * 1024)) as server:
        url = server.url + "/v1/trajectories/batch"
        body = {"trajectories": [traj(i, version=v).model_dump(mode="json") for i, v in enumerate((2, 1, 0))]}
        r = httpx.post(url, json=body).json()
    assert [x["status"] for x in r["results"]] == [200, 200, 409]
    assert r["results"][2]["code"] == "stale_policy" and "versions 1..2" in r["results"][2]["message"]
    assert len(buf) == 2


def test_staleness_stats_histogram():
    st = staleness_stats([0, 1, 1, 2, 0, 1], max_staleness=2)
    assert st == {"staleness_mean": 5 / 6, "staleness_max": 2.0, "staleness_0": 2.0, "staleness_1": 3.0,
                  "staleness_2": 1.0}  # fmt: skip
    assert staleness_stats([0, 0], 0) == {"staleness_mean": 0.0, "staleness_max": 0.0, "staleness_0": 2.0}


def test_staleness_diagnostics_reach_prometheus():
    from prometheus_client import generate_latest

    from services.learner.metrics import LearnerMetrics

    m = LearnerMetrics()
    stats = {"tokens": 10.0, "tokens_per_s": 5.0, "clip_fraction": 0.25, "behaviour_weight_mean": 0.9,
             "behaviour_cut_fraction": 0.1}  # fmt: skip
    m.observe_update(stats, lags=[0, 1, 1, 2])
    text = generate_latest(m.registry).decode()
    assert 'spopp_learner_trajectory_staleness_bucket{le="0.0"} 1.0' in text
    assert 'spopp_learner_trajectory_staleness_bucket{le="1.0"} 3.0' in text
    assert "spopp_learner_trajectory_staleness_sum 4.0" in text
    assert "spopp_learner_behaviour_weight_mean 0.9" in text
    assert "spopp_learner_behaviour_cut_fraction 0.1" in text
    assert "spopp_learner_clip_fraction 0.25" in text


@pytest.mark.parametrize("k", [0, 1, 3])
def test_the_window_rule_the_intake_and_the_replica_share(k):
    """spopp.staleness: exactly the versions version-k..version train; the future never does."""
    version = 5
    assert [v for v in range(-2, 9) if staleness.trainable(v, version, k)] == list(
        range(version - k, version + 1)
    )
    assert staleness.oldest_trainable(version, k) == version - k
    assert staleness.describe(version, k) == ("version 5" if k == 0 else f"versions {5 - k}..5")
    assert staleness.describe(1, 3) == "versions 0..1"  # no negative version is named
