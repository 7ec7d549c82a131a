"""`make images-gpu`: the GPU images (deploy/Dockerfile, FLAVOUR=gpu) built on a machine without a
registry, then checked from the inside.

    python3 deploy/images_gpu.py [--targets tracker,learner,rollout] [--record FILE]

What it does, each step skipped when already done:
1. Docker, as `make compose-cpu` starts it (deploy/compose_cpu.py).
2. The base `spopp-ubuntu:noble`: `debootstrap --variant=minbase --components=main,universe noble`
   from Ubuntu's archive, checked against Ubuntu's archive keyring (taken from the archive's
   `ubuntu-keyring` package; Debian's debootstrap has no keyring of its own for Ubuntu), then
   `docker import`. It is the OS of the default GPU base, `nvidia/cuda:12.8.1-cudnn-runtime-
   ubuntu24.04` (Ubuntu 24.04, Python 3.12.3), without NVIDIA's CUDA user-space libraries: those
   are what PyPI's torch and vLLM wheels bring themselves (the `nvidia-*` packages of the lock), so
   the images' Python environments are the same on either base. Where a registry is reachable the
   CUDA base stays the default (`docker compose build` with docker-compose.gpu.yml).
3. The targets built with `docker build --network host` (the legacy builder) and `BASE=spopp-
   ubuntu:noble FLAVOUR=gpu`, tagged `spopp/<target>:gpu-local`, each step printed as it starts.
4. Checks inside each image: Python's version; torch's version, CUDA release and compiled GPU
   architectures; vLLM's and DeepSpeed's imports (where the image has them); the shared libraries
   torch's CUDA library needs, of which only the driver's (libcuda.so.1, mounted by NVIDIA's
   container toolkit on a GPU node) may be missing.
5. A table of sizes, build times and check results; `--record FILE` writes them as JSON.
Standard library only: it runs on the host before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compose_cpu  # noqa: E402 - this folder's sibling script
from compose_cpu import (  # noqa: E402
    UBUNTU_BASE_IMAGE,
    check_disk,
    ensure_docker,
    ensure_ubuntu_base,
    keep_stage_images,
    prune_stale_images,
    say,
    sh,
    stream_build,
)

ROOT = Path(__file__).resolve().parents[1]
BASE_IMAGE = UBUNTU_BASE_IMAGE
TAG = "gpu-local"
TARGETS = ("tracker", "learner", "rollout")
# The GPUs the images must run on, by compute capability: Ampere (A100 8.0, A10/A40 8.6), Ada (L4,
# L40S 8.9), Hopper (H100/H200 9.0). A cubin for sm_XY runs on any GPU of major X and minor Y or
# above (CUDA's binary compatibility), so Ada is served by sm_86 code where no sm_89 is compiled.
NEEDED_GPUS = {"Ampere": (8, 0), "Ada": (8, 9), "Hopper": (9, 0)}
# The shared library the node's driver provides (NVIDIA's container toolkit mounts it).
DRIVER_LIBS = ("libcuda.so.1",)

CHECK = r"""
import json, platform, sys, importlib.util, subprocess, glob, os
out = {"python": platform.python_version()}
if importlib.util.find_spec("torch"):
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cudnn"] = torch.backends.cudnn.version() if torch.version.cuda else None
    flags = torch._C._cuda_getArchFlags() if torch.version.cuda else ""
    out["archs"] = sorted(set(flags.split())) if flags else []
    lib = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cuda.so"))
    if lib:
        ldd = subprocess.run(["ldd", lib[0]], capture_output=True, text=True).stdout
        out["missing_libs"] = sorted({l.split()[0] for l in ldd.splitlines() if "not found" in l})
        out["cuda_libs"] = sorted({l.split()[0] for l in ldd.splitlines()
                                   if "=>" in l and "/nvidia/" in l.split("=>")[1]})
for name in ("vllm", "deepspeed"):
    if importlib.util.find_spec(name):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception as e:
            out[name] = f"import failed: {type(e).__name__}: {e}"
