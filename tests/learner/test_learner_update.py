"""run_update against a plain PyTorch reference, for ZeRO 0/1/2/3, one and two processes, micro-batches.

The reference is written out here without the learner's code: one unpadded forward per
trajectory, the whole mini-batch's tokens in a single policy_loss call (token_count = its own
mask sum), loss.backward(), clip_grad_norm_, torch AdamW. run_update must reproduce its gradient
before every optimizer step, its pre-clip gradient norm, its statistics and the parameters after
the update, within the rounding noise of fp32 arithmetic.

How close is close enough is not guessed: it is measured on the machine running the test, with the
kernels it runs (see `bounded_reference` and `check_against_reference`). The reference runs once in
float64 (all but RMSNorm's normalisation and the rotary tables, which transformers computes in fp32
whatever the model's dtype: so it is the truth up to those few fp32 roundings, which the fp32 runs
contain too; the GPU tier measured what they leave, 1.7e-6 between a CPU and a GPU float64 run's
gradients), and twice in fp32 with its reductions in different orders. The distance of each fp32 run from the float64 one is
the fp32 noise of this very computation on these kernels (AVX2, AVX-512, the scalar fallback or a
GPU's); the learner, another fp32 evaluation of the same function in yet another order (padded
micro-batches, ZeRO's flat buffers, DeepSpeed's reductions), must be within NOISE_FACTOR times that
noise of the float64 truth. A kernel family with coarser rounding widens both sides alike, which a
fixed relative bound could not follow: 1e-5 held on AVX2 and failed at 1.9e-5 on an AVX-512 EPYC
and at 1.07e-5 on an H200.

Gradients are compared directly because Adam hides their scale: its first update is about
lr * sign(g), so a loss off by a constant factor (e.g. DeepSpeed's averaging over ranks or
accumulation steps left in place) would still move the parameters by nearly the right amount.
With two mini-batches the second step's ratios differ from 1 and the gradient clipping binds at
different norms, so the parameter comparison also covers the old log-probs and the clipping.

The parameter change is checked twice: against AdamW replayed on the gradients DeepSpeed itself
reported (in float64, its noise measured by the same replay in fp32), which isolates clipping and
the optimizer step, and against the independent reference, end to end. Adam's eps is 1e-6 here,
not the default 1e-8: gradient elements of size ~1e-8 (rarely used embedding rows) carry relative
fp32 noise of 1e-2 from the different batching, and with eps = 1e-8 Adam's g / (|g| + eps) would
pass that noise to the update at full size, although the gradients agree to ~1e-6. With eps = 1e-6
such elements move by lr * g / eps, in proportion to their gradient.

bf16 (one process) is compared with the same reference run in DeepSpeed's bf16 semantics (see
reference_update), to tolerances derived from bf16's 8-bit significand; see the bf16 section.
"""

from __future__ import annotations

import math

import pytest
import torch
from learner_worker import dist_env_restored, launch, make_batch, run_task

from spopp.loss import policy_loss

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

# fp32's unit roundoff: storing an exact value in fp32 moves it by at most U relatively.
U = 2.0**-24
# How far the learner may be from the float64 truth, in units of the fp32 reference's own distance
# from it (the largest of its three orders: plain, reversed, batched), per tensor and over the whole
# model. Two fp32 evaluations of one function that differ only in the order of their roundings have
# errors of the same size: over a tensor of n elements each error's norm is a sum of n independent
# roundings, so the ratio of two of them concentrates near 1 as n grows, and taking the largest of
# three orders as the reference's noise guards the small tensors (the norms' 32 to 64 elements),
# where one order can be luckily exact. Measured on the one-process cases of this file and the LoRA
# cases (2-core AMD EPYC, AVX2 and ATEN_CPU_CAPABILITY=default): at most 1.6 (AVX2) and 2.8
# (default) per gradient tensor, 1.35 over the model, 1.6 per tensor end to end, 0.8 for the
# optimizer alone, 0.2 for the statistics. 4 leaves room for kernels not measured here while a
# real error stays far outside: a loss off by one token of 369, or one missing micro-batch, moves
# the gradients by 1e-3 to 1e-1 of their size, hundreds of times the noise (~1e-7 .. 1e-5).
NOISE_FACTOR = 4.0

BASE = {
    "lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "adam_eps": 1e-6, "grad_clip": 0.3, "dual_clip": 2.0,
    "seed": 0,
}  # fmt: skip
# (mini_batches, micro_batch_size) per world size, with B = 8. One process: 8 -> micro-batches of
# 3, 3, 2 (a short last one) and 2 x (2, 2). Two processes: 4 per rank as 2 x 2, and 2 x (1, 1).
SPLITS = {1: [(1, 3), (2, 2)], 2: [(1, 2), (2, 1)]}
# (mini_batches, micro_batch_tokens) per world size. The batch's lengths are 69..135 tokens. One
# process: 250 packs M1 into 5 micro-batches of 1 or 2 (the 135-token one alone), 400 packs each
# M2 half into 2 of 1 to 3. Two processes: 400 gives each rank 2 micro-batches of 1 to 3; 250 at
# M2 packs one rank's share into 1 micro-batch and the other's into 2, so the first splits its own
# to match (test_token_plans_are_what_the_tests_need checks all of this).
TOKEN_SPLITS = {1: [(1, 250), (2, 400)], 2: [(1, 400), (2, 250)]}
STAGES = [0, 1, 2, 3]
# (stage, split) per world size: every stage on 1 and 2 ranks, each split under two stages (the
# full cross would double the time for no path that these leave out).
TOKEN_CASES = {
    w: [(stage, TOKEN_SPLITS[w][(stage + w) % 2]) for stage in STAGES] for w in (1, 2)
}  # fmt: skip


def _cfg(stage: int, mini: int, micro: int) -> dict:
    return {**BASE, "zero_stage": stage, "batch_size": 8, "mini_batches": mini, "micro_batch_size": micro}


def _token_cfg(stage: int, mini: int, tokens: int) -> dict:
    return {**_cfg(stage, mini, 1), "micro_batch_tokens": tokens}


