"""Does this node's NVIDIA driver run this image's CUDA build of torch? Asked before any work.

A driver older than the CUDA release torch (and vLLM, built against the same one) was compiled for
fails at the first CUDA call: in a GPU image, after the model step, the prior and init have run.
Every spopp container asks here first (deploy/image/entrypoint.sh, `python3 -m spopp.machine.cuda_driver`):

* torch's CUDA release is read from the installed torch's `torch/version.py` as text (no import of
  torch or of a CUDA library; the tracker's image has no torch and is never stopped);
* the driver, from `nvidia-smi`'s banner: its version and the newest CUDA release it supports;
* the rule is CUDA's minor-version compatibility: a build for CUDA X.y runs on any driver that
  supports CUDA X (X.0 or newer); a driver of an older major does not (the images ship no
  `cuda-compat` forward-compatibility package).

No nvidia-smi (a CPU node, or a container given no GPU) is no verdict: the check passes with a line
saying so, and the process's own device errors speak later, as they do without this check.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from spopp.machine.gpus import GpuListError, NoNvidiaSmi, run_nvidia_smi

# The oldest Linux driver of each CUDA major (NVIDIA's CUDA toolkit release notes, "minor version
# compatibility"): what to tell a user whose driver is too old, and the fallback when nvidia-smi's
# banner names no CUDA release (very old tools).
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
EXIT_TOO_OLD = 78  # EX_CONFIG: the node's setup, not the program, is what must change


@dataclass(frozen=True)
class TorchBuild:
    version: str  # e.g. 2.13.0+cu130
    cuda: str | None  # the CUDA release it was built for, e.g. 13.0; None for a CPU build


@dataclass(frozen=True)
class Driver:
    version: str  # e.g. 550.54.15
    cuda: str | None  # the newest CUDA release it supports, e.g. 12.4 (None when not printed)


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text))


def torch_build(version_file: Path | None = None) -> TorchBuild | None:
    """The installed torch's build (None where torch is not installed), from its version.py."""
    if version_file is None:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        version_file = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    try:
        text = version_file.read_text()
    except OSError:
        return None
    version = re.search(r"^__version__\b.*?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\b.*?=\s*['\"]([0-9.]+)['\"]", text, re.M)
    return TorchBuild(version.group(1) if version else "?", cuda.group(1) if cuda else None)


def parse_banner(text: str) -> Driver | None:
    """The driver in `nvidia-smi`'s banner ("Driver Version: 550.54.15   CUDA Version: 12.4")."""
    version = re.search(r"Driver Version:\s*([0-9][0-9.]*)", text)
    if version is None:
        return None
    cuda = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", text)
    return Driver(version.group(1), cuda.group(1) if cuda else None)


def node_driver(timeout: float = 30.0) -> Driver | None:
    """The node's driver as nvidia-smi reports it; None where there is no nvidia-smi.
    RuntimeError when nvidia-smi is there but fails: a broken driver install, worth stopping for."""
    try:
        out = run_nvidia_smi([], timeout)
    except NoNvidiaSmi:
        return None
    except GpuListError as e:
        raise RuntimeError(str(e)) from None
    driver = parse_banner(out)
    if driver is None:
        raise RuntimeError(f"nvidia-smi printed no driver version: {out.strip()[:200]!r}")
    return driver


def verdict(build: TorchBuild, driver: Driver) -> str | None:
    """None when `driver` runs `build`; else the one line that says why not and what to do."""
    if build.cuda is None:
        return None
    need_major = _release(build.cuda)[0]
    if driver.cuda is not None:
        fits = _release(driver.cuda)[0] >= need_major
        has = f"driver {driver.version}, which supports CUDA up to {driver.cuda}"
    else:  # an nvidia-smi too old to print its CUDA release: judge by the driver's own version
        oldest = MIN_DRIVER.get(need_major)
        fits = oldest is not None and _release(driver.version) >= _release(oldest)
        has = f"driver {driver.version}"
    if fits:
        return None
    oldest = MIN_DRIVER.get(need_major, "one that supports CUDA " + str(need_major))
    return (
        f"this image's torch {build.version} is built for CUDA {build.cuda}, which needs an NVIDIA driver "
        f"{oldest} or newer (CUDA {need_major}.x); this node has {has}. Upgrade the node's driver, or "
        f"build the images for the node's CUDA (deploy/README.md, GPU drivers)"
    )


def refusal(version_file: Path | None = None) -> str | None:
    """Why this node cannot run the installed torch (a driver too old, an nvidia-smi that fails);
    None when it can or there is nothing to judge (no torch, a CPU build, no nvidia-smi)."""
    build = torch_build(version_file)
    if build is None or build.cuda is None:
        return None
    try:
        driver = node_driver()
    except RuntimeError as e:
        return f"driver check: {e}"
    return None if driver is None else verdict(build, driver)


def main(argv: list[str] | None = None) -> int:
    why = refusal()
    if why is not None:
        print(f"spopp: {why}", file=sys.stderr)
        return EXIT_TOO_OLD
    build = torch_build()
    if build is not None and build.cuda is not None and shutil.which("nvidia-smi") is None:
        print(
            f"spopp: driver check: no nvidia-smi in this container (no GPU given to it); torch "
            f"{build.version} (CUDA {build.cuda}) not checked against a driver",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
