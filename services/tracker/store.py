"""Redis state of the tracker: one atomic Lua script per state change, floats as 17-digit strings.

The process keeps nothing between calls, so any number of tracker processes can share one Redis.
Exponential-race draws are made here, outside Lua, from a counter range the script reserves.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from spopp.api.tracker_api import LIMITS, MAX_RUNS, MAX_WORKERS_PER_RUN, RunConfig, TaskPrior
from spopp.compare.streams import stream_key
from spopp.evidence import jeffreys_init
from spopp.sampler import SAMPLER_FLOOR, race_draws

from .errors import ApiError

_SCRIPTS = (
    "put_run put_tasks dispatch outcomes renew release consume policy read_tasks read_run read_requests "
    "finish reopen budget heartbeat release_worker"
).split()
# The per-worker hashes of a run (common.lua): worker id -> count, or last seen (ms).
_WORKER_STATS = {
    "leases": "wk:leases",
    "outcomes": "wk:outcomes",
    "trajectories": "wk:traj",
    "episodes": "wk:eps",
}


def _limits_lua() -> str:
    """The API's bounds as Lua locals, so the scripts check what the API checks (one source)."""
    return "".join(f"local {name} = {value!r}\n" for name, value in LIMITS.items())


def _load(name: str) -> str:
    lua = resources.files(__package__) / "lua"
    return _limits_lua() + (lua / "common.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class _StaleStream(Exception):
    def __init__(self, stream: dict) -> None:
        self.stream = stream


def prefix(run: str) -> str:
    return f"spopp:{{{run}}}:"


def num(x: float) -> str:
    return repr(float(x))


def _run_view(run: str, raw: dict, workers: dict) -> dict:
    """GET /v1/runs/{run}'s body from read_run's reply and the run's workers."""
    version = int(raw["version"])
    finished = raw.get("status") == "finished"
    return {
        "run": run,
        "status": "finished" if finished else "running",
        "finished_at": rfc3339(float(raw["finished_ms"])) if finished else None,
        "final_version": int(raw["final_version"]) if finished else None,
        "finish_reason": raw.get("finish_reason") if finished else None,
        "workers": workers,
        "config": json.loads(raw["config"]),
        "policy_version": version,
        "snapshot": raw.get("snapshot"),
        "counts": {
            "tasks": raw["tasks"],
            "idle": raw["idle"],
            "in_flight": raw["in_flight"],
            "dispatches": int(raw["dispatches"]),
            "outcomes": int(raw["outcomes"]),
            "late_outcomes": int(raw.get("late_outcomes", 0)),
            "overtaken_outcomes": int(raw.get("overtaken_outcomes", 0)),
            "reorder_distance": int(raw.get("reorder_distance", 0)),
            "releases": int(raw["releases"]),
            "expirations": int(raw["expirations"]),
            "consumed_updates": int(raw["consumed"]),
        },
    }


def _worker_rows(stats: list[dict], seen: dict) -> dict[str, dict]:
    out = {}
    for worker, ms in sorted(seen.items()):
        row = {name: int(got.get(worker, 0)) for name, got in zip(_WORKER_STATS, stats, strict=True)}
        out[worker] = {**row, "last_seen": rfc3339(float(ms))}
    return out


def rfc3339(ms: float) -> str:
    stamp = datetime.fromtimestamp(int(ms) / 1000, UTC).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _list(x: Any) -> list:
    # cjson encodes an empty Lua table as an object.
    return x if isinstance(x, list) else []


class Store:
    def __init__(
        self,
        client: aioredis.Redis,
        idempotency_ttl_seconds: float = 3600.0,
        max_workers: int = MAX_WORKERS_PER_RUN,
        max_runs: int = MAX_RUNS,
    ) -> None:
        self.redis = client
        # Runs this tracker keeps: the bound on what callers can make Redis (and a scrape) hold.
        self.max_runs = str(max_runs)
        # Workers a run keeps stats of: the bound on what callers can make it remember per run.
        self.max_workers = str(max_workers)
        # How long finished calls are remembered (dispatch idempotency keys, consumed update ids,
        # finished requests): longer than any client retries one call.
        self.ttl_ms = str(max(1, round(idempotency_ttl_seconds * 1000)))
        self._scripts = {name: client.register_script(_load(name)) for name in _SCRIPTS}
        # Where each run's draw stream stood after our last call: only a hint that saves a round
        # trip. The scripts check it and answer the true position when it is stale.
        self._streams: dict[str, dict] = {}
        # Calls that use a run's stream go one at a time per process, so that coroutines of one
        # process do not invalidate each other's hint; across processes a stale hint is retried.
        # A run's lock lives only while calls hold or wait for it ([lock, users]), and a hint is
        # kept only for a run that answered one: nothing stays in memory per unknown run (20,000
        # dispatches to distinct unknown runs once grew the tracker by 6 MB of locks).
        self._locks: dict[str, list] = {}

    async def _call(self, name: str, run: str, *args: Any) -> Any:
        raw = await self._scripts[name](args=[prefix(run), *args])
        reply = json.loads(raw)
        if "stream" in reply:
            raise _StaleStream(reply["stream"])
        if "error" in reply:
            err = reply["error"]
            detail = dict(err["detail"])
            raise ApiError(err["status"], detail.pop("code"), detail.pop("message"), run=run, **detail)
        return reply["ok"]

    # -- runs ---------------------------------------------------------------------------------
    async def put_run(self, run: str, cfg: RunConfig) -> bool:
        fields = {
            "recipe": cfg.recipe,
            "lam": num(-math.log(cfg.retention)),
            "floor": num(SAMPLER_FLOOR),
            "lease_ms": str(max(1, round(cfg.lease_seconds * 1000))),
            "seed": str(cfg.seed),
            "stream": stream_key(run, cfg.study),
            "prior_mass": num(cfg.prior_mass),
            "d_half": num(cfg.d_half),
            "rho_min": num(cfg.rho_min),
            "rho_max": num(cfg.rho_max),
            "snapshot": cfg.base_snapshot or "",
        }
        flat = [x for kv in fields.items() for x in kv]
        canonical = json.dumps(cfg.canonical(), sort_keys=True)
        out = await self._call("put_run", run, run, canonical, self.max_runs, *flat)
        return bool(out["created"])

    async def set_budget(self, run: str, max_updates: int) -> bool:
        """Change the run's max_updates (or fix it, for a run created without one); 409
        budget_below_version for one under the run's policy version, which its learner has trained
        past already (a version is at least one update). Answers whether it changed."""
        stored, version = await self.redis.hmget(prefix(run) + "run", ["config", "version"])
        if stored is None:
            raise ApiError(404, "unknown_run", "no such run", run=run)
        if max_updates < int(version):
            raise ApiError(
                409, "budget_below_version", f"run {run} is at policy version {int(version)}: a budget of "
                f"{max_updates} updates would end before where it is", run=run, policy_version=int(version),
            )  # fmt: skip
        cfg = RunConfig.model_validate(json.loads(stored))
        changed = json.dumps(cfg.model_copy(update={"max_updates": max_updates}).canonical(), sort_keys=True)
        return bool((await self._call("budget", run, stored, changed))["changed"])

    async def get_run(self, run: str) -> dict:
        return _run_view(run, await self._call("read_run", run), await self.workers(run))

    async def scrape(self) -> dict[str, dict]:
        """Every run as get_run answers it, in two round trips whatever the number of runs (the
        run set, then one pipeline of every run's script and worker hashes): a scrape once made
        two per run, 5.8 s for 5,000 runs. A run deleted in between is left out."""
        runs = await self.runs()
        if not runs:
            return {}
        hashes = (*_WORKER_STATS.values(), "wk:seen")
        async with self.redis.pipeline(transaction=False) as pipe:
            for run in runs:
                await self._scripts["read_run"](args=[prefix(run)], client=pipe)
                for key in hashes:
                    pipe.hgetall(prefix(run) + key)
            replies = await pipe.execute(raise_on_error=False)
        out, width = {}, 1 + len(hashes)
        for i, run in enumerate(runs):
            raw, *rows = replies[i * width : (i + 1) * width]
            if isinstance(raw, Exception) or any(isinstance(r, Exception) for r in rows):
                continue
            reply = json.loads(raw)
            if "ok" not in reply:
                continue
            out[run] = _run_view(run, reply["ok"], _worker_rows(rows[:-1], rows[-1]))
        return out

    async def workers(self, run: str) -> dict[str, dict]:
        """Every worker's stats, read in one transaction (so the counts agree with each other)."""
        p = prefix(run)
        async with self.redis.pipeline(transaction=True) as pipe:
            for key in (*_WORKER_STATS.values(), "wk:seen"):
                pipe.hgetall(p + key)
            *stats, seen = await pipe.execute()
        return _worker_rows(stats, seen)

    async def finish(self, run: str, version: int, reason: str) -> bool:
        return bool((await self._call("finish", run, version, reason))["changed"])

    async def reopen(self, run: str, version: int) -> bool:
        return bool((await self._call("reopen", run, version))["changed"])

    async def heartbeat(self, run: str, worker: str, trajectories: int, episodes: int) -> dict:
        got = await self._call("heartbeat", run, worker, trajectories, episodes, self.max_workers)
        row = {name: int(got[name]) for name in _WORKER_STATS}
        last_seen = rfc3339(float(got["seen_ms"]))
        return {"worker_id": worker, **row, "last_seen": last_seen, "run_status": got["run_status"]}

    async def release_worker(self, run: str, worker: str) -> dict:
        out = await self._call("release_worker", run, worker, self.ttl_ms)
        return {"worker_id": worker, "released": _list(out["released"]), "expired": int(out["expired"])}

    async def runs(self) -> list[str]:
        return sorted(
            m.decode() if isinstance(m, bytes) else m for m in await self.redis.smembers("spopp:runs")
        )

    async def _with_draws(self, script: str, run: str, n: int, args: Callable[[float], list]) -> Any:
        """Call `script` with n Exp(1) draws from the run's stream, made here, outside Lua.

        `args(prior_mass)` builds the script's arguments before the draws. A stale hint costs
        one more round trip; a run that moves under heavy contention is retried a few times.
        """
        entry = self._locks.setdefault(run, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                return await self._with_draws_locked(script, run, n, args)
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._locks[run]

    async def _with_draws_locked(self, script: str, run: str, n: int, args: Callable[[float], list]) -> Any:
        stream = self._streams.get(run, {"start": "", "seed": "", "prior_mass": "", "key": ""})
        for _ in range(32):
            if stream["seed"]:
                # A run stored before streams had keys has none: its draws were keyed on its name.
                draws = race_draws(int(stream["seed"]), stream.get("key") or run, int(stream["start"]), n)
                mass = float(stream["prior_mass"])
            else:
                draws, mass = [1.0] * n, 1.0  # no hint yet: the script answers the stream
            head = [stream["start"], stream["seed"], stream["prior_mass"]]
            try:
                out = await self._call(script, run, *head, *args(mass), *map(num, draws))
            except _StaleStream as stale:
                stream = stale.stream
                continue
            used = out.pop("draws_used")
            if stream["seed"]:  # an idempotent replay may answer before the stream is checked
                self._streams[run] = {**stream, "start": str(int(stream["start"]) + used)}
            return out
        raise ApiError(503, "contention", "the run's draw stream kept moving; retry", run=run)

    # -- tasks --------------------------------------------------------------------------------
    async def put_tasks(self, run: str, tasks: list[TaskPrior]) -> dict:
        def args(mass: float) -> list:
            out: list = [len(tasks)]
            for task in tasks:
                if task.outcomes is not None:
                    a0, b0 = jeffreys_init(sum(task.outcomes), len(task.outcomes), mass)
                else:
                    a0, b0 = task.alpha0, task.beta0
                out += [task.task_id, num(a0), num(b0)]
            return out

        return await self._with_draws("put_tasks", run, len(tasks), args)

    async def read_tasks(self, run: str, task_ids: list[str]) -> list[dict]:
        raw = await self._call("read_tasks", run, *task_ids)
        zq = raw["version"] * float(raw["lam"])
        spopp = raw["recipe"] == "spopp"
        out = []
        for tid, a, b, zr, n_disp, n_out, in_flight in _list(raw["rows"]):
            a, b = float(a), float(b)
            # spopp keeps (a, b) relative to zr; the value never reads the underflowing masses.
            scale = math.exp(float(zr) - zq) if spopp else 1.0
            out.append(
                {
                    "task_id": tid,
                    "alpha": a * scale,
                    "beta": b * scale,
                    "value": a / (a + b),
                    "in_flight": bool(in_flight),
                    "dispatches": n_disp,
                    "outcomes": n_out,
                }
            )
        return out

    # -- requests -----------------------------------------------------------------------------
    async def dispatch(self, run: str, worker: str, version: int, k: int, idem: str | None) -> dict:
        args = [worker, version, k, idem or "", self.ttl_ms, self.max_workers]
        out = await self._with_draws("dispatch", run, k, lambda _: args)
        return {
            "policy_version": out["policy_version"],
            "snapshot": out["snapshot"] or None,
            "requests": [
                {
                    "request_id": r["request_id"],
                    "task_id": r["task_id"],
                    "value": float(r["value"]),
                    "policy_version": r["policy_version"],
                    "lease_expires_at": rfc3339(r["exp"]),
                }
                for r in _list(out["requests"])
            ],
        }

    async def outcomes(self, run: str, items: list[tuple[str, float]]) -> list[dict]:
        args = [x for rid, reward in items for x in (rid, num(reward))]
        out = await self._call("outcomes", run, self.ttl_ms, self.max_workers, *args)
        return [
            {
                "request_id": r["request_id"],
                "value": float(r["value"]),
                "advantage": float(r["advantage"]) if r["advantage"] != "" else None,
            }
            for r in out["results"]
        ]

    async def _request(self, script: str, run: str, rid: str) -> dict:
        r = await self._call(script, run, rid, self.ttl_ms)
        return {
            "request_id": rid,
            "task_id": r["task"],
            "state": r["state"],
            "policy_version": int(r["ver"]),
            "lease_expires_at": rfc3339(float(r["exp"])),
        }

    async def read_requests(self, run: str, rids: list[str]) -> list[dict]:
        out = await self._call("read_requests", run, *rids)
        return [
            {
                "request_id": rid,
                "state": state,
                "task_id": task or None,
                "policy_version": int(ver) if int(ver) >= 0 else None,
            }
            for rid, state, task, ver, _exp in _list(out["rows"])
        ]

    async def renew(self, run: str, rid: str) -> dict:
        return await self._request("renew", run, rid)

    async def release(self, run: str, rid: str) -> dict:
        return await self._request("release", run, rid)

    # -- evidence -----------------------------------------------------------------------------
    async def consume(self, run: str, update_id: str, items: list[tuple[str, float, float]]) -> list[dict]:
        args = [x for tid, reward, drift in items for x in (tid, num(reward), num(drift))]
        out = await self._call("consume", run, update_id, self.ttl_ms, *args)
        keys = ("rho", "alpha", "beta", "value")
        return [{"task_id": r["task_id"], **{k: float(r[k]) for k in keys}} for r in _list(out)]

    # -- policy -------------------------------------------------------------------------------
    async def publish(self, run: str, version: int, snapshot: str) -> bool:
        out = await self._call("policy", run, version, snapshot)
        return bool(out["changed"])

    async def policy(self, run: str) -> dict:
        got = await self._call("read_run", run)
        version = int(got["version"])
        return {"version": version, "z": version * float(got["lam"]), "snapshot": got.get("snapshot")}

    # -- export -------------------------------------------------------------------------------
    async def export(self, run: str, batch: int = 1000):
        """Yield every task's evidence, `batch` tasks per Redis round trip."""
        await self._call("read_run", run)
        cursor, seen = 0, set()
        while True:
            cursor, ids = await self.redis.sscan(prefix(run) + "tasks", cursor, count=batch)
            # SSCAN may repeat a member across pages.
            ids = sorted({i.decode() if isinstance(i, bytes) else i for i in ids} - seen)
            seen.update(ids)
            for lo in range(0, len(ids), batch):
                for row in await self.read_tasks(run, ids[lo : lo + batch]):
                    yield row
            if cursor == 0:
                return
