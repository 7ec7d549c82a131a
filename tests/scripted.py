"""A scripted engine for the agent loop's tests: each turn answers with the next item of its script,
as a real engine that stopped there would (token ids, log-probs, finish reason).

An item is text (encoded with the tokenizer, as a model that wrote it canonically) or a list of
token ids, taken as they are (a tokenization encode() may never give: what a sampling model can
write). The prompts it was asked to continue are kept in `prompts`."""

from __future__ import annotations

from runtime.engines.base import Engine, Generation, SamplingConfig


class ScriptedEngine(Engine):
    def __init__(self, tokenizer, script: list[str | list[int]], context_tokens: int | None = None) -> None:
        self.tokenizer, self.script, self.context_tokens = tokenizer, list(script), context_tokens
        self.prompts: list[list[int]] = []

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        self.prompts.append(list(prompt_ids))
        item = self.script.pop(0)
        full = self.tokenizer.encode(item, add_special_tokens=False) if isinstance(item, str) else list(item)
        # Cut at the turn's limit as an engine would, which then says "length".
        ids = full[: sampling.max_tokens]
        finish = "length" if len(full) > sampling.max_tokens else "stop"
        text = item if isinstance(item, str) else self.tokenizer.decode(ids)
        return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), finish_reason=finish, text=text)

    async def load_weights(self, snapshot_dir) -> None:
        raise NotImplementedError("a scripted engine has no weights")

    async def close(self) -> None:
        pass
