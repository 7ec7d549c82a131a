import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spopp.evidence import (
    EventTimeEvidence,
    event_coordinate,
    event_time_value,
    jeffreys_init,
    spo_retention,
    spo_update,
)

LAM = -math.log(0.875)


def brute_force(alpha0, beta0, z0, outcomes, zq):
    """Eq. 3 written out literally, valid where nothing under- or overflows."""
    a = math.exp(-(zq - z0)) * alpha0 + sum(math.exp(-(zq - z)) * r for z, r in outcomes)
    b = math.exp(-(zq - z0)) * beta0 + sum(math.exp(-(zq - z)) * (1 - r) for z, r in outcomes)
    return a, b, a / (a + b)


def test_jeffreys_init_matches_formula():
    assert jeffreys_init(3, 8) == pytest.approx((8 * 3.5 / 9, 8 * 5.5 / 9))
    a, b = jeffreys_init(0, 8, mass=4.0)
    assert a + b == pytest.approx(4.0 * 9 / 9)
    assert a / (a + b) == pytest.approx(0.5 / 9)


@pytest.mark.parametrize("s,n,m", [(-1, 8, 8.0), (9, 8, 8.0), (1, 8, 0.0), (1.5, 8, 8.0), (1, 8, math.nan)])
def test_jeffreys_init_rejects_bad_arguments(s, n, m):
    with pytest.raises(ValueError):
        jeffreys_init(s, n, m)


def test_closed_form_matches_literal_equation():
    outcomes = [(0.0, 1.0), (LAM, 0.0), (2 * LAM, 1.0), (2 * LAM, 1.0), (5 * LAM, 0.0)]
    got = event_time_value(2.0, 3.0, 0.0, outcomes, 7 * LAM)
    assert got == pytest.approx(brute_force(2.0, 3.0, 0.0, outcomes, 7 * LAM), rel=1e-13)


outcome_lists = st.lists(
    st.tuples(st.integers(0, 3000), st.sampled_from([0.0, 1.0, 0.25])), min_size=1, max_size=40
)


@settings(max_examples=200, deadline=None)
@given(outcome_lists, st.randoms(use_true_random=False))
def test_incremental_is_receipt_order_invariant(raw, rnd):
    outcomes = [(k * LAM, r) for k, r in raw]
    order = outcomes[:]
    rnd.shuffle(order)
    ev = EventTimeEvidence(1.5, 6.5)
    for z, r in order:
        ev.add(z, r)
    zq = max(z for z, _ in outcomes) + 3 * LAM
    alpha_q, beta_q, v = event_time_value(1.5, 6.5, 0.0, outcomes, zq)
    assert ev.value == pytest.approx(v, rel=1e-12)
    got_a, got_b = ev.at(zq)
    assert got_a == pytest.approx(alpha_q, rel=1e-12, abs=1e-300)
    assert got_b == pytest.approx(beta_q, rel=1e-12, abs=1e-300)


def test_publishing_versions_without_outcomes_keeps_value_and_decays_mass():
    ev = EventTimeEvidence(2.0, 6.0)
    ev.add(LAM, 1.0)
    before = ev.value
    a1, b1 = ev.at(LAM)
    a9, b9 = ev.at(9 * LAM)
    assert ev.value == before
    assert a9 / (a9 + b9) == pytest.approx(before, rel=1e-14)
    assert a9 == pytest.approx(a1 * 0.875**8, rel=1e-12)
    _, _, v_far = event_time_value(2.0, 6.0, 0.0, [(LAM, 1.0)], 50_000 * LAM)
    assert v_far == pytest.approx(before, rel=1e-14)


def test_no_overflow_or_underflow_after_a_million_versions():
    ev = EventTimeEvidence(1.0, 7.0)
    outcomes = []
    for k in range(0, 1_000_001, 50_000):
        ev.add(k * LAM, float(k % 3 == 0))
        outcomes.append((k * LAM, float(k % 3 == 0)))
    assert math.isfinite(ev.a) and math.isfinite(ev.b) and ev.a + ev.b > 0
    # The last outcome dominates: every older one is e^{-6676} lighter.
    assert ev.value == pytest.approx(float(1_000_000 % 3 == 0), abs=1e-12)
    _, _, v = event_time_value(1.0, 7.0, 0.0, outcomes, 2_000_000 * LAM)
    assert v == pytest.approx(ev.value, abs=1e-12)
    alpha_q, beta_q = ev.at(2_000_000 * LAM)
    assert alpha_q == 0.0 and beta_q == 0.0  # the masses underflow; the value above does not


def test_outcome_older_than_reference_weighs_less():
    ev = EventTimeEvidence(1.0, 1.0)
    ev.add(10 * LAM, 1.0)
    ev.add(2 * LAM, 0.0)
    _, _, v = event_time_value(1.0, 1.0, 0.0, [(10 * LAM, 1.0), (2 * LAM, 0.0)], 10 * LAM)
    assert ev.value == pytest.approx(v, rel=1e-14)
    assert ev.value > 0.5


@pytest.mark.parametrize("args", [(0.0, 1.0), (1.0, -1.0), (math.inf, 1.0)])
def test_evidence_rejects_bad_priors(args):
    with pytest.raises(ValueError):
        EventTimeEvidence(*args)


@pytest.mark.parametrize("z,r", [(math.nan, 1.0), (1.0, 1.5), (1.0, math.nan), (1.0, -0.1)])
def test_evidence_rejects_bad_outcomes(z, r):
    ev = EventTimeEvidence(1.0, 1.0)
    with pytest.raises(ValueError):
        ev.add(z, r)
    assert (ev.a, ev.b, ev.zr) == (1.0, 1.0, 0.0)
    with pytest.raises(ValueError):
        event_time_value(1.0, 1.0, 0.0, [(z, r)], 2.0)


def test_event_coordinate():
    assert event_coordinate(3) == pytest.approx(3 * LAM)
    with pytest.raises(ValueError):
        event_coordinate(1, retention=1.0)


def test_spo_retention_is_clipped_half_life():
    assert spo_retention(0.0) == 0.96
    assert spo_retention(0.06) == 0.875  # 2^-1 = 0.5, clipped up to rho_min
    d = 0.06 * -math.log2(0.9)
    assert spo_retention(d) == pytest.approx(0.9)
    assert spo_retention(1e9) == 0.875
    with pytest.raises(ValueError):
        spo_retention(-0.1)
    with pytest.raises(ValueError):
        spo_retention(math.nan)
    with pytest.raises(ValueError):
        spo_retention(0.1, rho_min=0.99, rho_max=0.9)


def test_spo_update_is_geometric_retention():
    a, b = spo_update(2.0, 6.0, 1.0, 0.9)
    assert (a, b) == pytest.approx((2.8, 5.4))
    rnd = random.Random(0)
    a, b = 1.0, 1.0
    for _ in range(200):
        a, b = spo_update(a, b, float(rnd.random() < 0.3), 0.96)
    assert a + b == pytest.approx(0.96**200 * 2 + (1 - 0.96**200) / 0.04)
    for bad in [(0.0, 1.0, 1.0, 0.9), (1.0, 1.0, 2.0, 0.9), (1.0, 1.0, 1.0, 0.0), (1.0, 1.0, 1.0, math.nan)]:
        with pytest.raises(ValueError):
            spo_update(*bad)