def _ref(references: dict, mini: int) -> dict:
    """The reference of an update with `mini` mini-batches (it has no micro-batches)."""
    return references[next(s for s in SPLITS[1] if s[0] == mini)]


def adamw(params, cfg: dict) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        params, lr=cfg["lr"], betas=cfg["betas"], eps=cfg["adam_eps"], weight_decay=cfg["weight_decay"]
    )


def reference_update(
    model_dir,
    trajs,
    advantages,
    cfg: dict,
    dtype: torch.dtype = torch.float32,
    version: int | None = None,
    lora: dict | None = None,
    *,
    device: str = "cpu",
    order: str = "plain",
) -> dict:
    """The update in plain PyTorch: gradients and pre-clip norms per step, final weights, stats.

    dtype=torch.float64 is the exact reference (weights, activations, log-softmax, loss, optimizer
    all in float64, from the same fp32 initial weights); float32 is the ordinary one.

    dtype=torch.bfloat16 follows DeepSpeed's bf16 mode as ZeRO 1-3 implement it (deepspeed 0.19.8,
    runtime/zero/stage_1_and_2.py and stage3.py, with the learner's config: bf16 enabled and
    data_types.grad_accum_dtype unset, so it defaults to bf16): weights, activations and gradients
    are bf16, and gradients add up over micro-batches in bf16 (here autograd adds the
    trajectories' contributions in bf16); at the step they become fp32, the norm and the clipping
    are fp32, AdamW steps an fp32 master copy of the weights (made from the bf16 weights), and the
    master is rounded back into the bf16 weights. The log-softmax runs in fp32, as in the learner.

    `version`: the policy version trained; tokens an older one generated (token_versions, else the
    trajectory's policy_version) are stale and get cfg's off_policy correction.

    `lora` (rank, alpha, target_modules, seed): a plain PEFT model instead, adapters initialised
    from `seed` in a forked RNG; only the adapters train, and only they are returned.

    `device`: where it runs (a GPU's own reference for its learner). `order`: the same update
    rounded another way: "reversed" takes each mini-batch's trajectories in reverse order (every
    sum over trajectories, the loss's and autograd's accumulation, in another order); "batched"
    runs each mini-batch's forward as one right-padded batch (other matrix shapes, so the kernels
    block and round their dot products otherwise, as the learner's padded micro-batches do).
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    # bf16 is loaded as the learner loads it (its buffers, e.g. the rotary frequencies, stay fp32).
    # float64 is the fp32 model's very function in float64: upcast after loading, so the rotary
    # frequencies are the fp32 ones exactly, not recomputed in float64 (a different function).
    mixed = dtype == torch.bfloat16
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype if mixed else torch.float32)
    if lora is not None:
        model = peft_model(model, lora)
    model = model.to(device=device) if mixed else model.to(device=device, dtype=dtype)
    model.train()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    # fp32 and float64: the optimizer steps the weights themselves. bf16: fp32 master copies of them.
    master = {n: p.detach().float().requires_grad_(True) for n, p in params.items()} if mixed else params
    opt = adamw(master.values(), cfg)
    # The loss's own arithmetic: float64 for the exact reference, fp32 otherwise (the learner's).
    fdt = torch.float64 if dtype == torch.float64 else torch.float32

    def tensor(values, dt=fdt):
        return torch.tensor(values, dtype=dt, device=device)

    def logps(idx: list[int]) -> list[torch.Tensor]:
        """Each trajectory's log-probs of its tokens after the first."""
        if order != "batched":
            out = []
            for i in idx:
                ids = tensor([trajs[i].token_ids], torch.long)
                logits = model(input_ids=ids).logits[0, :-1].to(fdt)
                out.append(torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0])
            return out
        lengths = [len(trajs[i].token_ids) for i in idx]
        ids = torch.zeros(len(idx), max(lengths), dtype=torch.long, device=device)
        att = torch.zeros_like(ids)
        for row, (i, n) in enumerate(zip(idx, lengths, strict=True)):
            ids[row, :n], att[row, :n] = tensor(trajs[i].token_ids, torch.long), 1
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].to(fdt)
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        return [lp[row, : n - 1] for row, n in enumerate(lengths)]

    per = len(trajs) // cfg["mini_batches"]
    parts = [list(range(m * per, (m + 1) * per)) for m in range(cfg["mini_batches"])]
    with torch.no_grad():
        old = {i: x for part in parts for i, x in zip(part, logps(part), strict=True)}
    grads, norms, losses = [], [], []
    sums = {"clip_fraction": 0.0, "approx_kl": 0.0, "is_weight_mean": 0.0, "is_capped_fraction": 0.0}
    stale_sums = {"behaviour_weight_mean": 0.0, "behaviour_cut_fraction": 0.0}
    tokens = stale_tokens = 0.0
    # Every log-prob computed (the old pass, then each mini-batch's), and how much a change of the
    # log-probs moves each statistic (see sensitivities): what bounds the statistics' comparison.
    seen = [torch.cat([old[i] for part in parts for i in part]).detach().double().cpu()]
    sens = {"loss": 0.0, "approx_kl": 0.0, "is_weight_mean": 0.0}

    def stale_of(t):
        versions = t.token_versions or [t.policy_version] * len(t.token_ids)
        return tensor([v < version for v in versions[1:]], torch.bool) if version is not None else None

    for part in parts:
        idx = part[::-1] if order == "reversed" else part
        cat = lambda xs: torch.cat(list(xs))  # noqa: E731
        by_traj = dict(zip(idx, logps(idx), strict=True))
        new = cat(by_traj[i] for i in idx)
        args = (
            new,
            cat(old[i] for i in idx),
            cat(torch.full((len(trajs[i].token_ids) - 1,), float(advantages[i]), dtype=fdt, device=device)
                for i in idx),
            cat(tensor(trajs[i].action_mask[1:], torch.long) for i in idx),
        )  # fmt: skip
        rollout = cat(tensor(trajs[i].rollout_logprobs[1:]) for i in idx)
        loss, st = policy_loss(
            *args,
            rollout_logp=rollout,
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=cfg["dual_clip"],
            is_cap=2.0,
            stale=cat(stale_of(trajs[i]) for i in idx) if version is not None else None,
            off_policy=cfg.get("off_policy", "decoupled"),
            behaviour_cap=cfg.get("behaviour_cap", 2.0),
        )
        seen.append(torch.cat([by_traj[i] for i in part]).detach().double().cpu())  # in one order for all
        for k, v in sensitivities(
            *(x.detach().double().cpu() for x in args), rollout.double().cpu(), cfg
        ).items():
            sens[k] += v / cfg["mini_batches"] if k == "loss" else v * st["tokens"]
        for p in params.values():
            p.grad = None
        loss.backward()
        grads.append({n: p.grad.to(fdt).cpu().clone() for n, p in params.items()})
        if mixed:
            for n, p in params.items():
                master[n].grad = p.grad.float()
        norms.append(float(torch.nn.utils.clip_grad_norm_(master.values(), cfg["grad_clip"])))
        opt.step()
        if mixed:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(master[n])  # round to nearest, as DeepSpeed's copy_ into the bf16 weights
        losses.append(float(loss.detach()))
        tokens += st["tokens"]
        stale_tokens += st["stale_tokens"]
        for k in sums:
            sums[k] += st[k] * st["tokens"]
        for k in stale_sums:
            stale_sums[k] += st[k] * st["stale_tokens"]
    stats = {k: v / tokens for k, v in sums.items()}
    stats.update({k: v / stale_tokens if stale_tokens else 0.0 for k, v in stale_sums.items()})
    stats["stale_tokens"] = stale_tokens
    stats.update(loss=sum(losses) / len(losses), tokens=tokens, grad_norm=sum(norms) / len(norms))
    sens.update({k: v / tokens for k, v in sens.items() if k != "loss"})
    keep = torch.float64 if dtype == torch.float64 else torch.float32
    return {
        "grads": grads,
        "norms": norms,
        "state": {n: p.detach().to(keep).cpu().clone() for n, p in params.items()},
        "master": {n: p.detach().cpu().clone() for n, p in master.items()},
        "stats": stats,
        "logps": seen,
        "sensitivity": sens,
    }


