"""Static checks of what cannot run here (no Docker engine): docker-compose.yml, .env.example, the
Dockerfiles and deploy/compose_gpus.py agree with the compose specification, with the CLI and the
settings, and give every long-running process its own GPUs.

Helpers here are shared with tests/test_k8s.py (the same checks of commands, flags and variables).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from services.cli import build
from services.evaluator.config import EvaluatorSettings
from services.evaluator.prior_config import PriorSettings
from services.launch.init import InitSettings
from services.learner.config import LearnerSettings
from services.rollout.config import RolloutSettings
from services.tracker.config import TrackerSettings
from spopp.settings import API_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text())
TOKEN = "t" * 32  # what a user puts in .env (the example leaves it empty)
SETTINGS = (TrackerSettings, RolloutSettings, LearnerSettings, EvaluatorSettings, PriorSettings, InitSettings)
SETTINGS_BY_PREFIX = {cls.env_prefix: cls for cls in SETTINGS}
# Compose services (and their GPU-file replicas) by the settings they read.
SERVICE_SETTINGS = {
    "tracker": TrackerSettings,
    "rollout": RolloutSettings,
    "learner": LearnerSettings,
    "evaluator": EvaluatorSettings,
    "prior": PriorSettings,
    "init": InitSettings,
}
LONG_RUNNING = ("learner", "rollout", "evaluator")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpus = _load("compose_gpus", ROOT / "deploy" / "compose_gpus.py")
fetch_model = _load("fetch_model", ROOT / "deploy" / "fetch_model.py")


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
DOTENV = {**ENV_EXAMPLE, API_TOKEN_ENV: TOKEN}  # .env as a user leaves it: the example and a token

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


def project(gpu_file: str | None = None) -> dict:
    """docker-compose.yml with a GPU file on top, `extends` resolved as compose does."""
    doc = copy.deepcopy(COMPOSE)
    if gpu_file is None:
        return doc
    for name, over in yaml.safe_load(gpu_file)["services"].items():
        if "extends" in over:
            ext = over.pop("extends")
            source = yaml.safe_load((ROOT / ext["file"]).read_text())["services"][ext["service"]]
            doc["services"][name] = _merge(source, over)
        else:
            doc["services"][name] = _merge(doc["services"][name], over)
    return doc


def generated(layout) -> str:
    return gpus.render(layout, "test")


def settings_of(service: str):
    return SERVICE_SETTINGS[re.sub(r"-\d+$", "", service)]


def service_env(spec: dict) -> dict[str, str]:
    """The environment a container gets: .env whole (env_file), then `environment` over it."""
    env = dict(DOTENV) if spec.get("env_file") else {}
    env.update({k: interpolate(str(v), DOTENV) for k, v in (spec.get("environment") or {}).items()})
    return env


def device_ids(spec: dict) -> list[int]:
    devices = spec.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
    return [int(d) for dev in devices for d in dev.get("device_ids", [])]


# --- helpers: commands, flags, Dockerfiles -------------------------------------------------------


def dockerfile(path: Path) -> dict:
    """ENTRYPOINT and CMD (exec form) and the COPY sources of a Dockerfile."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out: dict = {"ENTRYPOINT": None, "CMD": None, "COPY": []}
    for line in text.splitlines():
        word, _, rest = line.strip().partition(" ")
        if word in ("ENTRYPOINT", "CMD"):
            out[word] = json.loads(rest)
        elif word == "COPY":
            out["COPY"] += [a for a in rest.split()[:-1] if not a.startswith("--")]
    return out


def container_argv(image_dockerfile: Path, entrypoint=None, command=None) -> list[str]:
    """What a container runs: the image's ENTRYPOINT and CMD as compose or Kubernetes override them."""
    image = dockerfile(image_dockerfile)
    entry = entrypoint if entrypoint is not None else (image["ENTRYPOINT"] or [])
    cmd = command if command is not None else ([] if entrypoint is not None else (image["CMD"] or []))
    return list(entry) + list(cmd)


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
    for m in re.finditer(
        r"fetch_model\.py((?:\s+--?[a-z-]+(?:\s+\"[^\"]*\"|\s+[^-\s&;][^\s&;]*)?)+)", script
    ):
        check_fetch_model(m.group(1).split())
    return runs


