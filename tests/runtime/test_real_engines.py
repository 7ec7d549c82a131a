"""Both engines on a real pretrained model: SmolLM2-135M-Instruct as `spopp model import` wrote it.

The prompts are the demo's (tools/demo_real.py): toy-calc with the tool described and two worked
episodes, rendered by the model's own chat template. vLLM (CPU build) and transformers load the
imported folder; each engine's greedy tokens and log-probs are checked against a float64 forward
pass of the same weights (teacher-forced on the engine's own tokens, as tests/runtime/test_engines.py does
for the tiny model), and the two engines against each other. Then weight swaps in place: full
weights (a perturbed copy of the model) and a LoRA adapter, each checked against the float64
reference of what was loaded.

Tolerances, from the arithmetic of this model (30 layers, hidden 576, vocabulary 49,152):
LOGPROB_TOL bounds |engine - float64| per token. Each fp32 layer adds relative rounding of order
sqrt(hidden) * 2^-24 ~ 1.4e-6 to the residual stream, and the logits' scale here is ~20, so thirty
layers move a log-prob by ~30 * 1.4e-6 * 20 ~ 1e-3 in the worst case where every layer's error
adds up in one direction, and by ~sqrt(30) * 1.4e-6 * 20 ~ 1.5e-4 when they add as independent
roundings do. Measured on this model and these prompts (2-core AMD EPYC, AVX2): at most 2.6e-5 for
transformers and 3.2e-5 for vLLM's CPU kernels, so the bound, 1e-4, is the independent-rounding
estimate and 3x the measurement. A swap that did not happen is far outside it: the perturbed
weights move these log-probs by more than 1e-2.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from test_engines import logprobs_at

from runtime.chat import ChatRenderer
from runtime.engines.base import SamplingConfig
from runtime.engines.factory import make_engine
from runtime.envs.toy_calc import ToyCalcEnv, generate_toy_calc_tasks

pytestmark = pytest.mark.process  # vLLM's engine core is a process; the model's import runs pip

# See the module docstring: the independent-rounding estimate, 3x what was measured here.
LOGPROB_TOL = {"transformers": 1e-4, "vllm": 1e-4}
# Top-2 logit margins below this are ties as far as the engines' fp32 kernels can tell: a greedy
# choice is only compared up to the first one (logits ~20 in size, errors above ~1e-3).
TIE_MARGIN = 1e-2
MAX_MODEL_LEN = 1024
N_PROMPTS = 4


@pytest.fixture(scope="module")
def runner():
    with asyncio.Runner() as r:
        yield r


def run_all(runner, engine, prompts, cfg):
    async def go():
        return await asyncio.gather(*[engine.generate(p, cfg) for p in prompts])

    return runner.run(go())


@pytest.fixture(scope="module")
def hf(smollm2, runner):
    engine = make_engine("transformers", smollm2)
    yield engine
    runner.run(engine.close())


@pytest.fixture(scope="module")
def vllm(smollm2, runner):
    async def start():
        return make_engine("vllm", smollm2, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1, seed=0, lora_rank=8)

    engine = runner.run(start())
    yield engine
    runner.run(engine.close())


@pytest.fixture(scope="module")
def prompts(hf):
    renderer = ChatRenderer(hf.tokenizer)
    tasks = generate_toy_calc_tasks(N_PROMPTS, seed=5, split="heldout")
    return [renderer.prompt(ToyCalcEnv(describe_tool=True, shots=2).reset(t)) for t in tasks]


@pytest.fixture(scope="module")
def float64():
    """model folder -> its float64 model (loaded once per folder)."""
    from transformers import AutoModelForCausalLM

    cache = {}

    def get(folder):
        if folder not in cache:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            cache[folder] = model.to(torch.float64).eval()
        return cache[folder]

    return get


_FORCED: dict = {}


def teacher_forced(model, prompt, generated):
    """Logits (float64) of the positions that predicted each generated token. A float64 forward of
    this model costs seconds, and the engines' greedy turns mostly coincide: each is computed once."""
    key = (id(model), tuple(prompt), tuple(generated))
    if key not in _FORCED:
        ids = torch.tensor([list(prompt) + list(generated)])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        _FORCED[key] = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    return _FORCED[key]


def decided_prefix(logits):
    top2 = logits.topk(2, dim=-1).values
    small = ((top2[:, 0] - top2[:, 1]) < TIE_MARGIN).nonzero()
    return int(small[0]) if len(small) else len(logits)


def logprob_error(gens, prompts, model, temperature=0.0) -> float:
    """The largest |engine log-prob - `model`'s (float64)| over the generations' tokens."""
    worst = 0.0
    for p, g in zip(prompts, gens, strict=True):
        logits = teacher_forced(model, p, g.token_ids)
        want = logprobs_at(logits, g.token_ids, temperature)
        worst = max(worst, float((torch.tensor(g.logprobs, dtype=torch.float64) - want).abs().max()))
    return worst


