"""What DeepSpeed's ZeRO-3 keeps in module-level state (services/learner/zero3_state.py): an update
leaves its forward-module stack as it found it, also under gradient checkpointing, and a released
engine leaves nothing that keeps its model (and through it its GPU memory) alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from learner_worker import dist_env_restored, make_batch

from services.config.learner import LearnerSettings
from services.learner.backend import DeepSpeedBackend
from services.learner.deepspeed_engine import build_engine, release_engine
from services.learner.logprobs import token_logprobs
from services.learner.update import run_update
from services.learner.zero3_state import forward_stack_depth

# DeepSpeed on the CPU may build its communication op (ninja, a compiler).
pytestmark = pytest.mark.process
_dist_env = pytest.fixture(scope="module")(dist_env_restored)


def _settings(model, stage: int, ckpt: bool = False) -> LearnerSettings:
    return LearnerSettings(
        run="zero3-state", model=model, zero_stage=stage, batch_size=4, mini_batches=2, micro_batch_size=1,
        gradient_checkpointing=ckpt,
    )  # fmt: skip


def test_updates_leave_the_forward_stack_as_they_found_it(tiny_model, _dist_env):
    """ZeRO-3 with gradient checkpointing: torch's early-stopping recomputation skips the
    post-forward hooks that pop the stack. Without the trim it grew by 36 entries per update of the
    GPU bench's smoke model (37, 73, 109 after three updates); with it, it stays at its depth."""
    cfg = _settings(tiny_model, 3, ckpt=True)
    trajs, adv = make_batch(tiny_model, n=4)
    engine, _ = build_engine(cfg)
    try:
        depth = forward_stack_depth()
        assert depth >= 1  # the engine's own model, which ZeRO-3 pushes at start
        for _ in range(2):
            run_update(DeepSpeedBackend(engine), trajs, adv, cfg)
            assert forward_stack_depth() == depth
    finally:
        release_engine(engine)


@pytest.mark.parametrize(
    "stage,ckpt", [(2, False), (3, False), (3, True)], ids=["zero2", "zero3", "zero3-ckpt"]
)
def test_a_released_engine_lets_its_model_go(tiny_model, _dist_env, stage, ckpt):
    """After release_engine nothing keeps the model (its weights, and through them its gradients
    and optimizer states). With engine.destroy() alone ZeRO-3's module state kept it: on an H200,
    23 GiB of a 1.5B engine stayed allocated between the GPU bench's cases, enough to push later
    cases off an 80 GB card. ZeRO-3's replacement of torch.nn.functional.linear is undone too."""
    linear = torch.nn.functional.linear
    cfg = _settings(tiny_model, stage, ckpt)
    engine, _ = build_engine(cfg)
    ids = torch.randint(
        0, engine.module.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0)
    )
    # A forward and backward outside run_update (no trim): the coordinator records its trace and
    # caches by module, and a checkpointed backward leaves stale submodules on the stack.
    engine.backward(token_logprobs(engine, ids, torch.ones_like(ids)).sum())
    model, weight = weakref.ref(engine.module), weakref.ref(next(engine.module.parameters()))
    release_engine(engine)
    del engine
    gc.collect()
    assert model() is None and weight() is None
    assert torch.nn.functional.linear is linear