print(json.dumps(out))
"""


compose_cpu.PREFIX[0] = "images-gpu"  # say's lines, here and in the shared steps, say whose they are


def build(target: str) -> float:
    """Build one target, each Dockerfile step printed as it starts; its wall time."""
    t0 = time.monotonic()
    cmd = ["docker", "build", "--network", "host", "-f", str(ROOT / "deploy" / "Dockerfile"),
           "--target", target, "--build-arg", f"BASE={BASE_IMAGE}", "--build-arg", "FLAVOUR=gpu",
           "-t", f"spopp/{target}:{TAG}", str(ROOT)]  # fmt: skip
    keep_stage_images(stream_build(cmd, {**os.environ, "DOCKER_BUILDKIT": "0"}, target), "gpu")
    return time.monotonic() - t0


def size_mb(image: str) -> float:
    out = sh(["docker", "image", "inspect", "--format", "{{.Size}}", image], capture=True).stdout
    return int(out.strip()) / 2**20


def inspect(image: str) -> dict:
    done = sh(["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c", CHECK],
              check=False, capture=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"images-gpu: checking {image} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def runs_on(archs: list[str], cc: tuple[int, int]) -> str | None:
    """The compiled architecture (`sm_86`, ...) a GPU of compute capability `cc` runs: the newest
    cubin of its major at or below its minor; None when there is none."""
    fits = []
    for arch in archs:
        digits = arch.removeprefix("sm_").rstrip("af")
        if arch.startswith("sm_") and digits.isdigit() and len(digits) >= 2:
            major, minor = int(digits[:-1]), int(digits[-1])
            if major == cc[0] and minor <= cc[1]:
                fits.append((minor, arch))
    return max(fits)[1] if fits else None


def problems(target: str, found: dict) -> list[str]:
    """What a GPU image of `target` lacks."""
    out = []
    if not found["python"].startswith("3.12."):
        out.append(f"Python {found['python']}, not the CUDA base's 3.12")
    if target == "tracker":
        return out + (["the tracker image has torch"] if "torch" in found else [])
    if not found.get("cuda"):
        out.append(f"torch {found.get('torch')} is not a CUDA build")
    missing_archs = [name for name, cc in NEEDED_GPUS.items() if runs_on(found.get("archs", []), cc) is None]
    if missing_archs:
        out.append(f"torch has no code for {', '.join(missing_archs)} ({found.get('archs')})")
    missing = [lib for lib in found.get("missing_libs", []) if lib not in DRIVER_LIBS]
    if missing:
        out.append(f"libraries torch's CUDA library needs are missing: {', '.join(missing)}")
    for name in {"learner": ("deepspeed",), "rollout": ("vllm",)}[target]:
        if not str(found.get(name, "absent"))[:1].isdigit():
            out.append(f"{name}: {found.get(name, 'absent')}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated Dockerfile targets")
    p.add_argument("--record", type=Path, default=None, help="write sizes, times and checks here as JSON")
    a = p.parse_args(argv)
    targets = [t for t in a.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        p.error(f"--targets: unknown {', '.join(unknown)} (known: {', '.join(TARGETS)})")
    ensure_docker()
    t0 = time.monotonic()
    ensure_ubuntu_base()
    sh([sys.executable, str(ROOT / "deploy" / "image" / "host.py"), "--flavour", "gpu"])
    check_disk([BASE_IMAGE])
    record: dict = {"base": BASE_IMAGE, "images": {}}
    for target in targets:
        say(f"building {target} (FLAVOUR=gpu on {BASE_IMAGE})")
        seconds = build(target)
        image = f"spopp/{target}:{TAG}"
        found = inspect(image)
        record["images"][target] = {"build_s": round(seconds), "size_mib": round(size_mb(image)), **found}
        say(
            f"{image}: {record['images'][target]['size_mib']} MiB, built in {seconds:.0f} s; {json.dumps(found)}"
        )
    prune_stale_images([BASE_IMAGE])  # every stage built above is tagged: what is untagged is stale
    failed = {t: problems(t, r) for t, r in record["images"].items()}
    for r in record["images"].values():
        if r.get("archs"):
            r["runs_on"] = {name: runs_on(r["archs"], cc) for name, cc in NEEDED_GPUS.items()}
    print(f"\n{'image':<26}{'size MiB':>10}{'build s':>9}  python  torch / CUDA / archs")
    for target, r in record["images"].items():
        archs = ",".join(a.removeprefix("sm_") for a in r.get("archs", []))
        torch = f"{r.get('torch', '-')} / {r.get('cuda') or '-'} / {archs or '-'}"
        print(
            f"{'spopp/' + target + ':' + TAG:<26}{r['size_mib']:>10}{r['build_s']:>9}  {r['python']:<7} {torch}"
        )
    if a.record:
        a.record.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    bad = {t: why for t, why in failed.items() if why}
    for target, why in bad.items():
        print(f"images-gpu: {target}: {'; '.join(why)}", file=sys.stderr)
    say(f"{'checks failed' if bad else 'every check passed'} ({time.monotonic() - t0:.0f} s in all)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
