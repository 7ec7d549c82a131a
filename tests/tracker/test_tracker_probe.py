"""The tracker container's health check (services/tracker/probe.py, docker-compose.yml): healthy only
when /readyz is answered by the tracker process that wrote the container's instance file, never by
another program that holds the port (on the host network, a port that answers proves nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from services.tracker.probe import probe
from tools.tracker_process import TrackerProcess

ROOT = Path(__file__).resolve().parents[2]


class Stranger(BaseHTTPRequestHandler):
    """Another program on the tracker's port: answers every path 200 with a tracker-like body."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = json.dumps({"status": "ready"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stranger():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stranger)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_stranger_on_the_port_is_not_the_tracker(stranger, tmp_path):
    instance = tmp_path / "instance"
    assert "has not started" in probe(stranger + "/readyz", instance)  # no file: the tracker never started
    instance.write_text("0123abcd\n")  # a tracker of this container started once, then lost the port
    why = probe(stranger + "/readyz", instance)
    assert "answered by another process" in why and "0123abcd" in why
    assert "did not answer" in probe("http://127.0.0.1:9/readyz", instance, timeout=2)


@pytest.mark.process
def test_the_tracker_writes_its_instance_and_the_probe_passes_only_for_it(redis_server, tmp_path, stranger):
    instance = tmp_path / "instance"
    tracker = TrackerProcess(redis_server.url, env={"SPOPP_TRACKER_INSTANCE_FILE": str(instance)})
    try:
        written = instance.read_text().strip()
        assert len(written) == 32
        for route in ("/readyz", "/healthz"):
            body = json.loads(subprocess.check_output(
                [sys.executable, "-c", f"import urllib.request as u; print(u.urlopen('{tracker.url}{route}').read().decode())"],
                text=True, timeout=30))  # fmt: skip
            assert body["instance"] == written and body["service"] == "tracker"
        assert probe(tracker.url + "/readyz", instance) is None
        # The command the container runs, on this tracker's port and on the stranger's.
        port = tracker.url.rsplit(":", 1)[1]
        env = {**os.environ, "SPOPP_TRACKER_PORT": port, "SPOPP_TRACKER_INSTANCE_FILE": str(instance),
               "PYTHONPATH": str(ROOT)}  # fmt: skip
        ok = subprocess.run(
            [sys.executable, "-m", "services.tracker.probe"], env=env, capture_output=True, text=True
        )
        assert ok.returncode == 0, ok.stderr
        env["SPOPP_TRACKER_PORT"] = stranger.rsplit(":", 1)[1]
        bad = subprocess.run(
            [sys.executable, "-m", "services.tracker.probe"], env=env, capture_output=True, text=True
        )
        assert bad.returncode == 1 and "answered by another process" in bad.stderr
    finally:
        tracker.stop()
    # A restarted tracker is another instance: the file is rewritten with its id.
    again = TrackerProcess(redis_server.url, env={"SPOPP_TRACKER_INSTANCE_FILE": str(instance)})
    try:
        assert instance.read_text().strip() != written
        assert probe(again.url + "/readyz", instance) is None
    finally:
        again.stop()
