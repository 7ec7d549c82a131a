"""Memory settings that must show (GPU tier): on a model whose states and activations dwarf the
allocator's noise, each setting lowers the peak of GPU memory by most of what the model's own sizes
say it should, and leaves the update what it was.

The model is Qwen3's layout with random weights, built here from a config (no hub): 16 layers of
width 1024, about 201 M parameters, so its fp32 states are GiBs (weights 0.8 GiB, AdamW's moments
1.5 GiB) and a micro-batch of 4 of the test trajectories (4 rows x the longest, 540 padded tokens)
keeps about 0.8 GiB of activations. On the tiny model of the other GPU tests the states are
a few MiB beside DeepSpeed's own buffers (a 5e8-element gradient bucket, 1.9 GiB in fp32): on an
H200 the peak with parameter and optimizer offload came out 1.8 MiB above the plain one.

Five runs of one update (one mini-batch of two micro-batches, fp32) through the learner's own
`run_task`, each peak read with torch.cuda.max_memory_allocated after reset_peak_memory_stats and
counted from what was allocated before the run (so whatever an earlier engine left behind counts
in neither):

    optimizer offload    ZeRO 2 plain               -> ZeRO 2, offload_optimizer
    checkpointing        ZeRO 2, offload_optimizer  -> the same with gradient_checkpointing
    parameter offload    ZeRO 3, offload_optimizer  -> the same with offload_params

Optimizer offload shows in the second micro-batch's backward: the plain run holds DeepSpeed's fp32
master partition and the first micro-batch's gradient partition there (4 + 4 B per parameter, the
bytes of AdamW's moments, which appear only at the step), the offloaded run holds neither. Its
expected saving is the moments' 8 B per parameter, whichever phase is the plain run's peak.
Checkpointing is measured with the optimizer offloaded in both runs: on the GPU the step (weights,
master copy, gradients and moments, 20 B per parameter) could be the peak of both runs, hiding the
activations; with the step on the CPU the peak of each run is a backward pass. Parameter offload is
measured against ZeRO 3 with the optimizer offloaded for the same reason (and it is how `spopp
learner plan` offers it: optimizer+params).

Expected savings come from services/learner/memory_plan.py, which `spopp learner plan` prints: the fp32
moments (8 B per parameter) for the optimizer, the fp32 weights (4 B per parameter) for the
parameters, and the activation formula's difference with and without checkpointing. Each must show
at least `MOST` of its expected size (see there).

Each update is compared with the plain run of its pair rather than with the CPU reference: at this
size the CPU reference would take minutes on one thread (make sets OMP_NUM_THREADS=1), and the pair
isolates what the setting changes. The tiny-model tests beside this one hold the plain CUDA update to the reference. What
differs within a pair, and the bounds that follow, are written at GRAD_RTOL and STEP_RTOL.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
from learner_worker import dist_env_restored, make_batch, run_task

from services.learner import memory_plan

pytestmark = [
    pytest.mark.process,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU tier needs a CUDA GPU"),
]

SHAPE = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 64,
}  # fmt: skip
LAYERS = SHAPE["num_hidden_layers"]
EPS = torch.finfo(torch.float32).eps  # 2^-23: fp32's spacing at 1, twice its unit roundoff

# One update of B = 8 as one mini-batch of two micro-batches of 4 (the second backward adds to the
# first's gradients, which is where optimizer offload shows) and one AdamW step. The optimizer
# settings are the CPU equality tests' (tests/learner/test_learner_update.py); clipping binds.
CFG = {
    "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "adam_eps": 1e-6, "grad_clip": 0.3,
    "dual_clip": 2.0, "seed": 0, "batch_size": 8, "mini_batches": 1, "micro_batch_size": 4,
}  # fmt: skip

# A saving must reach 3/4 of what the sizes predict. The activation formula was checked against what
# autograd keeps to within 10% (tests/learner/test_learner_memory_plan.py); the rest is room for what the formula
# leaves out on CUDA (kernels' workspaces, the allocator's 512-byte rounding, a parameter's gradient
# in flight to the CPU, ZeRO 3's gathered working set). A setting that does not act saves ~0.
MOST = 0.75

# Gradients, whole model, setting against its plain run. Both runs execute the same CUDA kernels on
# bit-equal inputs (weights from the same file; an offloaded parameter is copied back exactly; a
# checkpointed layer recomputes the very same forward) and add the two micro-batches' gradients
# with one fp32 addition per element (correctly rounded on the CPU as on the GPU), so they agree bit
# for bit unless a kernel adds in a nondeterministic order. The fixture `deterministic` asks torch for its deterministic
# kernels; where one has none, the candidate on this path is sdpa's memory-efficient backward,
# which adds dQ's partial sums over key blocks (at most ceil(135 / 64) = 3 for these rows)
# atomically: at most 2 roundings, 2 EPS of each element, and up to 4x that relative to dQ itself
# where the partials cancel. Each of the LAYERS layers adds such a perturbation, which the backward
# carries to every gradient below it through the residual stream at about its own relative size:
# 8 * LAYERS * EPS = 1.5e-5. A wrong gradient (a factor, a stale or a missing micro-batch) is off
# by 1e-2 or more.
GRAD_RTOL = 8 * LAYERS * EPS
# The parameter change, per tensor. On top of the gradients' error, which AdamW's first step passes
# on at most at its own relative size (u = g / (|g| + eps) moves by du/u = dg/g * eps / (|g| + eps)),
# the step itself: the offloaded optimizer does the same fp32 arithmetic on the CPU (torch's
# single-tensor AdamW) as the GPU does with its own kernels (torch's foreach AdamW), about 8
# correctly rounded operations per element on each side, so up to 16 roundings apart; and each run
# rounds the new weight twice (the decay product and the step), 2 units in the last place of the
# weight apart: 2 EPS |w|. A tensor left unchanged or stepped twice is off by 100% of its change.
STEP_RTOL = GRAD_RTOL + 16 * EPS

_dist_env = pytest.fixture(scope="module", autouse=True)(dist_env_restored)


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    """torch's deterministic kernels where it has them (sdpa's backward among them), for this module
    only. warn_only: an op without one warns instead of failing, and GRAD_RTOL covers it. torch's
    NaN-filling of uninitialized memory stays off: DeepSpeed's gradient buckets are torch.empty."""
    import torch.utils.deterministic

    was, fill = (
        torch.are_deterministic_algorithms_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn)
    torch.utils.deterministic.fill_uninitialized_memory = fill


