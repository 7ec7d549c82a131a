"""The learner's process group (services/learner/deepspeed_engine.py `init_distributed`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from spopp.machine.net import port_range
from spopp.settings.base import environ_without_settings

_SCRIPT = """
import json, os, psutil
from services.learner.deepspeed_engine import init_distributed
rank_world = init_distributed()
listening = [c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN]
print(json.dumps({"rank_world": rank_world, "listening": listening, "master_port": os.environ.get("MASTER_PORT")}))
"""


@pytest.mark.process
def test_a_world_of_one_meets_in_process_and_draws_no_port():
    """A learner run without torchrun is rank 0 of a world of one. It has no one to meet, so it
    draws no port for a rendezvous (MASTER_PORT): a drawn port could be one the launcher has handed
    to a replica that has not bound it yet, and the replica would then fail to start. What gloo
    itself listens on is bound by the OS at once (port 0, the ephemeral range), never drawn."""
    env = {
        k: v for k, v in environ_without_settings().items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")
    }
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["rank_world"] == [0, 1] and seen["master_port"] is None
    lo, hi = port_range()  # where spopp.machine.net draws (this worker's share, inherited by the child)
    assert not [port for port in seen["listening"] if lo <= port <= hi], seen
