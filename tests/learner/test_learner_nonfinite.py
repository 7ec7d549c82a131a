"""No trajectory kills the learner through a number that is not finite where it trains.

`rollout_logprobs = -1e308` is a finite float64, so the wire schema took it; in the learner's
float32 tensors it is -inf, policy_loss raised, and the learner died at its first update, and
again after each restart, the trajectory being redelivered (by the replica, or from the
checkpoint's buffer). Now: the intake refuses any value outside float32's range, naming the field
(tests/learner/test_learner_intake_security.py has the field-by-field cases); the update screens what
still gets through (spopp.loss.screen_rows: a trajectory whose loss term is not finite is dropped
and counted before any step, and a later arrival takes its place); a checkpoint's buffer passes
today's checks again on resume.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
import torch
from learner_worker import make_batch
from procs import cli, learner_config, running, wait_learner
from test_learner_ingest import traj
from test_learner_intake_security import refused, scrape

from services.learner.batch import collate
from services.learner.ingest import TrajectoryBuffer
from spopp.api.trajectory import FLOAT32_MAX, Trajectory
from spopp.loss import policy_loss, screen_rows, screened
from spopp.machine.wait import wait_until

POISON = -1e308  # finite in float64, -inf in float32


def test_float32_max_is_float32s_largest_value():
    big = torch.tensor([FLOAT32_MAX, -FLOAT32_MAX], dtype=torch.float64)
    assert torch.isfinite(big.float()).all() and big.float().double().equal(big)
    assert torch.finfo(torch.float32).max == FLOAT32_MAX
    assert torch.isinf(torch.tensor([POISON], dtype=torch.float64).float()).all()


def test_the_edge_of_float32_is_accepted_and_trains_finitely():
    """-FLOAT32_MAX is a valid (absurd) log-prob: exp(old - rollout) overflows to inf, which the
    rollout cap (is_cap) brings back to a finite weight, so the loss stays finite."""
    edge = Trajectory(**traj(0, rollout_logprobs=[0.0, 0.0, -FLOAT32_MAX, -0.25]))
    b = collate([edge], [0.5])
    old = torch.full_like(b.rollout_logp, -1.0)
    loss, _ = policy_loss(old, old, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp)
    assert math.isfinite(float(loss))
    assert screen_rows(old, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp).tolist() == [0]


def test_what_the_old_schema_let_through_is_screened_instead_of_raised():
    """The trajectory of the finding, built without validation (as a checkpoint of an older learner
    or any future path could hold it): policy_loss raises on it, which stopped the learner;
    screen_rows names it instead, and the others of its micro-batch train."""
    bad = Trajectory.model_construct(**traj(1, rollout_logprobs=[0.0, 0.0, POISON, -0.25]))
    good = Trajectory(**traj(0))
    b = collate([good, bad], [0.5, -0.5])
    old = torch.full_like(b.rollout_logp, -1.0)
    with pytest.raises(ValueError, match="rollout_logp has NaN or infinite values"):
        policy_loss(old, old, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp)
    codes = screen_rows(old, b.advantages, b.loss_mask, rollout_logp=b.rollout_logp)
    assert codes.tolist() == [0, 2] and screened(2) == "rollout_logp not finite"
    keep = codes == 0
    loss, _ = policy_loss(
        old[keep], old[keep], b.advantages[keep], b.loss_mask[keep], rollout_logp=b.rollout_logp[keep]
    )
    assert math.isfinite(float(loss))


def test_screen_rows_names_each_rows_non_finite_part():
    n, t = 6, 4
    logp = torch.full((n, t), -1.0)
    adv = torch.full((n, t), 0.5)
    rollout = torch.full((n, t), -1.2)
    mask = torch.tensor([[0, 1, 1, 1]] * n, dtype=torch.bool)
    logp[1, 2] = math.nan  # the learner's own log-prob
    rollout[2, 3] = -math.inf
    adv[3] = math.nan
    logp[4, 0] = math.nan  # padding (mask 0): never looked at, as policy_loss never looks at it
    rollout[4, 0] = math.inf
    rollout[5, 1] = -100.0  # finite, but exp(-1 + 100) overflows float32: a weight of inf uncapped
    codes = screen_rows(logp, adv, mask, rollout_logp=rollout)
    assert codes.tolist() == [0, 1, 2, 4, 0, 0]  # capped at is_cap, row 5's weight is 2
    uncapped = screen_rows(logp, adv, mask, rollout_logp=rollout, is_cap=math.inf)
    assert uncapped.tolist() == [0, 1, 2, 4, 0, 8] and screened(8) == "loss term not finite"
    both = logp.clone()
    both[2, 1] = math.inf
    assert screen_rows(both, adv, mask, rollout_logp=rollout)[2] == 3
    assert screened(3) == "logp, rollout_logp not finite"
    # A stale token far off its behaviour policy is dropped (decoupled) or truncated (tis): finite.
    stale = torch.zeros_like(mask)
    stale[5] = True
    for off_policy in ("decoupled", "tis"):
        codes = screen_rows(
            logp, adv, mask, rollout_logp=rollout, is_cap=math.inf, stale=stale, off_policy=off_policy
        )
        assert codes[5] == 0, off_policy


def test_a_checkpointed_trajectory_the_intake_now_refuses_is_dropped_at_restore():
    """A buffer checkpointed by a learner without the float32 check holds the poisoned record:
    restoring drops it (answered, for the log and the count) and frees its place at k = 0, where
    the version's count is capped, so a later arrival takes it."""
    old = TrajectoryBuffer("r", capacity=3)
    for i in range(2):
        old.add(Trajectory(**traj(i)))
    state = old.state()
    state["pending"].insert(1, traj(9, request_id="poison", rollout_logprobs=[0.0, 0.0, POISON, -0.25]))
    state["seen"]["poison"] = [0, 2]
    state["count"] = 3
    fresh = TrajectoryBuffer("r", capacity=3)
    dropped = fresh.restore(state)
    assert list(dropped) == ["poison"] and "float32" in dropped["poison"], dropped
    assert fresh.accepted == 2
    assert fresh.add(Trajectory(**traj(2))) == 2  # the freed place (capacity 3)
    assert [t.request_id for t in fresh.take(3)] == ["q0", "q1", "q2"]


