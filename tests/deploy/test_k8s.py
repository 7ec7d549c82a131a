"""Static checks of deploy/k8s/ (no cluster here): every manifest, and what every kustomization
renders (`kubectl kustomize`), validates against the Kubernetes schemas in strict mode
(kubernetes-validate, offline), and the objects fit together and with the CLI and the settings:
commands, flags and variables exist, one run's settings everywhere, the learner's rank 0 behind its
Service and its probes right on every node, one GPU per replica and its worker id from a claim, the
token and Redis's password from the Secret (the password on no command line)."""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions
from test_deploy import (
    ENV_EXAMPLE,
    ROOT,
    SERVICE_SETTINGS,
    SETTINGS_BY_PREFIX,
    TOKEN,
    check_argv,
    check_spopp,
    click_flags,
    container_argv,
)

from services.config.init import InitSettings
from spopp.settings.base import API_TOKEN_ENV, SHARED_ENV, TRACKER_URL_ENV

K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"  # the manifests; deploy/k8s/kustomization.yaml and every overlay build on it
FILES = sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(p, doc) for p in FILES for doc in yaml.safe_load_all(p.read_text()) if doc]
MANIFESTS = [doc for _, doc in DOCS]
KUSTOMIZATIONS = sorted(p.parent for p in K8S.rglob("kustomization.yaml"))
OVERLAYS = sorted(p.parent for p in (K8S / "overlays").glob("*/kustomization.yaml"))
# appArmorProfile (the sandbox's AppArmor setting) is a field from 1.30 on; before, an annotation.
MIN_VERSION = "1.30.0"
# Each image is a build target of the one Dockerfile.
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
IMAGES = {"spopp/tracker": "tracker", "spopp/rollout": "rollout", "spopp/learner": "learner"}
# Container name -> the settings it reads (wait-for-run runs `spopp init`).
CONTAINER_SETTINGS = {**SERVICE_SETTINGS, "wait-for-run": InitSettings}
# REDIS_PASSWORD: the redis pod's config step and its exporter; REDISCLI_AUTH: its probes' redis-cli.
OTHER_VARIABLES = {"HF_TOKEN", "NNODES", "GPUS_PER_NODE", "REDIS_ADDR", "REDIS_PASSWORD", "REDISCLI_AUTH"}
REDIS_PASSWORD = "r" * 64  # what the Secret's redis-password holds once edited
# .env.example's variables that only compose reads (files and ports on the compose host).
COMPOSE_ONLY = {
    "COMPOSE_FILE", "SPOPP_MODELS", "SPOPP_DATA", API_TOKEN_ENV, "HF_TOKEN", "SPOPP_ENV_FILE",
    "SPOPP_BASE_IMAGE", "SPOPP_FLAVOUR", "SPOPP_IMAGE_TAG", "SPOPP_MODEL_BUILD",
    # The plug-ins' host folder and the data step's default task family: pods mount their own
    # volumes and are given their task files (docs/environments.md).
    "SPOPP_PLUGINS", "SPOPP_TASK_FAMILY",
    # Host-network addresses and the node's GPU layout: pods have their own network and GPUs.
    "SPOPP_BIND", "SPOPP_REDIS_PORT", "SPOPP_TRACKER_PORT", "SPOPP_LEARNER_PORT", "SPOPP_ROLLOUT_PORT",
    "SPOPP_EVALUATOR_PORT", "SPOPP_GPUS_LEARNER", "SPOPP_NPROC_LEARNER", "SPOPP_ROLLOUT_DEVICES",
    "SPOPP_EVALUATOR_DEVICES", "SPOPP_GPUS_PRIOR",
    # Containers' memory limits: the pods' own are in their resources (rollout.yaml, evaluator.yaml).
    "SPOPP_MEMORY_ROLLOUT", "SPOPP_MEMORY_EVALUATOR",
}  # fmt: skip
# The ConfigMap's only variable .env.example lacks: the tracker's address in the cluster, which
# compose derives from the host port (x-run-binding in docker-compose.yml).
K8S_ONLY = {TRACKER_URL_ENV}


def objects(kind: str, docs: list[dict] = MANIFESTS) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict] = MANIFESTS):
    """(kind, name, pod template) of every Deployment, StatefulSet and Job."""
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["kind"], d["metadata"]["name"], d["spec"]["template"]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def all_containers(docs: list[dict] = MANIFESTS):
    for kind, name, template in workloads(docs):
        for c in containers(template):
            yield f"{kind}/{name}/{c['name']}", template, c


def template_of(workload: str, docs: list[dict] = MANIFESTS) -> dict:
    kind, _, wname = workload.partition("/")
    return next(t for k, n, t in workloads(docs) if (k, n) == (kind, wname))


