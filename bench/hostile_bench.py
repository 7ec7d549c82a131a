"""The agent endpoint and the services' bodies under a hostile client: the worst event-loop stall and
the memory each attack costs.

    python -m bench.hostile_bench [--scale 1.0] [--only NAME ...] [--out FILE.json]

A replica-shaped server runs as a child process (`python -m bench.hostile_bench serve`): the tiny
model on the transformers engine, open agent episodes whose tokens it writes to a file, and the app
a replica serves its agents (`service_app` with the chat routes, the replica's 8 MiB body limit,
under `services.shell.server.serve` and its default bounds), with the replica's budget (1,024-token
turns, 4,096 tokens an episode, cut to the model's 1,024-token context, 16 calls). It also answers
GET /bench/lag: the worst lag of a 10 ms ticker on its event loop since the last read. A tracker
process (embedded Redis) takes the /healthz attack. For each attack: the server's worst loop stall,
the slowest answer to a /healthz probe sent every 50 ms meanwhile, its RSS before, at its peak
(VmHWM, reset before the attack) and 2 s after the attack's connections closed, and what the attack
was answered. Every request goes to 127.0.0.1; `--scale` multiplies the connection counts.

Run from another checkout (`cd old && python -m bench.hostile_bench`, this file copied there) to
measure that code: the server and the tracker are started from the working directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

MiB = 1024 * 1024
SESSIONS = 520  # episodes the server opens: one per attack that needs its own, 400 for the spread one


# -- the server (child process) -------------------------------------------------------------------
async def _serve(model: str, port: int, tokens_file: str) -> None:
    from fastapi.responses import JSONResponse

    from runtime.agent_session import AgentSession, AgentSessions
    from runtime.chat import ChatRenderer
    from runtime.chat_endpoint import MAX_CHAT_BODY_BYTES, add_chat_routes
    from runtime.engines.base import SamplingConfig
    from runtime.engines.hf import TransformersEngine
    from runtime.episode import Budget, within_context
    from services.shell import server as http
    from services.shell.routes import service_app

    engine = TransformersEngine(model)
    renderer = ChatRenderer(engine.tokenizer)
    budget = within_context(Budget(8, 1024, 4096), engine)
    sessions = AgentSessions()
    tokens = []
    for i in range(SESSIONS):
        session = AgentSession(
            engine, renderer, budget, SamplingConfig(max_tokens=1024, seed=i), max_calls=16
        )
        sessions.open(session)
        tokens.append(session.token)
    app = service_app(
        "spopp rollout", health=lambda: {"status": "ok"}, metrics=[], max_body_bytes=MAX_CHAT_BODY_BYTES
    )
    add_chat_routes(app, sessions)
    worst = [0.0]

    @app.get("/bench/lag")
    async def lag():
        out, worst[0] = worst[0], 0.0
        return JSONResponse({"worst_lag_s": out})

    async def ticker() -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            worst[0] = max(worst[0], time.monotonic() - t - 0.01)

    async def work() -> None:
        tick = asyncio.create_task(ticker())
        Path(tokens_file).write_text(json.dumps(tokens))
        try:
            await asyncio.Event().wait()  # until SIGTERM cancels it
        finally:
            tick.cancel()

    await http.serve(app, "127.0.0.1", port, work())


# -- measuring --------------------------------------------------------------------------------------
def _status(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return out


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the current RSS


class Probe:
    """GET /healthz every 50 ms (each with its own connection), the slowest answer kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst = 0.0
        self.failed = 0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            while True:
                t = time.monotonic()
                try:
                    await http.get(self.url + "/healthz", headers={"connection": "close"})
                except httpx.HTTPError:
                    self.failed += 1
                self.worst = max(self.worst, time.monotonic() - t)
                await asyncio.sleep(0.05)

    def __enter__(self) -> Probe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc) -> None:
        self._task.cancel()


