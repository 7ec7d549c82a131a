"""The learner's chunked log-probs (services/learner/logprobs.py) and the CPU smoke of the GPU bench
(bench/learner_gpu.py).

The chunked pass must give the whole-vocabulary pass's log-probs and gradients, for a plain, a tied
and a PEFT-wrapped model, and never hold more than one chunk of logits: the largest vocabulary-wide
tensor of forward and backward is one chunk's, and autograd keeps none. The update under DeepSpeed
ZeRO 0-3 (and LoRA under ZeRO 1-3) is checked against plain-PyTorch references that take no chunks
in tests/learner/test_learner_update.py and tests/learner/test_lora.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from learner_worker import DIST_ENV, dist_env_restored
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from services.learner import logprobs
from services.learner.logprobs import token_logprobs

U = 2.0**-24  # fp32's unit roundoff
VOCAB = 300  # unlike every other dimension below, so a vocabulary-wide tensor is recognisable


def gamma(n: int) -> float:
    """The classical bound on a sum or dot product of n fp32 terms in any order: |error| <= gamma(n) x
    the sum of the terms' magnitudes (Higham, Accuracy and Stability, 3.1)."""
    return n * U / (1 - n * U)


def tiny(tie: bool = True, model_type: str = "qwen2", **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=VOCAB, tie_word_embeddings=tie, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 41 tokens, two of them right-padded (to 30 and 12 tokens), as collate pads."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 41), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    mask[2, 12:] = 0
    return ids, mask


def values_and_grads(model, ids, mask, weights, chunk: int | None):
    """token_logprobs (chunk tokens at a time; None: the whole-vocabulary pass) and the gradients of
    sum(weights x log-probs) on real targets."""
    model.zero_grad(set_to_none=True)
    if chunk is None:
        lp = logprobs.whole_vocabulary_logprobs(model, ids, mask)
    else:
        lp = token_logprobs(model, ids, mask, chunk_tokens=chunk)
    real = mask[:, 1:].bool()
    (lp * weights * real).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), real, grads


def value_bound(model, ids, mask) -> torch.Tensor:
    """How far two fp32 evaluations of each log-prob may differ when only the output layer's
    reductions run in another order (the decoder body is the very same computation in both).

    Each logit is a dot product of n terms (n = H, or H + r for a LoRA layer's two products): off by
    at most gamma(n) x sum|h_i w_i| (|W| + scaling |B||A| for LoRA). The log-prob logit_t -
    logsumexp moves by at most twice the largest logit error (the target's own, and logsumexp's,
    whose sensitivity to each logit is its softmax weight, summing to 1); the sum of V rounded
    exponentials adds gamma(V + 2) relative to the sum, which the log makes absolute, and the final
    subtraction rounds once more relative to |logp|. Two evaluations: twice the bound."""
    head = model.get_output_embeddings()
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        hidden = base.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
        if hasattr(head, "lora_A"):
            a, b = head.lora_A["default"].weight, head.lora_B["default"].weight
            magnitude = head.base_layer.weight.abs() + head.scaling["default"] * (b.abs() @ a.abs())
            terms = a.shape[1] + a.shape[0]
        else:
            magnitude, terms = head.weight.abs(), head.weight.shape[1]
        scale = (hidden.abs() @ magnitude.T).amax(-1)  # the largest sum|h_i w_i| of each position
        logp = logprobs.whole_vocabulary_logprobs(model, ids, mask)
    return 2 * (2 * gamma(terms) * scale + gamma(magnitude.shape[0] + 2) + U * logp.abs())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).double().norm() / b.double().norm())


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunk", [7, 10_000], ids=["chunks-of-7", "one-chunk"])
def test_chunked_logprobs_equal_the_whole_vocabulary_pass(tie, chunk):
    model = tiny(tie)
    ids, mask = batch()
    weights = torch.randn(ids.shape[0], ids.shape[1] - 1, generator=torch.Generator().manual_seed(2))
    want, real, want_g = values_and_grads(model, ids, mask, weights, None)
    got, _, got_g = values_and_grads(model, ids, mask, weights, chunk)

    assert got.shape == want.shape == (3, 40) and got.dtype == torch.float32
    assert torch.all((got - want).abs()[real] <= value_bound(model, ids, mask)[real])
    assert torch.all(got[~real] == 0) and torch.all(want[~real] == 0)  # padded targets answer 0

    # The gradients reach every parameter through the same per-position loss gradients. What the
    # chunks change is the order of the output layer's reductions: its weight's gradient is summed
    # over the tokens chunk by chunk (n = tokens terms), and each hidden state's gradient is a
    # length-V dot product in a matmul of another shape; each is within gamma(n) of exact relative
    # to its terms, and the decoder's backward is the same linear map of them in both passes. So
    # per tensor, relative to its norm: 2 gamma(max(V, tokens)) = 3.6e-5 here (measured: ~1e-7).
    assert set(got_g) == set(want_g) == {n for n, p in model.named_parameters()}
    bound = 2 * gamma(max(VOCAB, int(real.sum())))
    for name in want_g:
        assert rel_err(got_g[name], want_g[name]) <= bound, name


