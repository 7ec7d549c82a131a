"""Packed micro-batches: the layout (collate), the bin packing (plan_micro_batches), and the model
reading a packed row as it reads each sequence alone (attention.py, logprobs.py).

The update itself, packed against padded and both against the plain-PyTorch reference, is in
tests/learner/test_learner_update.py (ZeRO 1-3, staleness, a short/long mix), tests/learner/test_lora.py and
tests/learner/test_real_learner.py (SmolLM2 cut to 2 layers).

Tolerances here are measured, not chosen, as in test_learner_update.py: the float64 forward of
each sequence alone is the truth; the fp32 forward of each sequence alone is one fp32 evaluation
of it, whose distance from the truth is the fp32 noise of this computation on this machine's
kernels; a packed or chunked fp32 evaluation is another, in a different order, and must be within
NOISE_FACTOR of that noise (the same factor and the same reasoning as there).
"""

from __future__ import annotations

import random

import pytest
import torch
from test_learner_update import NOISE_FACTOR, U

from services.learner.attention import PACKED_SDPA, model_attention, sequence_starts
from services.learner.batch import (
    collate,
    pack_by_tokens,
    pack_fill,
    packed_tokens,
    padded_tokens,
    plan_micro_batches,
)
from services.learner.logprobs import token_logprobs, token_logprobs_entropy
from spopp.api.trajectory import count_action_tokens
from spopp.loss import screen_rows

VOCAB = 256  # ids drawn below this: within the tiny model's vocabulary


class _Traj:
    def __init__(self, ids, mask, logp, segment_starts=None, policy_version=None, token_versions=None):
        self.token_ids, self.action_mask, self.rollout_logprobs = ids, mask, logp
        self.segment_starts = segment_starts
        self.policy_version, self.token_versions = policy_version, token_versions


def _traj(rng: random.Random, k: int, prompt: int = 3, **kw) -> _Traj:
    ids = [rng.randrange(5, VOCAB) for _ in range(k)]
    mask = [0] * min(prompt, k) + [1] * max(0, k - prompt)
    logp = [0.0] + [-rng.random() if m else 0.0 for m in mask[1:]]
    return _Traj(ids, mask, logp, **kw)


def _mixed(seed: int = 0) -> list[_Traj]:
    rng = random.Random(seed)
    out = [_traj(rng, k) for k in (5, 210, 4, 37, 2, 160, 9)]
    # Two segments (an agent that rewrote its history): the second starts at 20, not an action.
    seg = _traj(rng, 50)
    seg.action_mask[20] = 0
    seg.segment_starts = [0, 20]
    return [*out, seg]


# -- layout ----------------------------------------------------------------------------------------
def test_a_packed_row_holds_every_sequence_at_its_own_positions():
    trajs = _mixed()
    adv = [0.5, -1.0, 2.0, 0.25, -0.5, 1.5, -2.0, 0.75]
    padded = collate(trajs, adv)
    packed = collate(trajs, adv, packed=True)
    lengths = [len(t.token_ids) for t in trajs]
    assert packed.input_ids.shape == (1, sum(lengths)) and packed.attention_mask is None
    # The same tokens, no padding: the forward computes exactly the real ones.
    assert packed.forward_tokens == sum(lengths) < padded.forward_tokens
    assert torch.equal(packed.input_ids[0], torch.tensor([i for t in trajs for i in t.token_ids]))
    # Positions restart at every sequence (the segment's second part too) and count up from 0.
    starts = sequence_starts(packed.position_ids)
    seq_lengths = [5, 210, 4, 37, 2, 160, 9, 20, 30]
    assert starts == [0, *torch.tensor(seq_lengths).cumsum(0).tolist()]
    # The loss sees the same action tokens, with the same rollout log-probs, advantages, owners.
    assert packed.tokens == padded.tokens == sum(count_action_tokens(t.action_mask) for t in trajs)
    for name in ("rollout_logp", "advantages", "owners"):
        a, b = getattr(packed, name)[packed.loss_mask], getattr(padded, name)[padded.loss_mask]
        assert torch.equal(a, b), name
    # No scored position predicts across a boundary: each sequence's first token is never a target.
    firsts = torch.tensor(starts[1:-1]) - 1
    assert not packed.loss_mask[0, firsts].any()


def test_a_boundary_action_token_is_never_scored_across_sequences():
    """A trajectory whose first token is marked an action (it has no prefix): padded it is column
    -1, packed it would be predicted from the previous sequence; neither scores it."""
    rng = random.Random(1)
    a, b = _traj(rng, 6), _traj(rng, 6, prompt=0)
    assert b.action_mask[0] == 1
    packed, padded = collate([a, b], [1.0, 1.0], packed=True), collate([a, b], [1.0, 1.0])
    assert not packed.loss_mask[0, 5]
    assert packed.tokens == padded.tokens == 3 + 5


