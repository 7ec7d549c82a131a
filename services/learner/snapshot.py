"""Publishing the policy: full weights as an ordinary Hugging Face folder, atomically, newest K kept.

Layout under `root` (the naming, the manifest's `version` and `step` and the holds are the shared
contract in `spopp.files.snapshots`):

    v000007/                   one published policy version, never modified once it exists
      model.safetensors        full weights in the training dtype, tied aliases left out
      config.json, generation_config.json, tokenizer files   copied from the base model folder
      manifest.json            version, step (updates so far), sha256 and size of each weights
                               file, base model, time (`spopp.files.snapshots.Manifest`)
    v000008.tmp/               being written (or left by a crash; removed by the next publish)
    v000003.del/               being deleted (renamed first, so no half-deleted vNNNNNN exists)
    .holds/<holder>.json       an evaluator's hold: versions it has still to score

A consumer that sees `vNNNNNN/` sees it complete: the folder is written and fsynced under a
`.tmp` name and then renamed, which is atomic on one file system. Publishing a version whose
folder already exists succeeds only when the existing manifest names the same weights (the
re-publish of a learner that crashed after the rename); anything else is an error rather than a
silent change of a version replicas may already have loaded.

Pruning keeps the newest K snapshots and every version an unexpired hold covers (`v >=
from_version` and `v % every == 0`). That is all the learner knows of an evaluator: it never
waits for one, and a dead evaluator's hold expires by itself.

Under LoRA (`lora_rank` > 0) a snapshot carries the adapters alone by default (see
services/learner/lora.py): adapter_model.safetensors and adapter_config.json in PEFT's layout, and
the manifest, whose `lora` names rank, alpha and target modules and whose `base_model` is the base
the replicas keep. Only the adapters are gathered (ZeRO-3 included), so a publish moves megabytes.

Tied weights (lm_head = embed_tokens) are stored once, under the name the module registered
first, which is what save_pretrained writes; loaders re-tie from the config. Writing safetensors
directly avoids building a second model object on rank 0 just to call save_pretrained.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from spopp.files.adapters import ADAPTER_WEIGHTS, base_name
from spopp.files.snapshots import (
    Manifest,
    ManifestFile,
    held,
    list_snapshots,
    read_holds,
    read_manifest,
    version_dirname,
    write_manifest,
)

from .lora import adapter_state, is_lora, merged_state_dict, write_adapter_config

log = logging.getLogger("spopp.learner")

WEIGHTS_FILE = "model.safetensors"
# What a model folder needs besides its weights; copied when the base folder has them.
_AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def _zero_stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0


def gather_state_dict(engine: Any) -> dict[str, Any] | None:
    """The full state dict on CPU in the training dtype on rank 0, None on other ranks.

    Every rank must call it: under ZeRO-3 the parameters are partitioned and gathering them is a
    collective. Stages 0-2 keep whole parameters on every rank, so rank 0 reads its own module.
    """
    import torch.distributed as dist

    if _zero_stage(engine) == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
        return state if dist.get_rank() == 0 else None
    if dist.get_rank() != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def gather_adapter_state(engine: Any) -> dict[str, Any] | None:
    """The trainable (adapter) parameters on CPU on rank 0, None on other ranks; every rank calls
    it. Under ZeRO-3 only these few parameters are gathered, never the frozen base."""
    import torch.distributed as dist

    named = [(n, p) for n, p in engine.module.named_parameters() if p.requires_grad]
    gathered = contextlib.nullcontext()
    if _zero_stage(engine) == 3:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None)
    with gathered:
        return {n: p.detach().cpu().clone() for n, p in named} if dist.get_rank() == 0 else None


def tied_aliases(module: Any) -> set[str]:
    """Parameter names that share their tensor with a parameter registered earlier."""
    seen: set[int] = set()
    aliases = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        seen.add(id(p))
    return aliases


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # A directory's entries (new names, renames) are durable only once the directory is synced.
    _fsync_file(path)


def _clean_leftovers(root: Path) -> None:
    """Remove folders of interrupted publishes and deletions."""
    for p in root.iterdir():
        if p.is_dir() and p.name.startswith("v") and p.suffix in (".tmp", ".del"):
            shutil.rmtree(p)


def prune_snapshots(root: str | Path, keep: int, now: float | None = None) -> list[Path]:
    """Delete all but the newest `keep` snapshots, sparing every version an unexpired hold under
    `root/.holds/` covers (at unix time `now`, default the clock); returns the deleted paths."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    holds = read_holds(root, now)
    old = list_snapshots(root)[:-keep]
    doomed = [p for v, p in old if not held(v, holds)]
    spared = [v for v, _ in old if held(v, holds)]
    if spared:
        log.info(
            "pruning spares %d held snapshot(s), versions %d..%d (holders: %s)",
            len(spared),
            spared[0],
            spared[-1],
            ", ".join(h.holder for h in holds),
        )
    for p in doomed:
        _delete(p)
    return doomed


