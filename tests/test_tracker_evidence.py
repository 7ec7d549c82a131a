"""The tracker's values equal the reference formulas, whatever the order outcomes arrive in."""

import math
import random

import pytest

from spopp.evidence import event_time_value, spo_retention, spo_update

LAM = -math.log(0.875)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spopp_values_match_closed_form_after_shuffled_outcomes(client, make_run, seed):
    rnd = random.Random(seed)
    priors = {f"q{i}": (rnd.uniform(0.5, 7.5), rnd.uniform(0.5, 7.5)) for i in range(6)}
    run = make_run(tasks=[{"task_id": t, "alpha0": a, "beta0": b} for t, (a, b) in priors.items()])
    history = {t: [] for t in priors}
    held = []  # requests dispatched under some version, reported later in shuffled order
    for version in range(5):
        if version:
            client.publish(run, version, f"s{version}")
        for r in client.dispatch(run, "w", version, 6).requests:
            held.append((r, float(rnd.random() < 0.4)))
        rnd.shuffle(held)
        # Report a random part now; the rest arrives after newer versions are out.
        keep = rnd.randint(0, len(held))
        now, held = held[:keep], held[keep:]
        if now:
            client.outcomes(run, [(r.request_id, reward) for r, reward in now])
        for r, reward in now:
            history[r.task_id].append((r.policy_version * LAM, reward))
    if held:
        client.outcomes(run, [(r.request_id, reward) for r, reward in held])
        for r, reward in held:
            history[r.task_id].append((r.policy_version * LAM, reward))
    zq = 4 * LAM
    for tid, (a0, b0) in priors.items():
        alpha_q, beta_q, v = event_time_value(a0, b0, 0.0, history[tid], zq)
        t = client.get_task(run, tid)
        assert t.value == pytest.approx(v, rel=1e-12)
        assert (t.alpha, t.beta) == pytest.approx((alpha_q, beta_q), rel=1e-12)
        assert t.outcomes == len(history[tid])


def test_spopp_late_outcome_lands_at_its_own_version(client, make_run):
    run = make_run(tasks=[{"task_id": "q", "alpha0": 1.0, "beta0": 1.0}])
    old = client.dispatch(run, "w", 0, 1).requests[0]
    for v in range(1, 4):
        client.publish(run, v, f"s{v}")
    [res] = client.outcomes(run, [(old.request_id, 1.0)])
    assert res.value == 0.5  # the value frozen at dispatch, not a later one
    _, _, v = event_time_value(1.0, 1.0, 0.0, [(0.0, 1.0)], 3 * LAM)
    t = client.get_task(run, "q")
    assert t.value == pytest.approx(v) == pytest.approx(2 / 3)
    assert t.alpha == pytest.approx(2 * 0.875**3)


def test_spo_consume_matches_receipt_order_reference(client, make_run):
    rnd = random.Random(5)
    run = make_run(recipe="spo", tasks=[{"task_id": f"q{i}", "alpha0": 2.0, "beta0": 6.0} for i in range(4)])
    ref = {f"q{i}": (2.0, 6.0) for i in range(4)}
    for update in range(6):
        items = [
            (f"q{rnd.randrange(4)}", float(rnd.random() < 0.5), rnd.choice([0.0, 0.01, 0.05, 0.3]))
            for _ in range(5)
        ]
        vals = client.values(run, [t for t, _, _ in items])
        assert [v.value for v in vals] == pytest.approx([ref[t][0] / sum(ref[t]) for t, _, _ in items])
        client.consume(run, f"u{update}", items)
        for t, reward, drift in items:
            ref[t] = spo_update(*ref[t], reward, spo_retention(drift))
    for t, (a, b) in ref.items():
        got = client.get_task(run, t)
        assert (got.alpha, got.beta) == pytest.approx((a, b), rel=1e-13)
