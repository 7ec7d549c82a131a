"""A restart budget over a sliding window: at most `max_restarts` restarts within any
`window_seconds`. A process that dies more often than that is in a crash loop, and restarting it
again only hides the fault; deaths older than the window are forgotten, so a process that dies
now and then is restarted for ever.

`spopp launch` keeps one per child process (services/launch/supervise.py) and the tracker one for
its embedded redis-server (services/tracker/embedded.py).
"""

from __future__ import annotations

from collections import deque


class RestartWindow:
    def __init__(self, max_restarts: int, window_seconds: float) -> None:
        if max_restarts < 0 or window_seconds <= 0:
            raise ValueError(
                f"need max_restarts >= 0 and window_seconds > 0, got {max_restarts}, {window_seconds}"
            )
        self.max_restarts = max_restarts
        self.window_seconds = window_seconds
        self._times: deque[float] = deque()  # the restarts within the window, oldest first

    def spend(self, now: float) -> bool:
        """Count a restart at `now` (a monotonic clock's seconds) and answer True; False, counting
        nothing, when the window already holds `max_restarts` of them."""
        while self._times and now - self._times[0] > self.window_seconds:
            self._times.popleft()
        if len(self._times) >= self.max_restarts:
            return False
        self._times.append(now)
        return True

    @property
    def count(self) -> int:
        """Restarts in the window as of the last `spend`."""
        return len(self._times)

    def since_oldest(self, now: float) -> float:
        """Seconds from the oldest restart in the window to `now` (0 with none)."""
        return now - self._times[0] if self._times else 0.0
