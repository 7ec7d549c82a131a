"""Training checkpoints for `spopp learner run --resume`.

Layout under `cfg.checkpoints`:

    step00000004/                  DeepSpeed's own folder (weights, optimizer, ZeRO partitions)
        mp_rank_00_model_states.pt ...
        learner_state.pt           rank 0: step, policy version, SPO drift cache, trajectory buffer
        rng_rank{r}.pt             every rank: python / numpy / torch (and CUDA) generator states
    latest                         "step00000004", written (tmp + rename) once the folder is complete

Every rank calls save_checkpoint and load_checkpoint (DeepSpeed's save and load are collective).
The `latest` pointer only ever names a finished checkpoint, so a learner killed mid-save resumes
from the previous one; the newest `keep` checkpoints are kept, older ones removed after `latest`
moves on.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

LATEST = "latest"
STATE = "learner_state.pt"


def _tag(step: int) -> str:
    return f"step{step:08d}"


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_tag(root: str | Path) -> str | None:
    """The tag the `latest` pointer names, when it names an existing folder."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if tag and (Path(root) / tag / STATE).is_file() else None


def save_checkpoint(engine: Any, root: str | Path, step: int, client_state: dict, keep: int = 2) -> Path:
    """Collective: every rank calls it. Answers the checkpoint folder."""
    import torch

    root = Path(root)
    tag = _tag(step)
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        # A folder left by a save that died before `latest` moved is incomplete: start it afresh.
        if (root / tag).exists() and latest_tag(root) != tag:
            shutil.rmtree(root / tag)
    _barrier()
    # save_latest=False: our own pointer is written below, after the learner state is on disk.
    engine.save_checkpoint(str(root), tag=tag, client_state={"step": step}, save_latest=False)
    folder = root / tag
    torch.save(_rng_state(), folder / f"rng_rank{rank}.pt")
    if rank == 0:
        torch.save(client_state, folder / STATE)
    _barrier()
    if rank == 0:
        _atomic_write(root / LATEST, tag + "\n")
        kept = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in kept[:-keep] if keep > 0 else []:
            if old.name != tag:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return folder


def load_checkpoint(engine: Any, root: str | Path) -> dict | None:
    """Collective: loads weights, optimizer and scheduler into `engine` and this rank's RNG states.

    Answers the learner state written by rank 0 (on every rank), or None when there is no
    complete checkpoint under `root`.
    """
    import torch

    root = Path(root)
    tag = latest_tag(root)
    if tag is None:
        return None
    path, _ = engine.load_checkpoint(
        str(root), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed could not load checkpoint {root / tag}")
    folder = root / tag
    rng = folder / f"rng_rank{_rank()}.pt"
    if not rng.is_file():  # a different world size: fall back to rank 0's generators
        rng = folder / "rng_rank0.pt"
    _set_rng_state(torch.load(rng, weights_only=False))
    state = torch.load(folder / STATE, weights_only=False)
    state["tag"] = tag
    return state
