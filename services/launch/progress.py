"""The launcher's progress line, read from what the services already write.

    [spopp-s0] update 12/40 v12 | reward 0.531 | eval 0.612 @v8 | 9.8 episodes/s | 41s, ~1m35s left
    [spopp-s0] update 30/40 v30 | ... | restarts learner 1, rollout-1 2 | 3m02s, ~52s left

Updates and the training reward come from the learner's metrics.jsonl, the evaluation reward
from the evaluator's evals.jsonl, episodes/s from the tracker's outcome count: nothing new is
measured for the line, so it can never disagree with the records the report reads. When
`wandb` is on, the same records are mirrored to Weights & Biases as they appear.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Any

# The evaluation curve's metric: sampled episodes' mean reward (avg@k), else the greedy one.
EVAL_KEYS = ("eval/sampled/reward_mean", "eval/greedy/reward_mean")


def last_line(path: Path, tail_bytes: int = 65536) -> dict[str, Any] | None:
    """The last whole JSON line of `path` (None when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except FileNotFoundError:
        return None
    for raw in reversed(data.split(b"\n")):
        with contextlib.suppress(ValueError):
            line = json.loads(raw)
            if isinstance(line, dict):
                return line
    return None


def eval_points(path: Path) -> list[tuple[int, float, str]]:
    """(policy version, evaluation reward, metric) of each scored line of an evals.jsonl."""
    points = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    for raw in lines:
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        for key in EVAL_KEYS:
            if isinstance(line.get(key), int | float):
                points.append((int(line["policy_version"]), float(line[key]), key))
                break
    return points


class Progress:
    def __init__(self, plan, client, echo, restarts: dict[str, int] | None = None, tracker_up=None) -> None:
        """`restarts`: the launcher's live count per process (read at each line); `tracker_up()`:
        whether to ask the tracker now (not while supervision restarts it)."""
        self.restarts = restarts if restarts is not None else {}
        self.tracker_up = tracker_up or (lambda: True)
        self.plan = plan
        self.client = client
        self.echo = echo
        self.every = plan.launch.progress_seconds
        self.t0 = time.monotonic()
        self.last = -math.inf
        self.first_step: int | None = None
        self.rate: list[tuple[float, int]] = []  # (time, tracker outcomes) for episodes/s
        self.mirror = WandbMirror(plan) if plan.launch.wandb else None

    def tick(self, force: bool = False, waiting: str | None = None) -> None:
        now = time.monotonic()
        if self.mirror is not None:
            self.mirror.sync()
        if not force and now - self.last < self.every:
            return
        self.last = now
        self.echo(self.line(now, waiting))

    def line(self, now: float, waiting: str | None = None) -> str:
        p = self.plan
        s = p.launch
        m = last_line(p.run_dir / "learner" / "metrics.jsonl") or {}
        step = int(m.get("step", 0))
        if self.first_step is None:
            self.first_step = step
        parts = [f"[{s.run}] update {step}/{s.max_updates}"]
        if "reward_mean" in m:
            parts.append(f"reward {m['reward_mean']:.3f}")
        points = eval_points(p.run_dir / "eval" / "evals.jsonl")
        if points:
            parts.append(f"eval {points[-1][1]:.3f} @v{points[-1][0]}")
        # Not while supervision restarts the tracker; and the line must never stop the run.
        with contextlib.suppress(Exception):
            run = self.client.get_run(s.run) if self.tracker_up() else None
            if run is not None:
                parts[0] += f" v{run.policy_version}"
                self.rate.append((now, run.counts.outcomes))
                self.rate = self.rate[-6:]
                if len(self.rate) > 1 and self.rate[-1][0] > self.rate[0][0]:
                    (t_a, n_a), (t_b, n_b) = self.rate[0], self.rate[-1]
                    parts.append(f"{(n_b - n_a) / (t_b - t_a):.1f} episodes/s")
        if self.restarts:
            parts.append("restarts " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())))
        elapsed = now - self.t0
        done = step - (self.first_step or 0)
        clock = format_seconds(elapsed)
        if waiting:
            clock += f", {waiting}"
        elif done > 0 and step < s.max_updates:
            clock += f", ~{format_seconds(elapsed / done * (s.max_updates - step))} left"
        parts.append(clock)
        return " | ".join(parts)

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.sync()
            self.mirror.close()


class WandbMirror:
    """Mirrors the learner's and the evaluator's records to a W&B run in `run_dir/wandb`.

    Offline unless WANDB_MODE says otherwise, so it works without a network (`wandb sync` uploads
    later). The records stay the source of truth; this only copies new lines as they appear.
    """

    def __init__(self, plan) -> None:
        import os

        import wandb

        self.plan = plan
        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(
            project=plan.launch.wandb_project,
            name=plan.launch.run,
            dir=str(plan.run_dir),
            config=plan.identity() | {"arm": plan.arm(), "max_updates": plan.launch.max_updates},
            resume="allow",
            id=plan.launch.run.replace(":", "_"),
        )
        # Where the copy stopped, kept beside the W&B files: a resumed launch does not log twice.
        self.offsets_path = plan.run_dir / "wandb" / "offsets.json"
        self.offsets = {"learner": 0, "eval": 0}
        if self.offsets_path.is_file():
            with contextlib.suppress(ValueError, OSError):
                self.offsets.update(json.loads(self.offsets_path.read_text()))

    def _new_lines(self, key: str, path: Path) -> list[dict]:
        try:
            with path.open("rb") as f:
                f.seek(self.offsets[key])
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self.offsets[key] += len(whole)
        out = []
        for raw in whole.splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def sync(self) -> None:
        for line in self._new_lines("learner", self.plan.run_dir / "learner" / "metrics.jsonl"):
            values = {f"train/{k}": v for k, v in line.items() if isinstance(v, int | float) and k != "step"}
            self.run.log({**values, "update": line.get("step", 0)})
        for line in self._new_lines("eval", self.plan.run_dir / "eval" / "evals.jsonl"):
            values = {k: v for k, v in line.items() if k.startswith("eval/") and isinstance(v, int | float)}
            if values:
                self.run.log({**values, "policy_version": line["policy_version"]})
        tmp = self.offsets_path.with_name("offsets.json.tmp")
        tmp.write_text(json.dumps(self.offsets))
        tmp.replace(self.offsets_path)

    def close(self) -> None:
        self.run.finish()


def format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
