"""Answer checking for math tasks: the last `\\boxed{...}` of a response against the reference.

* `verify_answer(..., strict=False)`: math-verify decides equivalence (`\\frac{1}{2}` = 0.5 = 1/2,
  `x^2+1` = `1+x^2`, sets, intervals, ...). math-verify's own time limits use `signal.alarm`, which
  only works in the main thread, and environments run in worker threads, so it is called with its
  limits off and each check runs in its own daemon thread that we wait on for `timeout_s`; a check
  that overruns scores 0.0 (the thread is abandoned and finishes, or not, on its own).
* `verify_answer(..., strict=True)`: DAPO's strict boxed match. The boxed string and the reference
  are compared as strings after a light normalization (spaces, `\\text{...}` wrappers, `$`, a
  trailing `.` removed). DAPO itself compares without any normalization and only looks at the last
  100 characters of the response; we look at the whole response.

No boxed answer scores 0.0 in both modes.
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = ["extract_boxed", "normalize_answer", "verify_answer"]

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


def _math_verify(pred: str, ref: str) -> bool:
    from math_verify import parse, verify

    gold = parse("\\boxed{" + ref + "}", parsing_timeout=None)
    target = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold or not target:
        return False
    return bool(verify(gold, target, timeout_seconds=None))


def _with_time_limit(fn, timeout_s: float, *args) -> bool:
    result: list[bool] = []

    def work() -> None:
        try:
            result.append(fn(*args))
        except Exception:  # math-verify and sympy raise all sorts; a failed check is a wrong answer
            result.append(False)

    t = threading.Thread(target=work, name="verify-answer", daemon=True)
    t.start()
    t.join(timeout_s)
    return bool(result and result[0])


def verify_answer(
    response_text: str, reference: str | None, *, strict: bool = False, timeout_s: float = 5
) -> float:
    """1.0 when the last boxed answer of `response_text` matches `reference`, else 0.0."""
    if reference is None:
        return 0.0
    pred = extract_boxed(response_text)
    if pred is None:
        return 0.0
    ref = _reference_text(reference)
    if normalize_answer(pred) == normalize_answer(ref) and normalize_answer(ref):
        return 1.0
    if strict:
        return 0.0
    return 1.0 if _with_time_limit(_math_verify, timeout_s, pred, ref) else 0.0
