"""`make chaos`: the demo's configuration under `spopp launch` with several replicas, while random
children are SIGKILLed at random times; then whether the run came through whole.

    python -m tools.chaos [--out chaos-out] [--replicas 3] [--max-updates 120] [--kills 6] [--seed 0]

The run is the demo's launch config (tools/demo.py: rollout, learner and evaluator sections) on
an untrained toy model and generated toy-calc tasks, so it needs no cold start. Once the learner
has made its first update, a victim is drawn every few seconds (seeded): every kind of process
(tracker, learner, a replica, the evaluator) at least once, the rest at random, each killed only
while it runs. The launcher's supervision restarts each. At the end, from what the run left:

- updates: the learner's steps are 1..U, each once, and the run is finished at its budget;
- outcomes: every dispatch the tracker made ended exactly one way (outcome, release, expiry or a
  lease still in flight), the per-task evidence adds up to the outcomes counted and so do the
  per-replica counts (lost: fewer than that, doubled: more);
- versions published once: policy versions 0..U-1 each trained on once, evaluations strictly
  increasing to the last one, no snapshot written twice with other weights;
- no process of the run outlives the launcher.

One summary line, `chaos.json` with the details (kills, each restart's downtime by kind), and
exit 0 only if everything holds.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import yaml

from tools.demo import TINY, base_config

KINDS = ("tracker", "learner", "rollout", "evaluator")
UP_AGAIN = re.compile(r"^(\S+) is up again \(pid \d+; down ([0-9.]+) s\)")


def say(text: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {text}", flush=True)


def prepare(out: Path, replicas: int, max_updates: int) -> Path:
    """The toy model, tasks and launch config under `out` (kept between runs); answers the config."""
    from runtime.envs.toy_calc import write_toy_calc_tasks
    from tools.toy_model import build_toy_model

    if not (out / "model" / "config.json").is_file():
        build_toy_model(out / "model", seed=0)
    write_toy_calc_tasks(out / "data", seed=0, n_train=64, n_heldout=16)
    cfg = base_config(
        out, {**TINY, "max_updates": max_updates, "batch_size": 32, "eval_every": 4}, wandb=False
    )
    cfg.update(
        model=str(out / "model"), prior=None, run="chaos", run_dir=str(out / "run"), progress_seconds=15,
        supervision={"max_restarts": 10, "window_seconds": 600, "backoff_seconds": 1, "max_backoff_seconds": 8},
    )  # fmt: skip
    cfg.pop("prior")
    cfg["rollout"] = {**cfg["rollout"], "replicas": replicas, "concurrency": 16}
    cfg["evaluator"] = {**cfg["evaluator"], "concurrency": 16}
    path = out / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launched_child(launcher: int, name: str) -> psutil.Process | None:
    """The launcher's child `name` (started with --config <run_dir>/config/<name>.yaml), or None
    while it has none (a child being restarted)."""
    try:
        children = psutil.Process(launcher).children()
    except psutil.NoSuchProcess:
        return None
    for p in children:
        try:
            if any(arg.endswith(f"/config/{name}.yaml") for arg in p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            continue
    return None


class Descendants(threading.Thread):
    """Every pid ever below `pid`, sampled every 0.1 s until the process is gone or `halt` is set;
    `left()` answers those still running (not zombies): a run's orphans, once it is over."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.seen, self.halt = pid, set(), threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                self.seen |= {p.pid for p in psutil.Process(self.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    def left(self) -> list[psutil.Process]:
        alive = []
        for pid in self.seen:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.NoSuchProcess:
                pass
        return alive

    def gone(self, timeout: float) -> list[psutil.Process]:
        """Stop sampling and wait up to `timeout` s for every one to exit; answers those left."""
        self.halt.set()
        psutil.wait_procs(self.left(), timeout=timeout)
        return self.left()


class Launch:
    """`spopp launch` in a child process, its output kept in a file and echoed as it comes."""

    def __init__(self, config: Path, log: Path) -> None:
        self.log_path = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "launch", str(config)],
            stdout=log.open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.descendants = Descendants(self.proc.pid)
        self.descendants.start()
        self._echoed = 0

    def tick(self) -> None:
        """Echo new output."""
        text = self.log_path.read_text(errors="replace")
        for line in text[self._echoed :].splitlines(keepends=True):
            if not line.endswith("\n"):
                break
            print("  " + line, end="", flush=True)
            self._echoed += len(line)

    def child(self, name: str) -> psutil.Process | None:
        return launched_child(self.proc.pid, name)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "learner" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