def check_fetch_model(args: list[str]) -> None:
    flags = {o for a in fetch_model.parser()._actions for o in a.option_strings}
    for a in args:
        if a.startswith("--"):
            assert a in flags, f"deploy/fetch_model.py has no flag {a}"


def check_argv(argv: list[str], env: dict[str, str]) -> None:
    """Any container command line of this deployment: spopp, a shell script or the model step."""
    if argv[0] == "spopp":
        check_spopp(argv[1:])
    elif argv[:2] == ["sh", "-c"]:
        assert check_script(argv[2], env), f"the script runs no spopp command: {argv[2]!r}"
    elif argv[0] in ("python", "python3") and argv[1] == "/app/deploy/fetch_model.py":
        check_fetch_model(argv[2:])
        fetch_model.parser().parse_args(argv[2:])  # the required flags are there
    else:
        raise AssertionError(f"unexpected command {argv}")


# --- the compose file ------------------------------------------------------------------------------


def _check_jsonschema(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            *map(str, files),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compose_files_validate_against_the_compose_specification(tmp_path):
    files = [COMPOSE_FILE]
    for n, layout in [("1", gpus.plan(1, share=True)), ("2", gpus.plan(2)), ("8", gpus.plan(8))]:
        files.append(tmp_path / f"docker-compose.gpus-{n}.yml")
        files[-1].write_text(generated(layout))
        files.append(tmp_path / f"merged-{n}.yml")  # the project compose builds from both
        files[-1].write_text(yaml.safe_dump(project(generated(layout))))
    res = _check_jsonschema(*files)
    assert res.returncode == 0, res.stdout + res.stderr
    # The check does check: a key the specification lacks is refused.
    bad = tmp_path / "bad.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("cap_add:", "cap_adds:", 1))
    assert _check_jsonschema(bad).returncode == 1


def test_env_example_documents_every_compose_variable():
    used = compose_variables(COMPOSE) | compose_variables(yaml.safe_load(generated(gpus.plan(4))))
    assert used - ENV_EXAMPLE.keys() == set(), "variables docker-compose.yml uses but .env.example lacks"
    # Every variable sits in a commented block.
    blocks = (ROOT / ".env.example").read_text().split("\n\n")
    for block in blocks:
        lines = [line for line in block.splitlines() if line.strip()]
        if any(not line.startswith("#") for line in lines):
            assert any(line.startswith("#") for line in lines), f"uncommented: {block!r}"


def test_env_example_names_only_real_settings_and_compose_variables():
    compose_level = compose_variables(COMPOSE) | {"COMPOSE_FILE", "HF_TOKEN"}
    for name in ENV_EXAMPLE:
        prefix = next((p for p in SETTINGS_BY_PREFIX if name.startswith(p)), None)
        if prefix:  # reaches every service via env_file: a wrong name would stop its service
            assert name in SETTINGS_BY_PREFIX[prefix].env_names(), f".env.example: {name} is no setting"
        else:
            assert name in compose_level, f".env.example: {name} is neither a setting nor used by compose"
    # Its values validate: each service's settings from .env.example alone, plus the fields that
    # docker-compose.yml sets.
    required = {
        "run": "r",
        "model": "/m",
        "tasks": "/t",
        "out": "/o",
        "recipe": "spopp",
        "base_snapshot": "/m",
    }
    for cls in SETTINGS:
        env = {**DOTENV, **{cls.env_name(f): v for f, v in required.items() if f in cls.model_fields}}
        cls.resolve(env=env)


def test_env_example_learner_matches_its_recipe():
    from services.launch.config import RECIPE_DEFAULTS

    recipe = RECIPE_DEFAULTS[ENV_EXAMPLE["SPOPP_RECIPE"]]
    learner = LearnerSettings.resolve(env={**DOTENV, "SPOPP_LEARNER_RUN": "r", "SPOPP_LEARNER_MODEL": "/m"})
    assert (learner.normalization, learner.dual_clip) == (recipe["normalization"], recipe["dual_clip"])


def test_compose_refuses_to_start_without_a_token():
    with pytest.raises(KeyError, match="SPOPP_API_TOKEN"):
        interpolate(COMPOSE["services"]["tracker"]["environment"][API_TOKEN_ENV], ENV_EXAMPLE)


LAYOUTS = {
    "base": None,
    "8": lambda: gpus.plan(8),
    "2-evaluator-cpu": lambda: gpus.plan(2, evaluator="cpu"),
    "1-cpu-learner": lambda: gpus.plan(1, learner_gpus=0),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compose_environment_names_real_settings(layout):
    make = LAYOUTS[layout]
    services = project(generated(make()) if make else None)["services"]
    for name, spec in services.items():
        if re.sub(r"-\d+$", "", name) not in SERVICE_SETTINGS:
            assert not spec.get("environment"), f"{name}: variables for no spopp service"
            continue
        settings = settings_of(name)
        for var in spec["environment"]:
            assert var in settings.env_names(), f"{name}: {var} is no setting of {settings.__name__}"
        settings.resolve(env=service_env(spec))
        if name != "prior":  # the prior talks to nobody
            assert spec["environment"][API_TOKEN_ENV].startswith("${SPOPP_API_TOKEN")  # one token everywhere


def test_compose_services_resolve_to_one_consistent_run():
    """Each service's settings, from .env and its environment, validate, and they all describe the
    same run: one model path, one task file, one run name and recipe, the learner where the
    replicas post, snapshots where the learner writes them."""
    services = project(generated(gpus.plan(4)))["services"]
    s = {name: settings_of(name).resolve(env=service_env(spec)) for name, spec in services.items()
         if re.sub(r"-\d+$", "", name) in SERVICE_SETTINGS}  # fmt: skip
    model = f"/models/{ENV_EXAMPLE['SPOPP_MODEL']}"
    assert {str(s[n].model) for n in ("learner", "rollout", "rollout-1", "evaluator", "prior")} == {model}
    assert s["init"].base_snapshot == model  # version 0 as the replicas load it
    tasks = f"/data/{ENV_EXAMPLE['SPOPP_TASKS']}"
    assert {str(s[n].tasks) for n in ("init", "rollout", "rollout-1", "prior")} == {tasks}
    assert str(s["init"].prior) == str(s["prior"].out)  # init loads the prior the prior step wrote
    assert {s[n].run for n in ("init", "learner", "rollout", "rollout-1", "evaluator")} == {
        ENV_EXAMPLE["SPOPP_RUN"]
    }
    assert s["init"].recipe == s["learner"].recipe == ENV_EXAMPLE["SPOPP_RECIPE"]
    assert s["init"].seed == s["learner"].seed
    assert s["init"].run_config == yaml.safe_load(ENV_EXAMPLE["SPOPP_INIT_RUN_CONFIG"])
    assert {s[n].tracker for n in ("init", "learner", "rollout", "evaluator")} == {"http://tracker:8000"}
    assert s["rollout"].learner == f"http://learner:{s['learner'].port}"
    assert {s[n].api_token for n in s if n != "prior"} == {TOKEN}
    assert s["rollout"].worker_id != s["rollout-1"].worker_id
    for name in ("tracker", "learner", "rollout", "evaluator"):
        assert s[name].host == "0.0.0.0", f"{name} must listen beyond the container"
    assert str(s["learner"].snapshots) == str(s["evaluator"].snapshots) == "/snapshots"


def test_one_snapshot_volume_the_learner_writes_and_the_others_read():
    services = COMPOSE["services"]
    assert "snapshots:/snapshots" in services["learner"]["volumes"]
    assert "snapshots:/snapshots:ro" in services["rollout"]["volumes"]
    assert "snapshots:/snapshots" in services["evaluator"]["volumes"]  # its hold file
    writers = [n for n, spec in services.items() if "snapshots:/snapshots" in spec.get("volumes", [])]
    assert sorted(writers) == ["evaluator", "learner"]
    assert "redis-data:/data" in services["redis"]["volumes"]
    assert services["redis"]["command"][:3] == ["redis-server", "--appendonly", "yes"]


def test_start_order_is_gated_by_health_checks_and_one_shot_steps():
    services = COMPOSE["services"]

    def deps(name):
        return {k: v["condition"] for k, v in services[name].get("depends_on", {}).items()}

    assert deps("tracker") == {"redis": "service_healthy"}
    assert deps("prior") == {"model": "service_completed_successfully"}
    assert deps("init") == {"tracker": "service_healthy", "prior": "service_completed_successfully"}
    assert deps("learner") == {"init": "service_completed_successfully"}
    assert deps("rollout") == {"init": "service_completed_successfully", "learner": "service_healthy"}
    assert deps("rollout") == gpus.ROLLOUT_DEPENDS
    assert deps("evaluator") == {"init": "service_completed_successfully"}
    for name in ("redis", "tracker", "learner", "rollout", "evaluator"):
        assert "healthcheck" in services[name], name
    assert "/readyz" in " ".join(services["tracker"]["healthcheck"]["test"])
    for name in ("model", "prior", "init"):
        assert services[name]["restart"] == "no", f"{name} is a one-shot step"


def test_a_second_up_resumes_and_never_resets():
    services = COMPOSE["services"]
    assert "--resume" in services["learner"]["command"]
    assert "/spopp-data" in " ".join(services["learner"]["volumes"])  # checkpoints on a volume
    for layout in (gpus.plan(2), gpus.plan(8), gpus.plan(1, learner_gpus=0)):
        assert "--resume" in project(generated(layout))["services"]["learner"]["command"]
    script = services["prior"]["command"][0]
    assert "--overwrite" not in script and script.startswith('if [ -f "$$SPOPP_PRIOR_OUT" ]')
    assert services["init"]["command"] == ["init"]  # idempotent: the same run is found as it is


def test_every_command_flag_and_entry_point_exists():
    """Every container's command line, from its image's ENTRYPOINT/CMD and the compose file."""
    for spec in project(generated(gpus.plan(4)))["services"].values():
        if "build" not in spec:
            continue  # redis: not ours
        argv = container_argv(ROOT / spec["build"]["dockerfile"], spec.get("entrypoint"), spec.get("command"))
        argv = [interpolate(a, DOTENV) for a in argv]
        check_argv(argv, service_env(spec))


@pytest.mark.parametrize("path", sorted((ROOT / "deploy").glob("*.Dockerfile")), ids=lambda p: p.name)
def test_dockerfile_entry_points_and_sources_exist(path):
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    d = dockerfile(path)
    argv = container_argv(path)
    assert argv[0] in scripts, f"{path.name}: {argv[0]} is no installed script"
    check_spopp(argv[1:])
    for src in d["COPY"]:
        assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such file"


def test_learner_image_has_no_vllm_sandbox_or_privileges():
    text = (ROOT / COMPOSE["services"]["learner"]["build"]["dockerfile"]).read_text().lower()
    dockerfile_text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "vllm" not in dockerfile_text and "bubblewrap" not in dockerfile_text
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
        assert "bubblewrap" in (ROOT / spec["build"]["dockerfile"]).read_text()


# --- GPUs ----------------------------------------------------------------------------------------------


def _assigned(doc: dict) -> dict[str, list[int]]:
    return {
        n: device_ids(spec) for n, spec in doc["services"].items() if re.sub(r"-\d+$", "", n) in LONG_RUNNING
    }


@pytest.mark.parametrize("n_gpus", [1, 2, 4, 8])
def test_gpu_assignment_is_disjoint(n_gpus):
    from services.launch.gpus import GpuPlan, check

    if n_gpus == 1:  # one device cannot hold a learner and a replica apart: say so, offer the ways
        with pytest.raises(gpus.PlanError, match="--share"):
            gpus.plan(1)
        layout = gpus.plan(1, learner_gpus=0)  # the disjoint way: the learner on the CPU
    else:
        layout = gpus.plan(n_gpus)
    doc = project(generated(layout))
    assigned = _assigned(doc)
    replicas = [n for n in assigned if n.startswith("rollout")]
    assert replicas[0] == "rollout" and len(replicas) == len(layout.rollout) >= 1
    # Disjoint, on devices the node has, and checked again by the launcher's own plan checker.
    used = [d for devices in assigned.values() for d in devices]
    assert len(used) == len(set(used)) and set(used) <= set(range(n_gpus))
    plan = GpuPlan(learner=assigned["learner"], rollout=[assigned[r] for r in replicas],
                   evaluator=assigned["evaluator"])  # fmt: skip
    assert check(plan, len(replicas), n_gpus) == [] and gpus.problems(layout) == []
    assert all(len(assigned[r]) == 1 for r in replicas)  # each replica its own GPU
    assert len(used) == n_gpus  # and none left idle by the default layout
    # The learner runs one rank per GPU; each replica names itself apart.
    learner = doc["services"]["learner"]
    assert learner["command"][learner["command"].index("--nproc") + 1] == str(
        max(len(assigned["learner"]), 1)
    )
    ids = {doc["services"][r]["environment"]["SPOPP_ROLLOUT_WORKER_ID"] for r in replicas}
    assert len(ids) == len(replicas)
    # The prior runs on a replica's GPU before any of them starts (init waits for it).
    assert device_ids(doc["services"]["prior"])[0] in assigned["rollout"]
    # No GPU for the evaluator: the CPU engine, and off unless its profile is asked for.
    evaluator = doc["services"]["evaluator"]
    if not assigned["evaluator"]:
        assert evaluator["environment"]["SPOPP_EVALUATOR_ENGINE"] == "transformers"
        assert evaluator.get("profiles") == ["evaluator"]


def test_gpu_layouts_by_node_size():
    def layout(n, **kw):
        lay = gpus.plan(n, **kw)
        return lay.learner, [r[0] for r in lay.rollout], lay.evaluator_gpus

    assert layout(2) == ((0,), [1], ())
    assert layout(4) == ((0,), [1, 2], (3,))
    assert layout(5) == ((0, 1), [2, 3], (4,))
    assert layout(8) == ((0, 1), [2, 3, 4, 5, 6], (7,))
    assert layout(8, learner_gpus=4, evaluator="off") == ((0, 1, 2, 3), [4, 5, 6, 7], ())
    assert layout(8, replicas=2) == ((0, 1), [2, 3], (4,))  # fewer: GPUs 5-7 stay free
    with pytest.raises(gpus.PlanError, match="--share"):
        gpus.plan(4, learner_gpus=4)


def test_sharing_a_gpu_only_when_asked():
    from services.launch.gpus import GpuPlan, check

    layout = gpus.plan(1, share=True)
    assigned = _assigned(project(generated(layout)))
    assert assigned["learner"] == assigned["rollout"] == [0]
    assert gpus.problems(layout) == []
    # The launcher's checker refuses the same plan without share, and accepts it with it.
    plan = dict(learner=assigned["learner"], rollout=[assigned["rollout"]], evaluator=assigned["evaluator"])
    assert check(GpuPlan(**plan), 1, 1) and check(GpuPlan(**plan, share=True), 1, 1) == []
    assert "--share" in generated(layout)


def test_cpu_learner_trains_in_fp32():
    doc = project(generated(gpus.plan(1, learner_gpus=0)))
    learner = doc["services"]["learner"]
    assert device_ids(learner) == [] and learner["environment"]["SPOPP_LEARNER_DTYPE"] == "fp32"
    assert LearnerSettings.resolve(env=service_env(learner)).dtype == "fp32"


def test_generated_replicas_are_the_rollout_service_on_another_gpu():
    doc = project(generated(gpus.plan(8)))
    base = doc["services"]["rollout"]
    for name in ("rollout-1", "rollout-4"):
        replica = doc["services"][name]
        strip = ("deploy", "environment")
        assert {k: v for k, v in replica.items() if k not in strip} == {
            k: v for k, v in base.items() if k not in strip
        }
        diff = {k for k in base["environment"] if base["environment"][k] != replica["environment"][k]}
        assert diff == {"SPOPP_ROLLOUT_WORKER_ID"}


def test_compose_gpus_command_line(tmp_path, capsys):
    import os

    out = tmp_path / "docker-compose.gpus.yml"
    assert gpus.main(["--gpus", "4", "--out", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    # `extends` names the base file relative to the generated one, wherever that is written.
    assert doc["services"]["rollout-1"]["extends"]["file"] == os.path.relpath(COMPOSE_FILE, tmp_path)
    assert gpus.main(["--gpus", "1", "--out", str(out)]) == 2
    assert "--share" in capsys.readouterr().err
    assert gpus.main(["--gpus", "2", "--out", "-"]) == 0
    assert "file: docker-compose.yml" not in capsys.readouterr().out  # one replica: nothing extends


# --- the model step ---------------------------------------------------------------------------------


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
    from spopp.settings import SettingsError

    with pytest.raises(SettingsError, match="api_token .environment SPOPP_API_TOKEN."):
        TrackerSettings.resolve(env={"SPOPP_API_TOKEN": "short"})


def test_learner_example_config_loads_and_bad_configs_say_why(tmp_path):
    from spopp.settings import SettingsError

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
