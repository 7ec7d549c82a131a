"""`make compose-cpu` writes the stack's effective settings once per command and every compose
command reads them (deploy/compose_cpu.py): the shell's overrides and --max-updates go into the
file, secrets do not, and the compose commands' environment cannot override it. A larger budget is
grown explicitly at the tracker (a finished run reopened), a smaller one refused. The stack itself
runs under `make compose-cpu` (CI)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.process  # a real tracker process


def compose_cpu():
    spec = importlib.util.spec_from_file_location("compose_cpu", ROOT / "deploy" / "compose_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stack_file_holds_the_overrides_and_no_secret(tmp_path, monkeypatch):
    m = compose_cpu()
    monkeypatch.setattr(m, "STACK_FILE", ROOT / "deploy" / "compose-cpu.stack.env.test")
    file = {"COMPOSE_PROJECT_NAME": "spopp-cpu", "SPOPP_RUN": "a", "SPOPP_LEARNER_MAX_UPDATES": "6",
            "SPOPP_ENV_FILE": "deploy/compose-cpu.env"}  # fmt: skip
    environ = {"SPOPP_RUN": "b", "SPOPP_LORA_RANK": "8", "SPOPP_API_TOKEN": "t0ken", "PATH": "/bin",
               "SPOPP_REDIS_PASSWORD": "pw"}  # fmt: skip
    got = m.stack_settings(file, environ, 30)
    assert got == {"COMPOSE_PROJECT_NAME": "spopp-cpu", "SPOPP_RUN": "b", "SPOPP_LEARNER_MAX_UPDATES": "30",
                   "SPOPP_ENV_FILE": "deploy/compose-cpu.stack.env.test", "SPOPP_LORA_RANK": "8"}  # fmt: skip
    try:
        m.write_stack(got)
        assert m.read_env(m.STACK_FILE) == got  # what compose and the next command read back
    finally:
        m.STACK_FILE.unlink(missing_ok=True)
    monkeypatch.setenv("SPOPP_LEARNER_MAX_UPDATES", "6")
    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "other")
    env = m.compose_environ()
    assert "SPOPP_LEARNER_MAX_UPDATES" not in env and "COMPOSE_PROJECT_NAME" not in env and "PATH" in env


def test_a_larger_budget_is_grown_and_reopens_a_finished_run_a_smaller_one_is_refused(
    tracker, client, run_name, capsys
):
    m = compose_cpu()
    client.put_run(run_name, {"recipe": "spopp", "max_updates": 6})
    client.finish(run_name, 0)
    cfg = {"SPOPP_RUN": run_name, "SPOPP_TRACKER_PORT": tracker.url.rsplit(":", 1)[1]}
    before = json.loads(client.get_run(run_name).model_dump_json())
    m.grow_budget(cfg, None, before, 6)  # the same budget: nothing to do
    assert client.get_run(run_name).status == "finished"
    m.grow_budget(cfg, None, before, 8)
    run = client.get_run(run_name)
    assert (run.config.max_updates, run.status) == (8, "running") and before["status"] == "running"
    assert "budget grown from 6 to 8 updates" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="budget is 8 updates, fixed at its creation; --max-updates 4"):
        m.grow_budget(cfg, None, json.loads(run.model_dump_json()), 4)
    assert client.get_run(run_name).config.max_updates == 8
    m.grow_budget(cfg, None, None, 4)  # no run yet: the init step creates it with the stack's budget


def test_a_smaller_budget_is_refused_before_anything_is_written(request, monkeypatch):
    m = compose_cpu()
    last = {"COMPOSE_PROJECT_NAME": "spopp-cpu", "SPOPP_RUN": "a", "SPOPP_LEARNER_MAX_UPDATES": "30"}
    asked = {**last, "SPOPP_LEARNER_MAX_UPDATES": "6"}
    why = m.refused_budget(last, asked, volumes=True)
    assert "budget of 30 updates; MAX_UPDATES=6 would not match it (give MAX_UPDATES=30 or more" in why
    assert "''" not in why
    assert m.refused_budget(last, {**asked, "SPOPP_LEARNER_MAX_UPDATES": "30"}, True) is None
    assert m.refused_budget(last, {**asked, "SPOPP_LEARNER_MAX_UPDATES": "40"}, True) is None
    assert m.refused_budget(last, {**asked, "SPOPP_RUN": "b"}, True) is None  # another run
    assert m.refused_budget(last, asked, volumes=False) is None  # make compose-clean ran: a new run
    assert m.refused_budget({}, asked, True) is None  # nothing known
    # The command itself: refused with the file and the containers untouched (Docker is not asked to
    # build, start or recreate anything; the real stack's case runs in .ci/run).
    stack = ROOT / "deploy" / "compose-cpu.stack.env.refused-test"
    monkeypatch.setattr(m, "STACK_FILE", stack)
    m.write_stack({**last, "SPOPP_ENV_FILE": "deploy/compose-cpu.stack.env"})
    request.addfinalizer(lambda: stack.unlink(missing_ok=True))
    before = stack.read_bytes()
    calls = []
    monkeypatch.setattr(m, "ensure_docker", lambda: ["docker-compose"])
    monkeypatch.setattr(m, "has_volumes", lambda project: True)
    monkeypatch.setattr(m, "sh", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setenv("SPOPP_RUN", "a")
    monkeypatch.setenv("COMPOSE_PROJECT_NAME", "spopp-cpu")
    with pytest.raises(SystemExit, match="nothing was changed"):
        m.main(["--max-updates", "6"])
    assert stack.read_bytes() == before and calls == []


def test_a_build_says_each_step_and_that_a_long_one_goes_on(capsys):
    m = compose_cpu()
    script = ("echo 'Building rollout'; echo 'Step 1/2 : RUN pip install'; echo 'Building dependency tree...';"
              " sleep 1; echo noise; echo 'Step 2/2 : COPY . /app'")  # fmt: skip
    m.stream_build(["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, "build", beat_s=0.3)
    out = capsys.readouterr().out
    assert "build (0 s): Step 1/2 : RUN pip install" in out and "Step 2/2 : COPY . /app" in out
    assert "still on Step 1/2 : RUN pip install" in out and "noise" not in out
    assert "build (0 s): Building rollout" in out and "dependency tree" not in out
    with pytest.raises(SystemExit, match="the build failed \\(exit code 3\\)"):
        m.stream_build(
            ["sh", "-c", "echo 'Step 1/1 : RUN false'; echo why; exit 3"], {"PATH": "/usr/bin:/bin"}, "build"
        )
    assert "why" in capsys.readouterr().err  # the failed build's tail


def test_a_build_returns_each_stages_last_image_and_says_where_the_disk_went(monkeypatch, capsys):
    m = compose_cpu()
    # Two compose services' builds, as the legacy builder prints them: the second finds the stages cached.
    script = (
        "echo 'Building tracker'; echo 'Step 1/4 : FROM spopp-debian:bookworm AS os'; echo ' ---> 43ddf8435cd4';"
        " echo 'Step 2/4 : RUN apt-get install python3'; echo ' ---> Running in e087f65c2c5e'; echo ' ---> aaaaaaaaaaaa';"
        " echo 'Step 3/4 : FROM os AS venv-tracker'; echo ' ---> aaaaaaaaaaaa';"
        " echo 'Step 4/4 : RUN pip install'; echo ' ---> Using cache'; echo ' ---> bbbbbbbbbbbb';"
        " echo 'Building learner'; echo 'Step 1/2 : FROM os AS venv-learner'; echo ' ---> aaaaaaaaaaaa';"
        " echo 'Step 2/2 : RUN pip install'; echo ' ---> cccccccccccc'; echo 'Successfully built cccccccccccc'"
    )  # fmt: skip
    stages = m.stream_build(["sh", "-c", script], {"PATH": "/usr/bin:/bin"}, "build", beat_s=60)
    assert stages == {"os": "aaaaaaaaaaaa", "venv-tracker": "bbbbbbbbbbbb", "venv-learner": "cccccccccccc"}
    # A build that filled the disk says so, with what disk_report finds (free space, the images).
    monkeypatch.setattr(m, "disk_report", lambda: "/var/lib/docker has 0.1 GiB free")
    full = "echo 'Step 1/1 : COPY --from=venv-rollout /opt/venv /opt/venv'; echo 'write x.so: no space left on device'; exit 1"
    with pytest.raises(SystemExit, match="build failed \\(exit code 1\\); /var/lib/docker has 0.1 GiB free"):
        m.stream_build(["sh", "-c", full], {"PATH": "/usr/bin:/bin"}, "build")
    capsys.readouterr()


def test_only_untagged_images_on_spopps_bases_are_stale():
    m = compose_cpu()
    ours, other = "sha256:debian-rootfs", "sha256:someone-elses-rootfs"
    images = [
        {"Id": "old-venv", "RepoTags": [], "RootFS": {"Layers": [ours, "sha256:venv"]}},
        {"Id": "tagged", "RepoTags": ["spopp/build-cache:cpu-venv-rollout"], "RootFS": {"Layers": [ours]}},
        {"Id": "theirs", "RepoTags": [], "RootFS": {"Layers": [other, "sha256:x"]}},
        {"Id": "scratch-stage", "RepoTags": None, "RootFS": {"Layers": []}},
    ]
    assert [d["Id"] for d in m.stale_images(images, {ours})] == ["old-venv"]
    assert m.stale_images(images, set()) == []
