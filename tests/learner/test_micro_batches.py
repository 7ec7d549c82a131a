"""How an update's batch splits into micro-batches: by count and by a token budget.

The gradient equality of both ways against a plain PyTorch reference (ZeRO 0-3, one and two
processes) is in test_learner_update.py; here, the plans themselves, and what a token budget is
for: a batch with one very long episode, whose count-based micro-batch pads every row to that
episode, fits a memory limit that the count-based plan exceeds (measured as the bytes autograd
keeps for backward, on the real model).
"""

from __future__ import annotations

import random

import pytest

from services.config.learner import LearnerSettings
from services.learner.batch import accumulation_steps, pack_by_tokens, padded_tokens, plan_micro_batches


def _check_plan(plan, lengths, n_mini, world, budget=None):
    """Every trajectory exactly once, in its own mini-batch; equal counts per rank; the budget."""
    per = len(lengths) // n_mini
    for m, per_rank in enumerate(plan):
        rows = sorted(i for rank in per_rank for mb in rank for i in mb)
        assert rows == list(range(m * per, (m + 1) * per))
        assert len({len(rank) for rank in per_rank}) == 1, "ranks run different numbers of micro-batches"
        assert len({sum(map(len, rank)) for rank in per_rank}) == 1, "ranks hold different counts"
        for rank in per_rank:
            for mb in rank:
                assert mb, "an empty micro-batch"
                if budget is not None and len(mb) > 1:
                    assert padded_tokens(lengths, mb) <= budget


@pytest.mark.parametrize("seed", range(20))
def test_token_plans_cover_the_batch_within_the_budget(seed):
    rng = random.Random(seed)
    world = rng.choice([1, 2, 4])
    n_mini = rng.choice([1, 2, 4])
    n = world * n_mini * rng.randint(1, 6)
    lengths = [int(rng.lognormvariate(4, 1)) + 2 for _ in range(n)]
    budget = rng.choice([64, 256, 1024, 4096])
    plan = plan_micro_batches(lengths, n_mini, world, micro_batch_tokens=budget)
    _check_plan(plan, lengths, n_mini, world, budget)


def test_count_plan_is_the_contiguous_split():
    lengths = [5] * 8
    plan = plan_micro_batches(lengths, 2, 2, micro_batch_size=1)
    assert plan == [[[[0], [1]], [[2], [3]]], [[[4], [5]], [[6], [7]]]]
    plan = plan_micro_batches(lengths, 1, 1, micro_batch_size=3)
    assert plan == [[[[0, 1, 2], [3, 4, 5], [6, 7]]]]
    _check_plan(plan_micro_batches(list(range(2, 26)), 2, 3, micro_batch_size=2), list(range(2, 26)), 2, 3)


def test_packing_is_longest_first_and_greedy():
    lengths = [10, 50, 20, 40, 30]
    assert pack_by_tokens(lengths, range(5), 100) == [[1, 3], [4, 2, 0]]
    # A row longer than the budget goes alone; the rest still pack.
    assert pack_by_tokens([500, 10, 10], range(3), 100) == [[0], [1, 2]]


def test_snake_deal_balances_the_ranks_tokens():
    lengths = [100, 90, 80, 70, 60, 50, 40, 30]
    plan = plan_micro_batches(lengths, 1, 2, micro_batch_tokens=10_000)
    shares = [sum(lengths[i] for mb in rank for i in mb) for rank in plan[0]]
    # Round-robin would give 100+80+60+40 = 280 against 240; snake gives 260 each.
    assert shares == [260, 260]


def test_a_rank_with_fewer_micro_batches_splits_to_match():
    # Rank 0 gets 100 and 10 (2 micro-batches at 150); rank 1 gets 20 and 15 (1 at 150).
    lengths = [100, 20, 15, 10]
    plan = plan_micro_batches(lengths, 1, 2, micro_batch_tokens=150)
    assert [len(rank) for rank in plan[0]] == [2, 2]
    assert plan[0][1] == [[1], [2]]


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="give micro_batch_size or micro_batch_tokens"):
        plan_micro_batches([3] * 4, 1, 1)
    # A token budget wins over a count, as in the learner's settings (micro_batch_size is then unused).
    lengths = [30, 10, 20, 40]
    both = plan_micro_batches(lengths, 1, 1, micro_batch_size=1, micro_batch_tokens=64)
    assert both == plan_micro_batches(lengths, 1, 1, micro_batch_tokens=64) == [[[[3], [0, 2], [1]]]]
    with pytest.raises(ValueError, match="split evenly over 3 ranks"):
        plan_micro_batches([3] * 8, 1, 3, micro_batch_tokens=64)
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1"):
        pack_by_tokens([3], [0], 0)
    # By tokens, DeepSpeed is configured for the most micro-batches a step can have.
    assert accumulation_steps(8, 2, 2, 1, by_tokens=True) == 2
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        LearnerSettings(run="r", model="m", micro_batch_tokens=8)


def test_memory_settings_are_checked():
    with pytest.raises(ValueError, match="offload_params needs zero_stage 3"):
        LearnerSettings(run="r", model="m", zero_stage=2, offload_params=True)
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage 1, 2 or 3"):
        LearnerSettings(run="r", model="m", zero_stage=0, offload_optimizer=True)
    with pytest.raises(ValueError, match="attn_implementation"):
        LearnerSettings(run="r", model="m", attn_implementation="fast")
    ok = LearnerSettings(run="r", model="m", zero_stage=3, offload_params=True, offload_optimizer=True)
    assert ok.offload_params and ok.offload_optimizer


def test_flash_attention_without_its_package_is_a_clear_error(tiny_model, monkeypatch):
    import importlib.util

    from services.learner.deepspeed_engine import load_model

    real = importlib.util.find_spec
    # As on a machine without flash-attn (this one has none; the patch keeps the test honest where one has).
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real(name, *a)
    )
    with pytest.raises(ValueError, match="needs the flash-attn package"):
        load_model(tiny_model, None, "flash_attention_2")


def test_one_long_episode_fits_a_budget_that_count_based_micro_batches_exceed(tiny_model):
    """A batch of short episodes and one very long one. By count (4 a micro-batch) the long one
    pads three short ones to its length; by a token budget it goes alone and the short ones share.
    The memory limit is the plan's activation estimate for the budget (+10%); what autograd really
    keeps for each micro-batch is measured on the real model."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.logprobs import token_logprobs
    from services.learner.memory_plan import activation_bytes, model_shape, read_config, saved_bytes

    lengths = [60, 48, 900, 52, 64, 40, 56, 44]
    budget = 960
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).train()
    limit = 1.1 * activation_bytes(model_shape(read_config(tiny_model)), budget, "fp32")["saved"]
    gen = torch.Generator().manual_seed(0)

    def peak(plan) -> int:
        worst = 0
        for rows in plan[0][0]:
            width = max(lengths[i] for i in rows)
            ids = torch.randint(3, 300, (len(rows), width), generator=gen)
            mask = torch.zeros_like(ids)
            for r, i in enumerate(rows):
                mask[r, : lengths[i]] = 1
            forward = lambda ids=ids, mask=mask: token_logprobs(model, ids, mask).sum()  # noqa: E731
            worst = max(worst, saved_bytes(forward, list(model.parameters())))
        return worst

    by_count = plan_micro_batches(lengths, 1, 1, micro_batch_size=4)
    by_tokens = plan_micro_batches(lengths, 1, 1, micro_batch_tokens=budget)
    assert [2] in by_tokens[0][0]  # the long one alone
    assert peak(by_count) > limit >= peak(by_tokens)