def test_stale_tokens_are_marked_alike_in_both_layouts():
    rng = random.Random(2)
    trajs = [_traj(rng, 12, policy_version=3), _traj(rng, 9, token_versions=[3] * 4 + [4] * 5), _traj(rng, 7)]
    trajs[2].policy_version = 4
    packed = collate(trajs, [1.0, -1.0, 0.5], version=4, packed=True)
    padded = collate(trajs, [1.0, -1.0, 0.5], version=4)
    assert packed.stale is not None and padded.stale is not None
    assert torch.equal(packed.stale[packed.loss_mask], padded.stale[padded.loss_mask])
    assert int(packed.stale.sum()) == 9 + 1  # trajectory 0's 9 actions, and 1's first action


def test_the_screen_names_the_trajectory_inside_a_packed_row():
    rng = random.Random(3)
    trajs = [_traj(rng, 8) for _ in range(3)]
    trajs[1].rollout_logprobs[5] = float("nan")
    b = collate(trajs, [1.0, 1.0, 1.0], packed=True)
    logp = torch.where(b.loss_mask, torch.full_like(b.rollout_logp, -0.5), torch.zeros_like(b.rollout_logp))
    codes = screen_rows(
        logp, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp, owners=b.owners, n_owners=3
    )
    assert codes.tolist()[0] == 0 and codes.tolist()[2] == 0 and codes.tolist()[1] != 0
    # An advantage that is not finite is its trajectory's only.
    b = collate(trajs[:1] + trajs[2:], [float("inf"), 1.0], packed=True)
    codes = screen_rows(
        logp[:, : b.loss_mask.shape[1]], b.advantages, b.loss_mask, owners=b.owners, n_owners=2
    )
    assert codes.tolist()[0] != 0 and codes.tolist()[1] == 0
    with pytest.raises(ValueError, match="owners"):
        screen_rows(logp[:, : b.loss_mask.shape[1]], b.advantages, b.loss_mask, owners=b.owners)


# -- bin packing -----------------------------------------------------------------------------------
def test_first_fit_decreasing_packs_within_the_budget_and_fills_it():
    rng = random.Random(4)
    lengths = [rng.choice([rng.randint(20, 80), rng.randint(300, 900)]) for _ in range(64)] + [2500]
    budget = 2048
    packs = pack_by_tokens(lengths, range(len(lengths)), budget, packed=True)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    # Within the budget, except the one trajectory longer than it, alone.
    for p in packs:
        assert packed_tokens(lengths, p) <= budget or p == [len(lengths) - 1]
    # First-fit decreasing uses at most 11/9 OPT + 6/9 bins; OPT >= total / budget.
    total = sum(min(x, budget) for x in lengths)
    assert len(packs) <= 11 / 9 * -(-total // budget) + 6 / 9 + 1  # + 1: the oversized one's bin
    fill = pack_fill(lengths, packs, budget)
    assert fill > 0.9, fill
    # The padded greedy plan of the same budget computes more tokens (rows x width) in more bins.
    padded = pack_by_tokens(lengths, range(len(lengths)), budget)
    assert len(padded) > len(packs)
    assert sum(padded_tokens(lengths, p) for p in padded) > sum(lengths)


def test_the_packed_plan_keeps_ranks_in_step():
    lengths = [700, 30, 30, 30, 650, 40, 20, 10]
    plan = plan_micro_batches(lengths, 1, 2, micro_batch_tokens=800, packing=True)
    ranks = plan[0]
    assert len(ranks[0]) == len(ranks[1])  # the same number of micro-batches on every rank
    assert sorted(i for r in ranks for p in r for i in p) == list(range(8))


# -- the model reads a packed row as it reads each sequence alone ----------------------------------
@pytest.fixture(scope="module")
def models(tiny_model):
    from transformers import AutoModelForCausalLM

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=dtype, attn_implementation=model_attention("sdpa")
        ).eval()

    return {torch.float32: load(torch.float32), torch.float64: load(torch.float64)}


