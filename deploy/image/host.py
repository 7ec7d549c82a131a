"""Copy the build host's package-index settings into deploy/image/host/ for an image build.

    python3 deploy/image/host.py [--flavour cpu|gpu]

Image builds run pip in builder stages that see only the build context. Some hosts reach PyPI
through a TLS-inspecting proxy (its CA must be trusted) or a mirror (an index URL in pip's
configuration), and a CPU host may keep the CPU build of torch as a local wheel (PyPI's torch for
Linux is the CUDA build, gigabytes). This script copies exactly those three things: the CA bundle
pip uses, the http(s) index URLs of pip's configuration, and, for the CPU flavour, the local
wheels of the torch release that requirements.lock pins. Nothing is committed (.gitignore) and no
final image contains them (deploy/Dockerfile copies only the built venv out of the builder).
Standard library only: it runs on the host before anything is built.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "host"
LOCK = ROOT / "requirements.lock"
CA_CANDIDATES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def pip_config() -> dict[str, str]:
    """pip's effective settings (`pip config list`, then PIP_* variables, which win)."""
    found: dict[str, str] = {}
    try:
        text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                              text=True, timeout=60).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        text = ""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.split(".", 1)[-1].strip()] = value.strip().strip("'\"")
    for key, value in os.environ.items():
        if key.startswith("PIP_"):
            found[key[4:].lower().replace("_", "-")] = value
    return found


def remote(urls: str) -> list[str]:
    return [u for u in urls.split() if u.startswith(("http://", "https://"))]


def torch_version() -> str:
    m = re.search(r"^torch==(\S+)$", LOCK.read_text(), re.M)
    if not m:
        raise SystemExit("requirements.lock pins no torch")
    return m.group(1)


def local_wheels(config: dict[str, str], version: str) -> list[Path]:
    dirs = [Path(d.removeprefix("file://")) for d in config.get("find-links", "").split()]
    return sorted(w for d in dirs if d.is_dir() for w in d.glob(f"torch-{version}+cpu-*.whl"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavour", choices=("cpu", "gpu"), default="gpu")
    a = p.parse_args(argv)
    config = pip_config()
    for stale in ("ca-certificates.crt", "index-url", "extra-index-url"):
        (OUT / stale).unlink(missing_ok=True)
    shutil.rmtree(OUT / "wheels", ignore_errors=True)
    (OUT / "wheels").mkdir(parents=True)
    ca = next((c for c in (config.get("cert"), *CA_CANDIDATES) if c and Path(c).is_file()), None)
    if ca:
        shutil.copyfile(ca, OUT / "ca-certificates.crt")
    for key in ("index-url", "extra-index-url"):
        urls = remote(config.get(key, ""))
        if urls:
            (OUT / key).write_text(" ".join(urls) + "\n")
    wheels = local_wheels(config, torch_version()) if a.flavour == "cpu" else []
    for wheel in wheels:  # a hard link where the disk allows: the torch wheel is about 190 MB
        dest = OUT / "wheels" / wheel.name
        try:
            os.link(wheel, dest)
        except OSError:
            shutil.copy(wheel, dest)
    print(f"deploy/image/host: CA {ca or 'none (the image trusts its own)'}; "
          f"index {'from pip config' if (OUT / 'index-url').exists() else 'PyPI'}; "
          f"{len(wheels)} local wheel(s) {' '.join(w.name for w in wheels)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
