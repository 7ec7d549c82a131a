"""A tiny Qwen3-style chat model built locally in seconds (no model hub): what `spopp env check`
plays episodes with when no model is given, and the test suite's and benchmarks' model.

It is trained briefly on arithmetic chats with python tool use, so that it emits the structure
of the real task (a code block, a tool turn, a boxed answer) and its greedy choices are rarely
near-ties, which makes engines comparable token by token.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"

# ChatML as Qwen writes it, with a plain "tool" role for tool output.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_SYSTEM = "You are a helpful assistant. Use python to compute, then give the answer in \\boxed{}."
_ASK = ["What is {e}?", "Compute {e}.", "Calculate {e} using python.", "Please evaluate {e}.", "{e} = ?"]
_THINK = ["", "Let me compute it.\n", "I will use python.\n", "Let me run the code.\n"]
_ANSWER = ["The answer is \\boxed{{{v}}}.", "\\boxed{{{v}}}", "So {e} = {v}, the answer is \\boxed{{{v}}}."]


def _expression(rng: random.Random) -> tuple[str, int]:
    """A random arithmetic expression and its value."""
    a, b, c = (rng.randint(1, 999) for _ in range(3))
    form = rng.randrange(5)
    if form == 0:
        return f"{a}*{b}+{c}", a * b + c
    if form == 1:
        return f"{a}+{b}", a + b
    if form == 2:
        return f"{a}-{b}", a - b
    if form == 3:
        k = rng.randint(2, 20)
        return f"({a}+{b})*{k}", (a + b) * k
    return f"{a}*{b}", a * b


def sample_chat(rng: random.Random) -> list[dict]:
    """One arithmetic conversation: question, code, tool output, boxed answer."""
    e, v = _expression(rng)
    messages = [{"role": "system", "content": _SYSTEM}] if rng.random() < 0.5 else []
    messages += [
        {"role": "user", "content": rng.choice(_ASK).format(e=e)},
        {"role": "assistant", "content": f"{rng.choice(_THINK)}<code>print({e})</code>"},
        {"role": "tool", "content": f"<output>{v}</output>"},
        {"role": "assistant", "content": rng.choice(_ANSWER).format(e=e, v=v)},
    ]
    return messages


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template in Python (same output), so the corpus needs no tokenizer yet."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def _train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Single digits, as Qwen does, so numbers are spelled digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=EOT, extra_special_tokens=[IM_START]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    train_steps: int = 300,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    batch_size: int = 16,
    lr: float = 3e-3,
) -> Path:
    """Write tokenizer, config, generation config and safetensors weights to `out_dir`.

    `vocab_size` caps the BPE vocabulary (the corpus may support fewer tokens; the embedding has
    one row per actual token). Deterministic given the arguments. About 20 s on one CPU thread.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    corpus = [render(sample_chat(rng)) for _ in range(2000)]
    tok = _train_tokenizer(corpus, vocab_size)
    im_end, eot = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(EOT)

    config = Qwen3Config(
        # The trained vocabulary may fall short of `vocab_size` on this small corpus; an embedding
        # row per real token only, so no engine can sample an id the tokenizer cannot decode.
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=im_end,
        pad_token_id=eot,
        dtype="float32",
    )
    threads = torch.get_num_threads()
    # One thread is both fastest for a model this small and bitwise reproducible; the caller's
    # RNG state and thread count are left as they were.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
            _sft(model, tok, corpus, rng, steps=train_steps, batch_size=batch_size, lr=lr)
    finally:
        torch.set_num_threads(threads)

    model.eval()
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_model_key(seed: int = 0) -> str:
    """What the tiny model is a function of: this builder's source, the versions whose numerics and
    tokenizer training make its weights (torch, transformers, tokenizers) and the seed. Another of
    any of these is another cached model, never a stale one."""
    import tokenizers
    import torch
    import transformers

    versions = (torch.__version__, transformers.__version__, tokenizers.__version__, str(seed))
    parts = [Path(__file__).read_bytes(), *(v.encode() for v in versions)]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def tiny_model_folder(cache: Path | None = None, *, seed: int = 0) -> Path:
    """Where the tiny model of `seed` lives in the model cache (`cache`, else $SPOPP_MODEL_CACHE,
    else ~/.cache/spopp/models), whether or not it has been built there yet."""
    from spopp.files.model_cache import models_cache

    return (models_cache() if cache is None else cache) / f"tiny-model-{tiny_model_key(seed)}"


def cached_tiny_model(cache: Path | None = None, *, seed: int = 0) -> Path:
    """The tiny model of `seed` in the model cache (`cache`, else $SPOPP_MODEL_CACHE, else
    ~/.cache/spopp/models), built there the first time on a machine (about 20 s) and read from
    there after: `spopp model tiny`, `spopp env check` without a model and the test suite share it.
    The folder is shared: copy it before changing anything in it."""
    from spopp.files.model_cache import built_once

    return built_once(tiny_model_folder(cache, seed=seed), lambda out: build_tiny_model(out, seed=seed))


def _sft(
    model, tok, corpus: list[str], rng: random.Random, *, steps: int, batch_size: int, lr: float
) -> float:
    """Next-token training on random windows of the concatenated corpus.

    Packed windows waste no compute on padding and need no attention mask, which keeps the
    build within seconds on one CPU thread.
    """
    import torch

    stream = torch.tensor([i for t in corpus for i in tok.encode(t, add_special_tokens=False)])
    window = 64
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * (1 - s / steps))
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        starts = [rng.randrange(len(stream) - window) for _ in range(batch_size)]
        ids = torch.stack([stream[s : s + window] for s in starts])
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return float(loss.detach())
