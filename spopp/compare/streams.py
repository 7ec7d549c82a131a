"""A run's random streams that are not the method's: common random numbers across the arms of a study.

A paired comparison (SPO against SPO++ on one seed) measures the method only if everything else
draws alike in both arms: the sampler's Exp(1) race draws (which prompt is dispatched), each
episode's sampling seed (which tokens the engine samples) and each environment's stream (latency,
injected faults). All three are keyed on (seed, stream key, counter or request), where the stream
key is the run's study when it has one and its name otherwise. Request ids are the tracker's
per-run counter (r1, r2, ...), so two arms that dispatch alike play request r7 with the same
numbers whichever replica plays it; once the arms' policies differ their draws still pair, which
is what makes the arm-to-arm difference of a seed less noisy than the difference of two seeds.
"""

from __future__ import annotations

import hashlib
import json


def stream_key(run: str, study: str | None) -> str:
    """The key, beside the seed, of a run's draws: its study when it has one, so that the arms of a
    paired comparison (one seed, one study, different run names) draw the same numbers; else its
    name, so that unrelated runs of one seed stay independent."""
    return study or run


def sampling_seed(seed: int, key: str, request_id: str) -> int:
    """The engine's sampling seed for one episode (a request): a 63-bit integer from SHA-256, the
    same in every process and replica (unlike hash(), salted per process)."""
    digest = hashlib.sha256(f"sampling\x1f{seed}\x1f{key}\x1f{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def episode_seed(seed: int, *identity: str | int) -> int:
    """A 64-bit seed for one episode's environment stream, from the run's `seed` and the episode's
    identity (the environments' `stream`, runtime/envs/base.py).

    SHA-256 of the JSON of [seed, *identity]: the same in every process (unlike hash(), salted per
    process), and streams of different identities are unrelated (unlike seed + i). Its own encoding,
    not sampling_seed's, so the two families of streams never coincide."""
    text = json.dumps([seed, *identity], separators=(",", ":"))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
