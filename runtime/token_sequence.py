"""The token sequence an episode builds: one flat list of ids, with per token whether the policy
generated it (mask 1), the engine's log-prob of it, and the policy version that generated it.

Both ways of playing an episode append to one (the turn loop, runtime/turns.py, and an agent's
session, runtime/agent_session.py); what they record is what the engine did, never a re-tokenization.
"""

from __future__ import annotations


class TokenSequence:
    """Ids with their mask, log-probs and versions, appended together so they never disagree in length."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int | None] = []
        self._version: int | None = None

    def add(self, ids: list[int], logprobs: list[float] | None = None, version: int | None = None) -> None:
        """Append `ids`: generated ones with their `logprobs` and policy `version` (mask 1); without
        log-probs, text the policy did not generate (mask 0, log-prob 0), which carries the
        version of the last generation before it."""
        if logprobs is not None:
            self._version = version
        self.ids += ids
        self.mask += [1 if logprobs is not None else 0] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.versions += [self._version] * len(ids)