def sensitivities(new, old, adv, mask, rollout, cfg: dict) -> dict[str, float]:
    """Upper bounds, to first order, on how far one mini-batch's loss and its token means of the
    k3 KL estimate and of the rollout weight move when every log-prob (new and old) moves by at
    most 1, summed over its tokens (the caller scales by the log-prob noise). Per token, with
    r = exp(new - old), w = min(exp(old - rollout), cap) and the loss term c = w * max(-A r,
    -A clip(r)) (Dual-Clip only caps it): |dc/dnew| + |dc/dold| <= 2 w |A| max(r, 1 + clip_high)
    through r, and |dc/dold| <= w |A| max(r, 1 + clip_high) through w; k3 = exp(x) - 1 - x with
    x = old - new moves by |exp(x) - 1| per unit of x, and x by up to 2; w by w where w < cap."""
    keep = mask.bool()
    n = max(int(keep.sum()), 1)
    r = torch.exp(new - old)
    raw_w = torch.exp(old - rollout)
    w = raw_w.clamp(max=2.0)
    loss = (3 * w * adv.abs() * torch.maximum(r, torch.full_like(r, 1.28)))[keep].sum() / n
    kl = (2 * (torch.exp(old - new) - 1).abs())[keep].sum() / n
    isw = (raw_w * (raw_w < 2.0))[keep].sum() / n
    return {"loss": float(loss), "approx_kl": float(kl), "is_weight_mean": float(isw)}


def bounded_reference(model_dir, trajs, advantages, cfg: dict, **kwargs) -> dict:
    """The fp32 reference (its fields, as reference_update answers them) with what bounds the
    comparison: "exact", the same update in float64, and "variants", fp32 runs in three orders
    (plain, reversed, batched), whose distances from "exact" are the fp32 noise of this
    computation on these kernels. kwargs: reference_update's version, lora, device."""
    ref32 = reference_update(model_dir, trajs, advantages, cfg, **kwargs)
    exact = reference_update(model_dir, trajs, advantages, cfg, torch.float64, **kwargs)
    variants = [ref32] + [reference_update(model_dir, trajs, advantages, cfg, order=o, **kwargs)
                          for o in ("reversed", "batched")]  # fmt: skip
    return {**ref32, "exact": exact, "variants": variants}


def peft_model(model, lora: dict):
    """PEFT's LoRA model of `model`, its adapters drawn from lora["seed"]."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=0.0, target_modules=lora["target_modules"],
        bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lora["seed"])
        return get_peft_model(model, config)


def replay_optimizer(initial: dict, grads: list[dict], dtype: torch.dtype = torch.float32) -> dict:
    """AdamW with the reference's settings and clipping, stepped on given gradients, in `dtype`."""
    params = {n: initial[n].to(dtype).clone().requires_grad_(True) for n in grads[0]}
    opt = adamw(params.values(), BASE)
    for g in grads:
        for n, p in params.items():
            p.grad = g[n].to(dtype).clone()
        torch.nn.utils.clip_grad_norm_(params.values(), BASE["grad_clip"])
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _dist(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm())


def _norm(a: torch.Tensor) -> float:
    return float(a.double().norm())


# The largest learner-to-noise ratio each check saw in this process: printed by the tests (`-s`)
# so that NOISE_FACTOR's margin can be read off a run on any machine.
RATIOS: dict[str, float] = {}


def within_noise(what: str, got: dict, exact: dict, variants: list[dict], floors: dict | None = None) -> None:
    """Every tensor of `got` within NOISE_FACTOR x the fp32 noise (the larger of the variants'
    distances from `exact`) of `exact`, and so the whole model. The floor, 2 U |exact| (or the
    given one), is the rounding of storing the result in fp32 once on each side: a tensor that
    some variant computes exactly (e.g. all zeros) still has that much room."""
    num = den = 0.0
    for name, want in exact.items():
        noise = max(_dist(v[name], want) for v in variants)
        floor = floors[name] if floors is not None else 2 * U * _norm(want)
        err = _dist(got[name], want)
        RATIOS[what] = max(RATIOS.get(what, 0.0), err / max(noise, floor, 1e-300))
        assert err <= NOISE_FACTOR * noise + floor, (what, name, err, noise, floor)
        num, den = num + err**2, den + max(noise, floor) ** 2
    ratio = (num / den) ** 0.5 if den else 0.0
    RATIOS[what + " (model)"] = max(RATIOS.get(what + " (model)", 0.0), ratio)
    assert ratio <= NOISE_FACTOR, (what, "whole model", ratio)


