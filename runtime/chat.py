"""Incremental chat rendering: only new messages are rendered, generated tokens are never re-encoded.

Re-rendering the whole conversation each turn lets templates rewrite earlier turns (Qwen3 drops
past <think> blocks) and re-tokenizing generated text can merge tokens differently; either way
the sequence the learner trains on would differ from the one the engine sampled. So the renderer
renders a new message as the *difference* between the template applied to a fixed placeholder
conversation with and without that message, and the agent loop appends the engine's own ids.
"""

from __future__ import annotations

# A conversation that ends with an assistant turn, so that what follows it renders as in a real
# chat. Its contents never reach the model.
_PLACEHOLDER = [{"role": "user", "content": "\u2400"}, {"role": "assistant", "content": "\u2401"}]


class ChatRenderer:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        base = self._text(_PLACEHOLDER, generation_prompt=False)
        opened = self._text(_PLACEHOLDER[:1], generation_prompt=True)
        content = _PLACEHOLDER[1]["content"]
        start = base.index(content, len(opened) - 1 if opened else 0)
        # What the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self.turn_end = base[start + len(content) :]
        self.turn_end_ids = self.encode(self.turn_end)
        self._base = base

    def _text(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict]) -> list[int]:
        """The opening of an episode, up to and including the first assistant header."""
        return self.encode(self._text(messages, generation_prompt=True))

    def close_turn(self, generated_ids: list[int]) -> list[int]:
        """Tokens that close the assistant turn after what the model generated (masked out).

        A model that stopped on its end-of-turn token has written the start of the turn end
        itself (e.g. "<|im_end|>"); only the rest (e.g. "\n") is added. Matching is on token
        ids, so a turn that merely ends with the same characters is not mistaken for it.
        """
        end = self.turn_end_ids
        for k in range(min(len(end), len(generated_ids)), 0, -1):
            if generated_ids[-k:] == end[:k]:
                return end[k:]
        return list(end)

    def continuation(self, messages: list[dict]) -> list[int]:
        """New messages after a closed assistant turn, then the next assistant header."""
        full = self._text(_PLACEHOLDER + messages, generation_prompt=True)
        if not full.startswith(self._base):
            raise ValueError("the chat template rewrites earlier turns when messages are added")
        return self.encode(full[len(self._base) :])
