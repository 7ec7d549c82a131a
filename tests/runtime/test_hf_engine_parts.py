"""The transformers engine's parts, each alone (runtime/engines/hf/): the sampler against a direct
float64 computation, one sequence's stop rules, the KV-cached batch against plain forward passes,
the scheduler's admission and retirement, and the two weight loaders' round trips and refusals.
The engine they compose is held to the engine contract in tests/runtime/test_engines.py.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest
import torch

from runtime.engines.base import SamplingConfig
from runtime.engines.hf import batch as kv
from runtime.engines.hf.loaders import WeightLoader, full_weights
from runtime.engines.hf.sampler import Sampler, top_k_top_p
from runtime.engines.hf.scheduler import Scheduler
from runtime.engines.hf.sequence import Request, Row
from tools.tiny_model import random_adapter

CPU = torch.device("cpu")
# float32 log-softmax against float64 over V = 397 logits of magnitude <= 10: the log-sum-exp's sum
# of V terms errs by at most V * u = 397 * 6e-8 = 2.4e-5 relative in the worst case (u: float32's
# unit roundoff), sqrt(V) * u = 1.2e-6 typically, and the subtraction adds about u * 10 = 6e-7.
# 1e-5 sits between typical and worst case; a wrong temperature or mask is off by > 1e-2. It does
# not depend on the CPU's vector width (checked under ATEN_CPU_CAPABILITY=default and avx2).
LOGP_TOL = 1e-5
# One row's logits in a padded, cached, merged or trimmed batch against the same row alone: both
# float32, the same products summed in another order. The tiny model's reductions are K <= 256 terms
# (hidden 128, MLP 256) over 2 layers; a reordered sum of K terms of magnitude ~10 differs by at most
# K * u * 10 = 1.5e-4 per reduction, typically sqrt(K) * u * 10 = 1e-5. 1e-4 is between; a wrong
# cache position or mask moves logits by > 1e-1.
LOGIT_TOL = 1e-4


def greedy(max_tokens=8, **kw):
    return SamplingConfig(max_tokens=max_tokens, temperature=0.0, **kw)


def random_logits(rows, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def keep_set(logits, top_k, top_p):
    """The tokens top-k/top-p keeps, found apart from the code under test: the k largest, and the
    most likely tokens while the probability above them is still short of p."""
    keep = set(range(len(logits)))
    if 0 < top_k < len(logits):
        keep &= set(logits.topk(top_k).indices.tolist())
    if top_p < 1.0:
        probs = torch.softmax(logits.double(), -1)
        order = probs.argsort(descending=True).tolist()
        above = 0.0
        kept = set()
        for t in order:
            if above >= top_p:
                break
            kept.add(t)
            above += float(probs[t])
        keep &= kept
    return keep


# -- sampler -------------------------------------------------------------------------------------


def test_greedy_picks_the_argmax_reports_t1_logprobs_and_draws_nothing():
    logits = random_logits(4)
    # top-k and top-p do not apply to greedy rows: their log-probs stay those of the full softmax.
    samplings = [greedy(), greedy(top_k=3), greedy(top_p=0.5), greedy(top_k=2, top_p=0.3)]
    gen = torch.Generator().manual_seed(1)
    before = gen.get_state()
    chosen, picked = Sampler(CPU).sample(logits, samplings, [gen] * 4)
    assert chosen.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(4), chosen]
    assert torch.allclose(picked.double(), expected, atol=LOGP_TOL, rtol=0)
    assert torch.equal(gen.get_state(), before)  # a shared stream is not advanced by greedy rows


def test_sampled_logprobs_are_under_the_tempered_distribution():
    logits = random_logits(3, seed=1)
    temps = [0.5, 1.0, 1.7]
    samplings = [SamplingConfig(max_tokens=1, temperature=t, seed=k) for k, t in enumerate(temps)]
    sampler = Sampler(CPU)
    chosen, picked = sampler.sample(logits, samplings, [sampler.generator(s) for s in samplings])
    for k, t in enumerate(temps):
        expected = torch.log_softmax(logits[k].double() / t, -1)[chosen[k]]
        assert abs(float(picked[k]) - float(expected)) < LOGP_TOL, (t, float(picked[k]), float(expected))


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (-1, 0.7), (8, 0.6), (1, 1.0)])
def test_top_k_top_p_draw_only_from_the_kept_set_and_renormalize(top_k, top_p):
    logits = random_logits(1, seed=2)
    keep = sorted(keep_set(logits[0], top_k, top_p))
    assert 0 < len(keep) < logits.shape[1]  # the case masks something
    s = SamplingConfig(max_tokens=1, temperature=1.0, top_k=top_k, top_p=top_p)
    gen = torch.Generator().manual_seed(3)
    renormalized = torch.log_softmax(logits[0, keep].double(), -1)
    seen = set()
    for _ in range(200):
        chosen, picked = Sampler(CPU).sample(logits, [s], [gen])
        token = int(chosen[0])
        assert token in keep
        assert abs(float(picked[0]) - float(renormalized[keep.index(token)])) < LOGP_TOL
        seen.add(token)
    assert len(keep) == 1 or len(seen) > 1  # drawn, not always the argmax


def test_top_k_keeps_ties_at_the_kth_and_top_p_keeps_at_least_one():
    row = torch.tensor([3.0, 1.0, 3.0, 3.0, 0.0])
    assert torch.isfinite(top_k_top_p(row, 2, 1.0)).tolist() == [True, False, True, True, False]
    assert torch.isfinite(top_k_top_p(torch.tensor([5.0, 1.0, 0.0]), -1, 1e-9)).tolist() == [
        True,
        False,
        False,
    ]


def test_draw_frequencies_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    s = SamplingConfig(max_tokens=1, temperature=0.8)
    n = 20_000
    gen = torch.Generator().manual_seed(4)
    draws, _ = Sampler(CPU).sample(logits.expand(n, -1), [s] * n, [gen] * n)
    freq = torch.bincount(draws, minlength=6).double() / n
    probs = torch.softmax(logits[0].double() / 0.8, -1)
    # One binomial s.d. is at most sqrt(0.25 / n) = 0.0035; 0.015 is over 4 s.d., while T = 1
    # instead of 0.8 would move the top token's share by 0.05.
    assert (freq - probs).abs().max() < 0.015, (freq, probs)


def test_a_seeded_request_draws_the_same_tokens_in_any_sampler():
    logits = random_logits(1, vocab=300, seed=5)  # flat enough that two streams seldom agree

    def draws(sampler, sampling, n=30):
        gen = sampler.generator(sampling)
        return [int(sampler.sample(logits, [sampling], [gen])[0][0]) for _ in range(n)]

    seeded = SamplingConfig(max_tokens=1, temperature=1.0, seed=7)
    a, b = Sampler(CPU), Sampler(CPU)  # their shared streams start from different random seeds
    assert draws(a, seeded) == draws(b, seeded)
    assert draws(a, seeded) != draws(a, SamplingConfig(max_tokens=1, temperature=1.0, seed=8))
    unseeded = SamplingConfig(max_tokens=1, temperature=1.0)
    assert a.generator(unseeded) is a.shared
    a.shared.manual_seed(9)
    first = draws(a, unseeded)
    a.shared.manual_seed(9)
    assert draws(a, unseeded) == first


# -- one sequence: its tokens and when it stops ------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def row_for(sampling, stop_ids=frozenset()):
    # A row reads only its request's sampling and submission time: no caller is waiting here.
    request = Request([1, 2], sampling, future=None, loop=None, submitted=0.0)
    return Row(request, None, frozenset(stop_ids), sampling.max_tokens, admitted=0.0)


def test_a_stop_token_ends_the_row_and_stays_in_it(tokenizer):
    row = row_for(greedy(max_tokens=5), stop_ids={2})
    for token in (67, 68, 2):
        assert row.finish_reason is None
        row.append(token, -0.5, tokenizer)
    assert row.finish_reason == "stop" and row.token_ids == [67, 68, 2] and row.logprobs == [-0.5] * 3


def test_the_last_allowed_token_ends_the_row_as_length_unless_it_is_a_stop(tokenizer):
    row = row_for(greedy(max_tokens=3), stop_ids={2})
    for token in (67, 68, 90):
        row.append(token, 0.0, tokenizer)
    assert row.finish_reason == "length"
    row = row_for(greedy(max_tokens=3), stop_ids={2})
    for token in (67, 68, 2):
        row.append(token, 0.0, tokenizer)
    assert row.finish_reason == "stop"


def test_a_stop_string_ends_the_row_and_cuts_the_text_after_it(tokenizer):
    ids = tokenizer.encode("ab = 19 x", add_special_tokens=False)
    row = row_for(greedy(max_tokens=20, stop=("= 1", "zz")))
    for token in ids:
        row.append(token, 0.0, tokenizer)
        if row.finish_reason:
            break
    assert row.finish_reason == "stop"
    assert tokenizer.decode(row.token_ids) == "ab = 1"  # ends at the token completing "= 1"
    row.batch_rows = 3 * len(row.token_ids)
    g = row.generation(tokenizer, now=2.0)
    assert g.text == "ab = 1" and g.token_ids == row.token_ids and g.timings["batch_size"] == 3.0
    plain = row_for(greedy(max_tokens=3))
    for token in ids[:3]:
        plain.append(token, 0.0, tokenizer)
    assert plain.generation(tokenizer, now=1.0).text == "ab =" and plain.finish_reason == "length"


# -- the KV-cached batch ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def alone(model, ids):
    """Next-token logits of `ids` in one plain forward pass, no cache, no padding."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def check_rows(model, batch, tokens, logits):
    assert batch.mask.shape[0] == len(batch.rows) == logits.shape[0]
    for k, name in enumerate(batch.rows):
        assert torch.allclose(logits[k], alone(model, tokens[name]), atol=LOGIT_TOL, rtol=0), name
    # The cache holds one column per mask column; each row's real tokens are its mask's ones.
    assert all(layer.keys.shape[2] == batch.mask.shape[1] for layer in batch.cache.layers)
    assert batch.mask.sum(-1).tolist() == [len(tokens[name]) for name in batch.rows]


