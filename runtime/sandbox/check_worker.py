"""The child side of `runtime.sandbox.check_pool`: a process that runs checks one at a time.

It is started by the pool as `python -m runtime.sandbox.check_worker MEMORY_BYTES PRELOAD...`, caps its own
address space, imports the modules named in PRELOAD (math-verify and sympy take about a second,
paid once per worker, not per check) and says `ready`. Then, per line on stdin, a JSON request
`{"id": N, "fn": "module:attribute", "args": [...], "cpu_s": N}`, and per request one JSON line
`{"id": N, "value": ...}` or `{"id": N, "error": "..."}` (an exception the function raised: a
wrong answer to the caller, the worker lives on) on the pipe that was stdout; stdout itself is
sent to stderr, so nothing a library prints can be read as a reply.

What bounds it, from the outside and from the inside:
- the pool kills it at the check's wall-clock deadline (SIGKILL: sympy evaluates `9^(9^9)` in C
  holding the GIL, so nothing in this process could interrupt it);
- RLIMIT_CPU's soft limit is moved to "CPU used so far + the check's budget" before each check, so
  a check that outlives a dead pool (nobody left to kill it) is ended by the kernel's SIGXCPU;
- RLIMIT_AS caps its memory: an answer like `2^(2^30)` raises MemoryError here (a failed check),
  not on the host;
- end of stdin (the pool closed it, or its process died) ends the worker.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import resource
import sys
from collections.abc import Callable

from runtime.faults import site


def _cap_memory(memory_bytes: int) -> None:
    if memory_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))


def _cap_cpu(budget_s: float) -> None:
    """Let this process use `budget_s` more seconds of CPU, then SIGXCPU (its default: exit)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = math.ceil(used + budget_s) + 1  # whole seconds; one more so the wall deadline comes first
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


_functions: dict[str, Callable] = {}


def _function(spec: str) -> Callable:
    fn = _functions.get(spec)
    if fn is None:
        module, _, attribute = spec.partition(":")
        fn = getattr(importlib.import_module(module), attribute)
        _functions[spec] = fn
    return fn


def _answer(line: bytes) -> dict:
    """The reply to one request line, carrying the request's id (the pool checks it)."""
    reply: dict = {"id": None}
    try:
        request = json.loads(line)
        reply["id"] = request.get("id")
        fn = _function(request["fn"])
        _cap_cpu(float(request.get("cpu_s", 10)))
        reply["value"] = fn(*request.get("args", ()))
    except MemoryError:
        reply["error"] = "memory"
    except Exception as e:  # noqa: BLE001 - sympy and math-verify raise all sorts: a failed check
        reply["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        # Where it came from: a user's reward function that raised is the user's bug, and
        # `spopp env check` names its file and line (runtime/faults.py).
        reply["where"] = site(e)
    return reply


def _protocol_channel():
    """The pipe to the pool, on a descriptor of its own; stdout (fd 1) then goes to stderr, so that
    what a checked library prints (antlr4 prints to stdout) can never pass for a reply."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def main(argv: list[str]) -> None:
    out = _protocol_channel()
    _cap_memory(int(argv[0]))
    for module in argv[1:]:
        importlib.import_module(module)
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        reply = _answer(line)
        try:
            data = json.dumps(reply).encode()
        except (TypeError, ValueError):
            data = json.dumps(
                {"id": reply.get("id"), "error": f"unserializable result {type(reply.get('value')).__name__}"}
            ).encode()
        out.write(data + b"\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
