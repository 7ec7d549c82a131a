"""SPO's drift-dependent retention, learner side: the per-task cache and the drift D.

After each update, for every trajectory of the batch in receipt order, D is the mean over the
task's *previously stored* response's action tokens of |log pi_prev - log pi_now|, where pi_prev
are the log-probs cached right after the previous visit's update and pi_now those of the same
tokens under the weights just updated. A first visit has D = 0. The current response, with its
log-probs under the updated weights, then replaces the cache entry. The tracker turns D into
rho = clip(2^(-D/d_half), rho_min, rho_max) when the learner calls /consume.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# (token_ids lists) -> per-trajectory lists of log p(token_t | prefix) for t = 1..T-1
LogprobFn = Callable[[list[list[int]]], list[list[float]]]


@dataclass
class _Visit:
    token_ids: list[int]
    mask: list[int]  # over positions 1..T-1: 1 where the token was generated
    logprobs: list[float]  # over positions 1..T-1, under the weights right after that visit's update


class SpoDriftCache:
    def __init__(self) -> None:
        self._visits: dict[str, _Visit] = {}

    def __len__(self) -> int:
        return len(self._visits)

    def after_update(self, trajectories: Sequence, logprobs: LogprobFn) -> list[float]:
        """Drifts of `trajectories` (receipt order) with the updated weights; refreshes the cache."""
        tasks = dict.fromkeys(t.task_id for t in trajectories)
        earlier = [self._visits[task] for task in tasks if task in self._visits]
        # One pass over every response whose log-probs are needed under the new weights.
        fresh = logprobs([v.token_ids for v in earlier] + [list(t.token_ids) for t in trajectories])
        prev_now = {id(v): lp for v, lp in zip(earlier, fresh[: len(earlier)], strict=True)}
        cur_now = fresh[len(earlier) :]
        drifts, from_this_batch = [], set()
        for t, lp in zip(trajectories, cur_now, strict=True):
            prev = self._visits.get(t.task_id)
            if prev is None or t.task_id in from_this_batch:
                # First visit; or the previous visit was earlier in this same batch, whose cached
                # log-probs already are this update's: no drift.
                drifts.append(0.0)
            else:
                drifts.append(_masked_mean_abs(prev.logprobs, prev_now[id(prev)], prev.mask))
            self._visits[t.task_id] = _Visit(list(t.token_ids), list(t.action_mask[1:]), list(lp))
            from_this_batch.add(t.task_id)
        return drifts

    def state(self) -> dict:
        return {k: [v.token_ids, v.mask, v.logprobs] for k, v in self._visits.items()}

    def restore(self, state: dict) -> None:
        self._visits = {k: _Visit(*v) for k, v in state.items()}


def _masked_mean_abs(a: list[float], b: list[float], mask: list[int]) -> float:
    pairs = [abs(x - y) for x, y, m in zip(a, b, mask, strict=True) if m]
    return sum(pairs) / len(pairs) if pairs else 0.0
