"""An engine hosted in a child process, so that it has an interpreter (and a GIL) of its own.

The transformers engine decodes in a Python thread. In a replica the same interpreter also runs
the event loop (leases, outcome reports, trajectory POSTs, prompt rendering), and every
millisecond that loop holds the GIL is a millisecond the decoding thread stands still: with the
tiny CPU model the replica's loop took about 17% of the GIL and the replica delivered 0.76 of the
engine's own tokens/s. vLLM avoids this by running its engine core in a process of its own; this
does the same for any engine built by `make_engine`.

The child is `python -m runtime.engines.engine_child` (its side of the socket), not a
multiprocessing spawn, so that the caller's main module is never re-imported (scripts need no `__main__` guard). Requests and answers
cross an authenticated Unix socket (`multiprocessing.connection`, pickled: prompt ids, sampling,
generations). The tokenizer is loaded in the parent as well, because agents render prompts there.
If the child dies, every waiting request and every later call fails with an `EngineProcessError`
that names its exit code; nothing waits forever.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from multiprocessing.connection import Listener
from pathlib import Path

from .base import Engine, Generation, SamplingConfig, settle_threadsafe

# How long close() waits for the child to end before killing it. Closing takes the child one decode
# step (cancelled rows are dropped at the next) and its exit. Measured from a stopping replica's
# last line to the child gone, 2 cores: 0.5 s at load 6, 2.3-2.9 s at load 11 with two busy
# processes beside; 5-8 s while its exit still ran the interpreter's last full garbage collection
# (see engine_child.child_main). 10 s is over 3 times the loaded figure; a child killed past it
# loses nothing (its weights are on disk, its requests abandoned).
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
            [sys.executable, "-m", "runtime.engines.engine_child", spec],
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


def _import_path() -> str:
    """PYTHONPATH for the child: this project's root first, so `-m runtime.engines.engine_child` resolves
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