def advance(batch, tokens, logits):
    """Feed each row its argmax, as the scheduler feeds the sampled token."""
    batch.next_ids = logits.argmax(-1)
    for k, name in enumerate(batch.rows):
        tokens[name].append(int(batch.next_ids[k]))


def test_prefill_step_merge_and_trim_compute_what_each_row_would_alone(model):
    assert kv.merges_rows(model)
    tokens = {
        "a": [5, 9, 14, 3, 7, 7, 21, 30],
        "b": [40, 41],
        "c": [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70],
    }
    with torch.inference_mode():
        cache, mask, logits = kv.prefill(model, [tokens["a"], tokens["b"]], pad_id=0, device=CPU)
        batch = kv.Batch(["a", "b"], cache, mask, None)
        check_rows(model, batch, tokens, logits)
        advance(batch, tokens, logits)
        for _ in range(2):
            logits = kv.step(model, batch)
            check_rows(model, batch, tokens, logits)
            advance(batch, tokens, logits)
        # "c" is wider than the running rows: they are padded on the left to join it.
        cache, mask, logits = kv.prefill(model, [tokens["c"]], pad_id=0, device=CPU)
        joined = kv.Batch(["c"], cache, mask, None)
        advance(joined, tokens, logits)
        batch = kv.merge(batch, joined)
        assert batch.rows == ["a", "b", "c"] and batch.next_ids.tolist() == [t[-1] for t in tokens.values()]
        logits = kv.step(model, batch)
        check_rows(model, batch, tokens, logits)
        advance(batch, tokens, logits)
        # Without "c" (the widest), the columns only it used go.
        kv.keep_rows(batch, [0, 1])
        assert batch.rows == ["a", "b"] and bool(batch.mask[:, 0].any())
        assert batch.mask.shape[1] == len(tokens["a"]) - 1  # the newest token is not in the cache yet
        logits = kv.step(model, batch)
        check_rows(model, batch, tokens, logits)