def container(workload: str, name: str, docs: list[dict] = MANIFESTS) -> dict:
    return next(c for c in containers(template_of(workload, docs)) if c["name"] == name)


CONFIG = objects("ConfigMap")["spopp-config"]["data"]
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in env values, command and args; every reference must resolve."""

    def sub(m):
        assert m.group(1) in env, f"$({m.group(1)}) refers to no variable of its container"
        return env[m.group(1)]

    return _REF.sub(sub, text)


def container_env(c: dict, template: dict) -> dict[str, str]:
    """The environment a container gets: envFrom, the Job's completion index, then env in order."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        assert source["configMapRef"]["name"] == "spopp-config"
        env.update({k: str(v) for k, v in CONFIG.items()})
    env["JOB_COMPLETION_INDEX"] = "0"  # set by the Job controller in Indexed Jobs
    for e in c.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(str(e["value"]), env)
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = {"api-token": TOKEN, "redis-password": REDIS_PASSWORD}.get(
                ref["key"], "hf_secret"
            )
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name", e
            env[e["name"]] = f"{template['metadata']['labels']['app.kubernetes.io/name']}-7d9c-abcde"
    return env


def stage(target: str) -> str:
    """The instructions of one build target of deploy/Dockerfile, its `FROM ... AS target` up to the
    next FROM, without comments."""
    text = DOCKERFILE.read_text()
    m = re.search(rf"^FROM\s+\S+\s+AS\s+{re.escape(target)}\s*$", text, re.MULTILINE | re.IGNORECASE)
    assert m, f"deploy/Dockerfile has no target {target!r} (FROM ... AS {target})"
    end = re.search(r"^FROM\s", text[m.end() :], re.MULTILINE)
    text = text[m.start() : m.end() + end.start()] if end else text[m.start() :]
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def argv(c: dict, env: dict[str, str]) -> list[str]:
    image = c["image"].rpartition(":")[0]
    if image not in IMAGES:
        return []  # redis and its exporter: not ours
    args = container_argv(DOCKERFILE, c.get("command"), c.get("args"), target=IMAGES[image])
    return [expand(a, env) for a in args]


# --- schemas ---------------------------------------------------------------------------------------


def _versions():
    shipped = all_versions()
    out = [shipped[-1]]
    if any(v.startswith(MIN_VERSION.rsplit(".", 1)[0]) for v in shipped):
        out.insert(0, MIN_VERSION)
    return out


@pytest.mark.parametrize("version", _versions())
def test_every_manifest_validates_strictly(version):
    assert FILES and len(DOCS) >= len(FILES)
    for path, doc in DOCS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)  # an unknown kind raises too
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            pytest.fail(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")


def test_validation_refuses_an_unknown_field():
    doc = next(yaml.safe_load_all((BASE / "tracker.yaml").read_text()))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, MIN_VERSION, strict=True)


# --- kustomizations: what `kubectl apply -k` applies -------------------------------------------------


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.fail(
            "kubectl is not on PATH: tests/deploy/test_k8s.py renders every kustomization under deploy/k8s with "
            "`kubectl kustomize` (no cluster needed; on Debian: apt-get install kubernetes-client)",
            pytrace=False,
        )
    return path


@functools.cache
def _render(directory: Path) -> tuple[int, str, str]:
    proc = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120
    )
    return proc.returncode, proc.stdout, proc.stderr


def render(directory: Path) -> list[dict]:
    """`kubectl kustomize DIR`: the objects `kubectl apply -k DIR` would apply."""
    code, out, err = _render(directory)
    assert code == 0, f"kubectl kustomize {directory.relative_to(ROOT)} failed:\n{err}"
    return [d for d in yaml.safe_load_all(out) if d]


def kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def strategic_patches(overlay: Path) -> dict[tuple[str, str], dict]:
    """An overlay's patch files by (kind, name) of the object they patch."""
    patches = {}
    for name in kustomization(overlay).get("patchesStrategicMerge", []):
        for doc in yaml.safe_load_all((overlay / name).read_text()):
            patches[doc["kind"], doc["metadata"]["name"]] = doc
    return patches


def learner_nodes(docs: list[dict]) -> tuple[int, int, int, int, int]:
    """The learner's node count in its three places and its GPUs per node in its two."""
    job = objects("Job", docs)["learner"]
    c = container("Job/learner", "learner", docs)
    env = {e["name"]: e.get("value") for e in c["env"]}
    gpus = c["resources"]["limits"]["nvidia.com/gpu"]
    return (
        job["spec"]["completions"],
        job["spec"]["parallelism"],
        int(env["NNODES"]),
        int(env["GPUS_PER_NODE"]),
        gpus,
    )


