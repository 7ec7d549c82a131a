"""Bearer auth: every /v1 route needs the token when SPOPP_API_TOKEN is set; health stays open."""

import httpx
import pytest

from spopp.api.client import TrackerClient, TrackerError
from tools.tracker_process import TrackerProcess

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

TOKEN = "s3cret-token-for-tests-0123456789"


@pytest.fixture(scope="module")
def secured(redis_server):
    proc = TrackerProcess(redis_server.url, env={"SPOPP_API_TOKEN": TOKEN})
    yield proc
    proc.stop()


def test_auth_on(secured, run_name):
    url = f"{secured.url}/v1/runs/{run_name}"
    assert httpx.put(url, json={"recipe": "spopp"}).status_code == 401
    wrong = httpx.put(url, json={"recipe": "spopp"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["detail"]["code"] == "unauthorized"
    assert wrong.headers["www-authenticate"] == "Bearer"
    # Refused before the body is parsed: a malformed body without the token is still 401.
    assert httpx.post(url + "/outcomes", content=b"{").status_code == 401
    with TrackerClient(secured.url, token=TOKEN) as c:
        assert c.put_run(run_name, {"recipe": "spopp"}).policy_version == 0
    with TrackerClient(secured.url) as c, pytest.raises(TrackerError) as err:
        c.get_run(run_name)
    assert err.value.status == 401
    for open_route in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(secured.url + open_route).status_code == 200


def test_auth_off(tracker, run_name):
    assert httpx.put(f"{tracker.url}/v1/runs/{run_name}", json={"recipe": "spopp"}).status_code == 201
