"""The services as several folders' tests run them: a rollout replica on generated tasks, an
evaluator following a run, a learner's publish faked, the evaluator's records read back. Shared by
tests/rollout, tests/evaluator and tests/launch (tests/ is on pytest's pythonpath)."""

from __future__ import annotations

import json
from pathlib import Path

from procs import cli, running

from spopp.files.snapshots import version_dirname
from spopp.machine.net import free_port
from tools.tiny_model import perturb_weights

# The tasks `replica` generates (math-tir arithmetic, seed 0 where a test writes them too).
REPLICA_TASKS = 8
# What a faked publish writes as the learner's step of version v.
STEPS_PER_VERSION = 2


def replica(tiny_model, tracker, sink, run, port, log_path, *extra, env_extra=None):
    """`spopp rollout serve` on the tiny model with generated tasks, as a context manager."""
    args = cli(
        "rollout", "serve", "--model", str(tiny_model), "--tracker", tracker.url, "--learner", sink.url,
        "--run", run, "--engine", "transformers", "--env", "math-tir", "--generated-tasks", str(REPLICA_TASKS),
        "--concurrency", "4", "--max-turns", "3", "--max-tokens-per-turn", "48", "--max-total-tokens", "900",
        "--port", str(port), *extra,
    )  # fmt: skip
    return running(args, log_path, env_extra)


def publish(client, run: str, root: Path, tiny_model: Path, version: int) -> Path:
    """A learner's publish, faked: a perturbed copy with a manifest, renamed into place, announced."""
    tmp = root / f"{version_dirname(version)}.tmp"
    perturb_weights(tiny_model, tmp, scale=0.3, seed=version)
    manifest = {"version": version, "step": STEPS_PER_VERSION * version}
    (tmp / "manifest.json").write_text(json.dumps(manifest))
    final = root / version_dirname(version)
    tmp.rename(final)
    client.publish(run, version, str(final))
    return final


def evaluator_args(tracker, run: str, held_out: Path, out: Path, *extra: str) -> tuple[list[str], int]:
    """`spopp evaluator run`'s command line following `run`, and the port it serves on."""
    port = free_port()
    args = cli(
        "evaluator", "run", "--tracker", tracker.url, "--run", run, "--tasks", str(held_out),
        "--max-tasks", "3", "--out-dir", str(out), "--port", str(port), "--poll-seconds", "0.2",
        "--samples", "1", "--max-turns", "2", "--max-tokens-per-turn", "32", "--max-total-tokens", "600",
        "--engine-options", "{max_batch: 16}", *extra,
    )  # fmt: skip
    return args, port


def recorded(out: Path) -> list[dict]:
    """The evaluator's evals.jsonl lines so far (none before its first)."""
    path = out / "evals.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