# -- a real learner through the CLI, killed and resumed --------------------------------------
def _nan_token_model(src: Path, dst: Path) -> tuple[Path, int]:
    """The tiny model with its input and output embeddings untied (the same logits) and one
    token's input embedding NaN: a trajectory holding that token passes the intake (a valid id)
    but the learner's own log-probs of it are NaN; every other trajectory's are as before."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    emb = model.get_input_embeddings()
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(emb.weight.detach().clone())
    token = emb.num_embeddings - 1
    with torch.no_grad():
        emb.weight[token] = math.nan
    model.save_pretrained(dst)
    again = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    assert torch.isnan(again.get_input_embeddings().weight[token]).all()
    assert torch.isfinite(again.lm_head.weight).all()
    return dst, token


def _log(tmp: Path) -> str:
    path = tmp / "learner.log"
    return path.read_text() if path.exists() else ""


def _records(tmp: Path) -> list[dict]:
    path = tmp / "logs" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []


@pytest.mark.process
# Two ranks must agree on what the screen drops (one all-reduce) or their collectives would part:
# the same run under torchrun, in the slow tier (each leg starts two DeepSpeed ranks).
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)], ids=["1proc", "2proc"])
def test_poisoned_trajectories_stop_nothing_before_or_after_a_restart(
    tiny_model, tracker, client, run_name, tmp_path, nproc
):
    """Leg 1: the finding's trajectory is refused at the door (422, the field named); one whose
    loss term the learner itself finds NaN is screened out of the first update (logged, counted
    in /metrics and metrics.jsonl), a later arrival takes its place, and the update trains. The
    learner is SIGKILLed after that update's checkpoint, into which the poisoned record is put as
    a learner without the check would have buffered it. Leg 2 (--resume): the record is dropped
    from the restored buffer, the replica's redelivery is refused again, and the learner trains
    to its budget and exits 0. Before the check, leg 1's POST was accepted (200)."""
    model, nan_token = _nan_token_model(Path(tiny_model), tmp_path / "model")
    b = 2
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 60, "base_snapshot": str(model)})
    # Two updates per publish: the version takes 4 trajectories, so a checkpoint between them
    # carries a buffer (what a redelivered record could sit in).
    config, port = learner_config(
        tmp_path, tracker.url, model, run_name, batch_size=b, mini_batches=1, micro_batch_size=2,
        updates_per_publish=2, checkpoint_every=1, max_updates=2, lr=1e-4, verify_requests=False,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    trajs, _ = make_batch(tiny_model, n=6)
    assert all(nan_token not in t.token_ids for t in trajs)

    def body(i: int, **change) -> dict:
        t = trajs[i]
        return {
            **t.model_dump(), "run": run_name, "request_id": f"r{i}", "policy_version": 0,
            "value": 0.5, "advantage": t.reward - 0.5, **change,
        }  # fmt: skip

    action = trajs[4].action_mask.index(1)
    poison = body(4, request_id="poison")
    poison["rollout_logprobs"] = [
        POISON if k == action else x for k, x in enumerate(poison["rollout_logprobs"])
    ]
    nan_ids = list(trajs[5].token_ids)
    nan_ids[1] = nan_token  # a prompt token: the door checks its id, not what the model makes of it
    nan_traj = body(5, request_id="nan-token", token_ids=nan_ids)

    def post(x: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/trajectories", json=x, timeout=30)

    def refused_poison() -> None:
        r = post(poison)
        assert r.status_code == 422, r.text
        detail = r.json()["detail"]
        assert detail["errors"][0]["field"] == "rollout_logprobs", detail
        assert f"rollout_logprobs[{action}] = -1e+308" in detail["message"] and "float32" in detail["message"]

    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    learner_cmd = cli("learner", "run", "--config", str(config), "--nproc", str(nproc))
    with running(learner_cmd, tmp_path / "leg1.log", env) as learner:
        wait_learner(url, learner)
        refused_poison()
        for x in (nan_traj, body(0), body(1)):  # the first batch is [nan-token, r0]; r1 replaces it
            assert post(x).status_code == 200
        deadline = time.monotonic() + 180
        while not _records(tmp_path):  # written after the update's checkpoint
            assert learner.poll() is None, "the learner died"
            assert time.monotonic() < deadline, "no update"
            time.sleep(0.2)
        m = scrape(url)
        assert refused(m, "nonfinite") == 1 and refused(m, "invalid") == 1
        learner.kill()
        learner.wait(10)
    [first] = _records(tmp_path)
    assert first["dropped_nonfinite"] == 1.0
    assert first["tokens"] == trajs[0].action_tokens + trajs[1].action_tokens
    assert (
        "dropped trajectory nan-token: its loss term is not finite (logp not finite)"
        in (tmp_path / "leg1.log").read_text()
    )

    # The checkpoint as a learner that accepted the poisoned record would have written it.
    state_file = tmp_path / "ckpt" / "step00000001" / "learner_state.pt"
    state = torch.load(state_file, weights_only=False)
    buffered = state["buffer"]
    buffered["pending"].append(poison)
    buffered["seen"]["poison"] = [0, buffered["count"]]
    buffered["count"] += 1
    torch.save(state, state_file)

    with running([*learner_cmd, "--resume"], tmp_path / "leg2.log", env) as learner:
        wait_learner(url, learner)
        assert refused(scrape(url), "invalid") == 1  # dropped from the restored buffer
        refused_poison()  # the replica redelivers it after the restart
        for x in (body(2), body(3)):  # both fit: the dropped record's place was freed
            assert post(x).status_code == 200, post(x).text
        assert learner.wait(180) == 0
    log2 = (tmp_path / "leg2.log").read_text()
    assert "dropped trajectory poison from the checkpoint: the intake now refuses it" in log2
    assert [r["step"] for r in _records(tmp_path)] == [1, 2]
    assert _records(tmp_path)[1]["tokens"] == trajs[2].action_tokens + trajs[3].action_tokens
    assert client.policy(run_name).version == 1


@pytest.mark.process
def test_a_learner_whose_weights_fail_every_trajectory_stops_instead_of_draining_the_run(
    tiny_model, tracker, client, run_name, tmp_path
):
    """The screen drops trajectories, not the weights' failures: when every trajectory of
    WHOLE_BATCHES_DROPPED batches in a row is screened out (here each holds the NaN token, as
    every trajectory would under NaN weights), the learner exits non-zero with the reason, as it
    did before the screen, rather than consume the run's trajectories without training."""
    from services.learner.trainer import WHOLE_BATCHES_DROPPED

    model, nan_token = _nan_token_model(Path(tiny_model), tmp_path / "model")
    b = 2
    client.put_run(run_name, {"recipe": "spopp", "lease_seconds": 60, "base_snapshot": str(model)})
    config, port = learner_config(
        tmp_path, tracker.url, model, run_name, batch_size=b, mini_batches=1, micro_batch_size=2,
        max_updates=2, lr=1e-4, verify_requests=False,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    n = b * WHOLE_BATCHES_DROPPED
    trajs, _ = make_batch(tiny_model, n=n)
    env = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))}
    with running(cli("learner", "run", "--config", str(config)), tmp_path / "learner.log", env) as learner:
        wait_learner(url, learner)
        for i, t in enumerate(trajs):
            ids = list(t.token_ids)
            ids[1] = nan_token
            body = {
                **t.model_dump(), "run": run_name, "request_id": f"n{i}", "policy_version": 0,
                "value": 0.5, "advantage": t.reward - 0.5, "token_ids": ids,
            }  # fmt: skip
            assert httpx.post(f"{url}/v1/trajectories", json=body, timeout=30).status_code == 200
            if (i + 1) % b == 0 and i + 1 < n:
                # The batch's places stay taken (409 full) until the learner has dropped it.
                wait_until(
                    lambda k=i + 1: _log(tmp_path).count("its loss term is not finite") >= k, 120,
                    f"the learner to drop the first {i + 1}", proc=learner,
                )  # fmt: skip
        assert learner.wait(120) != 0
    log = (tmp_path / "learner.log").read_text()
    assert f"{WHOLE_BATCHES_DROPPED} batches in a row had a non-finite loss term" in log
    assert not _records(tmp_path)  # nothing was trained
