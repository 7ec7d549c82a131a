"""The three services end to end: tracker + a rollout replica + the learner, on the tiny model.

For both recipes (SPO++ with token normalization, SPO with trajectory normalization) the learner
trains on the replica's trajectories, publishes snapshots that the tracker announces and the
replica reloads; SPO's evidence moves only through /consume. The one-rank SPO++ run is under
bounded staleness (max_staleness 1): the replica keeps generating across swaps and the learner
trains on trajectories of the previous version too (k = 0 runs end to end in the other two, in the
launch, supervision and demo tests).
"""

import json
import os

import pytest
from procs import cli, learner_config, running

from runtime.tasks import generate_arithmetic_tasks
from spopp.machine.net import free_port

pytestmark = pytest.mark.process  # starts processes: the process tier (tests/conftest.py)

N_TASKS = 12


# `make test` runs the two-rank SPO++ case; the recipe's and the staleness window's variants of the
# same seam are in the slow tier (their differences are tested in this process too: test_advantages,
# test_staleness).
@pytest.mark.parametrize(
    "recipe,measure,dual_clip,nproc,k",
    [
        pytest.param("spopp", "token", 2.0, 1, 1, marks=pytest.mark.slow),
        pytest.param("spo", "trajectory", 10.0, 1, 0, marks=pytest.mark.slow),
        ("spopp", "token", 2.0, 2, 0),
    ],
    ids=["spopp-staleness-k1", "spo", "spopp-2ranks"],
)
def test_three_services_train_publish_and_reload(
    tiny_model, tracker, client, run_name, tmp_path, recipe, measure, dual_clip, nproc, k
):
    tasks = generate_arithmetic_tasks(N_TASKS, seed=0)  # the replica's --generated-tasks
    client.put_run(
        run_name,
        {"recipe": recipe, "lease_seconds": 30, "base_snapshot": str(tiny_model), "max_staleness": k},
    )
    client.put_tasks(run_name, [{"task_id": t.task_id, "outcomes": [1, 0, 0, 0, 1, 0, 0, 0]} for t in tasks])
    updates = 3
    # No evaluator runs: the learner trains and prunes without one.
    config, learner_port = learner_config(
        tmp_path, tracker.url, tiny_model, run_name, recipe=recipe, normalization=measure, dual_clip=dual_clip,
        lr=1e-4, max_updates=updates, max_staleness=k,
    )  # fmt: skip
    replica_port = free_port()
    # nproc 2: the CLI relaunches itself under torchrun; rank 0 serves the intake.
    learner_args = cli("learner", "run", "--config", str(config), "--nproc", str(nproc))
    replica_args = cli(
        "rollout", "serve", "--model", str(tiny_model), "--tracker", tracker.url,
        "--learner", f"http://127.0.0.1:{learner_port}", "--run", run_name, "--engine", "transformers",
        "--generated-tasks", str(N_TASKS), "--concurrency", "4", "--max-turns", "2", "--max-tokens-per-turn", "32",
        "--max-total-tokens", "900", "--port", str(replica_port),
    )  # fmt: skip
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    with (
        running(learner_args, tmp_path / "learner.log", env) as learner,
        running(replica_args, tmp_path / "replica.log") as replica,
    ):
        # The replica's generated task ids are the ones registered above.
        assert learner.wait(600) == 0
        policy = client.policy(run_name)
        assert policy.version == updates
        # The learner marked the run finished after its last update: the replica stops and exits 0.
        run = client.get_run(run_name)
        assert (run.status, run.final_version, run.finish_reason) == ("finished", updates, "max_updates")
        assert replica.wait(60) == 0
    replica_log = " ".join((tmp_path / "replica.log").read_text().split())
    assert f"run {run_name} is finished (version {updates}): replica rollout-0 exits" in replica_log
    assert (
        f"run {run_name} finished at version {updates} after {updates} updates"
        in (tmp_path / "learner.log").read_text()
    )
    assert "policy v1 loaded" in replica_log  # it followed the clock while the run went on
    stats = client.get_run(run_name).workers["rollout-0"]
    assert stats.trajectories >= updates * 8  # every batch came from it (batch_size 8)
    assert stats.leases >= stats.outcomes >= stats.trajectories
    records = [json.loads(x) for x in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("eval/") for r in records for k in r)  # the learner does not evaluate
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["policy_version"] for r in records] == [0, 1, 2]
    assert all(r["world_size"] == nproc for r in records)
    logged = (
        "reward_mean", "success_rate", "response_tokens_mean", "clip_fraction", "approx_kl", "is_weight_mean",
        "is_weight_max", "is_capped_fraction", "grad_norm", "lr", "tokens_per_s", "batch_wait_s", "publish_s",
    )  # fmt: skip
    for key in logged:
        assert all(key in r for r in records), key
    # The learner's throughput counts every token it ran through: at least the action tokens.
    assert all(r["sequence_tokens"] >= r["tokens"] > 0 for r in records)
    assert all(
        r["sequence_tokens_per_s"] == pytest.approx(r["sequence_tokens"] / r["update_seconds"])
        for r in records
    )
    # Each batch's staleness histogram covers it; with k = 1 the episodes generated during an
    # update train in the next one (one version old), corrected as stale tokens.
    assert all(sum(r[f"staleness_{i}"] for i in range(k + 1)) == 8 for r in records)
    if k:
        assert sum(r["staleness_1"] for r in records) > 0 and sum(r["stale_tokens"] for r in records) > 0
        assert all(r["behaviour_weight_max"] > 0 for r in records if r["stale_tokens"])
    else:
        assert all(r["staleness_max"] == 0 and r["stale_tokens"] == 0 for r in records)
    snaps = sorted(p.name for p in (tmp_path / "snapshots").iterdir())
    assert snaps == ["v000002", "v000003"]  # keep_snapshots = 2, no hold
    manifest = json.loads((tmp_path / "snapshots" / "v000003" / "manifest.json").read_text())
    assert (manifest["version"], manifest["step"]) == (3, 3)  # one update per publish
    counts = client.get_run(run_name).counts
    if recipe == "spo":
        assert counts.consumed_updates == updates  # SPO's evidence moved only through /consume
        assert all("drift_mean" in r for r in records)
    else:
        assert counts.consumed_updates == 0 and counts.outcomes >= updates * 8
