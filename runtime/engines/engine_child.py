"""The child side of an engine process (runtime/engines/process.py starts it as `python -m
runtime.engines.engine_child SPEC`): build the engine by name, then serve the parent's calls over
the authenticated socket until told to close or the parent goes. Apart from the parent's module,
as runtime/sandbox/check_worker.py is apart from runtime/sandbox/check_pool.py: the factory that builds engines
imports the parent, and only the child imports the factory.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import threading
import traceback
from multiprocessing.connection import Client

from .base import Engine


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class _CallServer:
    """The child's side of the socket: each call runs as a task on the event loop, so that
    generations overlap and a cancel can stop one; a reader thread feeds the loop the requests."""

    def __init__(self, conn, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.conn = conn
        self.engine = engine
        self.loop = loop
        self.tasks: dict[int, asyncio.Task] = {}
        self.stop = asyncio.Event()

    def reply(self, call_id: int, payload) -> None:
        # Only this loop's thread sends; the reader thread only receives.
        try:
            self.conn.send((call_id, payload))
        except (OSError, ValueError):  # the parent is gone
            self.stop.set()

    async def run(self, op: str, call_id: int, args) -> None:
        """Do one call and send its result (or its exception); a cancelled call sends nothing."""
        try:
            if op == "generate":
                result = await self.engine.generate(*args)
            elif op == "load_weights":
                result = await self.engine.load_weights(*args)
            else:
                raise ValueError(f"unknown engine call {op!r}")
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self.reply(call_id, _portable(exc))
        else:
            self.reply(call_id, result)
        finally:
            self.tasks.pop(call_id, None)

    def receive(self, message) -> None:
        """On the loop: act on one request (close, cancel, or a call to start)."""
        op, call_id, args = message
        if op == "close":
            self.stop.set()
        elif op == "cancel":
            task = self.tasks.get(call_id)
            if task is not None:
                task.cancel()
        else:
            self.tasks[call_id] = self.loop.create_task(self.run(op, call_id, args))

    def read(self) -> None:
        """Reader thread: pass each request to the loop, until "close" or the parent goes."""
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the parent died or closed the pipe
                self.loop.call_soon_threadsafe(self.stop.set)
                return
            self.loop.call_soon_threadsafe(self.receive, message)
            if message[0] == "close":
                return

    async def serve(self) -> None:
        """Serve until told to close or the parent goes; then cancel what runs and close the engine."""
        threading.Thread(target=self.read, name="engine-requests", daemon=True).start()
        await self.stop.wait()
        for task in list(self.tasks.values()):
            task.cancel()
        await self.engine.close()


def child_main(conn, kind: str, model_dir: str, kwargs: dict) -> None:
    """The child: build the engine, then serve calls until told to close or the parent goes."""
    from .factory import make_engine

    async def main() -> None:
        try:
            engine = make_engine(kind, model_dir, **kwargs)
        except BaseException as exc:
            traceback.print_exc()
            conn.send(_portable(exc))
            return
        conn.send({"context_tokens": engine.context_tokens, "device": engine.device_name})
        await _CallServer(conn, engine, asyncio.get_running_loop()).serve()

    asyncio.run(main())
    # The engine is closed; the parent waits for this process to end. Leave the imports' objects
    # (torch, transformers) out of the interpreter's last full collection, which took seconds
    # under load (services/rollout/cli.py says how many).
    gc.freeze()


if __name__ == "__main__":
    _spec = json.loads(sys.argv[1])
    _conn = Client(
        _spec["address"], family="AF_UNIX", authkey=bytes.fromhex(os.environ.pop("SPOPP_ENGINE_AUTHKEY"))
    )
    child_main(_conn, _spec["kind"], _spec["model_dir"], _spec["kwargs"])
