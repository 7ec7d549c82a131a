"""The staleness window: which policy versions may still train while the learner is at `version`.

With max_staleness k = 0 (the paper's protocol) only the current version trains; with k > 0 the k
versions before it do too (their tokens corrected by the learner's importance weights). The
learner's intake admits and prunes by this window and a replica keeps or releases its leases by
it, so both read the same rule here.
"""

from __future__ import annotations


def oldest_trainable(version: int, max_staleness: int) -> int:
    """The oldest policy version whose trajectories still train at `version` (may be below 0)."""
    return version - max_staleness


def trainable(policy_version: int, version: int, max_staleness: int) -> bool:
    """Whether a trajectory of `policy_version` may train at `version`: not from the future, at most
    `max_staleness` versions behind."""
    return 0 <= version - policy_version <= max_staleness


def describe(version: int, max_staleness: int) -> str:
    """The window in words, for a refusal: "version 5" or "versions 3..5"."""
    if max_staleness == 0:
        return f"version {version}"
    return f"versions {max(0, oldest_trainable(version, max_staleness))}..{version}"
