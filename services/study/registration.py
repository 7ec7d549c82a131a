"""The pre-registration of `spopp study compare`: `<out>/protocol.json`, written once, after the
pilot and before the first main run, and never again.

It fixes what the main runs may not influence: the hypothesis, the primary metric and the planned
secondary ones, the analysis, the effect the study is sized for, n and the seeds, the stopping
rule, the design checks (and whether they were run past with --force), the base config's hash and
the code. Its sha256 is set on every main run (`protocol` in run.json, part of the run's identity:
a run of another protocol cannot resume in its folder), so a protocol edited after the first main
run is caught by comparing the hash of the file with the hash each run carries.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

PROTOCOL = "protocol.json"
KIND = "spopp study compare"

STOPPING_RULE = (
    "exactly n pairs on the seeds listed, fixed here before the first main run; no interim analysis and no "
    "further runs after the last; a stopped run is resumed in its folder, never replaced"
)
ANALYSIS = (
    "per pair (same seed, common random numbers) the treatment's metric minus the control's, in points "
    "(x100); mean ± s.e., the 95 % t interval, the two-sided paired t test, the two-sided exact sign test; "
    "Holm's adjustment of the t test's p over the planned metrics. The page's sentences are generated from "
    "these numbers (services/study/conclusions.py)"
)

# What a resumed study must have been given as before; anything else is a new study.
REGISTERED_OPTIONS = ("config_sha256", "arms", "primary", "effect", "power", "pilot_seeds", "first_seed")


class ProtocolError(ValueError):
    """protocol.json is unreadable, not this command's, changed, or does not fit what was asked."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def config_sha256(values: dict[str, Any]) -> str:
    """A base config's hash: its values as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def hypothesis(control: str, treatment: str, primary: str) -> str:
    return (
        f"{treatment} learns faster than {control} on this config: its area under the online training-reward "
        f"curve ({primary}) over the common budget is higher (two-sided test: a difference either way is reported)"
    )


def read(out: Path) -> tuple[dict[str, Any], str] | None:
    """(protocol, its sha256) of the study in `out`; None before one was registered."""
    path = out / PROTOCOL
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ProtocolError(
            f"{path}: unreadable ({exc}); it fixes the study: restore it, or start a new --out"
        ) from None
    if not isinstance(data, dict) or data.get("kind") != KIND:
        raise ProtocolError(f"{path} is not a `{KIND}` protocol: start a new --out")
    return data, sha256(path)


def write(out: Path, protocol: dict[str, Any]) -> str:
    """Register `protocol` (refused when one is there); answers its sha256."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / PROTOCOL
    if path.exists():
        raise ProtocolError(f"{path} is registered already; a protocol is written once")
    body = {"kind": KIND, **protocol, "registered": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = path.with_suffix(".json.tmp")  # atomic: a study stopped while writing leaves no half a protocol
    tmp.write_text(json.dumps(body, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return sha256(path)


def check_options(protocol: dict[str, Any], asked: dict[str, Any], out: Path) -> None:
    """A resumed study must be asked what it was registered with: ProtocolError naming each option
    that differs."""
    changed = [k for k in REGISTERED_OPTIONS if protocol.get(k) != asked.get(k)]
    if changed:
        listed = "; ".join(f"{k}: {protocol.get(k)!r} registered, {asked.get(k)!r} now" for k in changed)
        raise ProtocolError(
            f"{out / PROTOCOL} registered another study ({listed}). A registered study runs as registered: "
            "give the same config and options, or start a new --out"
        )


def check_runs(digest: str, carried: dict[str, str | None], out: Path) -> None:
    """Every main run started so far (`carried`: run name → the protocol hash in its run.json) must
    carry `digest`, the hash of protocol.json now: ProtocolError otherwise (the file was changed
    after the first main run, or a run of another study is in the folder)."""
    wrong = {name: h for name, h in carried.items() if h != digest}
    if wrong:
        listed = ", ".join(f"{name} ({(h or 'none')[:12]})" for name, h in sorted(wrong.items()))
        raise ProtocolError(
            f"{out / PROTOCOL} (sha256 {digest[:12]}) is not the protocol its main runs were started under: "
            f"{listed}. It cannot change after the first main run: restore it, or start a new --out"
        )
