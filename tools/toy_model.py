"""The CPU demo's model: a character-level tokenizer and a ~331k-parameter Qwen3, built locally.

The tokenizer is word-level over single characters (digits, + - * ( )) plus a few whole-word
tokens for the toy-calc tags (`<code>`, `</code>`, `<out>`, `</out>`, `<ans>`, `</ans>`, `print`,
`error`) and the chat markers. Tags as single tokens keep responses short (a successful episode is
about 20 generated tokens) and make the environment's stop strings exact token boundaries. It is a
`PreTrainedTokenizerFast` with a chat template, saved as an ordinary Hugging Face folder, so
`AutoTokenizer`, `AutoModelForCausalLM`, our engines and `runtime.chat.ChatRenderer` load it offline.

The template writes no newlines: `<|user|>123*45+67<|end|><|assistant|>` is the whole prompt
(12 tokens). `<|end|>` is the end-of-turn (eos) token; chat markers are special tokens, so decoding
with skip_special_tokens leaves exactly the text the environment parses.

`build_word_tokenizer` is its word-level sibling for environments with a small closed vocabulary
(the ALFWorld demo): the same chat markers and template, one token per word with its leading space.
"""

from __future__ import annotations

from pathlib import Path

PAD, UNK, END = "<pad>", "<unk>", "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
SPECIAL = [PAD, UNK, END] + [f"<|{r}|>" for r in ROLES]
WORDS = ["<code>", "</code>", "<out>", "</out>", "<ans>", "</ans>", "print", "error"]
CHARS = list("0123456789+-*()")
# build_word_tokenizer's pieces: a word, a number or one other character, each with at most one
# leading space; a newline or any other space character on its own.
WORD_PATTERN = r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]|\s"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def build_toy_tokenizer():
    """The character-level chat tokenizer (deterministic: ids follow SPECIAL, WORDS, CHARS)."""
    # Added tokens are matched before pre-tokenization; everything left splits into characters.
    return _chat_tokenizer(SPECIAL + WORDS + CHARS, split=".", added=WORDS)


def build_word_tokenizer(words):
    """A word-level chat tokenizer over `words` (for environments with a small closed vocabulary).

    Text splits into pieces of `WORD_PATTERN`: a word, a number or one other character, each with
    its leading space, and a newline on its own; a piece is one token when it is in `words`, else
    `<unk>`. Decoding concatenates the pieces, so any text made of known pieces round-trips
    exactly. Chat markers and the template are those of `build_toy_tokenizer`.
    """
    return _chat_tokenizer(SPECIAL + sorted(set(words) - set(SPECIAL)), split=WORD_PATTERN, added=[])


def _chat_tokenizer(tokens: list[str], *, split: str, added: list[str]):
    """A word-level tokenizer with ids in the order of `tokens` (SPECIAL first), text pre-split into
    the matches of the regex `split`, `added` matched whole before that; the chat markers and template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(split), behavior="isolated")
    # WordLevel decodes with spaces between tokens by default; the pieces carry their own.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=END,
        pad_token=PAD,
        unk_token=UNK,
        extra_special_tokens=[f"<|{r}|>" for r in ROLES],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def word_pieces(text: str) -> list[str]:
    """The pieces `build_word_tokenizer` splits `text` into (to collect a vocabulary)."""
    import re

    return re.findall(WORD_PATTERN, text)


def toy_config(
    tok,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    mlp: int = 256,
    max_positions: int = 128,
):
    from transformers import Qwen3Config

    end, pad = tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(PAD)
    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=mlp,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        # A toy-calc episode is about 45 tokens; 128 positions leave room for a second tool call.
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=end,
        pad_token_id=pad,
        bos_token_id=None,
        dtype="float32",
    )


def new_toy_model(seed: int = 0, tok=None, **sizes):
    """(model, tokenizer) with freshly initialised weights, deterministic given `seed`.

    `tok`: the tokenizer to size the model for (default: the toy-calc character tokenizer)."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    tok = tok if tok is not None else build_toy_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(toy_config(tok, **sizes))
    end, pad = tok.convert_tokens_to_ids(END), tok.convert_tokens_to_ids(PAD)
    model.generation_config = GenerationConfig(eos_token_id=[end], pad_token_id=pad, do_sample=True)
    return model, tok


def save_toy_model(model, tok, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_toy_model(out_dir: str | Path, *, seed: int = 0, **sizes) -> Path:
    """An untrained toy model folder (tools.cold_start trains one)."""
    model, tok = new_toy_model(seed, **sizes)
    return save_toy_model(model, tok, out_dir)


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    path = build_toy_model(a.out, seed=a.seed)
    m, _ = new_toy_model(a.seed)
    print(f"wrote {path} ({sum(x.numel() for x in m.parameters())} parameters)")
