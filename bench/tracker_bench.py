"""Tracker throughput: dispatch+outcome pairs through HTTP against the same Lua work over raw redis-py.

For each task count (10^3 and 10^6) and batch size (1 and 128):
- `http`: a TrackerClient (keep-alive) against a real tracker process: POST dispatch, then POST
  outcomes for what it got; one pair = one request dispatched and reported.
- `raw`: a redis-py loop running the very scripts the tracker runs (reserve, dispatch, outcomes),
  with the same draws: the Redis floor the service stands on.
The ratio http/raw is the cost of HTTP, validation and JSON; pairs/s at 10^6 against 10^3 tasks
shows whether the per-request cost grows with the number of tasks (it should not: O(log n)).

    python -m bench.tracker_bench [--quick] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis

from services.tracker.embedded import EmbeddedRedis
from services.tracker.store import _load, num, prefix
from spopp.api.client import TrackerClient
from spopp.sampler import race_draws
from tools.tracker_process import TrackerProcess


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_tasks(client: TrackerClient, run: str, n: int) -> float:
    t0 = time.perf_counter()
    chunk = 10_000
    for lo in range(0, n, chunk):
        client.put_tasks(
            run,
            [
                {"task_id": f"t{i}", "alpha0": 1.0 + i % 7, "beta0": 1.0 + i % 5}
                for i in range(lo, min(n, lo + chunk))
            ],
        )
        if n > chunk and (lo // chunk) % 20 == 19:
            _progress(f"  loaded {lo + chunk:,} of {n:,} tasks")
    return time.perf_counter() - t0


def _summary(latencies: list[float], pairs: int, elapsed: float) -> dict:
    lat = sorted(latencies)
    return {
        "pairs_per_s": pairs / elapsed,
        "p50_ms": 1e3 * statistics.median(lat),
        "p99_ms": 1e3 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


REPEATS = 3


def _median(results: list[dict]) -> dict:
    return sorted(results, key=lambda x: x["pairs_per_s"])[len(results) // 2]


def bench_http(client: TrackerClient, run: str, batch: int, rounds: int) -> dict:
    latencies, pairs = [], 0
    t0 = time.perf_counter()
    for i in range(rounds):
        s = time.perf_counter()
        got = client.dispatch(run, "bench", 0, batch).requests
        client.outcomes(run, [(r.request_id, float((i + j) % 2)) for j, r in enumerate(got)])
        latencies.append(time.perf_counter() - s)
        pairs += len(got)
    return _summary(latencies, pairs, time.perf_counter() - t0)


class RawLoop:
    """The tracker's own scripts over redis-py, no HTTP: what one round costs in Redis alone."""

    def __init__(self, url: str, run: str) -> None:
        self.r = redis.Redis.from_url(url, decode_responses=True)
        self.run, self.p = run, prefix(run)
        self.scripts = {n: self.r.register_script(_load(n)) for n in ("dispatch", "outcomes")}
        self.stream = {"start": "", "seed": "", "prior_mass": ""}

    def _dispatch(self, batch: int) -> list:
        while True:
            s = self.stream
            draws = (
                race_draws(int(s["seed"]), s.get("key") or self.run, int(s["start"]), batch)
                if s["seed"]
                else [1.0] * batch
            )
            head = [self.p, s["start"], s["seed"], s["prior_mass"], "raw", 0, batch, ""]
            reply = json.loads(self.scripts["dispatch"](args=[*head, *map(num, draws)]))
            if "stream" in reply:  # the HTTP side moved the stream: same retry as the tracker's
                self.stream = reply["stream"]
                continue
            out = reply["ok"]
            self.stream = {**s, "start": str(int(s["start"]) + out["draws_used"])}
            return out["requests"] if isinstance(out["requests"], list) else []

    def round(self, batch: int, i: int) -> int:
        reqs = self._dispatch(batch)
        args = [x for j, q in enumerate(reqs) for x in (q["request_id"], num((i + j) % 2))]
        if args:
            json.loads(self.scripts["outcomes"](args=[self.p, *args]))
        return len(reqs)


def bench_raw(loop: RawLoop, batch: int, rounds: int) -> dict:
    latencies, pairs = [], 0
    t0 = time.perf_counter()
    for i in range(rounds):
        s = time.perf_counter()
        pairs += loop.round(batch, i)
        latencies.append(time.perf_counter() - s)
    return _summary(latencies, pairs, time.perf_counter() - t0)