def test_a_peft_model_chunks_through_its_adapted_output_layer():
    """LoRA on the attention and on the output layer itself: the chunks call the adapted layer."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    )
    model = get_peft_model(tiny(tie=False), config)
    ids, mask = batch()
    weights = torch.ones(ids.shape[0], ids.shape[1] - 1)
    want, real, want_g = values_and_grads(model, ids, mask, weights, None)
    got, _, got_g = values_and_grads(model, ids, mask, weights, 7)
    assert model.get_output_embeddings() not in logprobs._UNCHUNKABLE  # it did take the chunked path
    assert torch.all((got - want).abs()[real] <= value_bound(model, ids, mask)[real])
    assert {n for n in got_g if "lora_" in n} == {n for n in want_g if "lora_" in n} != set()
    for name in want_g:
        assert rel_err(got_g[name], want_g[name]) <= 2 * gamma(max(VOCAB, int(real.sum()))), name


class VocabularyWide(TorchDispatchMode):
    """The most rows (elements / V) of any operator's output whose last dimension is the vocabulary:
    logits, their float copy, their gradients. Tensors of the output layer's weight's transposed
    shape [H, V] are left out: the transpose itself (a view of the weight) and the weight's gradient
    as the matmul forms it, both of a parameter's size and counted with the model's states."""

    def __init__(self, hidden: int, vocab: int = VOCAB) -> None:
        super().__init__()
        self.rows = 0
        self.vocab = vocab
        self.weight_t = (hidden, vocab)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim()
                and t.shape[-1] == self.vocab
                and tuple(t.shape) != self.weight_t
            ):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def widest(model, ids, mask, chunk: int | None) -> tuple[int, int, int]:
    """(largest vocabulary-wide tensor of the forward and of the backward, in rows; and the
    vocabulary-wide bytes that autograd keeps for backward)."""
    kept = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        if t.dim() and t.shape[-1] == VOCAB:
            kept += t.untyped_storage().nbytes()
        return t

    with (
        VocabularyWide(model.config.hidden_size) as fwd,
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        if chunk is None:
            lp = logprobs.whole_vocabulary_logprobs(model, ids, mask)
        else:
            lp = token_logprobs(model, ids, mask, chunk_tokens=chunk)
    with VocabularyWide(model.config.hidden_size) as bwd:
        lp.sum().backward()
    return fwd.rows, bwd.rows, kept


def test_the_chunk_bounds_the_largest_logits_tensor():
    model = tiny()
    ids, mask = batch()
    # Without chunks, the model's whole [n, T, V] logits exist and [n, T-1, V] floats of them are
    # kept (the instrument sees them).
    fwd, bwd, kept = widest(model, ids, mask, None)
    assert fwd == 3 * 41 and bwd >= 3 * 40 and kept >= 3 * 40 * VOCAB * 4
    # In chunks of 16 tokens: no vocabulary-wide tensor has more than 16 rows, in forward or in the
    # backward's recomputation (which does run: it shows 16 rows), and autograd keeps none at all.
    fwd, bwd, kept = widest(model, ids, mask, 16)
    assert fwd == bwd == 16 and kept == 0
    # The old log-probs' pass (no gradients) is chunked as well.
    with VocabularyWide(model.config.hidden_size) as mode, torch.no_grad():
        token_logprobs(model, ids, mask, chunk_tokens=16)
    assert mode.rows == 16


_dist_env = pytest.fixture(scope="module")(dist_env_restored)


@pytest.mark.process  # DeepSpeed on the CPU may build its communication op (ninja, a compiler)
@pytest.mark.parametrize("stage,lora", [(0, 0), (2, 0), (3, 0), (3, 8)], ids=lambda v: str(v))
def test_a_deepspeed_engine_takes_the_chunked_path(tiny_model, _dist_env, stage, lora):
    """Through DeepSpeed's engine (its forward's backward hooks, ZeRO-3's gathering hooks, which
    return aliases of the outputs) the chunked path is taken, not the fallback, and forward and
    engine.backward hold one chunk of logits at most. (That the update is the reference's is
    tests/learner/test_learner_update.py's and tests/learner/test_lora.py's.)"""
    from services.config.learner import LearnerSettings
    from services.learner.deepspeed_engine import build_engine, release_engine

    cfg = LearnerSettings(
        run="chunks", model=tiny_model, zero_stage=stage, batch_size=2, mini_batches=1, micro_batch_size=2,
        lora_rank=lora,
    )  # fmt: skip
    engine, _ = build_engine(cfg)
    try:
        config = engine.module.config
        ids = torch.randint(0, config.vocab_size, (2, 100), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, 60:] = 0
        with VocabularyWide(config.hidden_size, config.vocab_size) as mode:
            logp = token_logprobs(engine, ids, mask, chunk_tokens=32)
            engine.backward(logp.sum())
        assert mode.rows == 32
        assert engine.module.get_output_embeddings() not in logprobs._UNCHUNKABLE
    finally:
        release_engine(engine)


def test_a_model_that_post_processes_its_logits_takes_the_whole_pass():
    """Gemma 2 soft-caps its logits after the output layer: log-probs of the output layer's raw
    logits would be wrong, so such a model is detected and computed on its real logits."""
    model = tiny(model_type="gemma2", head_dim=16, final_logit_softcapping=5.0)
    ids, mask = batch()
    got = token_logprobs(model, ids, mask)
    assert model.get_output_embeddings() in logprobs._UNCHUNKABLE
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    want = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
    real = mask[:, 1:].bool()
    # log_softmax against logit - logsumexp on the same fp32 logits: the V-term sum of exponentials
    # rounded in either (gamma(V + 2), absolute after the log) and one more rounding of |logp| each.
    bound = 2 * (gamma(VOCAB + 2) + U * want.abs())
    assert torch.all((got - want).abs()[real] <= bound[real])


def test_bad_arguments_are_refused():
    model = tiny()
    ids, mask = batch()
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        token_logprobs(model, ids, mask, chunk_tokens=0)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        token_logprobs(model, ids[:, :1], mask[:, :1])


@pytest.mark.parametrize("label", ["Qwen2-0.5B", "Qwen2-1.5B"])
def test_the_bench_counts_the_models_it_names(label):
    """The bench's configs are the published shapes (0.49 B and 1.54 B parameters, as the plan
    counts them), and its FLOPs count every matmul weight once per token and pass: the output
    layer's included, tied or not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from bench.learner_gpu import MODELS, matmul_params
    from services.learner.memory_plan import model_shape

    config = MODELS[label]
    published = {"Qwen2-0.5B": 0.49e9, "Qwen2-1.5B": 1.54e9}[label]
    assert model_shape(config).params == pytest.approx(published, rel=0.01)
    values = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(config) == linear


@pytest.mark.process  # starts the bench as its own process (DeepSpeed on gloo)
def test_the_gpu_bench_smoke_runs_its_cases_on_the_cpu():
    """`python -m bench.learner_gpu --smoke`: the GPU bench's code path (random model from a config,
    the learner's engine and run_update under ZeRO 2 and 3, checkpointing off and on, the plain
    loop, the plan's prediction) on a tiny shape, one line per case in the GPU run's format."""
    # The first DeepSpeed process on a machine compiles its CPU communication op (a minute or
    # more on a loaded machine); later ones load it.
    # A world of its own: not the process group that this process's in-process engines joined.
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "bench.learner_gpu", "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    number = r"[\d,.]+"
    for case in ("zero 2 ckpt off packed liger off", "zero 3 persistent ckpt on padded liger off"):
        assert re.search(
            rf"^learner gpu: smoke {case}: tokens/s {number}, MFU {number}% \(plain torch {number}%\)$",
            out.stdout,
            re.M,
        ), out.stdout
    assert (
        len(re.findall(r"^  peak memory n/a, plan [\d.]+ MiB \(n/a\); plain torch n/a", out.stdout, re.M))
        == 2
    )
