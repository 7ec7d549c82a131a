"""Tool calls in the model's own format: telling the model about `tools`, reading its calls back.

An agent passes OpenAI-style `tools` (JSON-schema function specs) with a chat request and gets
`tool_calls` back. What the model sees and writes is its chat template's business:

* a template that renders `tools` itself (Qwen2.5, Qwen3, Llama 3.1+, Hermes) is given them, and
  the calls it was trained to write are parsed back: `<tool_call>{"name", "arguments"}</tool_call>`
  blocks (Hermes, Qwen) or a bare JSON object `{"name", "parameters"}` (Llama 3.1+);
* a template that does not mention `tools` (SmolLM2's, the tiny test model's) gets them as a
  system message in the Hermes format (written here, `TOOLS_PREAMBLE`), and Hermes blocks are
  parsed back. An assistant message with `tool_calls` that such a template would drop is written
  as the same blocks in its content, so a conversation renders as the model would have written it.

Parsing never raises: text that is not a well-formed call stays content (an agent sees what the
model wrote and may penalise it). Only the text is parsed; the token ids the engine generated are
what the trajectory keeps, whatever the parse made of them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["hermes", "llama3_json"]

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are given "
    "as JSON schemas inside <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each call, write a "
    "JSON object with the function name and its arguments inside <tool_call></tool_call>:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_HERMES_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolFormat:
    format: Format
    native: bool  # the template renders `tools` itself


def tool_format(chat_template: str | None) -> ToolFormat:
    """How a model with this chat template is told about tools and writes its calls."""
    template = chat_template or ""
    native = "tools" in template
    if (
        native
        and "<tool_call>" not in template
        and ("<|python_tag|>" in template or '"parameters"' in template)
    ):
        return ToolFormat("llama3_json", native=True)
    return ToolFormat("hermes", native=native)


def preamble(tools: list[dict]) -> str:
    """The system text that tells a template without tool support what `tools` it may call."""
    return TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def arguments_value(arguments: Any) -> Any:
    """A call's `arguments` as a template renders them: the JSON they spell when they are JSON text,
    else as given (an agent may echo malformed arguments the model wrote)."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def calls_as_text(tool_calls: list[dict]) -> str:
    """Hermes blocks for an assistant message's `tool_calls` (for templates that would drop them)."""
    blocks = []
    for call in tool_calls:
        fn = call.get("function") or {}
        arguments = arguments_value(fn.get("arguments", "{}"))
        blocks.append(
            "<tool_call>\n"
            + json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
            + "\n</tool_call>"
        )
    return "\n".join(blocks)


def _call(name: Any, arguments: Any) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a generated text. Content is the text outside the calls (None when
    there is none and there are calls, as OpenAI's API gives it)."""
    if fmt.format == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                obj = None
            if isinstance(obj, dict):
                call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments")))
                if call is not None:
                    return None, [call]
        return text, []
    calls = []
    for m in _HERMES_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return text, []  # one malformed block: the whole text stays content
        call = _call(obj.get("name"), obj.get("arguments")) if isinstance(obj, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    rest = _HERMES_RE.sub("", text).strip()
    return (rest or None), calls
