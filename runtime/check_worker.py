"""The child side of `runtime.check_pool`: a process that runs checks one at a time.

It is started by the pool as `python -m runtime.check_worker MEMORY_BYTES PRELOAD...`, caps its own
address space, imports the modules named in PRELOAD (math-verify and sympy take about a second,
paid once per worker, not per check) and says `ready`. Then, per line on stdin, a JSON request
`{"fn": "module:attribute", "args": [...], "cpu_s": N}`, and per request one JSON line on stdout:
`{"value": ...}` or `{"error": "..."}` (an exception the function raised: a wrong answer to the
caller, the worker lives on).

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
import resource
import sys
from collections.abc import Callable


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
    try:
        request = json.loads(line)
        fn = _function(request["fn"])
        _cap_cpu(float(request.get("cpu_s", 10)))
        return {"value": fn(*request.get("args", ()))}
    except MemoryError:
        return {"error": "memory"}
    except Exception as e:  # noqa: BLE001 - sympy and math-verify raise all sorts: a failed check
        return {"error": f"{type(e).__name__}: {str(e)[:200]}"}


def main(argv: list[str]) -> None:
    _cap_memory(int(argv[0]))
    for module in argv[1:]:
        importlib.import_module(module)
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        reply = _answer(line)
        try:
            data = json.dumps(reply).encode()
        except (TypeError, ValueError):
            data = json.dumps(
                {"error": f"unserializable result {type(reply.get('value')).__name__}"}
            ).encode()
        out.write(data + b"\n")
        out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
