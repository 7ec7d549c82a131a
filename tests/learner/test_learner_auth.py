"""The learner against a tracker with bearer auth: the token comes from SPOPP_API_TOKEN.

Without it the learner stops at start-up with the tracker's 401; with it, it trains and publishes.
"""

import os
import re
import time
import uuid

import httpx
import pytest
from learner_worker import make_batch
from procs import cli, learner_config, running

from spopp.api.client import TrackerClient
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TOKEN = "learner-token-for-tests-0123456789"
B = 4


@pytest.fixture(scope="module")
def secured(redis_server):
    proc = TrackerProcess(redis_server.url, env={"SPOPP_API_TOKEN": TOKEN})
    yield proc
    proc.stop()


def _post_all(url: str, bodies: list[dict], deadline_s: float = 180) -> None:
    deadline = time.monotonic() + deadline_s
    with httpx.Client(timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for body in bodies:
            while True:
                try:
                    r = http.post(f"{url}/v1/trajectories", json=body)
                    break
                except httpx.TransportError:  # the intake is not up yet
                    assert time.monotonic() < deadline, "learner intake never came up"
                    time.sleep(0.2)
            assert r.status_code == 200 and r.json()["accepted"], r.text


def test_learner_takes_the_token_from_the_environment(secured, tiny_model, tmp_path):
    run = f"auth-{uuid.uuid4().hex[:10]}"
    with TrackerClient(secured.url, token=TOKEN) as c:
        c.put_run(run, {"recipe": "spopp", "lease_seconds": 30, "base_snapshot": str(tiny_model)})
    config, port = learner_config(
        tmp_path,
        secured.url,
        tiny_model,
        run,
        batch_size=B,
        mini_batches=2,
        micro_batch_size=2,
        max_updates=1,
        verify_requests=False,  # the request ids below are made up
    )
    ext = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}

    with running(cli("learner", "run", "--config", str(config)), tmp_path / "no-token.log", ext) as p:
        assert p.wait(180) != 0
    out = " ".join(re.sub(r"\n(\[rank0\]: )?", " ", (tmp_path / "no-token.log").read_text()).split())
    assert "401" in out and "unauthorized" in out

    trajs, _ = make_batch(tiny_model, n=B)
    bodies = [
        {**t.model_dump(), "run": run, "value": 0.5, "advantage": t.reward - 0.5, "request_id": f"a-{i}"}
        for i, t in enumerate(trajs)
    ]
    with running(
        cli("learner", "run", "--config", str(config)),
        tmp_path / "token.log",
        {**ext, "SPOPP_API_TOKEN": TOKEN},
    ) as p:
        _post_all(f"http://127.0.0.1:{port}", bodies)
        assert p.wait(240) == 0
    with TrackerClient(secured.url, token=TOKEN) as c:
        policy = c.policy(run)
    assert policy.version == 1 and policy.snapshot.endswith("v000001")
