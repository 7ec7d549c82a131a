"""Sizing probe for the CPU demo: on-policy RL from the toy cold start in one plain PyTorch loop.

No services: one process samples a batch of toy-calc episodes through the real agent loop
(`runtime.agent.run_episode`, transformers engine, T = 1), computes per-task Beta-baseline
advantages, standardizes them with `spopp.advantages.normalize_advantages` and takes `mini_batches`
optimizer steps of `spopp.loss.policy_loss` (one epoch, old log-probs recomputed before the update,
the engine's log-probs as the rollout policy), like the learner. The engine and the learner share
one model object, so every batch is sampled by the newest weights (a synchronous stand-in for the
demo's asynchronous loop: staleness is zero here).

The two recipes, as the services implement them:
* spopp: value frozen at dispatch from event-time evidence (retention 0.875 per update),
  token-measure standardization, Dual-Clip c = 2;
* spo: value read before the update, SPO's drift-dependent retention afterwards (the learner's
  SpoDriftCache), trajectory-measure standardization, Dual-Clip c = 10.

Every `eval_every` updates it scores held-out tasks at T = 1 (sampled) and T = 0 (greedy) and
reports the first update at which either rose by `rise` over update 0, and seconds per update.

    python -m tools.toy_rl_probe --model DIR --out probe.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from runtime.envs.toy_calc import generate_toy_calc_tasks
from services.learner.spo import SpoDriftCache
from spopp.advantages import normalize_advantages
from spopp.evidence import (
    EventTimeEvidence,
    event_coordinate,
    jeffreys_init,
    spo_retention,
    spo_update,
)
from spopp.loss import policy_loss
from tools.cold_start import evaluate, run_episodes

RECIPES = {
    "spopp": {"normalization": "token", "dual_clip": 2.0},
    "spo": {"normalization": "trajectory", "dual_clip": 10.0},
}


def _pad(seqs: list[list[int]], pad: int):
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
    return ids, att


def token_logprobs(model, ids, att):
    """log p(token_t | prefix) for t = 1..T-1, shape [B, T-1]."""
    import torch

    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


class _Traj:
    def __init__(self, task_id: str, ep) -> None:
        self.task_id = task_id
        self.token_ids = ep.token_ids
        self.action_mask = ep.action_mask


def run_probe(
    model_dir: str | Path,
    *,
    recipe: str = "spopp",
    batch_size: int = 32,
    lr: float = 3e-4,
    mini_batches: int = 2,
    max_updates: int = 60,
    eval_every: int = 5,
    eval_tasks: int = 128,
    n_train: int = 256,
    seed: int = 0,
    rise: float = 0.15,
    prior_mass: float = 8.0,
    retention: float = 0.875,
    weight_decay: float = 0.1,
    log=print,
) -> dict:
    probe = _Probe(model_dir, recipe, batch_size, lr, eval_tasks, n_train, seed, prior_mass, weight_decay)
    evals = [probe.score(0)]
    log(
        f"[{recipe} B={batch_size} lr={lr:g} seed={seed}] update 0: sampled {evals[0]['sampled']:.3f} greedy {evals[0]['greedy']:.3f}"
    )
    for k in range(1, max_updates + 1):
        probe.update(k, retention, mini_batches)
        if k % eval_every == 0 or k == max_updates:
            ev = probe.score(k)
            evals.append(ev)
            log(
                f"  update {k}: sampled {ev['sampled']:.3f} greedy {ev['greedy']:.3f} tool {ev['tool_rate']:.2f} "
                f"train reward {statistics.fmean(probe.rewards[-eval_every:]):.3f} kl {probe.stats_log[-1]['kl']:.4f} "
                f"gen {statistics.fmean(probe.gen_s[-eval_every:]):.3f}s train {statistics.fmean(probe.train_s[-eval_every:]):.3f}s"
            )
    asyncio.run(probe.engine.close())
    run = {"recipe": recipe, "batch_size": batch_size, "lr": lr, "mini_batches": mini_batches, "seed": seed,
           "max_updates": max_updates}  # fmt: skip
    return {**run, **_summary(evals, rise), **probe.timings(), "evals": evals, "train_reward": probe.rewards,
            "stats": probe.stats_log}  # fmt: skip


def _summary(evals: list[dict], rise: float) -> dict:
    """When either score first rose by `rise` over update 0, and the scores at the start and end."""
    base = evals[0]

    def first(key: str) -> int | None:
        return next((e["update"] for e in evals[1:] if e[key] >= base[key] + rise), None)

    final = evals[-5:] if len(evals) > 5 else evals[1:]
    return {
        "first_rise_sampled": first("sampled"),
        "first_rise_greedy": first("greedy"),
        "base_sampled": base["sampled"],
        "base_greedy": base["greedy"],
        "final5_sampled": statistics.fmean(e["sampled"] for e in final),
        "final5_greedy": statistics.fmean(e["greedy"] for e in final),
    }


class _Probe:
    """One recipe's run: the engine and the trained model (one object), the task values, the log."""

    def __init__(
        self,
        model_dir: str | Path,
        recipe: str,
        batch_size: int,
        lr: float,
        eval_tasks: int,
        n_train: int,
        seed: int,
        prior_mass: float,
        weight_decay: float,
    ) -> None:
        import torch

        from runtime.engines.hf import TransformersEngine

        self.recipe, self.cfg, self.batch_size = recipe, RECIPES[recipe], batch_size
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.rng = random.Random(seed)
        self.engine = TransformersEngine(model_dir, max_batch=max(64, batch_size))
        self.engine.sampler.shared.manual_seed(seed)  # reproducible sampling stream for the probe
        self.model = self.engine.model  # shared: the engine always samples with the newest weights
        self.pad = self.engine.tokenizer.pad_token_id
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=weight_decay
        )
        self.train = generate_toy_calc_tasks(n_train, seed=seed, split="train")
        # The same held-out tasks for every run.
        self.heldout = generate_toy_calc_tasks(eval_tasks, seed=12345, split="heldout")
        a0, b0 = jeffreys_init(0, 0, prior_mass)
        self.evidence = {t.task_id: EventTimeEvidence(a0, b0, 0.0) for t in self.train}  # spopp
        self.spo_state = {t.task_id: (a0, b0) for t in self.train}  # spo
        self.drift_cache = SpoDriftCache()
        self.gen_s: list[float] = []
        self.train_s: list[float] = []
        self.rewards: list[float] = []
        self.stats_log: list[dict] = []

    def score(self, update: int) -> dict:
        s = evaluate(self.engine, self.heldout, temperature=1.0, seed=10_000 + update)
        g = evaluate(self.engine, self.heldout, temperature=0.0)
        return {
            "update": update,
            "sampled": s["success"],
            "greedy": g["success"],
            "tool_rate": s["tool_rate"],
            "len_success": s["gen_tokens_success"],
            "len_failure": s["gen_tokens_failure"],
        }

    def update(self, k: int, retention: float, mini_batches: int) -> None:
        """Update k: sample a batch, value it as the recipe does, take the optimizer steps."""
        t0 = time.perf_counter()
        batch = self.rng.sample(self.train, self.batch_size)
        if self.recipe == "spopp":
            zq = event_coordinate(k - 1, retention)
            values = [self.evidence[t.task_id].value for t in batch]  # frozen at dispatch
        episodes = asyncio.run(run_episodes(self.engine, batch, temperature=1.0))
        t1 = time.perf_counter()
        rew = [e.reward for e in episodes]
        self.rewards.append(statistics.fmean(rew))
        if self.recipe == "spo":
            values = [
                self.spo_state[t.task_id][0] / sum(self.spo_state[t.task_id]) for t in batch
            ]  # read before
        else:
            for t, r in zip(batch, rew, strict=True):
                self.evidence[t.task_id].add(zq, r)  # placed at the policy version that produced it
        lengths = [e.generated_tokens for e in episodes]
        adv = normalize_advantages(
            [r - v for r, v in zip(rew, values, strict=True)], lengths, measure=self.cfg["normalization"]
        )
        step_stats = self._steps(episodes, adv, mini_batches)
        if self.recipe == "spo":
            self._spo_after(batch, episodes, rew)
        t2 = time.perf_counter()
        self.gen_s.append(t1 - t0)
        self.train_s.append(t2 - t1)
        self.stats_log.append(
            {
                "kl": statistics.fmean(s["approx_kl"] for s in step_stats),
                "clip": statistics.fmean(s["clip_fraction"] for s in step_stats),
            }
        )
        self.model.eval()

    def _steps(self, episodes: list, adv, mini_batches: int) -> list[dict]:
        """One epoch of `mini_batches` policy_loss steps, old log-probs taken before the first."""
        import torch

        ids, att = _pad([e.token_ids for e in episodes], self.pad)
        mask = torch.zeros_like(ids[:, 1:], dtype=torch.bool)
        roll = torch.zeros(ids[:, 1:].shape)
        for i, e in enumerate(episodes):
            n = len(e.token_ids) - 1
            mask[i, :n] = torch.tensor(e.action_mask[1:], dtype=torch.bool)
            roll[i, :n] = torch.tensor(e.rollout_logprobs[1:])
        with torch.no_grad():
            old = token_logprobs(self.model, ids, att)
        adv_tok = adv.float().unsqueeze(1).expand_as(old)
        step_stats = []
        for part in torch.arange(self.batch_size).chunk(mini_batches):
            logp = token_logprobs(self.model, ids[part], att[part])
            loss, st = policy_loss(
                logp, old[part], adv_tok[part], mask[part], rollout_logp=roll[part],
                dual_clip=self.cfg["dual_clip"], token_count=mask[part].sum(),
            )  # fmt: skip
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            step_stats.append(st)
        return step_stats

    def _spo_after(self, batch: list, episodes: list, rew: list[float]) -> None:
        """SPO's values after the update: retention from each trajectory's drift, then the outcome."""
        import torch

        trajs = [_Traj(t.task_id, e) for t, e in zip(batch, episodes, strict=True)]

        def lp_fn(seqs: list[list[int]]) -> list[list[float]]:
            i2, a2 = _pad(seqs, self.pad)
            with torch.no_grad():
                lp = token_logprobs(self.model, i2, a2)
            return [lp[j, : len(s) - 1].tolist() for j, s in enumerate(seqs)]

        drifts = self.drift_cache.after_update(trajs, lp_fn)
        for t, r, d in zip(batch, rew, drifts, strict=True):
            self.spo_state[t.task_id] = spo_update(*self.spo_state[t.task_id], r, spo_retention(d))

    def timings(self) -> dict:
        return {
            "gen_s_per_update": statistics.fmean(self.gen_s),
            "train_s_per_update": statistics.fmean(self.train_s),
        }


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description="RL sizing probe for the toy-calc CPU demo")
    p.add_argument("--model", required=True, help="cold-start model folder (tools.cold_start)")
    p.add_argument("--out", default=None, help="JSON file for all results")
    p.add_argument("--recipes", nargs="+", default=["spopp", "spo"], choices=sorted(RECIPES))
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[16, 32])
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 3e-4])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--mini-batches", type=int, default=2)
    p.add_argument("--max-updates", type=int, default=60, help="the budget of each probe in updates")
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--eval-tasks", type=int, default=128)
    a = p.parse_args(argv)
    results = []
    for recipe in a.recipes:
        for bs in a.batch_sizes:
            for lr in a.lrs:
                for seed in a.seeds:
                    r = run_probe(
                        a.model, recipe=recipe, batch_size=bs, lr=lr, mini_batches=a.mini_batches,
                        max_updates=a.max_updates, eval_every=a.eval_every, eval_tasks=a.eval_tasks, seed=seed,
                    )  # fmt: skip
                    results.append(r)
                    if a.out:
                        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return results


def table(results: list[dict]) -> str:
    """One row per (recipe, batch, lr): medians over seeds."""
    rows = [
        "| recipe | B | lr | seeds | base sampled / greedy | first +0.15 sampled (per seed) | first +0.15 greedy "
        "(per seed) | final-5 sampled / greedy | s/update gen + train |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = dict.fromkeys((r["recipe"], r["batch_size"], r["lr"]) for r in results)
    for recipe, bs, lr in keys:
        rs = [r for r in results if (r["recipe"], r["batch_size"], r["lr"]) == (recipe, bs, lr)]

        def m(k: str, rs=rs) -> float:
            return statistics.fmean(r[k] for r in rs)

        fs = ", ".join(str(r["first_rise_sampled"] or "-") for r in rs)
        fg = ", ".join(str(r["first_rise_greedy"] or "-") for r in rs)
        rows.append(
            f"| {recipe} | {bs} | {lr:g} | {len(rs)} | {m('base_sampled'):.2f} / {m('base_greedy'):.2f} | {fs} | {fg} | "
            f"{m('final5_sampled'):.2f} / {m('final5_greedy'):.2f} | "
            f"{m('gen_s_per_update'):.2f} + {m('train_s_per_update'):.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
