"""The Python API users import, by the names and parameters the design promises: the paper's
equations at the top of spopp, however the library's inside is grouped."""

from __future__ import annotations

import inspect

import pytest

# (module, name, the parameters in order with their defaults; inspect.Parameter.empty: none)
E = inspect.Parameter.empty
PROMISED = [
    (
        "spopp.advantages",
        "normalize_advantages",
        [("adv", E), ("lengths", E), ("measure", "token"), ("eps", 1e-8)],
    ),
    ("spopp.evidence", "jeffreys_init", [("successes", E), ("trials", E), ("mass", 8.0)]),
    (
        "spopp.evidence",
        "event_time_value",
        [("alpha0", E), ("beta0", E), ("z0", E), ("outcomes", E), ("zq", E)],
    ),
    ("spopp.evidence", "EventTimeEvidence", [("alpha0", E), ("beta0", E), ("z0", 0.0)]),
    (
        "spopp.evidence",
        "spo_retention",
        [("drift", E), ("d_half", 0.06), ("rho_min", 0.875), ("rho_max", 0.96)],
    ),
    ("spopp.evidence", "spo_update", [("alpha", E), ("beta", E), ("reward", E), ("rho", E)]),
    ("spopp.sampler", "uncertainty_weight", [("v", E), ("floor", 0.05)]),
    ("spopp.metrics", "paired_difference", [("method_runs", E), ("baseline_runs", E), ("metric", E)]),
]
# The loss takes more keywords than the design names (staleness, off-policy correction); the named
# ones keep their places and defaults.
LOSS = [("logp", E), ("old_logp", E), ("advantages", E), ("mask", E)]
LOSS_KEYWORDS = {
    "rollout_logp": None,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "dual_clip": 2.0,
    "is_cap": 2.0,
    "token_count": None,
}


def _params(obj) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]


@pytest.mark.parametrize(("module", "name", "params"), PROMISED, ids=[f"{m}.{n}" for m, n, _ in PROMISED])
def test_the_promised_names_import_with_their_parameters(module, name, params):
    obj = getattr(__import__(module, fromlist=[name]), name)
    assert _params(obj) == params


def test_policy_loss_keeps_its_promised_arguments():
    from spopp.loss import policy_loss

    params = inspect.signature(policy_loss).parameters
    assert _params(policy_loss)[:4] == LOSS
    for key, default in LOSS_KEYWORDS.items():
        assert params[key].kind is inspect.Parameter.KEYWORD_ONLY and params[key].default == default, key


def test_the_curve_metrics_are_where_the_design_says():
    from spopp.metrics import auc_trapezoid, final_mean, learning_composite, step_mean

    curve = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
    # A straight line from 0 to 0.9: its normalized trapezoid area and its step mean are both 0.45,
    # the mean of its last five points 0.7, C10 = (0.45 + 0.7) / 2; each a sum of at most ten
    # one-decimal numbers, so 1e-12 covers the rounding of any float summation order.
    assert auc_trapezoid(curve) == pytest.approx(0.45, abs=1e-12)
    assert step_mean(curve) == pytest.approx(0.45, abs=1e-12)
    assert final_mean(curve) == pytest.approx(0.7, abs=1e-12)
    assert learning_composite(curve) == pytest.approx(0.575, abs=1e-12)
