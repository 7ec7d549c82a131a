"""Answer checking for math tasks: the last `\\boxed{...}` of a response against the reference.

* `check_answer(..., strict=False)`: math-verify decides equivalence (`\\frac{1}{2}` = 0.5 = 1/2,
  `x^2+1` = `1+x^2`, sets, intervals, ...). math-verify runs sympy on what the model wrote, and
  sympy can take minutes and gigabytes on a tower of powers (`9^{9^{9}}`) while holding the GIL,
  so it runs out of process (`runtime.sandbox.check_pool`), in a worker that is killed at `timeout_s`. A
  killed or failed check scores 0.0 and says why (`Verdict.reason`). math-verify's own limits use
  `signal.alarm`, so they are off: the pool's deadline replaces them.
* `check_answer(..., strict=True)`: DAPO's strict boxed match. The boxed string and the reference
  are compared as strings after a light normalization (spaces, `\\text{...}` wrappers, `$`, a
  trailing `.` removed). DAPO itself compares without any normalization and only looks at the last
  100 characters of the response; we look at the whole response.

The normalized exact match is tried first in both modes, in-process (string operations, linear in
the answer's length): most right answers never reach a worker. No boxed answer scores 0.0.
`verify_answer` is `check_answer`'s reward alone.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from runtime.sandbox.check_pool import CheckPool, shared_pool

__all__ = ["Verdict", "check_answer", "extract_boxed", "normalize_answer", "verify_answer"]

_BOXED = "\\boxed"


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), or None.

    Also takes the brace-less form `\\boxed 5`. A last box that never closes (a truncated
    response) gives None rather than an earlier box.
    """
    if not text:
        return None
    start = text.rfind(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        if i < len(text) and text[i].isalpha():  # e.g. \boxedsomething: not our command
            start = text.rfind(_BOXED, 0, start)
            continue
        break
    if start == -1:
        return None
    i = start + len(_BOXED)
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        if text[i - 1] not in " \t":
            return None
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    j = i
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2  # an escaped character (\{, \}, \\) does not open or close a group
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")


def normalize_answer(s: str) -> str:
    """The strict mode's normalization: unwrap `\\text{..}`, drop spaces and `$`, a trailing `.`."""
    s = s.strip()
    prev = None
    while prev != s:
        prev, s = s, _TEXT_RE.sub(r"\1", s)
    s = s.replace("$", "")
    s = re.sub(r"\s+", "", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "")
    while s.endswith("."):
        s = s[:-1]
    return s


def _reference_text(reference: str) -> str:
    ref = str(reference).strip()
    if _BOXED in ref:
        boxed = extract_boxed(ref)
        if boxed is not None:
            return boxed
    return ref


class _QuietTimeoutWarning(logging.Filter):
    """math-verify warns once that its time limits are off: we enforce our own."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.grader", "math_verify.parser"):
    logging.getLogger(_name).addFilter(_QuietTimeoutWarning())


def math_equivalent(pred: str, ref: str) -> bool:
    """math-verify's verdict on two boxed contents; run in a check worker, never in a service."""
    from math_verify import parse, verify

    gold = parse("\\boxed{" + ref + "}", parsing_timeout=None)
    target = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=None))


@dataclass(frozen=True)
class Verdict:
    reward: float
    # Why a check gave no verdict (`runtime.sandbox.check_pool.REASONS`: "timeout", "memory", ...); None
    # when it gave one (right or wrong). Recorded in the episode's info as `answer_check`.
    reason: str | None = None


def check_answer(
    response_text: str,
    reference: str | None,
    *,
    strict: bool = False,
    timeout_s: float = 5,
    pool: CheckPool | None = None,
) -> Verdict:
    """Verdict(1.0) when the last boxed answer of `response_text` matches `reference`, else 0.0."""
    if reference is None:
        return Verdict(0.0)
    pred = extract_boxed(response_text)
    if pred is None:
        return Verdict(0.0)
    ref = _reference_text(reference)
    if normalize_answer(pred) == normalize_answer(ref) and normalize_answer(ref):
        return Verdict(1.0)
    if strict:
        return Verdict(0.0)
    outcome = (pool or shared_pool()).call("runtime.verify:math_equivalent", pred, ref, timeout_s=timeout_s)
    if not outcome.ok:
        return Verdict(0.0, outcome.reason)
    return Verdict(1.0 if outcome.value else 0.0)


def verify_answer(
    response_text: str, reference: str | None, *, strict: bool = False, timeout_s: float = 5
) -> float:
    """1.0 when the last boxed answer of `response_text` matches `reference`, else 0.0."""
    return check_answer(response_text, reference, strict=strict, timeout_s=timeout_s).reward
