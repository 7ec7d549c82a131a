"""One request's generation as the transformers engine decodes it: its tokens so far and when it
ends.

Stops follow the vLLM engine: the tokenizer's and generation config's end-of-sequence tokens stop
a turn, stop tokens and stop strings are kept in the output (the text ends where the first stop
string in it does; the tokens stay whole), and a stop on the last allowed token counts as "stop".
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..base import Generation, SamplingConfig


@dataclass
class Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    submitted: float = field(default_factory=time.perf_counter)

    def wanted(self) -> bool:
        """False once the caller stopped waiting (cancelled, or its event loop is gone)."""
        return not self.future.done() and not self.loop.is_closed()


@dataclass
class Row:
    """Decoding state of one request inside the running batch."""

    request: Request
    generator: object  # torch.Generator
    stop_ids: frozenset[int]
    max_tokens: int
    admitted: float
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None  # set where a stop string cut the decoded text
    batch_rows: int = 0  # summed over the forward passes this row took part in, for its mean batch size

    def append(self, token: int, logprob: float, tokenizer) -> None:
        """Record a sampled token, and whether it ends the row."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        stops = self.request.sampling.stop
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif stops:
            # Decoded whole each time: a stop string may span tokens, or a token may complete a
            # character only with the next one.
            text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
            found = [text.find(s) + len(s) for s in stops if s and s in text]
            if found:
                self.finish_reason = "stop"
                self.text = text[: min(found)]
        if self.finish_reason is None and len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"

    def generation(self, tokenizer, now: float) -> Generation:
        text = self.text
        if text is None:
            text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        timings = {
            "queue_s": self.admitted - self.request.submitted,
            "engine_s": now - self.admitted,
            "batch_size": self.batch_rows / max(1, len(self.token_ids)),
        }
        return Generation(self.token_ids, self.logprobs, self.finish_reason, text, timings)