def test_kustomization_layout():
    """deploy/k8s/base holds the manifests; deploy/k8s/ and every overlay build on it, none on a
    folder that contains it (kustomize's cycle)."""
    assert KUSTOMIZATIONS == sorted([K8S, BASE, *OVERLAYS]) and OVERLAYS
    base = kustomization(BASE)
    assert sorted(base["resources"]) == sorted(p.name for p in FILES)
    assert base["namespace"] == "spopp"
    used = {c["image"].rpartition(":")[0] for _, _, c in all_containers()}
    assert {i["name"] for i in base["images"]} == used & IMAGES.keys()
    assert kustomization(K8S)["bases"] == ["base"]
    for overlay in OVERLAYS:
        # bases and patchesStrategicMerge: what kubectl 1.20's kustomize (v2.0.3) also reads.
        k = kustomization(overlay)
        assert k["bases"] == ["../../base"] and "resources" not in k, overlay.name
        assert not {"patches", "replicas"} & k.keys(), f"{overlay.name}: kustomize v2.0.3 has no such field"
        for name in k.get("patchesStrategicMerge", []):
            assert (overlay / name).is_file(), f"{overlay.name}: no patch {name}"


@pytest.mark.process
@pytest.mark.parametrize(
    "directory", KUSTOMIZATIONS, ids=lambda d: str(d.relative_to(K8S)) if d != K8S else "k8s"
)
def test_every_kustomization_renders_and_validates_strictly(directory):
    rendered = render(directory)
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        (d["kind"], d["metadata"]["name"]) for d in MANIFESTS
    )
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in kustomization(BASE)["images"]}
    for doc in rendered:
        where = f"{directory.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "spopp", where
        for version in _versions():
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where}: {'.'.join(map(str, exc.path))}: {exc.message} (Kubernetes {version})")
    used = {c["image"] for _, _, c in all_containers(rendered)}
    assert not {i.rpartition(":")[0] for i in used} & IMAGES.keys(), "an image not set by the base's images:"
    assert set(images.values()) <= used
    # Every render: the learner's node count agrees in its three places, its GPUs in their two.
    completions, parallelism, nnodes, per_node, gpus = learner_nodes(rendered)
    assert completions == parallelism == nnodes and per_node == gpus, directory


@pytest.mark.process
def test_the_top_level_kustomization_is_the_base():
    assert render(K8S) == render(BASE)


@pytest.mark.process
@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda d: d.name)
def test_overlay_counts_reach_the_rendered_objects(overlay):
    """What an overlay's patches set (the rollout replicas, the learner's nodes and GPUs) is what
    its render holds, and everything else is the base's."""
    patches = strategic_patches(overlay)
    assert patches, f"{overlay.name}: patches nothing"
    rendered, base = render(overlay), render(BASE)
    if ("Deployment", "rollout") in patches:
        replicas = patches["Deployment", "rollout"]["spec"]["replicas"]
        assert objects("Deployment", rendered)["rollout"]["spec"]["replicas"] == replicas
        assert replicas != objects("Deployment", base)["rollout"]["spec"]["replicas"]
    if ("Job", "learner") in patches:
        patch = patches["Job", "learner"]
        env = {
            e["name"]: e["value"] for e in patch["spec"]["template"]["spec"]["containers"][0].get("env", [])
        }
        completions, parallelism, nnodes, _, _ = learner_nodes(rendered)
        assert completions == patch["spec"]["completions"] and parallelism == patch["spec"]["parallelism"]
        assert nnodes == int(env["NNODES"])  # all three patched: a patch of one would break the agreement
        assert len(container("Job/learner", "learner", rendered)["env"]) == len(
            container("Job/learner", "learner", base)["env"]
        )  # merged by name, not replaced
    untouched = {k for k in ((d["kind"], d["metadata"]["name"]) for d in base) if k not in patches}
    by_key = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    for d in base:
        key = (d["kind"], d["metadata"]["name"])
        if key in untouched:
            assert by_key[key] == d, f"{overlay.name} changes {key} without a patch"


@pytest.mark.process
def test_scale_out_renders_16_replicas_and_4_learner_nodes():
    """deploy/README.md's numbers for the scale-out overlay, in what `kubectl apply -k` applies."""
    rendered = render(K8S / "overlays" / "scale-out")
    assert objects("Deployment", rendered)["rollout"]["spec"]["replicas"] == 16
    assert learner_nodes(rendered) == (4, 4, 4, 8, 8)


def test_images_are_targets_of_the_one_dockerfile():
    for image, target in IMAGES.items():
        assert stage(target), image


