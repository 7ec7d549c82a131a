"""The agent endpoint's cost per call against the engine's own generate.

    python -m bench.agent_bench [--rounds N] [--out BENCHMARKS.md]

Baseline: `engine.generate` on the rendered prompt (the transformers engine in this process, the
tiny test model, 16 new tokens, one seed). Measured, on the same prompt and seed (so the engine
samples the same tokens and does the same work): one call of an agent episode through the `openai`
client, in-process (what an agent function spopp runs is given) and over HTTP on 127.0.0.1 (what
an agent in another process uses), the session's rendering, recording and response included.
Calls are interleaved (baseline, in-process, HTTP, ...) so that load from elsewhere falls on all
alike; medians of `rounds`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.tracker_bench import write_section

HEAD = "## Agent endpoint: a chat call against the engine's generate"
NEW_TOKENS = 16
MESSAGES = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 123*45+6?"}]


async def _measure(model: Path, rounds: int, warmup: int) -> dict:
    import openai

    from runtime.agent_session import AgentSession
    from runtime.chat import ChatRenderer
    from runtime.chat_endpoint import Endpoint, add_chat_routes, episode_client
    from runtime.engines.base import SamplingConfig
    from runtime.engines.hf import TransformersEngine
    from runtime.episode import Budget
    from services.shell.routes import service_app
    from services.shell.server import ThreadedServer

    engine = TransformersEngine(model)
    renderer = ChatRenderer(engine.tokenizer)
    sampling = SamplingConfig(max_tokens=NEW_TOKENS, seed=7)
    budget = Budget(4, NEW_TOKENS, 1024)
    endpoint = Endpoint()
    app = service_app("bench", health=lambda: {"status": "ok"}, metrics=[], max_body_bytes=1 << 20)
    add_chat_routes(app, endpoint.sessions)
    server = ThreadedServer(app).start()
    import httpx

    # One connection pool for every HTTP call, as a long-lived agent process keeps one.
    pool = httpx.AsyncClient(timeout=60)
    times: dict[str, list[float]] = {"generate": [], "in_process": [], "http": []}
    lengths = set()

    async def baseline() -> None:
        gen = await engine.generate(renderer.prompt(MESSAGES), sampling)
        lengths.add(len(gen.token_ids))

    async def through(http: bool) -> None:
        session = AgentSession(engine, renderer, budget, sampling)
        endpoint.sessions.open(session)
        if http:
            client = openai.AsyncOpenAI(
                base_url=server.url + "/v1", api_key=session.token, max_retries=0, http_client=pool
            )
        else:
            client = episode_client(endpoint, session, timeout_s=60)
        try:
            r = await client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=NEW_TOKENS)
            lengths.add(r.usage.completion_tokens)
        finally:
            endpoint.sessions.close(session)
            if not http:
                await client.close()

    try:
        for i in range(warmup + rounds):
            for name, call in (("generate", baseline), ("in_process", lambda: through(False)),
                               ("http", lambda: through(True))):  # fmt: skip
                t0 = time.perf_counter()
                await call()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    finally:
        await pool.aclose()
        server.stop()
        await engine.close()
    result = {k: statistics.median(v) for k, v in times.items()}
    result.update(rounds=rounds, lengths=sorted(lengths))
    return result


def run(rounds: int, warmup: int = 3) -> dict:
    import tools.tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = tools.tiny_model.build_tiny_model(Path(tmp) / "model")
        return asyncio.run(_measure(model, rounds, warmup))


def markdown(r: dict, command: str) -> str:
    ms = 1000
    g = r["generate"]
    return (
        f"{HEAD}\n\n`{command}` (the tiny model on the transformers engine in-process, {NEW_TOKENS} new "
        f"tokens of one seed, so every call samples the same {r['lengths']} tokens; median of {r['rounds']} "
        "interleaved calls each).\n\n"
        "| | ms per call | ratio |\n|---|---:|---:|\n"
        f"| `engine.generate` on the rendered prompt (baseline) | {g * ms:.1f} | 1.00 |\n"
        f"| an agent's call, `openai` client in-process (what an agent function gets) | {r['in_process'] * ms:.1f} | "
        f"{r['in_process'] / g:.2f} |\n"
        f"| an agent's call, `openai` client over HTTP on 127.0.0.1 (one connection pool across calls) | {r['http'] * ms:.1f} | {r['http'] / g:.2f} |\n\n"
        f"- the endpoint's own share (rendering, recording, the client, the route): "
        f"{(r['in_process'] - g) * ms:.1f} ms in-process, {(r['http'] - g) * ms:.1f} ms over HTTP; a real model's "
        "generate takes far longer than the tiny model's, so the ratio only falls from here\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", type=Path, help="write the table into this markdown file")
    args = ap.parse_args()
    section = markdown(run(args.rounds), "python -m bench.agent_bench")
    print(section)
    if args.out:
        write_section(args.out, section, HEAD)


if __name__ == "__main__":
    main()
