"""The cost of an answer check out of process (runtime.sandbox.check_pool) against the same check in-process.

    python -m bench.check_bench [--rounds N] [--out BENCHMARKS.md]

Baseline: `runtime.verify.math_equivalent` called directly in this process (what the replica did
before the checks moved out: fast, but a tower of powers froze the process). Measured: the same
pairs through `check_answer` with the pool (the exact-match fast path skipped, so that every check
goes to a worker), its first worker's start (its imports), and a worker's replacement after a kill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.tracker_bench import write_section
from runtime.sandbox.check_pool import CheckPool
from runtime.verify import check_answer, math_equivalent


def pairs(i: int) -> list[tuple[str, str]]:
    """Typical (prediction, reference) pairs that need math-verify (equal in value, not in text),
    different for every `i`: math-verify caches what it parsed, so a repeated pair would time the
    cache."""
    return [
        (f"\\frac{{{i}}}{{2}}", f"{i / 2}"),
        (f"x^2+{i}", f"{i}+x^2"),
        (f"\\sqrt{{2}}/{i + 1}", f"\\frac{{\\sqrt{{2}}}}{{{i + 1}}}"),
        (f"{i}", f"{i}.0"),
        (f"({i}, {i + 2}]", f"({i},{i + 2}]"),
        (f"{i + 1}\\pi", f"{i + 1} \\pi"),
        (f"2^{{{i % 20}}}", f"{2 ** (i % 20)}"),
        (f"\\{{{i},{i + 1}\\}}", f"\\{{{i + 1},{i}\\}}"),
    ]


PER_ROUND = len(pairs(0))
HEAD = "## Answer checks: out of process against in-process"


def _timed(fn, batch: list[tuple[str, str]]) -> float:
    t0 = time.perf_counter()
    for pred, ref in batch:
        assert fn(pred, ref), (pred, ref)
    return (time.perf_counter() - t0) / len(batch)


def run(rounds: int, warmup: int = 3) -> dict:
    pool = CheckPool(size=1, preload=("sympy", "math_verify"))
    try:
        t0 = time.perf_counter()
        pool.call("runtime.verify:math_equivalent", "1", "1", timeout_s=30)
        first = time.perf_counter() - t0

        def pooled(pred: str, ref: str) -> float:
            return check_answer(f"\\boxed{{{pred}}}", ref, pool=pool).reward

        # Interleaved passes on fresh pairs, so that load from elsewhere and sympy's warm-up fall on
        # both sides alike; the first `warmup` passes of each are not counted.
        inproc, out = [], []
        for r in range(warmup + rounds):
            a, b = _timed(math_equivalent, pairs(2 * r + 1)), _timed(pooled, pairs(2 * r + 2))
            if r >= warmup:
                inproc.append(a)
                out.append(b)
        t0 = time.perf_counter()
        killed = pool.call("runtime.verify:math_equivalent", "9^{9^{9}}", "3", timeout_s=0.5)
        assert killed.reason == "timeout", killed
        pooled(*pairs(0)[0])  # waits for the replacement if it is not ready yet
        replace = time.perf_counter() - t0 - 0.5
    finally:
        pool.close()
    return {
        "inproc": statistics.median(inproc),
        "pooled": statistics.median(out),
        "first": first,
        "replace": replace,
        "rounds": rounds,
    }


def markdown(r: dict, command: str) -> str:
    ms = 1000
    return (
        f"{HEAD}\n\n`{command}` ({PER_ROUND} answer pairs a pass that need math-verify, fresh each pass, median of "
        f"{r['rounds']} passes).\n\n"
        "| | ms per check | ratio |\n|---|---:|---:|\n"
        f"| in-process math-verify (baseline; a tower of powers freezes the process) | {r['inproc'] * ms:.2f} | 1.00 |\n"
        f"| out of process (`runtime.sandbox.check_pool`, one worker) | {r['pooled'] * ms:.2f} | "
        f"{r['pooled'] / r['inproc']:.2f} |\n\n"
        f"- a worker's start (its imports of sympy and math-verify): {r['first']:.2f} s, paid at the "
        "service's start (`warm()`), not by an episode\n"
        f"- a check killed at its deadline, then the next check: {r['replace']:.2f} s beyond the "
        "deadline (the replacement starts in the background at the kill)\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    section = markdown(run(args.rounds), "python -m bench.check_bench")
    print(section)
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
