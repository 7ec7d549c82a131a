"""Named points where a test kills the learner, to prove that a crash at each of them resumes.

`SPOPP_FAILPOINT=<name>:<step>` makes the process SIGKILL itself when it reaches point `name`
during update `step` (`after_snapshot:2`). It is a test hook, not a setting: nothing else reads
it, and a process without the variable never stops here.
"""

from __future__ import annotations

import os
import signal

ENV = "SPOPP_FAILPOINT"


def failpoint(name: str, step: int) -> None:
    if os.environ.get(ENV) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)