def _logp_noise(ref: dict) -> float:
    """The largest distance of any log-prob in the fp32 runs from its float64 value."""
    exact = ref["exact"]["logps"]
    return max(
        float((a - b).abs().max()) for v in ref["variants"] for a, b in zip(v["logps"], exact, strict=True)
    )


_dist_env = pytest.fixture(scope="module", autouse=True)(dist_env_restored)


@pytest.fixture(scope="module", autouse=True)
def _report_ratios():
    """After the module: the largest learner-to-noise ratio of each check (seen with `-s`)."""
    yield
    if RATIOS:
        print("\nlearner / fp32 noise, largest:", {k: round(v, 2) for k, v in sorted(RATIOS.items())})


@pytest.fixture(scope="module")
def batch(tiny_model):
    return make_batch(tiny_model, n=8, seed=0)


@pytest.fixture(scope="module")
def initial(tiny_model):
    from safetensors.torch import load_file

    return load_file(tiny_model / "model.safetensors")


class _References(dict):
    """Each split's bounded reference, computed when a test first asks for it: a child process or
    an xdist worker that runs one case computes one reference, not all four splits'."""

    def __init__(self, model_dir, trajs, adv) -> None:
        super().__init__()
        self.args = (model_dir, trajs, adv)

    def __missing__(self, split: tuple[int, int]) -> dict:
        model_dir, trajs, adv = self.args
        self[split] = bounded_reference(model_dir, trajs, adv, _cfg(1, *split))
        return self[split]

    def values(self):
        return [self[s] for s in sorted({s for v in SPLITS.values() for s in v})]


@pytest.fixture(scope="module")
def references(tiny_model, batch):
    trajs, adv = batch
    return _References(tiny_model, trajs, adv)


def check_against_reference(result: dict, ref: dict, initial: dict) -> None:
    """`result` (run_task's) against `ref` (bounded_reference's): each bound is the fp32 noise of the
    same quantity, measured here (module docstring)."""
    exact, variants = ref["exact"], ref["variants"]
    # Gradients of every mini-batch, before clipping and the step.
    assert len(result["grads"]) == len(exact["grads"])
    for m, got in enumerate(result["grads"]):
        assert set(got) == set(exact["grads"][m])
        within_noise("gradients", got, exact["grads"][m], [v["grads"][m] for v in variants])
    # The parameter change over the whole update. (a) Against AdamW replayed on DeepSpeed's own
    # gradients, in float64 (exact) and fp32 (its noise): clipping and the optimizer step alone.
    # (b) Against the independent reference, end to end. The floor is the rounding of the updated
    # weight when it is stored in fp32, 2 U |w| per side: a weight near 1 (the norms) is stored to
    # 1.2e-7 against a change of ~1e-3, so one rounding is already ~1e-4 of its change.
    names = list(exact["state"])
    state = {n: result["state"][n] for n in names}
    change = {n: state[n] - initial[n] for n in names}
    floors = {n: 2 * U * _norm(initial[n]) for n in names}

    def changes(weights: dict) -> dict:
        return {n: weights[n].double() - initial[n].double() for n in names}

    replayed = [replay_optimizer(initial, result["grads"], dt) for dt in (torch.float64, torch.float32)]
    within_noise("optimizer", change, changes(replayed[0]), [changes(replayed[1])], floors)
    within_noise(
        "end to end", change, changes(exact["state"]), [changes(v["state"]) for v in variants], floors
    )
    s, r = result["stats"], exact["stats"]
    assert s["tokens"] == r["tokens"]
    # The pre-clip norm: |(|a| - |b|)| <= |a - b|, so it is bounded by the gradients' own noise.
    grad_noise = max(
        sum(_dist(v["grads"][m][n], g[n]) ** 2 for n in g) ** 0.5
        for v in variants
        for m, g in enumerate(exact["grads"])
    )
    assert abs(s["grad_norm"] - r["grad_norm"]) <= NOISE_FACTOR * grad_noise + 2 * U * r["grad_norm"]
    # The loss and the token means are functions of the log-probs: each within its first-order
    # sensitivity (reference_update's) times the log-probs' fp32 noise (the largest of any token in
    # any of the fp32 runs), or the statistic's own noise in those runs where that is larger.
    logp_noise = _logp_noise(ref)
    for k, d in exact["sensitivity"].items():
        noise = max(max(abs(v["stats"][k] - r[k]) for v in variants), d * logp_noise)
        RATIOS["statistics"] = max(RATIOS.get("statistics", 0.0), abs(s[k] - r[k]) / max(noise, 1e-300))
        assert abs(s[k] - r[k]) <= NOISE_FACTOR * noise + 2 * U * abs(r[k]), (k, s[k], r[k], noise)
    # Shares of tokens: a token whose ratio sits within rounding of a clip edge may fall either
    # side, so they may differ by one token's share, and no more.
    for k in ("clip_fraction", "is_capped_fraction"):
        assert abs(s[k] - r[k]) <= 1.0 / r["tokens"] + 1e-12, k
    assert s["lr"] == BASE["lr"]


def stale_batch(trajs: list) -> list:
    """The batch under bounded staleness, trained at version 1: trajectories 0-3 were dispatched at
    version 0, and 2 and 3 swapped to version 1 halfway through; 4-7 are of version 1."""
    out = []
    for i, t in enumerate(trajs):
        if i >= 4:
            out.append(t.model_copy(update={"policy_version": 1}))
        elif i >= 2:
            half = len(t.token_ids) // 2
            versions = [0] * half + [1] * (len(t.token_ids) - half)
            out.append(t.model_copy(update={"token_versions": versions}))
        else:
            out.append(t)
    return out