# -- the scheduler -----------------------------------------------------------------------------


def make_scheduler(model, tokenizer, **kw):
    # No end-of-sequence ids: every row runs to its max_tokens, so lengths are known in advance.
    options = dict(max_batch=8, batch_window_s=0.0, max_len=1024, eos_ids=frozenset(), pad_id=0, device=CPU)
    return Scheduler(model, tokenizer, Sampler(CPU), **{**options, **kw})


def shut(scheduler):
    scheduler.close()
    scheduler.join()


async def ask(scheduler, prompt, sampling):
    loop = asyncio.get_running_loop()
    request = Request(prompt, sampling, loop.create_future(), loop)
    scheduler.submit(request)
    return await request.future


async def until(predicate, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_admission_keeps_to_max_batch_and_every_row_runs_its_length(model, tokenizer):
    s = make_scheduler(model, tokenizer, max_batch=2, batch_window_s=0.05)
    lengths = [3, 5, 7, 4, 6]

    async def scenario():
        return await asyncio.gather(*(ask(s, [10 + i, 20, 30], greedy(n)) for i, n in enumerate(lengths)))

    try:
        gens = asyncio.run(scenario())
    finally:
        shut(s)
    assert [len(g.token_ids) for g in gens] == lengths and {g.finish_reason for g in gens} == {"length"}
    # Mean rows per forward pass: two at most, and two for the first pair admitted together.
    assert max(g.timings["batch_size"] for g in gens) == 2.0


def test_a_request_nobody_waits_for_is_never_admitted(model, tokenizer):
    s = make_scheduler(model, tokenizer, batch_window_s=0.05)

    async def scenario():
        loop = asyncio.get_running_loop()
        gone = Request([7, 8, 9], greedy(50), loop.create_future(), loop)
        gone.future.cancel()
        s.submit(gone)
        g = await ask(s, [7, 8, 9], greedy(4))
        await until(lambda: not s.serving)
        return g

    try:
        g = asyncio.run(scenario())
    finally:
        shut(s)
    assert len(g.token_ids) == 4 and g.timings["batch_size"] == 1.0  # it ran alone


def test_retire_hands_back_finished_rows_drops_abandoned_ones_and_trims(model, tokenizer):
    s = make_scheduler(model, tokenizer)
    loop = asyncio.new_event_loop()
    try:
        prompts = {"long": list(range(3, 15)), "short": [40, 41, 42], "mid": [50, 51, 52, 53, 54, 55]}
        requests = {k: Request(p, greedy(10), loop.create_future(), loop) for k, p in prompts.items()}
        with torch.inference_mode():
            batch = s._prefill(list(requests.values()), batch_rows=3)
        batch.rows[0].finish_reason = "stop"  # "long" ends here
        requests["mid"].future.cancel()  # its caller went away
        kept = s._retire(batch)
        loop.run_until_complete(asyncio.sleep(0))  # the hand-back is scheduled on the loop
        assert [r.request for r in kept.rows] == [requests["short"]] and not requests["short"].future.done()
        # Only "short"'s columns are left.
        assert kept.mask.shape == (1, len(prompts["short"])) and bool(kept.mask.all())
        assert len(requests["long"].future.result().token_ids) == 1
        kept.rows[0].finish_reason = "length"
        assert s._retire(kept) is None
        loop.run_until_complete(asyncio.sleep(0))
        assert requests["short"].future.result().finish_reason == "length"
    finally:
        loop.close()
        shut(s)


def test_a_failed_forward_pass_fails_its_rows_and_the_next_requests_start_afresh(model, tokenizer):
    class FailsOnce:
        """The model, but its second forward pass (the first decode step) raises."""

        def __init__(self, model):
            self.model, self.config, self.calls = model, model.config, 0

        def __call__(self, **kw):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("boom")
            return self.model(**kw)

    s = make_scheduler(FailsOnce(model), tokenizer, batch_window_s=0.05)

    async def scenario():
        failed = await asyncio.gather(
            *(ask(s, [5, 6, 7], greedy(5)) for _ in range(2)), return_exceptions=True
        )
        return failed, await ask(s, [5, 6, 7], greedy(5))

    try:
        failed, after = asyncio.run(scenario())
    finally:
        shut(s)
    assert [str(e) for e in failed] == ["boom", "boom"]
    assert len(after.token_ids) == 5


@pytest.mark.parametrize("merges", [True, False])
def test_a_late_request_joins_the_running_batch_only_where_caches_merge(model, tokenizer, merges):
    s = make_scheduler(model, tokenizer)
    s.merges_rows = merges
    done = []

    async def one(name, prompt, sampling):
        g = await ask(s, prompt, sampling)
        done.append(name)
        return g

    async def scenario():
        long = asyncio.create_task(one("long", [3, 4, 5, 6], greedy(300)))
        await until(lambda: s.decoding)
        assert not long.done()
        short = await one("short", [9, 9], greedy(2))
        return await long, short

    try:
        long, short = asyncio.run(scenario())
    finally:
        shut(s)
    assert len(long.token_ids) == 300
    if merges:
        assert done == ["short", "long"] and short.timings["batch_size"] == 2.0
    else:  # it waits for the running batch to empty
        assert done == ["long", "short"] and short.timings["batch_size"] == 1.0


def test_a_swap_runs_with_no_row_running(model, tokenizer):
    s = make_scheduler(model, tokenizer)
    seen = []

    async def scenario():
        long = asyncio.create_task(ask(s, [3, 4, 5], greedy(200)))
        await until(lambda: s.decoding)
        await asyncio.to_thread(s.swap_in, lambda: seen.append((s.serving, s.swapping)))
        return await long

    try:
        long = asyncio.run(scenario())
    finally:
        shut(s)
    assert seen == [(False, True)]  # the running row had finished; the swap was registered
    assert len(long.token_ids) == 200  # and it ran to its end first


# -- weight loaders ----------------------------------------------------------------------------


def fresh_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def file_state(folder):
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def holds(model, state):
    params = dict(model.named_parameters(remove_duplicate=False))
    return all(torch.equal(params[name], tensor) for name, tensor in state.items())


def test_full_weights_round_trip_in_place(tiny_model, perturbed_model):
    model, loader = fresh_model(tiny_model), WeightLoader()
    objects = {n: p for n, p in model.named_parameters()}
    original, perturbed = file_state(tiny_model), file_state(perturbed_model)
    assert not holds(model, perturbed)
    with torch.no_grad():
        loader.prepare(model, perturbed_model)()
        assert holds(model, perturbed)
        loader.prepare(model, tiny_model)()
    assert holds(model, original)
    assert all(p is objects[n] for n, p in model.named_parameters())  # copied in place


def test_full_weights_that_do_not_fit_are_refused_before_any_copy(tiny_model, tmp_path):
    from safetensors.torch import save_file

    model = fresh_model(tiny_model)
    original = file_state(tiny_model)
    name = "model.layers.0.self_attn.q_proj.weight"
    cases = {
        "missing": {k: v for k, v in original.items() if k != name},
        "shape": {**original, name: original[name][:-1]},
        "unknown": {**original, "model.extra.weight": original[name].clone()},
    }
    for case, state in cases.items():
        folder = tmp_path / case
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in state.items()}, folder / "model.safetensors")
        with pytest.raises(ValueError, match=f"{case}=\\['"):
            full_weights(model, folder)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        full_weights(model, tmp_path / "missing" / "nothing-here")
    assert holds(model, original)


