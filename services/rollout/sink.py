"""A trajectory sink that stands in for the learner: rollout tests, benchmarks and dry runs.

It answers like the learner: 409 for a policy version other than its current one, 422 for a
record that fails the schema; it keeps what it accepts. It runs a real uvicorn server on a free
port in a background thread.
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI, HTTPException

from services.tracker.embedded import free_port
from spopp.trajectory import Trajectory


class LearnerSink:
    def __init__(self) -> None:
        self.version = 0
        self.accepted: list[Trajectory] = []
        self.refused: list[Trajectory] = []
        self._lock = threading.Lock()
        app = FastAPI()

        @app.post("/v1/trajectories")
        def receive(t: Trajectory) -> dict:
            with self._lock:
                if t.policy_version != self.version:
                    self.refused.append(t)
                    raise HTTPException(409, {"code": "stale_policy", "policy_version": self.version})
                self.accepted.append(t)
                return {"accepted": len(self.accepted)}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LearnerSink:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("learner sink did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def wait_for(self, n: int, timeout: float, version: int | None = None) -> list[Trajectory]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                got = [t for t in self.accepted if version is None or t.policy_version == version]
            if len(got) >= n:
                return got
            time.sleep(0.1)
        raise TimeoutError(f"{len(got)} of {n} trajectories (version {version}) within {timeout} s")
