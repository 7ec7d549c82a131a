"""Which GPUs each compose service gets on one node: writes docker-compose.gpus.yml.

Compose does not hand replicas distinct devices: with `count: 1`, every replica of `--scale
rollout=4` gets the same first GPU (docker/compose#11863, NVIDIA/nvidia-container-toolkit#521).
So each replica is a service of its own, `rollout`, `rollout-1`, ..., `rollout-k`, that extends
docker-compose.yml's `rollout` and names its own `device_ids`. The learner gets the first GPUs
(one rank each: `--nproc`), then each replica one, then the evaluator one; no device is given
twice unless --share asks for it.

    python3 deploy/compose_gpus.py                  # count the GPUs with nvidia-smi
    python3 deploy/compose_gpus.py --gpus 8         # learner 0-1, replicas 2-6, evaluator 7
    python3 deploy/compose_gpus.py --gpus 8 --learner-gpus 4 --evaluator off
    python3 deploy/compose_gpus.py --gpus 1 --share # learner and one replica on GPU 0

The one-shot `prior` step plays its episodes on the first replica's GPU: it ends before the
learner, the replicas and the evaluator start, so it shares a device with nobody.
Standard library only: it runs on the host, before any image is built.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "docker-compose.yml"
OUT = ROOT / "docker-compose.gpus.yml"
# Each generated replica waits for what docker-compose.yml's `rollout` waits for (declared again:
# `extends` does not carry depends_on in every Compose version).
ROLLOUT_DEPENDS = {
    "init": "service_completed_successfully",
    "learner": "service_healthy",
}
EVALUATOR_MODES = ("gpu", "cpu", "off")


class PlanError(ValueError):
    """No layout fits the request; the message says what to change."""


@dataclass(frozen=True)
class Layout:
    gpus: int
    learner: tuple[int, ...]  # empty: the learner trains on the CPU
    rollout: tuple[tuple[int, ...], ...]  # one entry per replica
    evaluator: str  # gpu | cpu | off
    evaluator_gpus: tuple[int, ...]
    share: bool = False

    def devices(self) -> dict[str, list[int]]:
        """Devices of every long-running service, by compose service name."""
        out = {"learner": list(self.learner)}
        out.update({replica_name(i): list(d) for i, d in enumerate(self.rollout)})
        out["evaluator"] = list(self.evaluator_gpus)
        return out

    def prior_gpus(self) -> list[int]:
        return list(self.rollout[0])


def replica_name(i: int) -> str:
    """`rollout` is replica 0 (the service docker-compose.yml defines); the others are numbered."""
    return "rollout" if i == 0 else f"rollout-{i}"


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def plan(
    gpus: int,
    learner_gpus: int | None = None,
    replicas: int | None = None,
    evaluator: str | None = None,
    share: bool = False,
) -> Layout:
    """The default layout: evaluator one GPU from 3 GPUs up (else off), learner a power of two
    up to half of the rest (one GPU up to 3), a replica on every GPU left."""
    if gpus < 1:
        raise PlanError("--gpus must be at least 1 (a CPU-only node needs no GPU file: see deploy/README.md)")
    evaluator = evaluator or ("gpu" if gpus >= 3 else "off")
    if evaluator not in EVALUATOR_MODES:
        raise PlanError(f"--evaluator must be one of {', '.join(EVALUATOR_MODES)}")
    e = 1 if evaluator == "gpu" else 0
    if learner_gpus is None:
        learner_gpus = 1 if gpus <= 3 else _pow2_floor((gpus - e) // 2)
    if learner_gpus < 0:
        raise PlanError("--learner-gpus must be >= 0 (0: the learner trains on the CPU)")
    if replicas is None:
        replicas = max(gpus - learner_gpus - e, 1 if share else 0)
    if replicas < 1:
        raise PlanError(
            f"{gpus} GPU(s) leave none for a rollout replica after the learner's {learner_gpus}"
            + (" and the evaluator's 1" if e else "")
            + ": give --share to put the learner and a replica on one device (lower the replicas' "
            "gpu_memory_utilization), --learner-gpus 0 to train on the CPU, or --evaluator cpu|off"
        )
    need = learner_gpus + replicas + e
    if need > gpus and not share:
        raise PlanError(
            f"learner {learner_gpus} + replicas {replicas} + evaluator {e} = {need} GPUs, but the node "
            f"has {gpus}: ask for fewer, or give --share to allow two processes on one device"
        )
    devices = itertools.cycle(range(gpus))  # sequential; wraps around only under --share
    learner = tuple(next(devices) for _ in range(learner_gpus))
    rollout = tuple((next(devices),) for _ in range(replicas))
    evaluator_gpus = (next(devices),) if e else ()
    return Layout(gpus, learner, rollout, evaluator, evaluator_gpus, share)


def problems(layout: Layout) -> list[str]:
    """Every device given twice (unless shared) or missing on the node; empty: the layout is good."""
    out, owner = [], {}
    for name, devices in layout.devices().items():
        for d in devices:
            if not 0 <= d < layout.gpus:
                out.append(f"GPU {d} (given to {name}) does not exist: the node has {layout.gpus}")
            elif d in owner and owner[d] != name and not layout.share:
                out.append(f"GPU {d} is given to both {owner[d]} and {name}")
            owner.setdefault(d, name)
    return out


def _devices(gpus: list[int], indent: str) -> str:
    ids = json.dumps([str(g) for g in gpus])
    return (
        f"{indent}deploy:\n{indent}  resources:\n{indent}    reservations:\n{indent}      devices:\n"
        f"{indent}        - driver: nvidia\n{indent}          device_ids: {ids}\n"
        f"{indent}          capabilities: [gpu]\n"
    )


def _describe(gpus: list[int]) -> str:
    if not gpus:
        return "no GPU (CPU)"
    return ("GPU " if len(gpus) == 1 else "GPUs ") + ",".join(map(str, gpus))


def render(layout: Layout, command: str, base: str = "docker-compose.yml") -> str:
    """The override file: device_ids per service, the replicas beyond the first, --nproc."""
    nproc = max(len(layout.learner), 1)
    lines = [
        f"# Generated by `{command}`: do not edit, run it again (deploy/README.md).",
        f"# Which GPUs each service sees on this {layout.gpus}-GPU node. Compose reads this file after",
        "# docker-compose.yml (COMPOSE_FILE in .env); don't `--scale rollout`: each replica is a service.",
    ]
    for name, gpus in layout.devices().items():
        note = f" ({nproc} rank{'s' if nproc > 1 else ''})" if name == "learner" else ""
        if name == "evaluator" and layout.evaluator == "off":
            note = " - off (start it with --profile evaluator)"
        lines.append(f"#   {name:<12} {_describe(gpus)}{note}")
    lines.append(
        f"#   {'prior':<12} {_describe(layout.prior_gpus())} (a one-shot step, done before the others start)"
    )
    if layout.share:
        lines.append("# --share: some devices serve two processes; lower gpu_memory_utilization (.env).")
    out = "\n".join(lines) + "\nservices:\n"
    out += f'  learner:\n    command: ["--nproc", "{nproc}", "--resume"]\n'
    if layout.learner:
        out += _devices(list(layout.learner), "    ")
    else:
        out += "    environment:\n      SPOPP_LEARNER_DTYPE: fp32  # no bf16 training on the CPU\n"
    out += "  prior:\n" + _devices(layout.prior_gpus(), "    ")
    for i, gpus in enumerate(layout.rollout):
        name = replica_name(i)
        out += f"  {name}:\n"
        if i:
            out += f"    extends:\n      file: {base}\n      service: rollout\n"
            out += f"    environment:\n      SPOPP_ROLLOUT_WORKER_ID: {name}\n    depends_on:\n"
            for dep, condition in ROLLOUT_DEPENDS.items():
                out += f"      {dep}:\n        condition: {condition}\n"
        out += _devices(list(gpus), "    ")
    out += "  evaluator:\n"
    if layout.evaluator == "gpu":
        out += _devices(list(layout.evaluator_gpus), "    ")
    else:
        # No GPU: the transformers engine on the CPU (vLLM's options from .env do not apply to
        # it), and with `off` only under its profile.
        out += "    environment:\n      SPOPP_EVALUATOR_ENGINE: transformers\n"
        out += '      SPOPP_EVALUATOR_ENGINE_OPTIONS: "{}"\n'
        if layout.evaluator == "off":
            out += "    profiles: [evaluator]\n"
    return out


def count_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        res = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in res.stdout.splitlines() if line.strip()) if res.returncode == 0 else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=None, help="GPUs on this node (default: nvidia-smi's count)")
    p.add_argument(
        "--learner-gpus", type=int, default=None, help="the learner's GPUs, one rank each (0: CPU)"
    )
    p.add_argument("--replicas", type=int, default=None, help="rollout replicas (default: every GPU left)")
    p.add_argument("--evaluator", choices=EVALUATOR_MODES, default=None,
                   help="its own GPU, the CPU, or off (default: gpu from 3 GPUs up, else off)")  # fmt: skip
    p.add_argument("--share", action="store_true", help="allow two processes on one device")
    p.add_argument("--out", default=str(OUT), help=f"file to write ('-': stdout; default {OUT.name})")
    a = p.parse_args(argv)
    gpus = a.gpus if a.gpus is not None else count_gpus()
    if gpus == 0 and a.gpus is None:
        print("compose_gpus: nvidia-smi finds no GPU here; give --gpus N", file=sys.stderr)
        return 2
    try:
        layout = plan(gpus, a.learner_gpus, a.replicas, a.evaluator, a.share)
    except PlanError as exc:
        print(f"compose_gpus: {exc}", file=sys.stderr)
        return 2
    bad = problems(layout)
    if bad:  # plan() never builds one; a guard for edits to it
        print("compose_gpus: " + "; ".join(bad), file=sys.stderr)
        return 2
    command = " ".join(["python3 deploy/compose_gpus.py", *argv])
    if a.out == "-":
        sys.stdout.write(render(layout, command))  # to be saved beside docker-compose.yml
        return 0
    out = Path(a.out).resolve()
    out.write_text(render(layout, command, os.path.relpath(BASE, out.parent)))
    for name, devices in layout.devices().items():
        print(f"{name:<12} {_describe(devices)}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