def check(gens, prompts, model, kind, temperature=0.0):
    """Every generation against `model` (float64): log-probs within LOGPROB_TOL[kind], greedy tokens
    equal up to the first near-tie. Returns the largest log-prob error and the tokens compared."""
    worst, compared = logprob_error(gens, prompts, model, temperature), 0
    for p, g in zip(prompts, gens, strict=True):
        if temperature == 0:
            logits = teacher_forced(model, p, g.token_ids)
            n = decided_prefix(logits)
            assert g.token_ids[:n] == logits.argmax(-1)[:n].tolist()
            compared += n
    print(f"\n{kind}: largest |log-prob - float64| {worst:.2e} over {len(gens)} generations")
    assert worst < LOGPROB_TOL[kind], (kind, worst)
    return worst, compared


GREEDY = SamplingConfig(max_tokens=24, temperature=0.0, stop=ToyCalcEnv.stop)


def test_both_engines_load_the_import_and_agree_greedily(hf, vllm, runner, prompts, smollm2, float64):
    model = float64(smollm2)
    a = run_all(runner, hf, prompts, GREEDY)
    b = run_all(runner, vllm, prompts, GREEDY)
    _, compared = check(a, prompts, model, "transformers")
    check(b, prompts, model, "vllm")
    assert compared >= 3 * len(prompts)  # not vacuous: most turns have no near-tie at all
    for p, x, y in zip(prompts, a, b, strict=True):
        n = decided_prefix(teacher_forced(model, p, x.token_ids))
        assert x.token_ids[:n] == y.token_ids[:n]
    # The model, with two worked episodes before it, calls the tool in the demonstrated format.
    assert sum(g.text.startswith("<code>") for g in a) >= len(prompts) // 2, [g.text for g in a]
    # Both stop on the env's stop string and report it the same way.
    assert [g.finish_reason for g in a] == [g.finish_reason for g in b]


def test_sampled_logprobs_are_those_of_the_sampling_distribution(hf, vllm, runner, prompts, smollm2, float64):
    model = float64(smollm2)
    cfg = SamplingConfig(max_tokens=24, temperature=0.7, seed=3, stop=ToyCalcEnv.stop)
    for engine, kind in ((hf, "transformers"), (vllm, "vllm")):
        check(run_all(runner, engine, prompts, cfg), prompts, model, kind, temperature=0.7)


@pytest.fixture(scope="module")
def perturbed(smollm2, tmp_path_factory):
    from tools.tiny_model import perturb_weights

    return perturb_weights(
        smollm2, tmp_path_factory.mktemp("smollm2-perturbed") / "model", scale=0.02, seed=1
    )


@pytest.fixture(scope="module")
def adapter(smollm2, tmp_path_factory):
    from tools.tiny_model import random_adapter

    return random_adapter(
        smollm2, tmp_path_factory.mktemp("smollm2-adapter") / "adapter", seed=2, rank=8, scale=0.05
    )


def merged(base, adapter_dir, tmp_path):
    """The base with the adapter merged, saved as a plain folder: the reference of an adapter swap."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter_dir
    )
    out = tmp_path / "merged"
    model.merge_and_unload().save_pretrained(out)
    return out


def test_full_weights_then_an_adapter_swap_in_place(hf, vllm, runner, prompts, smollm2, perturbed, adapter,
                                                    float64, tmp_path):  # fmt: skip
    prompts = prompts[:2]  # two prompts: each swap is then checked in a few float64 passes
    # Full weights: both engines now decode the perturbed model (its float64 log-probs, its greedy
    # tokens), and no longer the model they started with.
    for engine, kind in ((hf, "transformers"), (vllm, "vllm")):
        runner.run(engine.load_weights(perturbed))
        gens = run_all(runner, engine, prompts, GREEDY)
        check(gens, prompts, float64(perturbed), kind)
        assert logprob_error(gens, prompts, float64(smollm2)) > 100 * LOGPROB_TOL[kind]
    # A LoRA adapter of the original base. An adapter sits on the weights an engine holds, so each
    # goes back to the base (a full swap again), then takes the adapter: base + adapter, merged.
    reference = float64(merged(smollm2, adapter, tmp_path))
    for engine, kind in ((hf, "transformers"), (vllm, "vllm")):
        runner.run(engine.load_weights(smollm2))
        runner.run(engine.load_weights(adapter))
        gens = run_all(runner, engine, prompts, GREEDY)
        check(gens, prompts, reference, kind)
        assert logprob_error(gens, prompts, float64(smollm2)) > 100 * LOGPROB_TOL[kind]  # the adapter acts