def test_every_object_lives_in_the_spopp_namespace():
    assert "spopp" in objects("Namespace")
    for path, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "spopp", f"{path.name}: {doc['metadata']['name']}"


# --- commands, variables, settings ----------------------------------------------------------------


def test_every_variable_is_a_setting_or_a_known_one():
    for key in CONFIG:
        prefix = next((p for p in SETTINGS_BY_PREFIX if key.startswith(p)), None)
        if key in SHARED_ENV:  # the run binding: read under this name by every service joining the run
            assert any(key in cls.env_names() for cls in SETTINGS_BY_PREFIX.values()), key
        elif prefix:
            assert key in SETTINGS_BY_PREFIX[prefix].env_names(), f"spopp-config: {key} is no setting"
        else:
            assert key in ENV_EXAMPLE, f"spopp-config: {key} is neither a setting nor one of .env.example's"
    for where, _, c in all_containers():
        settings = CONTAINER_SETTINGS.get(c["name"])
        for e in c.get("env", []):
            name = e["name"]
            if name.startswith("SPOPP_") and name != API_TOKEN_ENV:
                assert settings and name in settings.env_names(), f"{where}: {name} is no setting of it"
            elif name != API_TOKEN_ENV:
                assert name in OTHER_VARIABLES, f"{where}: unexpected variable {name}"


def test_config_map_is_env_example_without_the_compose_host_parts():
    assert CONFIG.keys() == (ENV_EXAMPLE.keys() - COMPOSE_ONLY) | K8S_ONLY
    for key, value in CONFIG.items() - {(k, CONFIG[k]) for k in K8S_ONLY}:
        assert str(value) == ENV_EXAMPLE[key], f"{key}: spopp-config and .env.example differ"


def test_every_command_flag_and_entry_point_exists():
    """Each container's command line, from its image's ENTRYPOINT/CMD and the manifest."""
    from torch.distributed.run import get_args_parser

    torchrun_flags = {o for a in get_args_parser()._actions for o in a.option_strings}
    seen = set()
    for where, template, c in all_containers():
        env = container_env(c, template)
        args = argv(c, env)
        if not args:
            continue
        seen.add(c["name"])
        if args[:3] == ["python", "-m", "torch.distributed.run"]:
            module = args.index("-m", 3)
            for a in args[3:module]:
                assert a.split("=")[0] in torchrun_flags, f"{where}: torchrun has no {a}"
            assert args[module + 1] == "services.learner.cli"  # runnable per rank, as torchrun runs it
            from services.learner.cli import group

            cmd = group.commands[args[module + 2]]
            for a in args[module + 3 :]:
                assert a in click_flags(cmd), f"{where}: learner run has no {a}"
        else:
            check_argv(args, env)
    assert seen >= {"tracker", "rollout", "learner", "evaluator", "init", "prior", "model", "wait-for-run"}
    check_spopp(["learner", "run", "--resume"])


def test_containers_resolve_to_one_consistent_run():
    s = {}
    for where, template, c in all_containers():
        if c["name"] in CONTAINER_SETTINGS:
            s[where] = CONTAINER_SETTINGS[c["name"]].resolve(env=container_env(c, template))
    model = f"/models/{CONFIG['SPOPP_MODEL']}"
    tasks = f"/data/{CONFIG['SPOPP_TASKS']}"
    learner = s["Job/learner/learner"]
    rollout = s["Deployment/rollout/rollout"]
    evaluator = s["Deployment/evaluator/evaluator"]
    prior = s["Job/spopp-init/prior"]
    inits = [v for k, v in s.items() if k.endswith(("/init", "/wait-for-run"))]
    assert len(inits) == 4 and len({v.model_dump_json() for v in inits}) == 1  # one run, one identity
    init = inits[0]
    assert {str(learner.model), str(rollout.model), str(evaluator.model), str(prior.model)} == {model}
    assert init.base_snapshot == model
    assert {str(init.tasks), str(rollout.tasks), str(prior.tasks)} == {tasks}
    assert str(init.prior) == str(prior.out)
    assert init.run == learner.run == rollout.run == evaluator.run == CONFIG["SPOPP_RUN"]
    assert init.seed == learner.seed
    assert learner.recipe is None and learner.max_staleness is None  # the run's, read at start
    service = objects("Service")
    tracker = f"http://tracker:{service['tracker']['spec']['ports'][0]['port']}"
    assert {init.tracker, learner.tracker, rollout.tracker, evaluator.tracker} == {tracker}
    intake = service["learner"]["spec"]["ports"][0]
    assert rollout.learner == f"http://learner:{intake['port']}" and learner.port == intake["port"]
    assert str(learner.snapshots) == str(evaluator.snapshots) == "/snapshots"
    assert {learner.host, rollout.host, evaluator.host} == {"0.0.0.0"}
    assert s["Deployment/tracker/tracker"].redis_url == "redis://redis:6379/0"
    assert service["redis"]["spec"]["ports"][0]["port"] == 6379