@pytest.mark.parametrize(
    "off_policy,packing", [("decoupled", True), ("tis", True), ("decoupled", False)],
    ids=["decoupled-packed", "tis-packed", "decoupled-padded"],
)  # fmt: skip
def test_stale_tokens_are_corrected_as_the_reference_corrects_them(
    tiny_model, batch, initial, off_policy, packing
):
    trajs, adv = batch
    stale = stale_batch(trajs)
    # A cap of 1.2 cuts a good share of the noisy rollout weights, so the two corrections differ.
    cfg = {
        **_cfg(1, 2, 2), "off_policy": off_policy, "behaviour_cap": 1.2, "max_staleness": 1, "packing": packing,
    }  # fmt: skip
    ref = bounded_reference(tiny_model, stale, adv, cfg, version=1)
    result = run_task(tiny_model, stale, adv, {"cfg": cfg, "grads": True, "version": 1})
    check_against_reference(result, ref, initial)
    s, r = result["stats"], ref["stats"]
    assert s["stale_tokens"] == r["stale_tokens"] > 0
    assert s["stale_tokens"] < s["tokens"]  # versions 1's tokens (and the swapped halves) are current
    assert 0 < r["behaviour_cut_fraction"] < 1
    exact = ref["exact"]["stats"]
    # The applied weight moves with the old log-prob by at most itself (<= the cap) per unit: within
    # the cap times the log-probs' fp32 noise (check_against_reference's rule for the statistics).
    want = exact["behaviour_weight_mean"]
    noise = max(
        max(abs(v["stats"]["behaviour_weight_mean"] - want) for v in ref["variants"]), 1.2 * _logp_noise(ref)
    )
    assert abs(s["behaviour_weight_mean"] - want) <= NOISE_FACTOR * noise + 2 * U * want
    # A share of tokens: one token within rounding of the cap may fall either side.
    assert (
        abs(s["behaviour_cut_fraction"] - exact["behaviour_cut_fraction"])
        <= 1.0 / exact["stale_tokens"] + 1e-12
    )


def test_at_k0_the_update_is_exactly_todays(tiny_model, batch):
    """Nothing stale (every trajectory of the version trained): the update with versions known is
    the update without them, bit for bit, gradients and statistics."""
    trajs, adv = batch
    cfg = {**_cfg(1, 2, 2), "off_policy": "decoupled", "behaviour_cap": 1.01}
    plain = run_task(tiny_model, trajs, adv, {"cfg": cfg, "grads": True})
    versioned = run_task(tiny_model, trajs, adv, {"cfg": cfg, "grads": True, "version": 0})
    for a, b in zip(plain["grads"], versioned["grads"], strict=True):
        assert all(torch.equal(a[n], b[n]) for n in a)
    drop = ("update_seconds", "tokens_per_s")
    assert {k: v for k, v in plain["stats"].items() if k not in drop} == {
        k: v for k, v in versioned["stats"].items() if k not in drop
    }
    assert versioned["stats"]["stale_tokens"] == 0.0


def test_the_bounds_pass_fp32_noise_and_catch_a_one_token_error(references, initial):
    """check_against_reference can fail: the plain fp32 reference itself passes (its own noise, a
    ratio of 1), and the same result with one mini-batch's gradient off by one action token's share
    (1/369, what a loss missing a token would do) is refused."""
    ref = references[(2, 2)]
    plain = ref["variants"][0]
    result = {"grads": plain["grads"], "state": plain["state"], "stats": {**plain["stats"], "lr": BASE["lr"]}}
    check_against_reference(result, ref, initial)
    off = 1.0 + 1.0 / plain["stats"]["tokens"]
    wrong = [{n: g * off for n, g in plain["grads"][0].items()}, *plain["grads"][1:]]
    with pytest.raises(AssertionError, match="gradients"):
        check_against_reference({**result, "grads": wrong}, ref, initial)


def test_reference_is_a_meaningful_target(references, batch):
    """The batch exercises what the comparison is meant to catch."""
    trajs, adv = batch
    assert min(adv) < 0 < max(adv)
    assert len({len(t.token_ids) for t in trajs}) > 4
    # Clipping binds at least once, and the second mini-batch is off-policy.
    assert max(max(r["norms"]) for r in references.values()) > BASE["grad_clip"]
    two = references[(2, 2)]["stats"]
    assert two["approx_kl"] > 1e-6 and two["clip_fraction"] > 0
    assert 0 < two["is_capped_fraction"] < 1
    # The two splits are different updates (otherwise comparing both would add nothing).
    a, b = references[(1, 3)]["state"], references[(2, 2)]["state"]
    assert max(rel_err(a[n], b[n]) for n in a) > 1e-4


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("split", SPLITS[1], ids=lambda s: f"M{s[0]}-micro{s[1]}")
def test_single_process_matches_reference(tiny_model, batch, references, initial, stage, split):
    trajs, adv = batch
    result = run_task(tiny_model, trajs, adv, {"cfg": _cfg(stage, *split), "grads": True})
    check_against_reference(result, references[split], initial)
    if split[0] == 1:
        # old_logp and the training forward see the same micro-batches: the ratio is exactly 1.
        assert result["stats"]["approx_kl"] == 0.0 and result["stats"]["clip_fraction"] == 0.0


def test_token_plans_are_what_the_tests_need(batch):
    """The token budgets above make the plans their comment says (else the tests test less)."""
    from services.learner.batch import pack_by_tokens, plan_micro_batches

    lengths = [len(t.token_ids) for t in batch[0]]
    one = {T: plan_micro_batches(lengths, m, 1, micro_batch_tokens=T) for m, T in TOKEN_SPLITS[1]}
    assert [len(mb) for mb in one[250][0][0]] == [1, 2, 2, 2, 1]
    assert one[250][0][0][0] == [lengths.index(max(lengths))]
    assert all(len(p[0]) == 2 for p in one[400]) and {len(mb) for p in one[400] for mb in p[0]} > {1}
    two = plan_micro_batches(lengths, 2, 2, micro_batch_tokens=250)
    # Rank 1's first share fits one micro-batch of 250; it is split to match rank 0's two.
    assert [[len(mb) for mb in rank] for rank in two[0]] == [[1, 1], [1, 1]]
    assert len(pack_by_tokens(lengths, two[0][1][0] + two[0][1][1], 250)) == 1


