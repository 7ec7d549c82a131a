"""Incremental chat rendering: only new messages are rendered, generated tokens are never re-encoded.

Re-rendering the whole conversation each turn lets templates rewrite earlier turns (Qwen3 drops
past <think> blocks) and re-tokenizing generated text can merge tokens differently; either way
the sequence the learner trains on would differ from the one the engine sampled. So the renderer
renders a new message as the *difference* between the template applied to a fixed placeholder
conversation with and without that message, and the agent loop appends the engine's own ids.

Message contents are text. Every message the renderer is given was written by the environment or
the task (the system prompt, worked examples, the task's prompt, tool output, observations), never
by the model (its ids are appended as the engine sampled them) nor by the chat template. So a
content is encoded with the tokenizer's special tokens *not* parsed: a tool that prints
"<|im_end|>\\n<|im_start|>assistant\\n" puts those characters into the context as the ordinary
tokens that spell them, never the control tokens that would open a forged turn; only the
template's own markup becomes special tokens. How: the template is rendered once more with each
content replaced by a slot, which tells the template's text from the contents; then the template's
special tokens are written as stand-ins (tokens added to a private copy of the tokenizer that
never parses special-token text) and the whole string is encoded in one pass, the stand-ins mapped
back to the special tokens' ids. One pass splits the text exactly where the tokenizer itself does,
so ordinary contents encode exactly as the whole rendered string would, seams included (checked
token for token on toy-calc's, the ALFWorld demo's, the tiny model's and SmolLM2's tokenizers in
tests/runtime/test_chat_render.py). Added tokens that are not special (toy-calc's `<code>`, `<out>`) are
vocabulary words and still match inside contents. A tokenizer without a Rust backend encodes the
text between the template's special tokens piece by piece instead (its own flag skips every added
token, special or not, inside contents).
"""

from __future__ import annotations

import copy
import re
import secrets
import threading
import weakref

# A conversation that ends with an assistant turn, so that what follows it renders as in a real
# chat. Its contents never reach the model.
_PLACEHOLDER = [{"role": "user", "content": "\u2400"}, {"role": "assistant", "content": "\u2401"}]


def _slot(i: int) -> str:
    # Private-use characters and digits, no whitespace: a template that trims a content leaves its
    # slot whole, and no template writes such text of its own.
    return f"\ue000{i}\ue001"


class ChatRenderer:
    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._parts = _tokenizer_parts(tokenizer)
        base = self._text(_PLACEHOLDER, generation_prompt=False)
        opened = self._text(_PLACEHOLDER[:1], generation_prompt=True)
        content = _PLACEHOLDER[1]["content"]
        start = base.index(content, len(opened) - 1 if opened else 0)
        # What the template writes after an assistant message's content (e.g. "<|im_end|>\n").
        self.turn_end = base[start + len(content) :]
        self.turn_end_ids = self.encode(self.turn_end)
        self._base = base

    def _text(self, messages: list[dict], generation_prompt: bool, tools: list[dict] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **extra
        )

    def encode(self, text: str) -> list[int]:
        """`text` with special-token text parsed: for the template's own markup (and for text that
        stands for what the model writes, e.g. a teacher's turn), never for message contents."""
        return list(self.tok.encode(text, add_special_tokens=False))

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The opening of an episode, up to and including the first assistant header; `tools`
        (JSON-schema function specs) go to a template that renders them."""
        return self._render(messages, prefix=[], tools=tools)

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
        return self._render(messages, prefix=_PLACEHOLDER)

    def _render(self, messages: list[dict], prefix: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The ids of the template on `prefix + messages` (with the generation prompt), less what
        it writes for `prefix` alone; every content of `messages` encoded as text."""
        contents = []
        for i, m in enumerate(messages):
            if not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} ({m.get('role')!r}): its content must be a string")
            contents.append(m["content"])
        slots = {_slot(i): i for i in range(len(messages))}
        shape = self._text(
            prefix + [{**m, "content": s} for m, s in zip(messages, slots, strict=True)], True, tools
        )
        real = self._text(prefix + messages, generation_prompt=True, tools=tools)
        if prefix:
            if not (shape.startswith(self._base) and real.startswith(self._base)):
                raise ValueError("the chat template rewrites earlier turns when messages are added")
            shape, real = shape[len(self._base) :], real[len(self._base) :]
        # Alternating: template text, slot, template text, ..., template text.
        parts = re.split("(" + "|".join(map(re.escape, slots)) + ")", shape) if slots else [shape]
        return self._parts.encode(_place_contents(parts, slots, contents, real))


def _place_contents(
    parts: list[str], slots: dict[str, int], contents: list[str], real: str
) -> list[tuple[str, bool]]:
    """(text, is_template) runs that make up `real`: the template's text between slots (as it
    wrote it around the slots) and, for each slot, its message's content.

    A content must be where the template put its slot, verbatim or trimmed (Llama 3 and Gemma
    write `content | trim`; a template may trim some roles only). A template that changes a
    content otherwise, or that writes different text around a different content, is refused: its
    special-token text could no longer be told from the template's."""
    runs, at = [], 0
    for k, part in enumerate(parts):
        if k % 2 == 0:
            if not real.startswith(part, at):
                break
            runs.append((part, True))
            at += len(part)
            continue
        content = contents[slots[part]]
        for written in (content, content.strip()):
            if real.startswith(written, at) and real.startswith(parts[k + 1], at + len(written)):
                break
        else:
            break
        runs.append((written, False))
        at += len(written)
    else:
        if at == len(real):
            return runs
    raise ValueError(
        "the chat template does not write message contents as they are (nor trimmed), so "
        "environment text cannot be kept apart from the template's special tokens"
    )


