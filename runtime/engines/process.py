"""An engine hosted in a child process, so that it has an interpreter (and a GIL) of its own.

The transformers engine decodes in a Python thread. In a replica the same interpreter also runs
the event loop (leases, outcome reports, trajectory POSTs, prompt rendering), and every
millisecond that loop holds the GIL is a millisecond the decoding thread stands still: with the
tiny CPU model the replica's loop took about 17% of the GIL and the replica delivered 0.76 of the
engine's own tokens/s. vLLM avoids this by running its engine core in a process of its own; this
does the same for any engine built by `make_engine`.

The child is `python -m runtime.engines.process`, not a multiprocessing spawn, so that the
caller's main module is never re-imported (scripts need no `__main__` guard). Requests and answers
cross an authenticated Unix socket (`multiprocessing.connection`, pickled: prompt ids, sampling,
generations). The tokenizer is loaded in the parent as well, because agents render prompts there.
If the child dies, every waiting request and every later call fails with an `EngineProcessError`
that names its exit code; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Client, Listener
from pathlib import Path

from .base import Engine, Generation, SamplingConfig, settle_threadsafe

# How long close() waits for the child to end before killing it. Closing takes the child one decode
# step (cancelled rows are dropped at the next) and its exit. Measured from a stopping replica's
# last line to the child gone, 2 cores: 0.5 s at load 6, 2.3-2.9 s at load 11 with two busy
# processes beside; 5-8 s while its exit still ran the interpreter's last full garbage collection
# (see _child_main). 10 s is over 3 times the loaded figure; a child killed past it loses nothing
# (its weights are on disk, its requests abandoned).
CLOSE_TIMEOUT_S = 10.0


class EngineProcessError(RuntimeError):
    """The engine's process failed to start or has exited."""


class EngineProcess(Engine):
    def __init__(self, kind: str, model_dir: str | Path, *, start_timeout_s: float = 600.0, **kwargs) -> None:
        from transformers import AutoTokenizer

        self.kind = kind
        self.model_dir = Path(model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._waiting_lock = threading.Lock()
        self._dead: EngineProcessError | None = None
        self._closed = False
        self._tmp = tempfile.TemporaryDirectory(prefix="spopp-engine-")
        self._proc: subprocess.Popen | None = None
        self._conn = None
        try:
            self._start(kind, kwargs, start_timeout_s)
        except BaseException:
            # Nothing of a failed start outlives it: no child, no socket, no folder.
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait(5)
            if self._conn is not None:
                self._conn.close()
            self._tmp.cleanup()
            raise
        self._reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
        self._reader.start()

    def _start(self, kind: str, kwargs: dict, timeout_s: float) -> None:
        address = os.path.join(self._tmp.name, "engine.sock")
        authkey = os.urandom(32)
        listener = Listener(address, family="AF_UNIX", authkey=authkey)
        spec = json.dumps(
            {"address": address, "kind": kind, "model_dir": str(self.model_dir), "kwargs": kwargs}
        )
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.engines.process", spec],
            env={**os.environ, "SPOPP_ENGINE_AUTHKEY": authkey.hex(), "PYTHONPATH": _import_path()},
        )
        try:
            self._conn = _accept(listener, self._proc, timeout_s)
        finally:
            listener.close()
        # The child sends its engine's context and device once the engine is built, or the
        # exception that stopped it.
        what = f"{kind} engine process for {self.model_dir}"
        if not self._conn.poll(timeout_s):
            raise EngineProcessError(f"{what} did not start in {timeout_s:.0f} s")
        try:
            started = self._conn.recv()
        except (EOFError, OSError):
            raise EngineProcessError(f"{what} exited while starting (code {self._proc.wait()})") from None
        if isinstance(started, BaseException):
            raise started
        self.context_tokens = started["context_tokens"]
        self.device_name = started["device"]

    # -- calls --------------------------------------------------------------------------------

    async def _call(self, op: str, *args):
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise RuntimeError("engine is closed")
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future = loop.create_future()
        with self._waiting_lock:
            self._waiting[call_id] = (loop, future)
        try:
            with self._send_lock:
                self._conn.send((op, call_id, args))
        except (OSError, ValueError):
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
            raise self._dead or EngineProcessError(f"{self.kind} engine process is gone") from None
        try:
            return await future
        except asyncio.CancelledError:
            # The child stops decoding a request nobody waits for.
            with self._waiting_lock:
                self._waiting.pop(call_id, None)
            if self._dead is None and not self._closed:
                try:
                    with self._send_lock:
                        self._conn.send(("cancel", call_id, ()))
                except (OSError, ValueError):
                    pass
            raise

    async def generate(self, prompt_ids: list[int], sampling: SamplingConfig) -> Generation:
        return await self._call("generate", list(map(int, prompt_ids)), sampling)

    async def load_weights(self, snapshot_dir: str | Path) -> None:
        await self._call("load_weights", str(snapshot_dir))

    def _read(self) -> None:
        """Reader thread: hand each answer to the event loop that waits for it."""
        while True:
            try:
                call_id, payload = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._waiting_lock:
                entry = self._waiting.pop(call_id, None)
            if entry is not None:
                settle_threadsafe(*entry, payload)  # a failed call's payload is its exception
        try:
            code = self._proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if not self._closed:
            self._dead = EngineProcessError(
                f"{self.kind} engine process exited (code {code}); the replica needs a restart"
            )
        with self._waiting_lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for loop, future in waiting:
            settle_threadsafe(loop, future, self._dead or RuntimeError("engine closed"))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._stop)

    def _stop(self) -> None:
        try:
            with self._send_lock:
                self._conn.send(("close", -1, ()))
        except (OSError, ValueError):
            pass
        try:
            self._proc.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logging.getLogger("spopp.engine").warning(
                "%s engine process (pid %d) not gone %.0f s after close: killed",
                self.kind, self._proc.pid, CLOSE_TIMEOUT_S,
            )  # fmt: skip
            self._proc.kill()
            self._proc.wait(5)
        self._reader.join(10)
        self._conn.close()
        self._tmp.cleanup()

    @property
    def pid(self) -> int | None:
        return self._proc.pid


def _portable(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def _import_path() -> str:
    """PYTHONPATH for the child: this project's root first, so `-m runtime.engines.process` resolves
    to this very code whatever the working directory."""
    root = str(Path(__file__).resolve().parents[2])
    rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    return os.pathsep.join([root, *rest])


def _accept(listener: Listener, proc: subprocess.Popen, timeout_s: float):
    """The child's connection, or an error if it exits (or hangs) before connecting."""
    import time

    result: list = []
    thread = threading.Thread(target=lambda: result.append(listener.accept()), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        thread.join(0.1)
        if proc.poll() is not None and thread.is_alive():
            raise EngineProcessError(f"engine process exited before connecting (code {proc.returncode})")
        if time.monotonic() > deadline:
            proc.kill()
            raise EngineProcessError(f"engine process did not connect in {timeout_s:.0f} s")
    if not result:
        raise EngineProcessError("engine process connected but failed authentication")
    return result[0]


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


def _child_main(conn, kind: str, model_dir: str, kwargs: dict) -> None:
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
    _child_main(_conn, _spec["kind"], _spec["model_dir"], _spec["kwargs"])