@pytest.mark.parametrize(
    "stage,split", TOKEN_CASES[1], ids=lambda c: f"zero{c}" if isinstance(c, int) else f"M{c[0]}-tokens{c[1]}"
)
def test_token_budget_single_process_matches_reference(tiny_model, batch, references, initial, stage, split):
    """Micro-batches packed by tokens (sorted, uneven counts per step) give the full-batch
    gradient, norm, statistics and parameters of the reference, like count-based ones."""
    trajs, adv = batch
    result = run_task(tiny_model, trajs, adv, {"cfg": _token_cfg(stage, *split), "grads": True})
    check_against_reference(result, _ref(references, split[0]), initial)
    if split[0] == 1:
        assert result["stats"]["approx_kl"] == 0.0 and result["stats"]["clip_fraction"] == 0.0


def agree(packed: dict, padded: dict, ref: dict) -> None:
    """The packed and the padded update, each checked against the truth, agree with each other:
    each is within NOISE_FACTOR x the fp32 noise (plus the storage floor) of the float64 truth, so
    by the triangle inequality they are within twice that of each other, gradient by gradient."""
    exact, variants = ref["exact"], ref["variants"]
    for m, want in enumerate(exact["grads"]):
        for name, g in want.items():
            noise = max(_dist(v["grads"][m][name], g) for v in variants)
            floor = 2 * U * _norm(g)
            gap = _dist(packed["grads"][m][name], padded["grads"][m][name])
            assert gap <= 2 * (NOISE_FACTOR * noise + floor), ("packed vs padded", m, name, gap, noise)


@pytest.mark.parametrize("stage", [1, 2, 3], ids=lambda z: f"zero{z}")
def test_packed_and_padded_updates_agree(tiny_model, batch, references, initial, stage):
    """Packing is a layout, not a different update: packed rows (the default) and padded rows (the
    reference path) give the reference's gradients, norm, statistics and weights, and each other's.
    By tokens at 250, where the two plans differ (packed, fewer and fuller micro-batches)."""
    trajs, adv = batch
    cfg = _token_cfg(stage, 2, 250)
    packed = run_task(tiny_model, trajs, adv, {"cfg": cfg, "grads": True})
    padded = run_task(tiny_model, trajs, adv, {"cfg": {**cfg, "packing": False}, "grads": True})
    for result in (packed, padded):
        check_against_reference(result, _ref(references, 2), initial)
    agree(packed, padded, _ref(references, 2))
    assert packed["stats"]["padding_fraction"] == 0.0 < padded["stats"]["padding_fraction"]
    # The entropy before the update is the same statistic either way: -sum p log p moves by at
    # most the largest change of a log-prob, so each side is within NOISE_FACTOR x the log-probs'
    # noise of the truth, and the two within twice that of each other.
    want = padded["stats"]["entropy"]
    noise = _logp_noise(_ref(references, 2))
    assert abs(packed["stats"]["entropy"] - want) <= 2 * NOISE_FACTOR * noise + 4 * U * want
    assert 0 < want < math.log(397)  # nats: above zero, below a uniform next token's


def mixed_lengths(trajs: list) -> list:
    """The batch with very short and very long trajectories side by side: three cut right after
    their first action token's successor, three each the concatenation of three chats (a long
    multi-turn episode), two unchanged."""
    out = []
    for i, t in enumerate(trajs):
        if i in (0, 2, 4):
            k = t.action_mask.index(1) + 2
        elif i in (1, 3, 5):
            others = [trajs[(i + j) % len(trajs)] for j in (0, 1, 2)]
            out.append(t.model_copy(update={
                "token_ids": [x for o in others for x in o.token_ids],
                "action_mask": [x for o in others for x in o.action_mask],
                "rollout_logprobs": [x for o in others for x in o.rollout_logprobs],
            }))  # fmt: skip
            continue
        else:
            k = len(t.token_ids)
        out.append(t.model_copy(update={
            "token_ids": t.token_ids[:k], "action_mask": t.action_mask[:k], "rollout_logprobs": t.rollout_logprobs[:k],
        }))  # fmt: skip
    return out


def test_a_mix_of_very_short_and_very_long_trajectories(tiny_model, batch, initial):
    trajs, adv = batch
    mixed = mixed_lengths(trajs)
    lengths = [len(t.token_ids) for t in mixed]
    assert min(lengths) < 40 and max(lengths) > 250 and max(lengths) / min(lengths) > 8
    # By count, 2 a micro-batch in receipt order: each pairs a short trajectory with a long one.
    cfg = _cfg(2, 2, 2)
    ref = bounded_reference(tiny_model, mixed, adv, _cfg(1, 2, 2))
    packed = run_task(tiny_model, mixed, adv, {"cfg": cfg, "grads": True})
    padded = run_task(tiny_model, mixed, adv, {"cfg": {**cfg, "packing": False}, "grads": True})
    for result in (packed, padded):
        check_against_reference(result, ref, initial)
    agree(packed, padded, ref)
    # Padded, the long rows pad the short ones heavily; packed, nothing is padding.
    assert padded["stats"]["padding_fraction"] > 0.3 and packed["stats"]["padding_fraction"] == 0.0


# Settings that change memory, not results: each must give the reference's update. Two
# mini-batches of 2 x 2 micro-batches, so the second step sees the first's weights. ZeRO 1 and 2
# share DeepSpeed's optimizer (stage_1_and_2.py), so the optimizer's offload is run on 2 and,
# with the parameters', on 3.
MEMORY_SETTINGS = [
    ("checkpointing", {"gradient_checkpointing": True}, [1]),
    ("offload-optimizer", {"offload_optimizer": True}, [2]),
    ("offload-params", {"offload_optimizer": True, "offload_params": True}, [3]),
    # No parameter kept gathered between uses: every one gathered and released per module (the
    # tiny model's are all below DeepSpeed's default threshold of 100,000 elements, so all persist).
    ("no-persistent-params", {"zero3_persistence_threshold": 0}, [3]),
    ("tokens-checkpointing-offload", {"micro_batch_tokens": 250, "gradient_checkpointing": True,
                                      "offload_optimizer": True}, [2]),
]  # fmt: skip