def plan_kills(rng: random.Random, kills: int, replicas: int) -> list[str]:
    """Every kind once in a random order, then random kinds; a replica kind names one replica."""
    kinds = list(KINDS)
    rng.shuffle(kinds)
    kinds += [rng.choice(KINDS) for _ in range(max(0, kills - len(kinds)))]
    return [f"rollout-{rng.randrange(replicas)}" if k == "rollout" else k for k in kinds]


def wait(launch: Launch, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and launch.proc.poll() is None:
        launch.tick()
        time.sleep(0.2)


def unleash(launch: Launch, victims: list[str], rng: random.Random, run_dir: Path, budget: int) -> list[dict]:
    """Kill each victim in turn at a random moment while the run trains; answers the kills made."""
    while not steps(run_dir):
        if launch.proc.poll() is not None:
            raise SystemExit(f"chaos: the launch ended before its first update:\n{launch.text()[-3000:]}")
        wait(launch, 0.5)
    made = []
    for victim in victims:
        wait(launch, rng.uniform(6.0, 24.0))  # spread over the run (about 3 minutes here)
        target = None
        while launch.proc.poll() is None and len(steps(run_dir)) < budget:
            target = launch.child(victim)  # absent while it is being restarted: wait for it
            if target is not None:
                break
            wait(launch, 0.5)
        if target is None or launch.proc.poll() is not None or len(steps(run_dir)) >= budget:
            say(f"the run reached its end before {victim} could be killed")
            break
        with_update = len(steps(run_dir))
        target.send_signal(signal.SIGKILL)
        made.append({"victim": victim, "pid": target.pid, "at_update": with_update, "time": time.time()})
        say(f"kill {len(made)}: {victim} (pid {target.pid}) at update {with_update}")
    return made


def check(run_dir: Path, budget: int, out_text: str) -> dict:
    state = json.loads((run_dir / "run.json").read_text())
    records = steps(run_dir)
    counts = state.get("tracker_counts") or {}
    export = [json.loads(x) for x in (run_dir / "export.jsonl").read_text().splitlines()]
    evals = [
        json.loads(x)["policy_version"] for x in (run_dir / "eval" / "evals.jsonl").read_text().splitlines()
    ]
    ended = sum(counts.get(k, 0) for k in ("outcomes", "releases", "expirations", "in_flight"))
    evidence = sum(row["outcomes"] for row in export)
    per_worker = sum(w["outcomes"] for w in (state.get("workers") or {}).values())
    outcomes = counts.get("outcomes", 0)
    lost = (
        max(0, counts.get("dispatches", 0) - ended)
        + max(0, outcomes - evidence)
        + max(0, outcomes - per_worker)
    )
    doubled = (
        max(0, ended - counts.get("dispatches", 0))
        + max(0, evidence - outcomes)
        + max(0, per_worker - outcomes)
    )
    once = (
        [r["step"] for r in records] == list(range(1, budget + 1))
        and [r["policy_version"] for r in records] == list(range(budget))
        and evals == sorted(set(evals)) and evals[-1:] == [budget]
        and "already exists with other weights" not in (run_dir / "logs" / "learner.log").read_text()
    )  # fmt: skip
    down: dict[str, list[float]] = defaultdict(list)
    for line in out_text.splitlines():
        if m := UP_AGAIN.match(line):
            down["rollout" if m[1].startswith("rollout") else m[1]].append(float(m[2]))
    return {
        "status": state.get("status"), "updates": len(records), "budget": budget,
        "restarts": state.get("restarts", {}), "counts": counts, "evidence_outcomes": evidence,
        "worker_outcomes": per_worker, "lost": lost, "doubled": doubled, "published_once": once,
        "downtime_seconds": {k: sorted(v) for k, v in down.items()},
    }  # fmt: skip


def training_lost(records: list[dict], kills: list[dict]) -> list[dict]:
    """Per kill, the training time it cost: the gap between the updates on either side of it less
    the run's median gap. Kills that land in one gap share its stall, which is put on the first
    of them (the others are `during` it)."""
    times = [r["time"] for r in records]
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    median = gaps[len(gaps) // 2] if gaps else 0.0
    out, seen = [], {}
    for k in kills:
        i = next((j for j, t in enumerate(times) if t > k["time"]), None)
        if i is None or i == 0:
            out.append({"victim": k["victim"], "lost_seconds": None})
            continue
        if i in seen:
            out.append({"victim": k["victim"], "lost_seconds": 0.0, "during": seen[i]})
            continue
        seen[i] = k["victim"]
        out.append(
            {"victim": k["victim"], "lost_seconds": round(max(0.0, times[i] - times[i - 1] - median), 1)}
        )
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, its bounds checked (argparse's usage error otherwise)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("chaos-out"), help="folder of the run (made anew)")
    p.add_argument("--replicas", type=int, default=3, help="rollout replicas")
    p.add_argument(
        "--max-updates", type=int, default=120, help="the run's budget in learner updates (a multiple of 4)"
    )
    p.add_argument("--kills", type=int, default=6, help="kills to make (at least one of each kind: 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the victims and their moments")
    a = p.parse_args(argv)
    if a.kills < len(KINDS) or a.replicas < 1 or a.max_updates < 8 or a.max_updates % 4:
        p.error(f"--kills at least {len(KINDS)}, --replicas at least 1, --max-updates a multiple of 4 from 8")
    return a


def main(argv: list[str] | None = None) -> int:
    a = _parse_args(argv)
    run_dir = a.out / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)  # a fresh run each time: a resumed one would not be killed mid-run
    a.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t0 = time.monotonic()
    config = prepare(a.out, a.replicas, a.max_updates)
    victims = plan_kills(rng, a.kills, a.replicas)
    say(f"{a.replicas} replicas, {a.max_updates} updates; victims in order: {', '.join(victims)}")
    launch = Launch(config, a.out / "launch.log")
    try:
        kills = unleash(launch, victims, rng, run_dir, a.max_updates)
        while launch.proc.poll() is None:
            wait(launch, 1.0)
            if time.monotonic() - t0 > 1800:
                raise SystemExit("chaos: the run took over 30 minutes")
        launch.tick()
    finally:
        if launch.proc.poll() is None:
            launch.proc.send_signal(signal.SIGINT)
            launch.proc.wait(120)
    orphans = [p.pid for p in launch.descendants.gone(20)]
    result = check(run_dir, a.max_updates, launch.text())
    result.update(
        kills=kills,
        seconds=round(time.monotonic() - t0, 1),
        orphans=orphans,
        exit_code=launch.proc.returncode,
        training_lost=training_lost(steps(run_dir), kills),
    )
    (a.out / "chaos.json").write_text(json.dumps(result, indent=2) + "\n")
    _say_summary(result, kills, a.max_updates)
    problems = _problems(result, kills, orphans, launch.proc.returncode)
    for problem in problems:
        say("FAILED: " + problem)
    say(f"{a.out / 'chaos.json'}; {result['seconds']:.0f} s in all")
    return 1 if problems else 0


def _say_summary(result: dict, kills: list[dict], max_updates: int) -> None:
    """The outages, the training time each kill cost, and the one summary line."""
    restarts = sum(result["restarts"].values())
    say(
        "outage per restart (launcher: death seen until its health route answers again; a kill that "
        "lands while the process is still coming back extends the same outage), by kind: "
        + "; ".join(
            f"{k} {', '.join(f'{s:.1f}' for s in v)} s" for k, v in sorted(result["downtime_seconds"].items())
        )
    )
    say(
        "training time lost per kill (the gap in updates around it less the median gap): "
        + "; ".join(
            f"{t['victim']} " + (f"within {t['during']}'s" if "during" in t else f"{t['lost_seconds']} s")
            for t in result["training_lost"]
        )
    )
    print(
        f"chaos: kills {len(kills)}, restarts {restarts}, updates {result['updates']}/{max_updates}, "
        f"outcomes lost {result['lost']}, doubled {result['doubled']}, "
        f"versions published once: {'yes' if result['published_once'] else 'no'}",
        flush=True,
    )


def _problems(result: dict, kills: list[dict], orphans: list[int], exit_code: int | None) -> list[str]:
    """The checks of the module's list that the run failed; none when everything holds."""
    kinds_killed = {"rollout" if k["victim"].startswith("rollout") else k["victim"] for k in kills}
    restarts = sum(result["restarts"].values())
    problems = []
    if len(kills) < 5 or kinds_killed != set(KINDS):
        problems.append(f"{len(kills)} kills of kinds {sorted(kinds_killed)}: at least 5, every kind")
    if result["status"] != "finished" or exit_code != 0:
        problems.append(f"the run ended {result['status']} (launcher exit {exit_code})")
    if restarts != len(kills):
        problems.append(f"{restarts} restarts for {len(kills)} kills")
    if result["lost"] or result["doubled"] or not result["published_once"]:
        problems.append("outcomes lost or doubled, or a version not published exactly once")
    if orphans:
        problems.append(f"processes outlived the run: {orphans}")
    return problems


if __name__ == "__main__":
    raise SystemExit(main())