def run_all(task_counts: list[int], rounds: dict[int, int]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp), appendonly=False) as server:
        tracker = TrackerProcess(server.url)
        try:
            with TrackerClient(tracker.url) as client:
                for n in task_counts:
                    run = f"bench-{n}-{uuid.uuid4().hex[:6]}"
                    client.put_run(run, {"recipe": "spopp", "seed": 1})
                    _progress(f"loading {n:,} tasks")
                    load_s = load_tasks(client, run, n)
                    raw = RawLoop(server.url, run)
                    for batch, r in rounds.items():
                        # Warm both paths, then alternate repeats so that drift in a busy 2-core
                        # machine hits both alike; report each side's median repeat.
                        bench_http(client, run, batch, 5)
                        bench_raw(raw, batch, 5)
                        _progress(f"  {n:,} tasks, batch {batch}: {REPEATS} x {r} rounds each")
                        hs, ws = [], []
                        for _ in range(REPEATS):
                            hs.append(bench_http(client, run, batch, r))
                            ws.append(bench_raw(raw, batch, r))
                        rows.append(
                            {
                                "tasks": n,
                                "batch": batch,
                                "http": _median(hs),
                                "raw": _median(ws),
                                "load_s": load_s,
                            }
                        )
                        print(_line(rows[-1]), flush=True)
        finally:
            tracker.stop()
    return rows


def _line(row: dict) -> str:
    h, w = row["http"], row["raw"]
    return (
        f"tasks={row['tasks']:>9,} batch={row['batch']:>3}  http {h['pairs_per_s']:>9,.0f} pairs/s "
        f"(p50 {h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms)  raw redis-py {w['pairs_per_s']:>9,.0f} pairs/s "
        f"(p50 {w['p50_ms']:.2f} ms)  http/raw {h['pairs_per_s'] / w['pairs_per_s']:.2f}"
    )


def markdown(rows: list[dict], command: str) -> str:
    out = [
        "## Tracker: dispatch + outcome pairs",
        "",
        f"Command: `{command}` on {platform.machine()}, {platform.python_version()}, "
        f"{time.strftime('%Y-%m-%d')}. One pair = one request dispatched and its outcome reported; "
        "latency is one dispatch call plus one outcomes call. `raw` runs the tracker's own Lua scripts "
        "over redis-py with no HTTP, in the same run against the same Redis. Each figure is the median "
        f"of {REPEATS} alternating repeats. Client, tracker and Redis share the machine's 2 cores.",
        "",
        "| tasks | batch | HTTP pairs/s | HTTP p50 ms | HTTP p99 ms | raw pairs/s | raw p50 ms | HTTP/raw |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        h, w = r["http"], r["raw"]
        out.append(
            f"| {r['tasks']:,} | {r['batch']} | {h['pairs_per_s']:,.0f} | {h['p50_ms']:.2f} | {h['p99_ms']:.2f} "
            f"| {w['pairs_per_s']:,.0f} | {w['p50_ms']:.2f} | {h['pairs_per_s'] / w['pairs_per_s']:.2f} |"
        )
    small, big = min(r["tasks"] for r in rows), max(r["tasks"] for r in rows)
    out.append("")
    for batch in sorted({r["batch"] for r in rows}):
        a = next(r for r in rows if r["tasks"] == small and r["batch"] == batch)
        b = next(r for r in rows if r["tasks"] == big and r["batch"] == batch)
        out.append(
            f"- batch {batch}: pairs/s at {big:,} tasks / at {small:,} tasks = "
            f"{b['http']['pairs_per_s'] / a['http']['pairs_per_s']:.2f} (HTTP), "
            f"{b['raw']['pairs_per_s'] / a['raw']['pairs_per_s']:.2f} (raw)"
        )
    loads = {r["tasks"]: r["load_s"] for r in rows}
    out.append(
        "- loading tasks through `PUT /tasks` (10,000 a call): "
        + ", ".join(f"{n:,} in {s:.1f} s" for n, s in sorted(loads.items()))
    )
    return "\n".join(out) + "\n"


def write_section(path: Path, section: str, head: str = "## Tracker: dispatch + outcome pairs") -> None:
    """Replace one benchmark's section of BENCHMARKS.md (the one starting with `head`), keeping the others."""
    text = (
        path.read_text()
        if path.exists()
        else "# Benchmarks\n\nFigures from `make bench`; each row names its baseline.\n\n"
    )
    if head in text:
        start = text.index(head)
        nxt = text.find("\n## ", start + len(head))
        text = text[:start] + section + (text[nxt + 1 :] if nxt != -1 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10^3 and 10^4 tasks, fewer rounds (a smoke run)")
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    if args.quick:
        counts, rounds = [1_000, 10_000], {1: 200, 128: 10}
    else:
        counts, rounds = [1_000, 1_000_000], {1: 2_000, 128: 60}
    rows = run_all(counts, rounds)
    command = "python -m bench.tracker_bench" + (" --quick" if args.quick else "")
    section = markdown(rows, "make bench" if not args.quick else command)
    print(section)
    if args.out:
        write_section(args.out, section)


if __name__ == "__main__":
    main()