@pytest.mark.parametrize(
    "stage,extra",
    [(stage, extra) for _name, extra, stages in MEMORY_SETTINGS for stage in stages],
    ids=[f"{name}-zero{stage}" for name, _extra, stages in MEMORY_SETTINGS for stage in stages],
)
def test_memory_settings_do_not_change_the_update(tiny_model, batch, references, initial, stage, extra):
    trajs, adv = batch
    result = run_task(tiny_model, trajs, adv, {"cfg": {**_cfg(stage, 2, 2), **extra}, "grads": True})
    check_against_reference(result, references[(2, 2)], initial)
    # The settings took: the model recomputes, DeepSpeed's ZeRO optimizer offloads.
    assert result["memory"] == {
        "checkpointing": extra.get("gradient_checkpointing", False),
        "offload_optimizer": extra.get("offload_optimizer", False),
        "offload_params": extra.get("offload_params", False),
    }
    if stage == 3:  # ZeRO 3's persistence: all of the tiny model's by default, none at threshold 0
        kept, every = result["persistent"]
        assert kept == (0 if extra.get("zero3_persistence_threshold") == 0 else every), result["persistent"]


@pytest.fixture(scope="module")
def two_process_results(tiny_model, batch, tmp_path_factory):
    """One torchrun launch with 2 ranks runs every (stage, split) task, by count and by tokens."""
    trajs, adv = batch
    tasks = [
        {"name": f"z{stage}-M{mini}-micro{micro}", "cfg": _cfg(stage, mini, micro), "grads": True}
        for stage in STAGES
        for mini, micro in SPLITS[2]
    ] + [
        {"name": f"z{stage}-M{mini}-tokens{tokens}", "cfg": _token_cfg(stage, mini, tokens), "grads": True}
        for stage, (mini, tokens) in TOKEN_CASES[2]
    ]
    job = {
        "model": str(tiny_model),
        "trajectories": [t.model_dump() for t in trajs],
        "advantages": adv,
        "tasks": tasks,
    }
    return launch(job, tmp_path_factory.mktemp("learner-2proc"), nproc=2)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("split", SPLITS[2], ids=lambda s: f"M{s[0]}-micro{s[1]}")
def test_two_processes_match_reference(two_process_results, references, initial, stage, split):
    name = f"z{stage}-M{split[0]}-micro{split[1]}"
    rank0, rank1 = (r[name] for r in two_process_results)
    assert (rank0["world_size"], rank1["world_size"]) == (2, 2)
    check_against_reference(rank0, references[split], initial)
    # Statistics are reduced over ranks: both report the same numbers.
    timing = {"update_seconds", "tokens_per_s"}
    assert {k: v for k, v in rank1["stats"].items() if k not in timing} == {
        k: v for k, v in rank0["stats"].items() if k not in timing
    }
    assert rank1["state"] is None


@pytest.mark.parametrize(
    "stage,split", TOKEN_CASES[2], ids=lambda c: f"zero{c}" if isinstance(c, int) else f"M{c[0]}-tokens{c[1]}"
)
def test_token_budget_two_processes_match_reference(two_process_results, references, initial, stage, split):
    name = f"z{stage}-M{split[0]}-tokens{split[1]}"
    rank0, rank1 = (r[name] for r in two_process_results)
    check_against_reference(rank0, _ref(references, split[0]), initial)
    timing = {"update_seconds", "tokens_per_s"}
    assert {k: v for k, v in rank1["stats"].items() if k not in timing} == {
        k: v for k, v in rank0["stats"].items() if k not in timing
    }


def test_uneven_split_is_refused(tiny_model, batch):
    from services.learner.batch import accumulation_steps, rank_share

    with pytest.raises(ValueError, match="split evenly over 3 ranks"):
        rank_share(slice(0, 8), 0, 3)
    with pytest.raises(ValueError, match="equal mini-batches"):
        accumulation_steps(8, 3, 1, 2)
    assert accumulation_steps(8, 2, 2, 3) == 1 and accumulation_steps(8, 1, 1, 3) == 3


# -- bf16 -------------------------------------------------------------------------------------------
# bf16 keeps 8 significant bits: neighbouring values are 2^-8 = 3.9e-3 apart, relatively. DeepSpeed
# and the reference round the same quantities at every layer but batch them differently (padded
# micro-batches vs one sequence at a time, other summation orders), so their results differ by a
# few such steps per element and do not cancel. Measured on this batch: first-step gradients
# 0.6-0.9e-2 per tensor (about two steps), 0.6e-2 over the whole model (three batch seeds alike).
BF16_GRAD_RTOL = 2e-2  # per tensor: five bf16 steps
# The weights' change after one step. AdamW's first step moves each weight by about lr * sign(g), so a
# gradient element whose sign is within bf16 noise moves the other way (an error of twice the
# change), and each weight is rounded to bf16, whose step at |w| ~ 0.02-0.05 (1.2e-4 .. 2.4e-4) is
# a sizeable part of lr = 1e-3. Measured: 0.05-0.06 over the model (three batch seeds).
BF16_CHANGE_RTOL = 0.1
# The fp32 master against AdamW replayed on DeepSpeed's own gradients: the same fp32 arithmetic in
# another order (one flat partition vs per tensor; DeepSpeed clips by dividing by (norm + 1e-6) /
# clip, torch multiplies by clip / (norm + 1e-6)) differs by one fp32 step in a few elements:
# 1.2e-7 at the norm weights' 1.0, about 1e-4 of such an element's change of 1-2e-3, and up to
# 1.1e-5 over a tensor (measured).
MASTER_RTOL = 1e-4
# ZeRO 1-3. ZeRO 0 with bf16 is refused by LearnerSettings because it does not implement these semantics in
# deepspeed 0.19.8: it wraps the optimizer in FP16_UnfusedOptimizer, whose constructor
# (initialize_optimizer_states) steps AdamW once on zero gradients. That decays the fp32 master by
# lr * weight_decay before training and starts AdamW's step count at 1, so every bias correction
# is one step late: the first update is about 0.73 * lr * sign(g) with betas (0.9, 0.95) instead of
# lr * sign(g). Observed: the gradients match, the weights' change is 28% off the reference, and
# AdamW replayed with that extra zero-gradient step first reproduces DeepSpeed's weights exactly.
BF16_STAGES = [1, 2, 3]


