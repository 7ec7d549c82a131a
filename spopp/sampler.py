"""Uncertainty sampler: weights and the reproducible draws of the exponential race.

Each idle task holds a key t = now + E / w with E ~ Exp(1); popping the smallest key picks idle
task i with probability w_i / sum(w) (memorylessness), and a weight change rescales the remaining
gap (t - now) * w_old / w_new without a fresh draw. The draws come from a counter-based generator
(seed, stream key (spopp.compare.streams), counter) so that several tracker processes reproduce one run's stream; they are made
outside Redis's Lua, whose math.random is reseeded to the same value on every call in Redis 6.2.
"""

from __future__ import annotations

import hashlib
import math

SAMPLER_FLOOR = 0.05


def uncertainty_weight(v: float, floor: float = SAMPLER_FLOOR) -> float:
    """sqrt(v(1-v)) + floor: most weight on prompts whose outcome is least certain."""
    v = float(v)
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"value must lie in [0, 1], got {v!r}")
    if not floor > 0 or not math.isfinite(floor):
        raise ValueError(f"floor must be a positive finite number, got {floor!r}")
    return math.sqrt(v * (1.0 - v)) + floor


def race_draws(seed: int, key: str, start: int, count: int) -> list[float]:
    """`count` Exp(1) draws for counters start, start+1, ... of (seed, key): key is stream_key's."""
    out = []
    for counter in range(start, start + count):
        digest = hashlib.blake2b(f"{seed}\x1f{key}\x1f{counter}".encode(), digest_size=8).digest()
        # 53 random bits, offset by half a unit so that u lies strictly inside (0, 1).
        u = ((int.from_bytes(digest, "big") >> 11) + 0.5) / 2.0**53
        out.append(-math.log(u))
    return out