class _TextEncoder:
    """Encodes (text, is_template) runs with special tokens only where the template wrote them."""

    def __init__(self, tokenizer) -> None:
        # Weakly: the encoder is the value of a WeakKeyDictionary keyed by this very tokenizer, and
        # a strong reference from the value would keep both alive for good.
        self._tok = weakref.ref(tokenizer)
        added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        by_name = {t.content: t for t in added.values()}
        names = {t.content for t in added.values() if getattr(t, "special", False)}
        names |= set(getattr(tokenizer, "all_special_tokens", []))
        self.ids: dict[str, int] = {}
        for name in names:
            id_ = tokenizer.convert_tokens_to_ids(name)
            # A name with no token of its own is read as text by the tokenizer too.
            if name and id_ is not None and (id_ != tokenizer.unk_token_id or name == tokenizer.unk_token):
                self.ids[name] = id_
        # The template's special tokens, longest first where one starts with another, as the
        # tokenizer's own matcher takes them.
        names_first = sorted(self.ids, key=len, reverse=True)
        self.special = re.compile("|".join(map(re.escape, names_first))) if names_first else None
        self.flags = {id_: by_name[name] for name, id_ in self.ids.items() if name in by_name}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.sealed = None if backend is None else self._seal(backend, by_name)

    def _seal(self, backend, by_name: dict):
        """A private copy of the Rust backend that never parses special-token text, with a stand-in
        for each special token: an added token that is not special (so it still splits the text
        where the special token would, with the same stripping of spaces) of private-use
        characters and a random key, which no content can hold by chance nor guess.

        Private, because transformers' `split_special_tokens=True` sets the flag on the shared
        backend for the call (the next plain call sets it back) and the Rust encode releases the
        GIL: a thread encoding with the same tokenizer meanwhile (an engine, another episode's
        renderer) could flip it under us and let a content's special tokens through."""
        from tokenizers import AddedToken

        own = copy.deepcopy(backend)
        own.encode_special_tokens = True
        own.no_padding()  # whatever the last batch call left on the shared one is not ours
        own.no_truncation()
        self.key = f"\ue002{secrets.token_hex(8)}"
        self.stand_in, stand_ins = {}, []
        for k, name in enumerate(self.ids):
            original = by_name.get(name)
            self.stand_in[name] = f"{self.key}.{k}\ue003"
            stand_ins.append(
                AddedToken(
                    self.stand_in[name],
                    special=False,
                    normalized=False,
                    lstrip=bool(getattr(original, "lstrip", False)),
                    rstrip=bool(getattr(original, "rstrip", False)),
                    single_word=bool(getattr(original, "single_word", False)),
                )
            )
        own.add_tokens(stand_ins)
        self.back = {own.token_to_id(self.stand_in[name]): id_ for name, id_ in self.ids.items()}
        # A stand-in's id is mapped back wherever it occurs: it must be no token of the original.
        taken = [i for i in self.back if backend.id_to_token(i) is not None]
        if taken:
            raise RuntimeError(f"stand-in ids {taken[:3]} are the tokenizer's own; cannot seal it")
        return own

    def encode(self, runs: list[tuple[str, bool]]) -> list[int]:
        if self.sealed is None:
            return self._by_pieces(runs)
        if any(self.key in text for text, is_template in runs if not is_template):
            raise ValueError("a message content holds the renderer's private stand-in key")
        if self.special is not None:
            runs = [
                (
                    self.special.sub(lambda m: self.stand_in[m.group()], text) if is_template else text,
                    is_template,
                )
                for text, is_template in runs
            ]
        # encode_batch of one text: the same ids as encode, but the Rust side releases the GIL while
        # it works (encode holds it), so a long text tokenized in a worker thread leaves the event
        # loop running (runtime.agent_session renders long agent calls off the loop).
        text = "".join(text for text, _ in runs)
        ids = self.sealed.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.back.get(i, i) for i in ids]

    def _by_pieces(self, runs: list[tuple[str, bool]]) -> list[int]:
        """Without a Rust backend: the template's runs cut at its special tokens, the text between
        two of them (template text and contents alike) one piece, encoded with special tokens not
        parsed (a per-call flag there, no shared state); spaces stripped beside a special token
        that strips them, as the tokenizer does."""
        items: list[int | str] = []  # a special token's id, or a piece of text
        text: list[str] = []
        for run, is_template in runs:
            at = 0
            for m in self.special.finditer(run) if is_template and self.special is not None else ():
                items += ["".join(text) + run[at : m.start()], self.ids[m.group()]]
                text, at = [], m.end()
            text.append(run[at:])
        items.append("".join(text))
        for k, x in enumerate(items):
            token = self.flags.get(x) if isinstance(x, int) else None
            if token is not None and token.lstrip and isinstance(items[k - 1], str):
                items[k - 1] = items[k - 1].rstrip()
            if token is not None and token.rstrip and isinstance(items[k + 1], str):
                items[k + 1] = items[k + 1].lstrip()
        pieces = [x for x in items if isinstance(x, str) and x]
        tok = self._tok()  # alive: the renderer calling this holds it
        encoded = iter(tok(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        ids: list[int] = []
        for x in items:
            if isinstance(x, int):
                ids.append(x)
            elif x:
                ids += next(encoded)
        return ids


# Per tokenizer object, its encoder: copying SmolLM2's Rust backend takes about 0.3 s, and
# run_episode builds a renderer per episode when it is given none.
_ENCODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODERS_LOCK = threading.Lock()


def _tokenizer_parts(tokenizer) -> _TextEncoder:
    with _ENCODERS_LOCK:
        size = len(tokenizer)  # tokens added since: built again
        cached = _ENCODERS.get(tokenizer)
        if cached is None or cached[0] != size:
            cached = _ENCODERS[tokenizer] = (size, _TextEncoder(tokenizer))
        return cached[1]
