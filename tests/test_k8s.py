"""Static checks of deploy/k8s/ (no cluster here): every manifest validates against the Kubernetes
schemas in strict mode (kubernetes-validate, offline), and the objects fit together and with the
CLI and the settings: commands, flags and variables exist, one run's settings everywhere, the
learner's rank 0 behind its Service, one GPU per replica, the token from the Secret."""

from __future__ import annotations

import re

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

from services.launch.init import InitSettings
from spopp.settings import API_TOKEN_ENV

K8S = ROOT / "deploy" / "k8s"
FILES = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
DOCS = [(p, doc) for p in FILES for doc in yaml.safe_load_all(p.read_text()) if doc]
# appArmorProfile (the sandbox's AppArmor setting) is a field from 1.30 on; before, an annotation.
MIN_VERSION = "1.30.0"
IMAGES = {
    "spopp/tracker": ROOT / "deploy" / "tracker.Dockerfile",
    "spopp/rollout": ROOT / "deploy" / "rollout.Dockerfile",
    "spopp/learner": ROOT / "deploy" / "learner.Dockerfile",
}
# Container name -> the settings it reads (wait-for-run runs `spopp init`).
CONTAINER_SETTINGS = {**SERVICE_SETTINGS, "wait-for-run": InitSettings}
OTHER_VARIABLES = {"HF_TOKEN", "NNODES", "GPUS_PER_NODE", "REDIS_ADDR"}
# .env.example's variables that only compose reads (files and ports on the compose host).
COMPOSE_ONLY = {"COMPOSE_FILE", "SPOPP_MODELS", "SPOPP_DATA", "SPOPP_PUBLISH", API_TOKEN_ENV, "HF_TOKEN"}


def objects(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in DOCS if d["kind"] == kind}


def workloads():
    """(kind, name, pod template) of every Deployment, StatefulSet and Job."""
    for _, d in DOCS:
        if d["kind"] in ("Deployment", "StatefulSet", "Job"):
            yield d["kind"], d["metadata"]["name"], d["spec"]["template"]


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def all_containers():
    for kind, name, template in workloads():
        for c in containers(template):
            yield f"{kind}/{name}/{c['name']}", template, c


def container(workload: str, name: str) -> dict:
    kind, _, wname = workload.partition("/")
    template = next(t for k, n, t in workloads() if (k, n) == (kind, wname))
    return next(c for c in containers(template) if c["name"] == name)


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
            env[e["name"]] = TOKEN if ref["key"] == "api-token" else "hf_secret"
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[e["name"]] = f"{template['metadata']['labels']['app.kubernetes.io/name']}-7d9c-abcde"
    return env


def argv(c: dict, env: dict[str, str]) -> list[str]:
    image = c["image"].rpartition(":")[0]
    if image not in IMAGES:
        return []  # redis and its exporter: not ours
    return [expand(a, env) for a in container_argv(IMAGES[image], c.get("command"), c.get("args"))]


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
    doc = next(yaml.safe_load_all((K8S / "tracker.yaml").read_text()))
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, MIN_VERSION, strict=True)


def test_kustomization_lists_every_manifest_and_the_overlay_patches_agree():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(p.name for p in FILES)
    assert kustomization["namespace"] == "spopp"
    used = {c["image"].rpartition(":")[0] for _, _, c in all_containers()}
    assert {i["name"] for i in kustomization["images"]} == used & IMAGES.keys()
    for overlay in sorted((K8S / "overlays").glob("*/kustomization.yaml")):
        k = yaml.safe_load(overlay.read_text())
        for resource in k["resources"]:
            assert (overlay.parent / resource / "kustomization.yaml").exists()
        for item in k.get("patches", []):
            patch = yaml.safe_load(item["patch"])
            if (patch["kind"], patch["metadata"]["name"]) == ("Job", "learner"):
                nodes = {
                    e["name"]: e["value"] for e in patch["spec"]["template"]["spec"]["containers"][0]["env"]
                }
                assert patch["spec"]["completions"] == patch["spec"]["parallelism"] == int(nodes["NNODES"])
        for r in k.get("replicas", []):
            assert r["name"] in objects("Deployment")


def test_every_object_lives_in_the_spopp_namespace():
    assert "spopp" in objects("Namespace")
    for path, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "spopp", f"{path.name}: {doc['metadata']['name']}"


# --- commands, variables, settings ----------------------------------------------------------------


def test_every_variable_is_a_setting_or_a_known_one():
    for key in CONFIG:
        prefix = next((p for p in SETTINGS_BY_PREFIX if key.startswith(p)), None)
        if prefix:
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
    assert CONFIG.keys() == ENV_EXAMPLE.keys() - COMPOSE_ONLY
    for key, value in CONFIG.items():
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
    assert init.recipe == learner.recipe and init.seed == learner.seed
    service = objects("Service")
    tracker = f"http://tracker:{service['tracker']['spec']['ports'][0]['port']}"
    assert {init.tracker, learner.tracker, rollout.tracker, evaluator.tracker} == {tracker}
    intake = service["learner"]["spec"]["ports"][0]
    assert rollout.learner == f"http://learner:{intake['port']}" and learner.port == intake["port"]
    assert str(learner.snapshots) == str(evaluator.snapshots) == "/snapshots"
    assert {learner.host, rollout.host, evaluator.host} == {"0.0.0.0"}
    assert rollout.worker_id.startswith("spopp-rollout-")  # the pod's name: one per replica
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
    assert c["args"][:3] == ["redis-server", "--appendonly", "yes"]
    claim = redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert {"name": claim, "mountPath": "/data"} in c["volumeMounts"]
    headless = objects("Service")[redis["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"


def test_tracker_is_replicated_and_ready_on_readyz():
    tracker = objects("Deployment")["tracker"]
    assert tracker["spec"]["replicas"] >= 2
    c = tracker["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_rollout_replicas_request_one_gpu_each():
    rollout = objects("Deployment")["rollout"]
    assert rollout["spec"]["replicas"] >= 1
    assert rollout["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0  # never GPUs beyond replicas
    c = container("Deployment/rollout", "rollout")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container("Deployment/evaluator", "evaluator")["resources"]["limits"]["nvidia.com/gpu"] == 1


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
    assert "bubblewrap" in IMAGES["spopp/rollout"].read_text()
    assert "bubblewrap" not in IMAGES["spopp/learner"].read_text().split("FROM", 1)[1]


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
