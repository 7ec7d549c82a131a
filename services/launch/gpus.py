"""Which GPUs each launched process sees: disjoint `CUDA_VISIBLE_DEVICES` sets, checked before start.

The plan names physical device indices per role (`learner: [0, 1]`, `rollout: [[2], [3]]`,
`evaluator: [4]`). Nothing is inferred: on a CPU machine every process gets an empty
`CUDA_VISIBLE_DEVICES`, so that no library grabs a device it was not given. Two processes on one
device is refused unless `share: true`, since vLLM sizes its cache from the free memory it finds
at start and a learner beside it would run out.
"""

from __future__ import annotations

from services.config.launch import GpuPlan


def assignment(plan: GpuPlan, replicas: int) -> dict[str, list[int]]:
    """Devices per process name (`learner`, `rollout-0`..., `evaluator`); empty lists on a CPU plan."""
    out = {"learner": list(plan.learner), "evaluator": list(plan.evaluator)}
    for i in range(replicas):
        out[f"rollout-{i}"] = list(plan.rollout[i]) if i < len(plan.rollout) else []
    return out


def check(plan: GpuPlan, replicas: int, available: int) -> list[str]:
    """Every problem with the plan on a machine of `available` devices (empty: the plan is good)."""
    problems = []
    if plan.rollout and len(plan.rollout) != replicas:
        problems.append(
            f"gpus.rollout lists devices for {len(plan.rollout)} replicas but rollout.replicas is {replicas}"
        )
    owner: dict[int, str] = {}
    for name, devices in assignment(plan, replicas).items():
        if len(set(devices)) != len(devices):
            problems.append(f"gpus for {name} name a device twice: {devices}")
        for d in devices:
            if d < 0 or d >= available:
                have = f"devices 0..{available - 1}" if available else "no GPU"
                problems.append(f"GPU {d} (given to {name}) does not exist: this machine has {have}")
            elif d in owner and not plan.share and owner[d] != name:
                problems.append(
                    f"GPU {d} is given to both {owner[d]} and {name}; set gpus.share: true to allow it"
                )
            owner.setdefault(d, name)
    return problems


def visible_devices(devices: list[int]) -> str:
    """The CUDA_VISIBLE_DEVICES value of a process given `devices` ('' hides every GPU)."""
    return ",".join(str(d) for d in devices)
