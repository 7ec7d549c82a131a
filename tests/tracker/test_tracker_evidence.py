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
    fresh = client.dispatch(run, "w", 3, 1).requests
    assert fresh == []  # the only task is in flight
    [res] = client.outcomes(run, [(old.request_id, 1.0)])
    assert res.value == 0.5  # the value frozen at dispatch, not a later one
    _, _, v = event_time_value(1.0, 1.0, 0.0, [(0.0, 1.0)], 3 * LAM)
    t = client.get_task(run, "q")
    assert t.value == pytest.approx(v) == pytest.approx(2 / 3)
    assert t.alpha == pytest.approx(2 * 0.875**3)
    # Reported after versions 1..3 were published: counted as late (the map's reordering measure).
    assert client.get_run(run).counts.late_outcomes == 1
    now = client.dispatch(run, "w", 3, 1).requests[0]
    client.outcomes(run, [(now.request_id, 0.0)])
    assert client.get_run(run).counts.late_outcomes == 1  # on time: not late


def test_outcomes_out_of_dispatch_order_are_counted_as_overtaken(client, make_run):
    run = make_run(tasks=[{"task_id": f"q{i}", "alpha0": 1.0, "beta0": 1.0} for i in range(4)])
    a, b, c, d = client.dispatch(run, "w", 0, 4).requests  # dispatched in this order
    client.outcomes(run, [(b.request_id, 1.0)])
    client.outcomes(run, [(a.request_id, 0.0), (d.request_id, 1.0)])  # a: overtaken by b
    client.outcomes(run, [(c.request_id, 1.0)])  # c: overtaken by d
    client.outcomes(run, [(c.request_id, 1.0)])  # a repeat changes nothing
    counts = client.get_run(run).counts
    assert (counts.outcomes, counts.overtaken_outcomes, counts.late_outcomes) == (4, 2, 0)
    assert counts.reorder_distance == 1 + 1  # a was 1 dispatch behind b; c 1 behind d


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


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_outcomes_k_versions_late_are_receipt_order_invariant(client, run_name, k):
    """Bounded staleness: every outcome arrives k versions after its dispatch, in either receipt
    order; SPO++'s evidence equals the closed form over the outcomes at their own dispatch
    coordinates (which no order enters). The run reports its k."""
    tasks = [{"task_id": f"q{i}", "alpha0": 1.0 + i, "beta0": 2.0} for i in range(4)]
    finals = []
    for order in ("forward", "reversed"):
        run = f"{run_name}-{order}"
        client.put_run(run, {"recipe": "spopp", "max_staleness": k})
        client.put_tasks(run, tasks)
        assert client.get_run(run).config.max_staleness == k
        rnd, held, history = random.Random(11), {}, {t["task_id"]: [] for t in tasks}
        for version in range(6):
            if version:
                client.publish(run, version, f"s{version}")
            held[version] = [
                (r, float(rnd.random() < 0.5)) for r in client.dispatch(run, "w", version, 4).requests
            ]
            late = held.pop(version - k, [])  # dispatched k versions ago: reported now
            if order == "reversed":
                late = late[::-1]
            if late:
                client.outcomes(run, [(r.request_id, reward) for r, reward in late])
            for r, reward in late:
                history[r.task_id].append((r.policy_version * LAM, reward))
        for t in tasks:
            got = client.get_task(run, t["task_id"])
            alpha, beta, v = event_time_value(t["alpha0"], t["beta0"], 0.0, history[t["task_id"]], 5 * LAM)
            assert (got.alpha, got.beta, got.value) == pytest.approx((alpha, beta, v), rel=1e-12)
            assert got.outcomes == len(history[t["task_id"]])
        finals.append(sum(len(h) for h in history.values()))
    assert min(finals) > 0  # outcomes did arrive late, in both orders


def test_max_staleness_defaults_to_0_and_a_run_stored_without_it_still_matches(client, make_run):
    """0 is left out of the stored config, so a run PUT before the field existed (or by an older
    client) and the same run PUT again now compare equal."""
    run = make_run()
    assert client.get_run(run).config.max_staleness == 0
    assert client.put_run(run, {"recipe": "spopp", "max_staleness": 0}) is not None  # the same run
