"""A trajectory sink that stands in for the learner: rollout tests, benchmarks and dry runs.

It is the learner's own intake (buffer and HTTP route) with room for every trajectory and no
training: it answers exactly as the learner does (409 for another policy version, 422 for
another run or a malformed record) and keeps what it accepts.
"""

from __future__ import annotations

from services.learner.ingest import TrajectoryBuffer, ingest_app
from services.shell.server import ThreadedServer
from spopp.api.trajectory import Trajectory
from spopp.machine.wait import wait_until


class LearnerSink:
    def __init__(self, run: str, max_body_bytes: int = 64 * 1024 * 1024, port: int = 0) -> None:
        self.buffer = TrajectoryBuffer(run, capacity=1 << 62)
        self.accepted: list[Trajectory] = []
        self._server = ThreadedServer(ingest_app(self.buffer, max_body_bytes), port=port)
        self.url = self._server.url

    @property
    def version(self) -> int:
        return self.buffer.version

    @version.setter
    def version(self, v: int) -> None:
        self._drain()
        self.buffer.advance(v)

    @property
    def refused_stale(self) -> int:
        return self.buffer.refused["stale"]

    def trajectories(self) -> list[Trajectory]:
        """Everything accepted so far, in arrival order."""
        self._drain()
        return list(self.accepted)

    def _drain(self) -> None:
        n = len(self.buffer)
        if n:
            self.accepted += self.buffer.take(n)

    def __enter__(self) -> LearnerSink:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()

    def wait_for(self, n: int, timeout: float, version: int | None = None, proc=None) -> list[Trajectory]:
        """The first `n` or more trajectories (of `version`, when given) once they are here; with
        `proc` (the process that sends them), its exit ends the wait at once (ProcessExited)."""

        def got() -> list[Trajectory] | None:
            self._drain()
            found = [t for t in self.accepted if version is None or t.policy_version == version]
            return found if len(found) >= n else None

        return wait_until(got, timeout, f"{n} trajectories (version {version})", proc=proc)
