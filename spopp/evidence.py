"""Prompt evidence: Jeffreys offline init, SPO++ event-time evidence (paper eq. 3), SPO retention.

Event-time evidence weighs an outcome generated at policy coordinate z_i by e^{-(z_q - z_i)} at a
later dispatch coordinate z_q. The common factor e^{-z_q} cancels in the value, so the state keeps
sums relative to a reference coordinate zr (the largest coordinate seen): a = e^{z0-zr} a0 +
sum e^{z_i-zr} R_i, b likewise. That state is O(1), independent of receipt order up to rounding,
and never overflows; the value is read from (a, b), never from alpha_q/beta_q, which underflow
after a few thousand versions without outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def _finite(name: str, x: float) -> float:
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return x


def _positive(name: str, x: float) -> float:
    x = _finite(name, x)
    if x <= 0:
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return x


def _reward(r: float) -> float:
    r = _finite("reward", r)
    if not 0.0 <= r <= 1.0:
        raise ValueError(f"reward must lie in [0, 1], got {r!r}")
    return r


def jeffreys_init(successes: int, trials: int, mass: float = 8.0) -> tuple[float, float]:
    """Offline prior from `successes` of `trials` base-policy outcomes, total Beta mass `mass`."""
    if isinstance(successes, bool) or isinstance(trials, bool):
        raise ValueError("successes and trials must be integers, not booleans")
    if int(successes) != successes or int(trials) != trials:
        raise ValueError(f"successes and trials must be integers, got {successes!r}, {trials!r}")
    s, n = int(successes), int(trials)
    if n < 0 or not 0 <= s <= n:
        raise ValueError(f"need 0 <= successes <= trials, got successes={s}, trials={n}")
    m = _positive("mass", mass)
    return m * (s + 0.5) / (n + 1), m * (n - s + 0.5) / (n + 1)


def event_coordinate(version: int, retention: float = 0.875) -> float:
    """z_k = k * (-ln rho): one policy event decays old evidence by rho."""
    if not 0.0 < retention < 1.0:
        raise ValueError(f"retention must lie in (0, 1), got {retention!r}")
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version!r}")
    return version * -math.log(retention)


def event_time_value(
    alpha0: float,
    beta0: float,
    z0: float,
    outcomes: Iterable[tuple[float, float]],
    zq: float,
) -> tuple[float, float, float]:
    """Closed form of eq. 3: (alpha_q, beta_q, v_q) for outcomes [(z_i, R_i)] seen at coordinate zq.

    Exponents are shifted by the largest coordinate so that neither the sums nor the value
    underflow; alpha_q and beta_q themselves may legitimately underflow to 0 far in the future.
    """
    a0, b0 = _positive("alpha0", alpha0), _positive("beta0", beta0)
    z0, zq = _finite("z0", z0), _finite("zq", zq)
    pts = [(_finite("z", z), _reward(r)) for z, r in outcomes]
    zmax = max([z0] + [z for z, _ in pts])
    # Sum the small terms first so that the result does not depend on the order given.
    terms = sorted(((math.exp(z - zmax), r) for z, r in pts), key=lambda t: t[0])
    a = math.fsum([math.exp(z0 - zmax) * a0] + [w * r for w, r in terms])
    b = math.fsum([math.exp(z0 - zmax) * b0] + [w * (1.0 - r) for w, r in terms])
    scale = math.exp(zmax - zq)
    return a * scale, b * scale, a / (a + b)


class EventTimeEvidence:
    """Incremental eq. 3 with O(1) state (a, b, zr); any receipt order gives the same state."""

    __slots__ = ("a", "b", "zr")

    def __init__(self, alpha0: float, beta0: float, z0: float = 0.0) -> None:
        self.a = _positive("alpha0", alpha0)
        self.b = _positive("beta0", beta0)
        self.zr = _finite("z0", z0)

    def add(self, z: float, reward: float) -> None:
        z, r = _finite("z", z), _reward(reward)
        if z > self.zr:
            # Move the reference forward: old mass shrinks, new terms enter with weight 1.
            shrink = math.exp(self.zr - z)
            self.a *= shrink
            self.b *= shrink
            self.zr = z
        w = math.exp(z - self.zr)
        self.a += w * r
        self.b += w * (1.0 - r)

    @property
    def value(self) -> float:
        return self.a / (self.a + self.b)

    def at(self, zq: float) -> tuple[float, float]:
        """(alpha_q, beta_q): the evidence mass as seen from coordinate zq."""
        scale = math.exp(self.zr - _finite("zq", zq))
        return self.a * scale, self.b * scale


def spo_retention(drift: float, d_half: float = 0.06, rho_min: float = 0.875, rho_max: float = 0.96) -> float:
    """SPO's drift-dependent retention rho = clip(2^(-D/d_half), rho_min, rho_max)."""
    d = _finite("drift", drift)
    if d < 0:
        raise ValueError(f"drift must be >= 0, got {d!r}")
    _positive("d_half", d_half)
    if not 0.0 < rho_min <= rho_max <= 1.0:
        raise ValueError(f"need 0 < rho_min <= rho_max <= 1, got {rho_min!r}, {rho_max!r}")
    return min(max(2.0 ** (-d / d_half), rho_min), rho_max)


def spo_update(alpha: float, beta: float, reward: float, rho: float) -> tuple[float, float]:
    """SPO receipt-order update (paper eq. 2): alpha <- rho alpha + R, beta <- rho beta + (1 - R)."""
    a, b, r = _positive("alpha", alpha), _positive("beta", beta), _reward(reward)
    rho = _finite("rho", rho)
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"rho must lie in (0, 1], got {rho!r}")
    return rho * a + r, rho * b + (1.0 - r)
