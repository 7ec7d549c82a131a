"""What each recipe's learner defaults to: the full recipes of the paper's paired comparison (§5).

The tracker's run fixes the recipe at its creation; a learner that is not told its normalization
or Dual-Clip takes its run's recipe's (services/learner/run_terms.py), and `spopp launch` writes
them into the learner's config the same way, under what its learner section gives
(spopp/compare/arms.py builds the comparison's arms on them).
"""

from __future__ import annotations

from typing import Any

RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "spopp": {"normalization": "token", "dual_clip": 2.0},
    "spo": {"normalization": "trajectory", "dual_clip": 10.0},
}