@pytest.fixture(scope="module")
def big_model(tiny_model, tmp_path_factory):
    """SHAPE with random weights and the tiny model's tokenizer (so make_batch's chats are its
    tokens), written as a Hugging Face folder."""
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out = tmp_path_factory.mktemp("memory-model") / "model"
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tiny = AutoConfig.from_pretrained(tiny_model)
    config = Qwen3Config(
        vocab_size=len(tok), max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id, dtype="float32", **SHAPE,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def shape(big_model) -> memory_plan.ModelShape:
    return memory_plan.model_shape(memory_plan.read_config(big_model))


@pytest.fixture(scope="module")
def batch(tiny_model):
    """The CPU tests' batch (8 tool-use chats, 69-135 tokens): the tiny model's tokens, which are
    the big model's too; their rollout log-probs are the tiny model's, as good as any for memory.
    Shortest first, so the second micro-batch, the one that meets the first's gradients, is also
    the one with the most activations: every saving shows in the same backward."""
    trajs, adv = make_batch(tiny_model, n=8, seed=0)
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))
    return [trajs[i] for i in order], [adv[i] for i in order]


@pytest.fixture(scope="module")
def initial(big_model) -> dict:
    from safetensors.torch import load_file

    return load_file(big_model / "model.safetensors")


@pytest.fixture(scope="module")
def measured(big_model, batch):
    """name -> (run_task's result, peak bytes above what was allocated before), each run once."""
    runs = {
        "plain-z2": {"zero_stage": 2},
        "offload-z2": {"zero_stage": 2, "offload_optimizer": True},
        "offload-ckpt-z2": {"zero_stage": 2, "offload_optimizer": True, "gradient_checkpointing": True},
        "offload-z3": {"zero_stage": 3, "offload_optimizer": True},
        "offload-params-z3": {"zero_stage": 3, "offload_optimizer": True, "offload_params": True},
    }
    done: dict[str, tuple[dict, int]] = {}

    def measure(name: str) -> tuple[dict, int]:
        if name not in done:
            trajs, adv = batch
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            result = run_task(big_model, trajs, adv, {"cfg": {**CFG, **runs[name]}, "grads": True})
            torch.cuda.synchronize()
            done[name] = result, torch.cuda.max_memory_allocated() - before
        return done[name]

    return measure


def padded_tokens(batch) -> int:
    """Tokens of the largest micro-batch, padding included (rows x the longest: what activations
    scale with), as the learner cuts them by count: consecutive chunks of micro_batch_size."""
    trajs, _ = batch
    m = CFG["micro_batch_size"]
    chunks = [trajs[i : i + m] for i in range(0, len(trajs), m)]
    return max(len(c) * max(len(t.token_ids) for t in c) for c in chunks)


def _norm(t: torch.Tensor) -> float:
    return float(t.double().norm())