def test_a_tied_weight_may_come_under_either_name(tiny_model, perturbed_model, tmp_path):
    from safetensors.torch import save_file

    state = file_state(perturbed_model)
    state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    save_file(state, tmp_path / "model.safetensors")
    model = fresh_model(tiny_model)
    with torch.no_grad():
        full_weights(model, tmp_path)()
    assert torch.equal(model.model.embed_tokens.weight, state["lm_head.weight"])
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    targets = ["q_proj", "v_proj"]
    return {
        "v1": random_adapter(tiny_model, root / "v1", seed=1, rank=4, alpha=8.0, targets=targets, scale=0.2),
        "v2": random_adapter(tiny_model, root / "v2", seed=2, rank=4, alpha=8.0, targets=targets, scale=0.2),
        "rank8": random_adapter(
            tiny_model, root / "r8", seed=3, rank=8, alpha=8.0, targets=targets, scale=0.2
        ),
    }


def holds_adapter(model, folder):
    from safetensors.torch import load_file

    from spopp.files.adapters import adapter_targets

    tensors = load_file(folder / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    return all(
        torch.equal(params[target], tensors[name]) for name, target in adapter_targets(tensors).items()
    )


def test_adapters_round_trip_in_place_on_an_untouched_base(tiny_model, perturbed_model, adapters):
    model, loader = fresh_model(tiny_model), WeightLoader()
    base_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone()
    with torch.no_grad():
        loader.prepare(model, adapters["v1"])()
    assert loader.lora == (4, 8.0, ("q_proj", "v_proj"), False)
    assert holds_adapter(model, adapters["v1"])
    objects = dict(model.named_parameters())
    copy_v2 = loader.prepare(model, adapters["v2"])
    assert holds_adapter(model, adapters["v1"])  # prepared, not yet copied: nothing changed
    with torch.no_grad():
        copy_v2()
        assert holds_adapter(model, adapters["v2"])
        loader.prepare(model, adapters["v1"])()
    assert holds_adapter(model, adapters["v1"])
    assert all(p is objects[n] for n, p in model.named_parameters())
    assert torch.equal(model.model.layers[0].self_attn.q_proj.base_layer.weight, base_q)
    # Another layout, or full weights, would change what the run's adapters mean: refused.
    with pytest.raises(ValueError, match="share a layout"):
        loader.prepare(model, adapters["rank8"])
    with pytest.raises(ValueError, match="holds full weights"):
        loader.prepare(model, perturbed_model)
    assert holds_adapter(model, adapters["v1"])


def test_an_adapter_for_other_modules_is_refused_before_injection(tiny_model, adapters, tmp_path):
    shutil.copytree(adapters["v1"], tmp_path / "a")
    config_file = tmp_path / "a" / "adapter_config.json"
    config_file.write_text(config_file.read_text().replace('"q_proj"', '"k_proj"'))
    model, loader = fresh_model(tiny_model), WeightLoader()
    names = {n for n, _ in model.named_parameters()}
    with pytest.raises(ValueError):
        loader.prepare(model, tmp_path / "a")
    assert loader.lora is None and {n for n, _ in model.named_parameters()} == names
