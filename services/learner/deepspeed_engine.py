"""The learner's DeepSpeed engine: process group, model, optimizer and ZeRO configuration.

The optimizer is a plain torch.optim.AdamW handed to deepspeed.initialize rather than named in the
config: DeepSpeed's own "AdamW" builds FusedAdam (a CUDA extension) and CPU offload builds CPUAdam,
both compiled at start-up, while ZeRO partitions a torch optimizer just as well. DeepSpeed's
dataloader, scheduler and loss scaling are not used: run_update feeds micro-batches itself, so the
batch settings here only tell DeepSpeed how many backward calls make one optimizer step.

Launch: under torchrun (or deepspeed) every rank finds RANK, WORLD_SIZE, ... in its environment.
A bare `python` process is a world of one: the same variables are filled in with a free local
port, so tests and single-process runs need no launcher.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

from services.config.learner import LearnerSettings

from .batch import accumulation_steps
from .lora import apply_lora
from .op_build import LockWatch, build_shm_op
from .zero3_state import forget_model


def init_distributed() -> tuple[int, int]:
    """Join (or create) the process group; returns (rank, world_size). Idempotent.

    gloo on CPU, NCCL on CUDA. Without a launcher's environment, this process becomes rank 0 of a
    world of one, met through an in-process store (the variables are only filled where unset, so a
    launcher's values always win).
    """
    import torch

    if not torch.cuda.is_available():
        # DeepSpeed picks its accelerator once, at first use; say it rather than rely on detection.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    alone = "WORLD_SIZE" not in os.environ
    if alone:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.setdefault("LOCAL_RANK", os.environ.get("RANK", "0"))

    import deepspeed
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if alone:
            # A world of one has no one to meet: an in-process store, and no TCP port. A port drawn
            # here could be one a launcher has handed to a replica that has not bound it yet.
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        with LockWatch():  # a live build that never ends would hang this silently (op_build.py)
            # DeepSpeed builds its CPU op in init_distributed under torch's lock file alone, which a
            # killed build leaves behind: built here first under a lock that dies with its holder,
            # the op is already loaded when DeepSpeed asks for it.
            build_shm_op()
            deepspeed.init_distributed(dist_backend=backend)  # takes the group above when there is one
    return dist.get_rank(), dist.get_world_size()


def seed_everything(seed: int) -> None:
    """Python, NumPy (when installed) and torch generators on every device."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % (1 << 32))


def deepspeed_config(cfg: LearnerSettings, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for `cfg` on `world_size` ranks."""
    by_tokens = cfg.micro_batch_tokens is not None
    gas = accumulation_steps(cfg.batch_size, cfg.mini_batches, world_size, cfg.micro_batch_size, by_tokens)
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _pin()}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": _pin()}
    if cfg.zero3_persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = cfg.zero3_persistence_threshold
    config = {
        # train_batch_size is left out: DeepSpeed derives it as micro * gas * world, which with a
        # short last micro-batch may exceed the real B; nothing here reads it.
        "train_micro_batch_size_per_gpu": 1 if by_tokens else cfg.micro_batch_size,
        "gradient_accumulation_steps": gas,
        "zero_optimization": zero,
        # 0 disables clipping in DeepSpeed.
        "gradient_clipping": float(cfg.grad_clip or 0.0),
        "bf16": {"enabled": cfg.dtype == "bf16"},
        "fp16": {"enabled": False},
        # ZeRO refuses optimizers it has not been tested with unless told; AdamW is elementwise,
        # so partitioning it is exact.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if cfg.offload_optimizer or cfg.offload_params:
        # Offloading otherwise insists on DeepSpeedCPUAdam, a C++ extension compiled at start-up;
        # torch's AdamW steps the CPU-resident fp32 partition just as exactly.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def _pin() -> bool:
    """Pinned host memory speeds up copies to and from a GPU; without one there is nothing to pin."""
    import torch

    return torch.cuda.is_available()


def load_model(path: str | Path, dtype: Any, attn_implementation: str = "sdpa") -> Any:
    """The causal LM in `path` with the chosen attention kernel; a clear error when the kernel's
    package is not installed (transformers' own message names a pip command, not the setting)."""
    from transformers import AutoModelForCausalLM

    if attn_implementation == "flash_attention_2":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is None:
            raise ValueError(
                "attn_implementation flash_attention_2 needs the flash-attn package (and a CUDA GPU); "
                "it is not installed here: use sdpa (the default) or install flash-attn"
            )
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)


def build_engine(cfg: LearnerSettings, model_dir: str | Path | None = None) -> tuple[Any, Any]:
    """(DeepSpeed engine, tokenizer) for the weights in `model_dir` (default: cfg.model).

    Every rank calls this with the same arguments. The model is loaded in the training dtype
    (bf16 or fp32); with bf16, DeepSpeed keeps fp32 master weights in the optimizer.
    """
    import deepspeed
    import torch
    from transformers import AutoTokenizer

    from . import kernels
    from .attention import model_attention

    _, world = init_distributed()
    seed_everything(cfg.seed)
    path = Path(model_dir if model_dir is not None else cfg.model)
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    model = load_model(path, dtype, model_attention(cfg.attn_implementation))
    # Caching key/values is for generation; in training it only costs memory.
    model.config.use_cache = False
    kernels.enable(model, cfg.liger, "cuda" if torch.cuda.is_available() else "cpu", cfg.zero_stage)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: works with inputs that need no grad and under ZeRO-3's hooks.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = apply_lora(
        model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
        target_modules=cfg.lora_target_modules, seed=cfg.seed,
    )  # fmt: skip
    model.train()
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(
        # Under LoRA only the adapters train: the optimizer (and ZeRO's partitions of it) holds them alone.
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
    )
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(cfg, world))
    return engine, tokenizer


def release_engine(engine: Any) -> None:
    """Destroy `engine` and drop what DeepSpeed's ZeRO-3 keeps of it in module-level state
    (zero3_state.py), so its weights, gradients and optimizer states can be freed: the learner
    builds one engine per process, but the bench and the tests build several in one."""
    import gc

    module = getattr(engine, "module", None)
    engine.destroy()
    forget_model(module)
    gc.collect()