def check_same_update(got: dict, base: dict, initial: dict) -> tuple[float, float]:
    """`got`'s update is `base`'s within GRAD_RTOL and STEP_RTOL; answers the whole model's relative
    error of the gradient and of the parameter change."""
    assert len(got["grads"]) == len(base["grads"]) == 1  # one optimizer step each (of two micro-batches)
    g, b = got["grads"][0], base["grads"][0]
    assert set(g) == set(b)
    grad_err = math.sqrt(sum(_norm(g[n] - b[n]) ** 2 for n in b) / sum(_norm(b[n]) ** 2 for n in b))
    assert grad_err <= GRAD_RTOL
    num = den = 0.0
    for name, w0 in initial.items():
        mine, theirs = got["state"][name] - w0, base["state"][name] - w0
        err, size = _norm(mine - theirs), _norm(theirs)
        assert size > 0, f"{name} did not move in the plain run"
        assert err <= STEP_RTOL * size + 2 * EPS * _norm(w0), name
        num, den = num + err**2, den + size**2
    s, r = got["stats"], base["stats"]
    assert s["tokens"] == r["tokens"]
    assert s["loss"] == pytest.approx(r["loss"], rel=GRAD_RTOL, abs=1e-7)
    # The clipping norm: the gradients' own error, plus two fp32 norms over ~2e8 elements summed in
    # different orders (GPU tree, CPU cascade), each within log2(n) roundings of the exact value.
    n = sum(t.numel() for t in initial.values())
    assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=GRAD_RTOL + 2 * math.log2(n) * EPS)
    return grad_err, math.sqrt(num / den)


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f} MiB"


def _report(gpu_report, what: str, peaks: tuple[int, int], expected: float, why: str, errs) -> float:
    saved = peaks[0] - peaks[1]
    gpu_report.append(
        f"memory, {what}: peak {_mib(peaks[0])} -> {_mib(peaks[1])}, lower by {_mib(saved)}; expected "
        f"{_mib(expected)} ({why}), asked at least {MOST:.0%} of it; update off its plain run by "
        f"{errs[0]:.1e} (gradient) and {errs[1]:.1e} (change), bounds {GRAD_RTOL:.1e} and {STEP_RTOL:.1e}"
    )
    print(gpu_report[-1])
    return saved


def test_optimizer_offload_lowers_the_peak_by_the_optimizer_states(measured, shape, initial, gpu_report):
    (plain, p0), (off, p1) = measured("plain-z2"), measured("offload-z2")
    assert off["memory"]["offload_optimizer"] and not plain["memory"]["offload_optimizer"]
    errs = check_same_update(off, plain, initial)
    # plan's fp32 table: AdamW's two moments, 8 B per parameter, go to the CPU. In the backward the
    # same 8 B show as DeepSpeed's fp32 master and gradient partitions, which go with them.
    on_gpu = lambda offload: memory_plan.state_bytes(shape, 1, 2, "fp32", offload, False)["optimizer"]  # noqa: E731
    expected = on_gpu(False) - on_gpu(True)
    assert expected == 8 * shape.params
    why = f"the fp32 moments, 8 B x {shape.params / 1e6:.1f} M parameters"
    saved = _report(gpu_report, "optimizer offload (ZeRO 2)", (p0, p1), expected, why, errs)
    assert saved >= MOST * expected


def test_checkpointing_lowers_the_peak_by_the_activations_it_drops(
    measured, shape, batch, initial, gpu_report
):
    (plain, p0), (ckpt, p1) = measured("offload-z2"), measured("offload-ckpt-z2")
    assert ckpt["memory"]["checkpointing"] and not plain["memory"]["checkpointing"]
    errs = check_same_update(ckpt, plain, initial)
    tokens = padded_tokens(batch)
    act = lambda on: memory_plan.activation_bytes(shape, tokens, "fp32", checkpointing=on)["peak"]  # noqa: E731
    expected = act(False) - act(True)
    why = (
        f"plan's fp32 activations of {tokens} padded tokens, {_mib(act(False))} without, {_mib(act(True))} "
        f"with checkpointing"
    )
    saved = _report(
        gpu_report, "gradient checkpointing (ZeRO 2, optimizer offloaded)", (p0, p1), expected, why, errs
    )
    assert saved >= MOST * expected


def test_parameter_offload_lowers_the_peak_by_the_parameters(measured, shape, initial, gpu_report):
    (plain, p0), (off, p1) = measured("offload-z3"), measured("offload-params-z3")
    assert off["memory"]["offload_params"] and not plain["memory"]["offload_params"]
    errs = check_same_update(off, plain, initial)
    # plan's fp32 table under ZeRO 3 on one GPU: the weights' partition, 4 B per parameter, goes to
    # the CPU; the layer being gathered (4 B x the largest layer) is on the GPU either way.
    weights = lambda offload: memory_plan.state_bytes(shape, 1, 3, "fp32", True, offload)["weights"]  # noqa: E731
    expected = weights(False) - weights(True)
    assert expected == 4 * shape.params
    why = f"the fp32 weights, 4 B x {shape.params / 1e6:.1f} M parameters"
    saved = _report(
        gpu_report, "parameter offload (ZeRO 3, optimizer offloaded)", (p0, p1), expected, why, errs
    )
    assert saved >= MOST * expected