def _delete(folder: Path) -> None:
    # Rename first: a reader never finds a vNNNNNN folder with files missing.
    trash = folder.with_name(folder.name + ".del")
    folder.rename(trash)
    shutil.rmtree(trash)


def discard_unannounced(root: str | Path, announced: int) -> list[Path]:
    """Delete snapshots above version `announced`, the tracker's: a learner killed after writing
    one and before checkpointing it leaves a folder no replica can have loaded (replicas load
    only what the tracker announces), which the resumed learner writes again with its own
    weights. Answers the deleted paths."""
    doomed = [p for v, p in list_snapshots(root) if v > announced]
    for p in doomed:
        _delete(p)
    return doomed


def _write_folder(
    state: dict[str, Any],
    aliases: set[str],
    model_dir: Path,
    tmp: Path,
    version: int,
    step: int | None,
    lora_module: Any = None,
) -> Manifest:
    """Write the folder's files under `tmp`: full weights, or with `lora_module` (the PEFT model)
    the adapters of `state` alone."""
    from safetensors.torch import save_file

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json")
    tmp.mkdir()
    # Clones: tied or otherwise shared storage would make safetensors refuse the dict, and a
    # tensor that is a view into a bigger buffer would be written with its whole buffer.
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items() if k not in aliases}
    extra: dict[str, Any] = {}
    if lora_module is not None:
        weights = tmp / ADAPTER_WEIGHTS
        save_file(adapter_state(tensors), str(weights), metadata={"format": "pt"})
        write_adapter_config(lora_module, tmp, model_dir.resolve())
        config = lora_module.peft_config["default"]
        extra["lora"] = {
            "rank": config.r, "alpha": config.lora_alpha, "target_modules": sorted(config.target_modules),
        }  # fmt: skip
    else:
        weights = tmp / WEIGHTS_FILE
        save_file(tensors, str(weights), metadata={"format": "pt"})
        for name in _AUX_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, tmp / name)
    manifest = Manifest(
        version=version,
        step=step,
        files={weights.name: ManifestFile(sha256=_sha256(weights), bytes=weights.stat().st_size)},
        base_model=str(model_dir.resolve()),
        created_at=datetime.now(UTC).isoformat(),
        **extra,
    )
    write_manifest(tmp, manifest)
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    return manifest


def _existing_manifest(folder: Path) -> Manifest | None:
    """The manifest of a published folder; None when it has none or an unreadable one (either way
    not the same weights, so the publish refuses to touch the folder)."""
    try:
        return read_manifest(folder)
    except (FileNotFoundError, ValueError):
        return None


def publish_snapshot(
    engine: Any,
    model_dir: str | Path,
    root: str | Path,
    version: int,
    *,
    keep: int,
    step: int | None = None,
    lora_publish: str = "adapter",
) -> Path | None:
    """Write the engine's weights as snapshot `version` under `root`; every rank calls it.

    Returns the snapshot folder on rank 0 and None elsewhere. `model_dir` is the base model folder
    (config, generation config and tokenizer are copied from it); `step`, the number of updates
    behind these weights, goes into the manifest. A LoRA model publishes its adapters alone
    (`lora_publish` "adapter") or the merged full weights ("merged"). Afterwards the newest `keep` snapshots and the
    held ones are kept (see prune_snapshots). Raises FileExistsError when
    `root/vNNNNNN` exists with different weights, ValueError on a negative version or keep < 1.
    """
    if version < 0:
        raise ValueError(f"version must be >= 0, got {version}")
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    if lora_publish not in ("adapter", "merged"):
        raise ValueError(f"lora_publish must be 'adapter' or 'merged', got {lora_publish!r}")
    adapters_only = is_lora(engine.module) and lora_publish == "adapter"
    # Collective under ZeRO-3: before any rank-0-only branch.
    state = gather_adapter_state(engine) if adapters_only else gather_state_dict(engine)
    if state is None:
        return None
    aliases = set() if adapters_only else tied_aliases(engine.module)
    if is_lora(engine.module) and not adapters_only:
        # Full weights for replicas that take no adapters: merged into the base, under its names.
        state, aliases = merged_state_dict(state, engine.module), {base_name(a) for a in aliases}
    model_dir, root = Path(model_dir), Path(root)
    root.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(root)
    name = version_dirname(version)
    final, tmp = root / name, root / f"{name}.tmp"
    try:
        manifest = _write_folder(
            state, aliases, model_dir, tmp, version, step, engine.module if adapters_only else None
        )
        if final.exists():
            existing = _existing_manifest(final)
            if existing is None or not existing.same_weights(manifest):
                raise FileExistsError(f"{final} already exists with other weights")
            shutil.rmtree(tmp)
        else:
            os.rename(tmp, final)
            _fsync_dir(root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    prune_snapshots(root, keep)
    return final