async def _raw(port: int, head: bytes, body_parts, read: bool = True, hold: float = 0.0) -> str:
    """One connection: `head`, then each part of `body_parts` (bytes), then the reply's status line
    (when `read`); held `hold` s before it is closed. Answers the status, or why there is none."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect: {type(exc).__name__}"
    status = "-"
    try:
        writer.write(head)
        for part in body_parts:
            writer.write(part)
            await writer.drain()
        if read:
            line = await asyncio.wait_for(reader.readline(), 120)
            status = line.split(b" ")[1].decode() if line.count(b" ") >= 2 else "closed"
        if hold:
            await asyncio.sleep(hold)
    except (OSError, TimeoutError) as exc:
        status = type(exc).__name__
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:
            pass
    return status


def _post_head(path: str, length: int | None, token: str | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    if token:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _pieces(body: bytes, piece: int = 256 * 1024):
    """`body` in slices (written one at a time, each drained: the client never buffers a body)."""
    view = memoryview(body)
    for at in range(0, len(body), piece):
        yield view[at : at + piece]


def _chunked(total: int, piece: int = 256 * 1024, finish: bool = True):
    data = b"x" * piece
    sent = 0
    while sent + piece <= total:
        yield f"{piece:x}\r\n".encode() + data + b"\r\n"
        sent += piece
    if finish:
        yield b"0\r\n\r\n"


def _chat(token: str, body: dict, timeout: float = 600) -> tuple[int, str, float]:
    """One chat call (a new connection, so as not to share one with the attack); (status, code, s)."""
    # A client made before the clock starts: making one loads the CA bundle, no part of the answer.
    with httpx.Client(timeout=timeout) as http:
        t = time.monotonic()
        r = http.post(
            URL["replica"] + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {token}"}
        )
        took = time.monotonic() - t
    code = ""
    if r.status_code != 200:
        try:
            code = r.json().get("error", r.json().get("detail", {})).get("code", "")
        except (ValueError, AttributeError):
            code = r.text[:60]
    return r.status_code, code, took


URL: dict[str, str] = {}


def _words(chars: int) -> str:
    return ("hello world " * (chars // 12 + 1))[:chars]


# -- the attacks ------------------------------------------------------------------------------------
class Attacks:
    def __init__(self, port: int, tokens: list[str], tracker_port: int, scale: float) -> None:
        self.port, self.tokens, self.tracker_port, self.scale = port, tokens, tracker_port, scale
        self.next = 0

    def token(self) -> str:
        self.next += 1
        return self.tokens[self.next - 1]

    def n(self, count: int) -> int:
        return max(1, round(count * self.scale))

    async def message_7mib(self) -> str:
        s = await asyncio.to_thread(
            _chat,
            self.token(),
            {"model": "policy", "messages": [{"role": "user", "content": _words(7 * MiB)}]},
        )
        return f"{s[0]} {s[1]} in {s[2]:.2f} s"

    async def tools_7mib(self) -> str:
        tool = {"type": "function", "function": {"name": "f", "description": _words(7 * MiB),
                                                 "parameters": {"type": "object"}}}  # fmt: skip
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
        s = await asyncio.to_thread(_chat, self.token(), body)
        return f"{s[0]} {s[1]} in {s[2]:.2f} s"

    async def messages_4096(self) -> str:
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": _words(1900)} for i in range(4095)
        ]
        messages.append({"role": "user", "content": _words(1900)})
        s = await asyncio.to_thread(_chat, self.token(), {"model": "policy", "messages": messages})
        return f"{s[0]} {s[1]} in {s[2]:.2f} s"

    async def three_in_a_row(self) -> str:
        token, other = self.token(), self.token()
        body = {"model": "policy", "messages": [{"role": "user", "content": _words(7 * MiB)}]}

        async def attack():
            return [await asyncio.to_thread(_chat, token, body) for _ in range(3)]

        async def bystander():
            await asyncio.sleep(1.0)  # the first big call is in
            cheap = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            return await asyncio.to_thread(_chat, other, cheap)

        calls, cheap = await asyncio.gather(attack(), bystander())
        return (
            f"{', '.join(f'{c[0]} {c[1]}' for c in calls)} in {sum(c[2] for c in calls):.2f} s; another "
            f"episode's 1-token call {cheap[2]:.2f} s ({cheap[0]})"
        )

    async def chunked_no_token(self) -> str:
        n = self.n(200)
        # Bodies of 8 MiB less one chunk (under the limit), never finished: held until the server
        # gives up on them (its 30 s body deadline) or the client leaves (after 5 s here).
        parts = lambda: _chunked(8 * MiB - 256 * 1024, finish=False)  # noqa: E731
        head = _post_head("/v1/chat/completions", None, None)
        got = await asyncio.gather(*(_raw(self.port, head, parts(), read=False, hold=5.0) for _ in range(n)))
        return f"{n} connections, {sum(g == '-' for g in got)} held 5 s then closed"

    async def tracker_healthz(self) -> str:
        n = self.n(100)
        head = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        got = await asyncio.gather(*(_raw(self.tracker_port, head, _chunked(7 * MiB)) for _ in range(n)))
        return f"{n} x 7 MiB chunked: " + ", ".join(f"{s} x{got.count(s)}" for s in sorted(set(got)))

    async def tracker_healthz_post(self) -> str:
        n = self.n(100)
        body = b'{"pad": "' + b"x" * (7 * MiB - 11) + b'"}'
        head = _post_head("/healthz", len(body), None)
        got = await asyncio.gather(*(_raw(self.tracker_port, head, _pieces(body)) for _ in range(n)))
        return f"{n} x 7 MiB POST: " + ", ".join(f"{s} x{got.count(s)}" for s in sorted(set(got)))

    async def _bodies_8mib(self, tokens: list[str]) -> str:
        # Valid JSON of 8 MiB - 1 asking for one token: read, parsed and (old code) queued for a
        # 1-token generation each.
        pad = (
            8 * MiB
            - 1
            - len(b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "pad": ""}')
        )
        body = (
            b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "pad": "'
            + b"x" * pad
            + b'"}'
        )
        assert len(body) == 8 * MiB - 1
        got = await asyncio.gather(*(_raw(self.port, _post_head("/v1/chat/completions", len(body), t), _pieces(body))
                                     for t in tokens))  # fmt: skip
        return ", ".join(f"{s} x{got.count(s)}" for s in sorted(set(got)))

    async def bodies_one_token(self) -> str:
        n = self.n(400)
        return f"{n} x (8 MiB - 1), one episode's token: " + await self._bodies_8mib([self.token()] * n)

    async def bodies_many_tokens(self) -> str:
        n = self.n(400)
        return f"{n} x (8 MiB - 1), each its own episode's token: " + await self._bodies_8mib(
            [self.token() for _ in range(n)]
        )


ATTACKS = {
    "message_7mib": ("a 7 MiB message", "replica"),
    "tools_7mib": ("a 7 MiB tool schema", "replica"),
    "messages_4096": ("4,096 messages of 1.9 KiB", "replica"),
    "three_in_a_row": ("3 x 7 MiB messages in a row", "replica"),
    "chunked_no_token": ("200 unfinished chunked bodies, no token", "replica"),
    "tracker_healthz": ("100 x 7 MiB chunked to the tracker's /healthz", "tracker"),
    "tracker_healthz_post": ("100 x 7 MiB POST to the tracker's /healthz", "tracker"),
    "bodies_one_token": ("400 x (8 MiB - 1) with one episode's token", "replica"),
    "bodies_many_tokens": ("400 x (8 MiB - 1), 400 episodes' tokens", "replica"),
}


async def _measure(attacks: Attacks, pids: dict[str, int], names: list[str]) -> list[dict]:
    rows = []
    async with httpx.AsyncClient(timeout=120) as http:
        for name in names:
            title, target = ATTACKS[name]
            pid = pids[target]
            await asyncio.sleep(2.0)
            before = _status(pid)["VmRSS"]
            _reset_peak(pid)
            await http.get(URL["replica"] + "/bench/lag")  # reset the worst lag
            with Probe(URL[target]) as probe:
                t = time.monotonic()
                answer = await getattr(attacks, name)()
                took = time.monotonic() - t
                await asyncio.sleep(0.5)
            peak = _status(pid)["VmHWM"]
            lag = (await http.get(URL["replica"] + "/bench/lag")).json()["worst_lag_s"]
            await asyncio.sleep(2.0)
            after = _status(pid)["VmRSS"]
            row = {
                "attack": title, "target": target, "answer": answer, "seconds": round(took, 2),
                "worst_loop_stall_s": round(lag, 3) if target == "replica" else None,
                "worst_healthz_s": round(probe.worst, 3), "healthz_failed": probe.failed,
                "rss_before_mb": round(before), "rss_peak_mb": round(peak), "rss_after_mb": round(after),
            }  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


async def _main(args) -> list[dict]:
    from services.shell.child import Child
    from spopp.machine.net import free_port
    from tools.tiny_model import build_tiny_model
    from tools.tracker_process import TrackerProcess

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_tiny_model(Path(tmp) / "model")
        port = free_port()
        tokens_file = Path(tmp) / "tokens.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        server = Child(
            "replica", ["-m", "bench.hostile_bench", "serve", str(model), str(port), str(tokens_file)], env
        )
        tracker = TrackerProcess(None, data_dir=Path(tmp) / "tracker")
        try:
            URL["replica"], URL["tracker"] = f"http://127.0.0.1:{port}", tracker.url
            server.wait_http(URL["replica"] + "/healthz", 300)
            while not tokens_file.exists():
                await asyncio.sleep(0.2)
            tokens = json.loads(tokens_file.read_text())
            attacks = Attacks(port, tokens, tracker.port, args.scale)
            rows = await _measure(attacks, {"replica": server.pid, "tracker": tracker.proc.pid}, args.only)
        finally:
            server.stop(20)
            tracker.stop()
            print(server.tail(5), file=sys.stderr)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        model, port, tokens_file = sys.argv[2:5]
        asyncio.run(_serve(model, int(port), tokens_file))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", type=float, default=1.0, help="multiplies the connection counts")
    p.add_argument("--only", nargs="*", default=list(ATTACKS), choices=list(ATTACKS))
    p.add_argument("--model", default=None, help="a model folder (default: the tiny model, built)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args()
    rows = asyncio.run(_main(args))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
