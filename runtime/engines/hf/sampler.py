"""Token choice for the transformers engine, one token per row of a batch's logits.

The log-prob of a sampled token is taken under the distribution it was drawn from (logits / T,
then top-k/top-p masking and renormalization when those are on), as vLLM reports it, because the
learner uses it as the behaviour policy. Greedy decoding (T = 0) reports log-probs at T = 1, as
vLLM's processed log-probs do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ..base import SamplingConfig


class Sampler:
    def __init__(self, device) -> None:
        import torch

        self.device = device
        # Requests without a seed draw from this engine-wide stream; a caller that wants a
        # reproducible run of unseeded requests reseeds it (`shared.manual_seed`).
        self.shared = torch.Generator(device).manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    def generator(self, sampling: SamplingConfig):
        """The stream a request draws from for its whole generation: its own when it has a seed, so
        that its tokens do not depend on what else is running."""
        import torch

        if sampling.seed is None:
            return self.shared
        return torch.Generator(self.device).manual_seed(int(sampling.seed))

    def sample(self, logits, samplings: Sequence[SamplingConfig], generators: Sequence):
        """Row k's token drawn from `logits[k]` (float32) under `samplings[k]` with `generators[k]`:
        the chosen ids (LongTensor) and their log-probs (FloatTensor)."""
        import torch

        temps = torch.tensor([s.temperature for s in samplings], device=logits.device)
        greedy = temps <= 0
        scaled = logits / torch.where(greedy, 1.0, temps).unsqueeze(1)
        for k, s in enumerate(samplings):
            if not greedy[k] and (0 < s.top_k < logits.shape[1] or s.top_p < 1.0):
                scaled[k] = top_k_top_p(scaled[k], s.top_k, s.top_p)
        logp = torch.log_softmax(scaled, dim=-1)
        chosen = logp.argmax(dim=-1)
        probs = logp.exp()
        # Row by row, in batch order: rows sharing the engine-wide stream draw from it in turn.
        for k, gen in enumerate(generators):
            if not greedy[k]:
                chosen[k] = torch.multinomial(probs[k], 1, generator=gen)[0]
        return chosen, logp.gather(1, chosen.unsqueeze(1)).squeeze(1)


def top_k_top_p(logits, top_k: int, top_p: float):
    """Mask one row of logits to its top-k and top-p set, as vLLM does (ties at the k-th kept)."""
    import torch

    if 0 < top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[-1] = False  # at least one token survives
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits
