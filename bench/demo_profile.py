"""Where the time of a demo run goes: updates per hour, the learner waiting for data, the
replicas draining and swapping weights; and what bounded staleness buys.

Runs of `make demo`'s configuration (SPO++, seed 9) through `spopp launch`, in the demo folder's
`profile/`: one at max_staleness 0 (the paper's protocol), whose breakdown is the table, then the
same at k = 1 and 2, which give the line `staleness: updates/h s0 X, s1 Y, s2 Z (s1/s0 R)` (the
baseline is the k = 0 run of the same invocation, on the same machine). The learner's own records give its side (metrics.jsonl: per update the wait
for a full batch, the update, the publication and the checkpoint); the replica's `/metrics`,
read every half second while it runs, give its side (time spent draining for a new policy and
swapping weights, episodes in flight). The demo's data, cold start and prior are reused; where
the folder has none, `python -m tools.demo --seeds 0` makes them first (with its two runs).

    python -m bench.demo_profile [--demo demo-out] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from bench.tracker_bench import write_section
from spopp.settings.base import environ_without_settings

HEAD = "## Demo run profile: updates per hour, waits, drains and swaps"


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class Scraper(threading.Thread):
    """Reads a replica's /metrics every `period` seconds; keeps the last reading and the in-flight gauge's samples."""

    def __init__(self, config: Path, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.config, self.period = config, period
        self.stop = threading.Event()
        self.first = self.last = None
        self.t_first = self.t_last = 0.0
        self.in_flight: list[float] = []

    def run(self) -> None:
        url = None
        while not self.stop.is_set():
            if url is None and self.config.is_file():
                url = f"http://127.0.0.1:{yaml.safe_load(self.config.read_text())['port']}/metrics"
            if url is not None:
                try:
                    m = _prometheus(httpx.get(url, timeout=2).text)
                except httpx.HTTPError:
                    m = None
                if m:
                    now = time.monotonic()
                    if self.first is None:
                        self.first, self.t_first = m, now
                    self.last, self.t_last = m, now
                    self.in_flight.append(m.get("spopp_rollout_in_flight", 0.0))
            self.stop.wait(self.period)


STALENESS = (0, 1, 2)  # max_staleness of the runs behind the staleness line


def profile(demo: Path, max_staleness: int = 0) -> dict:
    if not (demo / "prior.json").is_file() or not (demo / "launch.yaml").is_file():
        _progress(f"{demo} has no demo yet: running python -m tools.demo --out {demo} --seeds 0")
        subprocess.run([sys.executable, "-m", "tools.demo", "--out", str(demo), "--seeds", "0"], check=True)
    name = "spopp-s9" + (f"-k{max_staleness}" if max_staleness else "")
    run_dir = demo / "profile" / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    _progress(f"profile run {name} (max_staleness {max_staleness})")
    scraper = Scraper(run_dir / "config" / "rollout-0.yaml")
    scraper.start()
    env = environ_without_settings()
    t0 = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "services.cli", "launch", str(demo / "launch.yaml"), "--set", "recipe=spopp",
         "--set", "seed=9", "--set", f"run=profile-{name}", "--set", f"run_dir={run_dir}",
         "--set", f"max_staleness={max_staleness}"],
        check=True, env=env,
    )  # fmt: skip
    wall = time.monotonic() - t0
    scraper.stop.set()
    scraper.join()
    steps = [json.loads(line) for line in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    first = steps[0]
    # The learner's clock starts when it began waiting for its first batch.
    learner_start = first["time"] - sum(
        first.get(k, 0.0) for k in ("batch_wait_s", "update_seconds", "publish_s", "checkpoint_s")
    )
    learner_wall = steps[-1]["time"] - learner_start
    share = {
        k: sum(s.get(k, 0.0) for s in steps) / learner_wall
        for k in ("batch_wait_s", "update_seconds", "publish_s", "checkpoint_s")
    }
    a, b = scraper.first or {}, scraper.last or {}
    replica_wall = max(1e-9, scraper.t_last - scraper.t_first)

    def delta(name: str) -> float:
        return b.get(name, 0.0) - a.get(name, 0.0)

    launch = yaml.safe_load((demo / "launch.yaml").read_text())
    return {
        "updates": len(steps), "launch_wall": wall, "learner_wall": learner_wall,
        "updates_per_hour": len(steps) / learner_wall * 3600, "learner": share,
        "replica_wall": replica_wall, "drain": delta("spopp_rollout_drain_seconds_sum") / replica_wall,
        "swap": delta("spopp_rollout_reload_seconds_sum") / replica_wall,
        "drains": delta("spopp_rollout_drain_seconds_count"), "swaps": delta("spopp_rollout_weight_reloads_total"),
        "in_flight": sum(scraper.in_flight) / max(1, len(scraper.in_flight)),
        "concurrency": launch["rollout"]["concurrency"], "batch": launch["learner"]["batch_size"],
        "staleness_mean": sum(s.get("staleness_mean", 0.0) for s in steps) / len(steps),
    }  # fmt: skip


def staleness_line(rates: dict[int, float]) -> str:
    """`staleness: updates/h s0 X, s1 Y, s2 Z (s1/s0 R)` from {k: updates per hour}."""
    listed = ", ".join(f"s{k} {rate:,.0f}" for k, rate in sorted(rates.items()))
    return f"staleness: updates/h {listed} (s1/s0 {rates[1] / rates[0]:.2f})"


def markdown(r: dict, command: str, stale: dict[int, dict] | None = None) -> str:
    sh = r["learner"]
    return "\n".join([
        HEAD, "",
        f"Command: `{command}` on {platform.machine()}, Python {platform.python_version()}, one torch thread, "
        f"{time.strftime('%Y-%m-%d')}. One SPO++ run (seed 9) of `make demo`'s configuration: toy-calc, the "
        f"cold-start model, one replica on the transformers engine with {r['concurrency']} slots, learner batch "
        f"{r['batch']}, a new policy every update, the evaluator beside them; everything on the same 2 cores.", "",
        "| measure | value |", "| --- | ---: |",
        f"| updates | {r['updates']} |",
        f"| `spopp launch` wall time, start and stop included | {r['launch_wall']:.1f} s |",
        f"| learner wall time (first wait to last update) | {r['learner_wall']:.1f} s |",
        f"| updates per hour | {r['updates_per_hour']:,.0f} |",
        f"| learner: waiting for a full batch | {sh['batch_wait_s']:.2f} |",
        f"| learner: updating | {sh['update_seconds']:.2f} |",
        f"| learner: publishing snapshots | {sh['publish_s']:.2f} |",
        f"| learner: checkpoints | {sh['checkpoint_s']:.2f} |",
        f"| replica: draining for a new policy ({r['drains']:.0f} drains) | {r['drain']:.2f} |",
        f"| replica: swapping weights ({r['swaps']:.0f} swaps) | {r['swap']:.2f} |",
        f"| replica: mean episodes in flight / slots | {r['in_flight'] / r['concurrency']:.2f} |",
        "",
        "Shares are of each process's own wall time. The learner waits while the replica generates (one policy "
        "version per update, so each batch is collected under the newest weights); the replica drains at every new "
        "policy, and with one replica on a shared CPU the two mostly take turns.",
        "",
        *(_staleness_section(stale) if stale else []),
    ])  # fmt: skip


def _staleness_section(stale: dict[int, dict]) -> list[str]:
    """The same configuration at max_staleness k = 0, 1, 2 (runs one after another, same seed)."""
    rows = [
        f"| {k} | {r['updates_per_hour']:,.0f} | {r['updates_per_hour'] / stale[0]['updates_per_hour']:.2f} "
        f"| {r['learner']['batch_wait_s']:.2f} | {r['staleness_mean']:.2f} | {r['drain']:.2f} | {r['launch_wall']:.1f} s |"
        for k, r in sorted(stale.items())
    ]
    return [
        "### Bounded staleness: the same run at max_staleness k = 0, 1, 2", "",
        "`" + staleness_line({k: r["updates_per_hour"] for k, r in stale.items()}) + "`", "",
        "| k | updates per hour | vs k = 0 | learner waiting | mean staleness of a batch (versions) "
        "| replica waiting at swaps | launch wall |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows, "",
        "With k = 0 each batch is generated after the previous update's publication, so the learner and the "
        "replica take turns; with k >= 1 the replica's episodes during an update count for the next one "
        "(corrected as stale where an older version generated them), and the two overlap.", "",
    ]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", type=Path, default=Path("demo-out"), help="the demo folder (make demo's)")
    ap.add_argument("--out", type=Path, help="write the section into this markdown file")
    args = ap.parse_args()
    stale = {k: profile(args.demo.resolve(), k) for k in STALENESS}
    section = markdown(stale[0], "make profile", stale)
    print(section)
    print(staleness_line({k: r["updates_per_hour"] for k, r in stale.items()}))
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