def model_rel_err(a: dict, b: dict) -> float:
    """rel_err over all of b's tensors at once (one norm over the whole model)."""
    num = sum(float((a[n].double() - b[n].double()).norm()) ** 2 for n in b)
    den = sum(float(b[n].double().norm()) ** 2 for n in b)
    return (num / den) ** 0.5


def kept_fraction(master: dict, weights: dict) -> float:
    """The share of master elements that differ from the bf16 weights (0 for a bf16 master)."""
    return sum(int((master[n] != weights[n]).sum()) for n in master) / sum(m.numel() for m in master.values())


def _bf16_cfg(stage: int, mini: int, micro: int) -> dict:
    return {**_cfg(stage, mini, micro), "dtype": "bf16"}


@pytest.fixture(scope="module")
def bf16_references(tiny_model, batch):
    trajs, adv = batch
    return {s: reference_update(tiny_model, trajs, adv, _cfg(1, *s), dtype=torch.bfloat16) for s in SPLITS[1]}


def test_bf16_reference_is_a_meaningful_target(references, bf16_references, initial):
    """The bf16 reference is the fp32 update give or take bf16 rounding, and rounding is visible."""
    for split, ref16 in bf16_references.items():
        ref32 = references[split]
        # Close to fp32 (bf16 training approximates the same update)...
        err = model_rel_err(ref16["grads"][0], ref32["grads"][0])
        assert err < 5e-2, split
        # ...but several times DeepSpeed's distance to it (~6e-3), so that the comparison below can
        # tell bf16 arithmetic from fp32.
        assert err > 1e-2, split
        # Its master weights are fp32 (not bf16 values) and its weights are them rounded to bf16.
        master, weights = ref16["master"], ref16["state"]
        assert all(torch.equal(weights[n], master[n].bfloat16().float()) for n in master)
        assert kept_fraction(master, weights) > 0.9


@pytest.mark.parametrize("stage", BF16_STAGES, ids=lambda z: f"zero{z}")
@pytest.mark.parametrize("split", SPLITS[1], ids=lambda s: f"M{s[0]}-micro{s[1]}")
def test_bf16_matches_bf16_reference(tiny_model, batch, initial, references, bf16_references, stage, split):
    trajs, adv = batch
    task = {"cfg": _bf16_cfg(stage, *split), "grads": True, "master": True}
    result = run_task(tiny_model, trajs, adv, task)
    ref16, ref32 = bf16_references[split], references[split]
    names = list(ref16["master"])
    start = {n: initial[n].bfloat16().float() for n in names}  # the model as loaded in bf16

    # Gradients of the first mini-batch (bf16, summed over micro-batches in bf16, read as fp32):
    # within bf16 noise of the bf16 reference, and clearly closer to it than to the fp32 one.
    got, want = result["grads"][0], ref16["grads"][0]
    assert set(got) == set(want)
    for name in names:
        assert rel_err(got[name], want[name]) <= BF16_GRAD_RTOL, name
    assert model_rel_err(got, want) < 0.5 * model_rel_err(got, ref32["grads"][0])

    # The optimizer, on DeepSpeed's own gradients of every mini-batch: AdamW with fp32 clipping on an
    # fp32 master made from the bf16 weights, each step from the master (not from the rounded
    # weights), and the weights = the master rounded to bf16. The master is kept apart: most of it
    # is not representable in bf16.
    master, weights = result["master"], result["state"]
    replayed = replay_optimizer(start, result["grads"])
    for name in names:
        assert rel_err(master[name] - start[name], replayed[name] - start[name]) <= MASTER_RTOL, name
        assert torch.equal(weights[name], master[name].bfloat16().float()), name
    assert kept_fraction(master, weights) > 0.9

    s, r = result["stats"], ref16["stats"]
    assert s["tokens"] == r["tokens"]
    if split[0] > 1:
        # End to end only over one step: this tiny model at lr 1e-3 moves far in one step
        # (approx_kl of the next mini-batch 0.03 .. 8 over batch seeds), so the second mini-batch's
        # gradients amplify the first step's rounding differences (1e-2 .. 1.3e-1 observed) beyond
        # anything bf16's precision can justify. Its optimizer step is checked above.
        return
    change, change16 = ({n: w[n] - start[n] for n in names} for w in (weights, ref16["state"]))
    change32 = {n: ref32["state"][n] - initial[n] for n in names}
    assert model_rel_err(change, change16) <= BF16_CHANGE_RTOL
    assert model_rel_err(change, change16) < 0.5 * model_rel_err(change, change32)
    # The bf16 update is still the fp32 update, roughly: the same direction and size.
    assert model_rel_err(change, change32) < 0.25
    assert model_rel_err(got, ref32["grads"][0]) < 5e-2
    # The pre-clip norm sums ~3e5 squared elements, whose independent rounding errors average out.
    assert s["grad_norm"] == pytest.approx(r["grad_norm"], rel=4e-3)
    # Log-probs carry bf16 noise; a token whose ratio sits at the cap may flip (1 / 369 tokens).
    assert s["loss"] == pytest.approx(r["loss"], rel=1e-2)
    assert s["is_weight_mean"] == pytest.approx(r["is_weight_mean"], rel=1e-3)
    assert s["is_capped_fraction"] == pytest.approx(r["is_capped_fraction"], abs=3e-3)
    # old_logp and the training forward see the same micro-batches: the ratio is exactly 1.
    assert s["approx_kl"] == 0.0 and s["clip_fraction"] == 0.0