def test_the_token_comes_from_the_secret():
    secret = objects("Secret")["spopp-secrets"]
    assert "api-token" in secret["stringData"]
    for where, _, c in all_containers():
        if not c["image"].startswith("spopp/") or c["name"] in ("model", "prior"):
            continue
        token = next(e for e in c["env"] if e["name"] == API_TOKEN_ENV)
        assert token["valueFrom"]["secretKeyRef"] == {"name": "spopp-secrets", "key": "api-token"}, where


# --- the objects ------------------------------------------------------------------------------------


def test_redis_is_a_statefulset_with_aof_on_a_persistent_volume():
    redis = objects("StatefulSet")["redis"]
    c = redis["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:4] == ["redis-server", "/conf/redis.conf", "--appendonly", "yes"]
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": "/data"} in c["volumeMounts"]
    headless = objects("Service")[redis["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"


def _from_secret(c: dict, name: str) -> str | None:
    """The Secret key an env variable of a container comes from, or None."""
    e = next((e for e in c.get("env", []) if e["name"] == name), None)
    ref = (e or {}).get("valueFrom", {}).get("secretKeyRef")
    assert ref is None or ref["name"] == "spopp-secrets", (name, ref)
    return ref and ref["key"]


def test_redis_requires_the_secrets_password_on_no_command_line_and_the_tracker_reads_a_file():
    secret = objects("Secret")["spopp-secrets"]["stringData"]
    assert len(secret["redis-password"]) < 16  # the placeholder: the config step refuses it
    pod = objects("StatefulSet")["redis"]["spec"]["template"]["spec"]
    config, redis = container("StatefulSet/redis", "config"), container("StatefulSet/redis", "redis")
    exporter = container("StatefulSet/redis", "exporter")
    assert [c["name"] for c in pod["initContainers"]] == ["config"]
    # The config step writes requirepass into redis.conf on this pod's memory-backed volume ...
    conf = next(v for v in pod["volumes"] if v["name"] == "conf")
    assert conf["emptyDir"]["medium"] == "Memory"
    assert {"name": "conf", "mountPath": "/conf"} in config["volumeMounts"]
    assert {"name": "conf", "mountPath": "/conf", "readOnly": True} in redis["volumeMounts"]
    assert _from_secret(config, "REDIS_PASSWORD") == "redis-password"
    script = config["args"][0]
    assert config["command"] == ["sh", "-c"] and "> /conf/redis.conf" in script and "umask 077" in script
    # ... which Redis starts with; the probes' redis-cli and the exporter authenticate from the Secret.
    assert redis["args"][:2] == ["redis-server", "/conf/redis.conf"]
    assert _from_secret(redis, "REDISCLI_AUTH") == "redis-password"
    assert _from_secret(exporter, "REDIS_PASSWORD") == "redis-password"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert redis[probe]["exec"]["command"] == ["sh", "-c", "redis-cli ping | grep -qx PONG"], probe
    # No password and no way of giving one on any command line, in any container of any pod.
    for where, _, c in all_containers():
        words = [*c.get("command", []), *c.get("args", [])]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            words += c.get(probe, {}).get("exec", {}).get("command", [])
        text = " ".join(words)
        assert "--requirepass" not in text and "-a" not in words and REDIS_PASSWORD not in text, where
        assert not re.search(r"redis-cli[^|;]*\s-a\s", text), where
    # The tracker: the password as a file from the Secret (that key alone), readable by its group.
    tpod = objects("Deployment")["tracker"]["spec"]["template"]["spec"]
    tracker = container("Deployment/tracker", "tracker")
    env = container_env(tracker, objects("Deployment")["tracker"]["spec"]["template"])
    settings = SERVICE_SETTINGS["tracker"].resolve(env=env)
    assert str(settings.redis_password_file) == "/secrets/redis-password"
    assert _from_secret(tracker, "SPOPP_TRACKER_REDIS_PASSWORD_FILE") is None  # a path, not the secret
    mount = next(m for m in tracker["volumeMounts"] if m["mountPath"] == "/secrets")
    assert mount["readOnly"] is True
    volume = next(v for v in tpod["volumes"] if v["name"] == mount["name"])["secret"]
    assert volume["secretName"] == "spopp-secrets"
    assert volume["items"] == [{"key": "redis-password", "path": "redis-password"}]
    assert (
        volume["defaultMode"] == 0o440
        and tpod["securityContext"]["fsGroup"] == tpod["securityContext"]["runAsGroup"]
    )


@pytest.mark.process
def test_redis_config_step_and_probes_work_with_a_real_redis(tmp_path):
    """The config step's script (with its /conf here), then redis-server as the pod starts it: NOAUTH
    without the password, PONG with it (even one with quotes and backslashes), the probe healthy with
    REDISCLI_AUTH only; a placeholder password stops the step before it writes anything."""
    import os
    import time

    import redis as redis_client

    from services.tracker.embedded import find_redis_server
    from spopp.machine.net import free_port

    config, redis = container("StatefulSet/redis", "config"), container("StatefulSet/redis", "redis")
    script = config["args"][0].replace("/conf", str(tmp_path))
    base = {"PATH": os.environ["PATH"]}
    short = subprocess.run(["sh", "-c", script], env={**base, "REDIS_PASSWORD": "REPLACE_ME"},
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    assert short.returncode == 1 and "at least 16" in short.stderr
    assert not (tmp_path / "redis.conf").exists()
    password = 'p4ss "quoted" \\ and spaces'
    subprocess.run(["sh", "-c", script], env={**base, "REDIS_PASSWORD": password}, check=True, timeout=30)
    assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
    port = free_port()
    args = [a.replace("/conf", str(tmp_path)).replace("/data", str(tmp_path)) for a in redis["args"][1:]]
    proc = subprocess.Popen([find_redis_server(), *args, "--port", str(port), "--bind", "127.0.0.1",
                             "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                redis_client.Redis(port=port, socket_timeout=5).ping()
                pytest.fail("redis answered PING without the password")
            except redis_client.exceptions.AuthenticationError:
                break
            except redis_client.exceptions.ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        assert redis_client.Redis(port=port, password=password, socket_timeout=5).ping() is True
        assert password not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        if shutil.which("redis-cli"):
            probe = redis["readinessProbe"]["exec"]["command"]
            probe = [*probe[:2], probe[2].replace("redis-cli", f"redis-cli -p {port}")]
            assert subprocess.run(probe, env={**base, "REDISCLI_AUTH": password}, timeout=30).returncode == 0
            assert subprocess.run(probe, env=base, timeout=30).returncode != 0  # NOAUTH is not healthy
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_tracker_is_replicated_and_ready_on_readyz():
    tracker = objects("Deployment")["tracker"]
    assert tracker["spec"]["replicas"] >= 2
    c = tracker["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_a_killed_container_of_any_long_lived_kind_is_restarted_in_place():
    """Supervision under Kubernetes is the kubelet's: Deployments and the StatefulSet restart a
    dead container always (their only allowed policy, unset or Always), the learner's Job on
    failure (not after its clean exit 0 at max_updates) and from its newest checkpoint; a wedged
    process is restarted too, through its liveness probe."""
    for kind in ("Deployment", "StatefulSet"):
        for name, obj in objects(kind).items():
            assert obj["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always", (
                f"{kind}/{name}"
            )
    learner = objects("Job")["learner"]["spec"]
    assert learner["template"]["spec"]["restartPolicy"] == "OnFailure" and learner["backoffLimit"] >= 10
    assert "--resume" in " ".join(
        container("Job/learner", "learner")["command"] + container("Job/learner", "learner").get("args", [])
    )
    for where in ("Deployment/tracker", "Deployment/rollout", "Deployment/evaluator"):
        assert container(where, where.split("/")[1])["livenessProbe"]["httpGet"]["path"] == "/healthz", where
    assert "exec" in container("Job/learner", "learner")["livenessProbe"]  # index-aware (see below)


def test_rollout_replicas_request_one_gpu_each():
    rollout = objects("Deployment")["rollout"]
    assert rollout["spec"]["replicas"] >= 1
    assert rollout["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # never GPUs beyond replicas
    c = container("Deployment/rollout", "rollout")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container("Deployment/evaluator", "evaluator")["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_replicas_and_the_evaluator_take_their_ids_from_claims_on_a_shared_volume():
    """`kubectl scale deployment/rollout --replicas=N` starts N alike pods: each claims a numbered
    slot (its worker id) in a folder on a ReadWriteMany volume that every replica mounts writable;
    no device claims (each pod sees its one GPU as device 0), no port claims (a network per pod)."""
    claims = objects("PersistentVolumeClaim")
    shared = set()
    for workload, name in (("Deployment/rollout", "rollout"), ("Deployment/evaluator", "evaluator")):
        template, c = template_of(workload), container(workload, name)
        env = container_env(c, template)
        settings = CONTAINER_SETTINGS[name].resolve(env=env)
        prefix = CONTAINER_SETTINGS[name].env_prefix
        assert settings.claim_dir is not None and settings.devices is None, workload
        assert settings.claim_ports is False, f"{workload}: a pod has its own network; keep its port"
        assert settings.port == c["ports"][0]["containerPort"]
        assert f"{prefix}WORKER_ID" not in env, f"{workload}: the worker id comes from the claim"
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(settings.claim_dir))
        assert not mount.get("readOnly"), f"{workload}: the claim folder must be writable"
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claims[claim]["spec"]["accessModes"] == ["ReadWriteMany"], f"{workload}: pods on many nodes"
        shared.add((claim, mount.get("subPath"), str(settings.claim_dir)))
    assert len(shared) == 1  # one folder: each role has slots of its own
    rollout = objects("Deployment")["rollout"]
    assert rollout["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def _serve(status: int) -> http.server.ThreadingHTTPServer:
    """A stand-in intake on a free port: `status` on /healthz, 404 elsewhere."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.process
def test_learner_probes_are_right_on_every_index():
    """Only index 0 (global rank 0) serves HTTP: there the probes ask the intake's /healthz; on the
    other indexes, whether torchrun (pid 1, the container's command) still has a learner rank. The
    probe script is run here, against a stand-in intake and a stand-in torchrun."""
    c = container("Job/learner", "learner")
    probes = {p: c[p] for p in ("startupProbe", "livenessProbe", "readinessProbe") if p in c}
    assert probes.keys() == {"startupProbe", "livenessProbe", "readinessProbe"}
    commands = [p["exec"]["command"] for p in probes.values()]
    assert all(cmd == commands[0] for cmd in commands)
    python, flag, script, agent = commands[0]
    assert (python, flag, agent) == ("python3", "-c", "1")
    assert c["command"] == ["python", "-m", "torch.distributed.run"]  # replaces the ENTRYPOINT: pid 1
    assert not template_of("Job/learner")["spec"].get("shareProcessNamespace")  # else pid 1 is pause
    env = container_env(c, template_of("Job/learner"))
    intake = next(p["containerPort"] for p in c["ports"] if p["name"] == "intake")
    assert (
        env["SPOPP_LEARNER_PORT"] == str(intake) and "SPOPP_LEARNER_PORT" in script and "/healthz" in script
    )
    assert objects("Service")["learner"]["spec"]["ports"][0]["targetPort"] == "intake"
    startup = probes["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # rendezvous, model, resume

    def probe(index: str, port: int = 0, pid: int = 1) -> int:
        env = {"PATH": "/usr/bin:/bin", "JOB_COMPLETION_INDEX": index, "SPOPP_LEARNER_PORT": str(port)}
        return subprocess.run(
            [sys.executable, "-c", script, str(pid)], env=env, capture_output=True
        ).returncode

    for status, healthy in ((200, True), (503, False)):
        server = _serve(status)
        try:
            assert (probe("0", server.server_address[1]) == 0) is healthy
        finally:
            server.shutdown()
            server.server_close()
    assert probe("0", server.server_address[1]) != 0  # nothing listens

    def torchrun(child: str) -> subprocess.Popen:
        """A stand-in torchrun with one child that runs `child`, until the test closes its stdin."""
        code = (
            "import subprocess, sys; "
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {child!r}], "
            "stdin=subprocess.DEVNULL); print('started', flush=True); sys.stdin.read(); p.kill(); p.wait()"
        )
        agent = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert agent.stdout.readline() == "started\n"  # the child runs: Popen returns after its exec
        return agent

    for child, alive in (("services.learner.cli", True), ("something-else", False)):
        agent = torchrun(child)
        try:
            assert (probe("1", pid=agent.pid) == 0) is alive, f"a child of torchrun that runs {child}"
        finally:
            agent.stdin.close()
            agent.wait(timeout=20)
    assert probe("1", pid=agent.pid) != 0  # torchrun's ranks gone


def test_learner_is_a_multi_node_indexed_job_with_rank_0_behind_its_service():
    job = objects("Job")["learner"]
    spec, pod = job["spec"], job["spec"]["template"]
    assert spec["completionMode"] == "Indexed"
    c = container("Job/learner", "learner")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert spec["completions"] == spec["parallelism"] == int(env["NNODES"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == int(env["GPUS_PER_NODE"])
    # Rendezvous: pod i is learner-i.<subdomain>, a headless Service over the learner pods.
    headless = objects("Service")[pod["spec"]["subdomain"]]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    labels = pod["metadata"]["labels"]
    assert headless["spec"]["selector"].items() <= labels.items()
    args = c["args"]
    assert f"--master_addr=learner-0.{pod['spec']['subdomain']}" in args  # static: node rank = index
    assert "--node_rank=$(JOB_COMPLETION_INDEX)" in args and "--nnodes=$(NNODES)" in args
    assert "--nproc_per_node=$(GPUS_PER_NODE)" in args and "--resume" in args
    assert not any(a.startswith("--rdzv_backend") for a in args)  # c10d would order nodes by arrival
    # The intake Service selects index 0, where global rank 0 runs.
    selector = objects("Service")["learner"]["spec"]["selector"]
    assert selector["batch.kubernetes.io/job-completion-index"] == "0"
    assert {k: v for k, v in selector.items() if not k.startswith("batch.")}.items() <= labels.items()


def test_volumes_snapshots_shared_read_write_many():
    claims = objects("PersistentVolumeClaim")
    for name in ("spopp-snapshots", "spopp-models", "spopp-data", "spopp-learner"):
        assert claims[name]["spec"]["accessModes"] == ["ReadWriteMany"], name
    for _, _, template in workloads():
        for v in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in claims

    def snapshot_mount(workload, name):
        c = container(workload, name)
        return next(m for m in c["volumeMounts"] if m["mountPath"] == "/snapshots")

    assert snapshot_mount("Deployment/rollout", "rollout").get("readOnly") is True
    assert not snapshot_mount("Job/learner", "learner").get("readOnly")
    assert not snapshot_mount("Deployment/evaluator", "evaluator").get("readOnly")  # its hold file


def test_prometheus_annotations_on_every_service():
    for name, svc in objects("Service").items():
        notes = svc["metadata"].get("annotations", {})
        assert notes.get("prometheus.io/scrape") in ("true", "false"), f"Service {name}"
        if notes["prometheus.io/scrape"] == "true":
            assert int(notes["prometheus.io/port"]) in {p["port"] for p in svc["spec"]["ports"]}
            assert notes["prometheus.io/path"] == "/metrics"
        else:  # a headless twin of a scraped Service
            assert svc["spec"]["clusterIP"] == "None"


def test_bubblewrap_rights_only_where_model_code_runs_and_never_privileged():
    sandboxed = set()
    for where, template, c in all_containers():
        pod = template["spec"]
        assert not (pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC")), where
        assert not any("hostPath" in v for v in pod.get("volumes", [])), where
        sc = c.get("securityContext", {})
        assert not sc.get("privileged"), where
        added = sc.get("capabilities", {}).get("add")
        if added:
            sandboxed.add(c["name"])
            assert sorted(added) == ["NET_ADMIN", "SYS_ADMIN"], where
            assert sc["seccompProfile"] == {"type": "Unconfined"}, where
            assert sc["appArmorProfile"] == {"type": "Unconfined"}, where
            assert c["image"].startswith("spopp/rollout:"), where  # the image with bubblewrap
    assert sandboxed == {"rollout", "evaluator", "prior"}
    assert "bubblewrap" in stage(IMAGES["spopp/rollout"])
    assert "bubblewrap" not in stage(IMAGES["spopp/learner"]) + stage(IMAGES["spopp/tracker"])


def test_every_pod_waits_for_the_run_the_init_job_creates():
    init = container("Job/spopp-init", "init")
    assert [
        c["name"] for c in objects("Job")["spopp-init"]["spec"]["template"]["spec"]["initContainers"]
    ] == [
        "model",
        "prior",
    ]
    for workload in ("Job/learner", "Deployment/rollout", "Deployment/evaluator"):
        gate = container(workload, "wait-for-run")
        assert gate["env"] == init["env"], workload  # the very same run
        script = gate["args"][0]
        assert "fetch_model.py --check" in script and "spopp init" in script and script.startswith("until ")


def test_probes_and_services_point_at_declared_ports():
    for where, _, c in all_containers():
        ports = {p["name"] for p in c.get("ports", [])}
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            http = c.get(probe, {}).get("httpGet")
            if http:
                assert http["port"] in ports, f"{where}: {probe} port {http['port']}"
    for name, svc in objects("Service").items():
        # The pods a Service selects (the Job's index label aside, which pods get at run time).
        selector = {k: v for k, v in svc["spec"]["selector"].items() if not k.startswith("batch.")}
        matched = [t for _, _, t in workloads() if selector.items() <= t["metadata"]["labels"].items()]
        assert len(matched) == 1, f"Service {name} selects {len(matched)} workloads"
        ports = {p["name"] for c in containers(matched[0]) for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {name}: no container port {p['targetPort']}"
