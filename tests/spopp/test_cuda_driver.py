"""The driver check every container runs first (spopp/machine/cuda_driver.py, deploy/image/entrypoint.sh):
a node whose NVIDIA driver is older than the image's CUDA build of torch is refused before any
work, with one line naming both; a fitting driver, a CPU torch or no GPU at all pass.

nvidia-smi is a fake (a script printing the banner of a real driver) and torch's build is a
version.py written here: the machine has neither a GPU nor a CUDA torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spopp.machine.cuda_driver import EXIT_TOO_OLD, Driver, TorchBuild, parse_banner, torch_build, verdict

ROOT = Path(__file__).resolve().parents[2]


def banner(driver: str, cuda: str | None) -> str:
    """The top of `nvidia-smi`'s output as drivers of this generation print it."""
    cuda_part = f"CUDA Version: {cuda}" if cuda else ""
    return (
        "+-----------------------------------------------------------------------------------------+\n"
        f"| NVIDIA-SMI {driver}              Driver Version: {driver}      {cuda_part}     |\n"
        "|-----------------------------------------+------------------------+----------------------+\n"
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |\n"
        "|   0  NVIDIA H100 80GB HBM3          On  |   00000000:18:00.0 Off |                    0 |\n"
    )


CU130 = TorchBuild("2.13.0+cu130", "13.0")
CU128 = TorchBuild("2.13.0+cu128", "12.8")


def test_the_banner_gives_the_driver_and_its_cuda():
    assert parse_banner(banner("550.54.15", "12.4")) == Driver("550.54.15", "12.4")
    assert parse_banner(banner("580.65.06", "13.0")) == Driver("580.65.06", "13.0")
    assert parse_banner(banner("470.82.01", None)) == Driver("470.82.01", None)
    assert parse_banner("No devices were found") is None


@pytest.mark.parametrize(
    "build, driver, refused",
    [
        (CU130, Driver("580.65.06", "13.0"), False),
        (CU130, Driver("590.10", "13.1"), False),
        (CU130, Driver("550.54.15", "12.4"), True),  # PyPI's wheels of this generation on a CUDA 12 node
        (CU128, Driver("550.54.15", "12.4"), False),  # minor-version compatibility: 12.8 on a 12.4 driver
        (CU128, Driver("525.60.13", "12.0"), False),
        (CU128, Driver("470.82.01", "11.4"), True),
        (CU130, Driver("575.57.08", None), True),  # no CUDA in the banner: by the driver's version
        (CU130, Driver("580.95.05", None), False),
        (TorchBuild("2.13.0+cpu", None), Driver("470.82.01", "11.4"), False),  # a CPU build needs no driver
    ],
)
def test_a_driver_runs_builds_of_its_cuda_major_or_older(build, driver, refused):
    assert (verdict(build, driver) is not None) == refused


def test_the_refusal_names_both_and_what_to_do():
    why = verdict(CU130, Driver("550.54.15", "12.4"))
    assert "torch 2.13.0+cu130" in why and "CUDA 13.0" in why and "580.65.06 or newer" in why
    assert "driver 550.54.15" in why and "up to 12.4" in why and "deploy/README.md" in why
    assert "\n" not in why


def test_torch_build_reads_version_py_without_importing_torch(tmp_path):
    (tmp_path / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.13.0+cu130'\ngit_version = 'abc'\n"
        "debug = False\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n"
    )
    assert torch_build(tmp_path / "version.py") == CU130
    # This machine's torch is the CPU build: no CUDA to check.
    assert torch_build().cuda is None
    assert torch_build(tmp_path / "missing.py") is None


def fake_node(tmp_path: Path, smi: str | None, torch_cuda: str | None) -> dict:
    """An environment whose nvidia-smi prints `smi` (a shell body; None: no nvidia-smi) and whose
    torch is a package with only version.py, built for `torch_cuda`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "cat"):  # the entrypoint's needs and the fake's, nothing else of PATH
        (bin_dir / tool).symlink_to(subprocess.check_output(["which", tool], text=True).strip())
    # `python3` is the interpreter running the suite, not PATH's: that may be a shim (pyenv's is a
    # bash script, and bash is not on this PATH), and a link to a venv's python would lose the venv.
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text("raise ImportError('the check must not import torch')\n")
    cuda = repr(torch_cuda)
    (site / "torch" / "version.py").write_text(f"__version__ = '2.13.0+test'\ncuda = {cuda}\n")
    return {
        "PATH": str(bin_dir),
        "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]),
        "SPOPP_SECRETS_DIR": str(tmp_path / "no-secrets"),
        "HOME": str(tmp_path),
    }


def entrypoint(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["sh", str(ROOT / "deploy" / "image" / "entrypoint.sh"), "sh", "-c", "echo the service ran"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.process
def test_the_entrypoint_stops_on_an_old_driver_before_the_service(tmp_path):
    smi = f"cat <<'EOF'\n{banner('550.54.15', '12.4')}EOF"
    done = entrypoint(fake_node(tmp_path, smi, "13.0"))
    assert done.returncode == EXIT_TOO_OLD, done
    assert "the service ran" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA 13.0" in lines[0] and "driver 550.54.15" in lines[0]


@pytest.mark.process
@pytest.mark.parametrize(
    "smi, torch_cuda, says",
    [
        (f"cat <<'EOF'\n{banner('580.65.06', '13.0')}EOF", "13.0", ""),
        (None, "13.0", "no nvidia-smi in this container"),  # a container given no GPU
        (f"cat <<'EOF'\n{banner('470.82.01', '11.4')}EOF", None, ""),  # a CPU torch
    ],
)
def test_the_entrypoint_runs_the_service_when_the_driver_fits_or_there_is_none(
    tmp_path, smi, torch_cuda, says
):
    done = entrypoint(fake_node(tmp_path, smi, torch_cuda))
    assert done.returncode == 0, done
    assert done.stdout.strip() == "the service ran"
    assert says in done.stderr


@pytest.mark.process
def test_a_failing_nvidia_smi_stops_the_container_with_its_error(tmp_path):
    done = entrypoint(
        fake_node(
            tmp_path, "echo 'Failed to initialize NVML: Driver/library version mismatch' >&2; exit 18", "13.0"
        )
    )
    assert done.returncode == EXIT_TOO_OLD
    assert "Driver/library version mismatch" in done.stderr and "the service ran" not in done.stdout


@pytest.mark.process
def test_the_check_can_be_turned_off(tmp_path):
    env = fake_node(tmp_path, f"cat <<'EOF'\n{banner('550.54.15', '12.4')}EOF", "13.0")
    done = entrypoint({**env, "SPOPP_DRIVER_CHECK": "0"})
    assert done.returncode == 0 and done.stdout.strip() == "the service ran"


@pytest.mark.process
def test_refusal_asks_the_nodes_nvidia_smi(tmp_path, monkeypatch):
    """What `spopp launch` asks before it starts a GPU plan (services/launch/run.py)."""
    from spopp.machine.cuda_driver import refusal

    env = fake_node(tmp_path, f"cat <<'EOF'\n{banner('550.54.15', '12.4')}EOF", "13.0")
    version_file = Path(env["PYTHONPATH"].split(os.pathsep)[0]) / "torch" / "version.py"
    monkeypatch.setenv("PATH", env["PATH"])
    assert "CUDA 13.0" in refusal(version_file) and "550.54.15" in refusal(version_file)
    (tmp_path / "bin" / "nvidia-smi").unlink()
    assert refusal(version_file) is None  # no nvidia-smi: nothing to judge
    assert refusal(tmp_path / "no-torch" / "version.py") is None