def _alone(model, seqs: list[list[int]], entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each sequence's own forward, its log-probs (and entropies) end to end."""
    lps, ents = [], []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            if entropy:
                lp, ent = token_logprobs_entropy(model, ids, torch.ones_like(ids))
                ents.append(ent[0])
            else:
                lp = token_logprobs(model, ids, torch.ones_like(ids))
            lps.append(lp[0])
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def _packed(model, seqs, entropy: bool = False, chunk: int = 512):
    ids = torch.tensor([[i for s in seqs for i in s]])
    pos = torch.tensor([[p for s in seqs for p in range(len(s))]])
    with torch.no_grad():
        if entropy:
            lp, ent = token_logprobs_entropy(model, ids, None, position_ids=pos, chunk_tokens=chunk)
        else:
            lp, ent = token_logprobs(model, ids, None, position_ids=pos, chunk_tokens=chunk), None
    keep = pos[0, 1:] != 0  # the columns that predict a token of the same sequence
    return lp[0][keep], (ent[0][keep] if entropy else None)


def _within(got: torch.Tensor, fp32: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    noise = float((fp32.double() - exact).abs().max())
    floor = 2 * U * float(exact.abs().max())  # storing the answer in fp32 once on each side
    err = float((got.double() - exact).abs().max())
    assert err <= NOISE_FACTOR * noise + floor, (what, err, noise)


def test_a_packed_row_gives_each_sequence_its_own_logprobs_and_entropy(models):
    rng = random.Random(5)
    seqs = [[rng.randrange(5, VOCAB) for _ in range(k)] for k in (3, 140, 7, 2, 61, 30)]
    exact, exact_ent = _alone(models[torch.float64], seqs, entropy=True)
    fp32, fp32_ent = _alone(models[torch.float32], seqs, entropy=True)
    for chunk in (512, 16):  # one chunk, and many (chunks cross sequence boundaries)
        got, ent = _packed(models[torch.float32], seqs, entropy=True, chunk=chunk)
        _within(got, fp32, exact, f"log-probs, chunk {chunk}")
        _within(ent, fp32_ent, exact_ent, f"entropy, chunk {chunk}")
    # The entropy is the whole distribution's: against the full logits' own formula in float64.
    with torch.no_grad():
        logits = models[torch.float64](input_ids=torch.tensor([seqs[1]])).logits[0, :-1]
    want = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    # (The learner's answers are float32: one rounding of a float64 value, relative U at most.)
    assert torch.allclose(exact_ent[2:141].double(), want, rtol=2 * U, atol=1e-12)
    # And the agreement is not an accident of the data: the same row read as one sequence (each
    # attending to those before it) gives something else.
    ids = torch.tensor([[i for s in seqs for i in s]])
    pos = torch.tensor([[p for s in seqs for p in range(len(s))]])
    with torch.no_grad():
        leaky = models[torch.float32](input_ids=ids, use_cache=False).logits
    leaky_lp = torch.log_softmax(leaky[0, :-1].double(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert float((leaky_lp[pos[0, 1:] != 0] - exact).abs().max()) > 1e-2


def test_packed_gradients_are_the_sequences_own(models):
    """The gradient of a sum of packed log-probs is the sum of each sequence's own (fp32 noise
    measured against float64 as above)."""
    rng = random.Random(6)
    seqs = [[rng.randrange(5, VOCAB) for _ in range(k)] for k in (90, 4, 33)]

    def grads(model, packed: bool) -> dict:
        model.zero_grad()
        if packed:
            ids = torch.tensor([[i for s in seqs for i in s]])
            pos = torch.tensor([[p for s in seqs for p in range(len(s))]])
            token_logprobs(model, ids, None, position_ids=pos, chunk_tokens=32).sum().backward()
        else:
            for s in seqs:
                ids = torch.tensor([s])
                token_logprobs(model, ids, torch.ones_like(ids), chunk_tokens=32).sum().backward()
        return {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}

    f64, f32 = models[torch.float64], models[torch.float32]
    exact, alone, packed = grads(f64, False), grads(f32, False), grads(f32, True)
    for name in exact:
        noise = float((alone[name] - exact[name]).norm())
        floor = 2 * U * float(exact[name].norm())
        assert float((packed[name] - exact[name]).norm()) <= NOISE_FACTOR * noise + floor, name


def test_the_packed_attention_is_what_the_model_is_loaded_with(models):
    assert models[torch.float32].config._attn_implementation == PACKED_SDPA
    assert model_attention("eager") == "eager"


# -- liger-kernel's settings on a machine without CUDA ------------------------------------------
def test_liger_is_off_on_a_cpu_and_on_says_why(models):
    from services.learner import kernels

    model = models[torch.float32]
    assert kernels.enable(model, "auto", "cpu", 1) is False
    assert kernels.enable(model, "off", "cuda", 1) is False
    with pytest.raises(ValueError, match="liger: on, but the device is cpu"):
        kernels.enable(model, "on", "cpu", 1)
    # A family liger has no patch for is named with the ones it has.
    model.config.model_type, kept = "gemma3", model.config.model_type
    try:
        assert "no patch for model_type 'gemma3'" in kernels.why_not(model, "cuda")
    finally:
        model.config.model_type = kept
    # Nothing chose this model's output layer: the log-probs take the chunked PyTorch path.
    assert kernels.fused_logprobs(model.get_output_embeddings(), torch.device("cpu")) is None


def test_the_starts_of_a_new_row_are_its_own():
    """Every layer reads one row's starts from a cache; a new row's are found afresh, even where
    the new tensor takes the old one's place in memory (the cache holds the old one weakly)."""
    first = torch.tensor([[0, 1, 2, 0, 1]])
    assert sequence_starts(first) == [0, 3, 5]
    del first
    second = torch.tensor([[0, 1, 0, 1, 2]])
    assert sequence_starts(second) == [0, 2, 5]
    second[0, 2:] = torch.tensor([2, 3, 4])  # changed in place: one sequence now
    assert sequence_starts(second) is None
