"""A calculator agent that uses OpenAI-style tool calls: `tools=[calculate]`, `tool_calls` back.

Where toy_calc_agent.py has the model write toy-calc's own `<code>` blocks, this agent offers a
`calculate` function through the chat API's `tools` and reads the model's calls from the reply's
`tool_calls`, as an agent written for any OpenAI-compatible server would. The replica renders the
tools in the model's own format and parses its calls back (runtime/tool_calls.py): for SmolLM2,
whose template knows nothing of tools, that is a system message in the Hermes format and
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

A 135M instruct model told about a tool in prose alone answers in prose. What makes it call is
worked examples: the conversation opens with earlier turns in which the assistant calls
`calculate`, reads the tool's reply and answers (WORKED, two toy-calc training-split expressions,
so no held-out task is ever shown with its answer). The examples are ordinary chat messages with
`tool_calls` and `tool` messages, so the replica renders them exactly as it renders the model's own
calls later in the episode.

An episode: the model either calls `calculate` (the agent evaluates the expression with toy-calc's
integer evaluator, never `eval`, and sends the value back as a `tool` message with the call's
`tool_call_id`) or answers; the reward is 1.0 iff the last integer of its answer is the task's
answer. At most MAX_TOOL_CALLS calls; a turn cut by the token limit, or a call past the limit,
earns 0. The stop string `</tool_call>` (kept in the content by `include_stop_str_in_output`, so
the block is whole when it is parsed) ends the turn right after a call, so the model never goes on
to write the tool's reply itself.

Tasks: toy-calc's (`spopp tasks toy-calc`, the prompt is the bare expression `a*b+c`). Put this
folder on PYTHONPATH and launch with

    env: calculator_agent:solve
    env_options: {max_calls: 3}
"""

from __future__ import annotations

import json
import re

from runtime.envs.toy_calc import ToolError, evaluate_tool_code

MAX_TOOL_CALLS = 2
SYSTEM = "You are a calculator assistant. Use the calculate tool to compute, then give the answer."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "Evaluate an integer arithmetic expression (+, -, *, parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 12*34+5"}},
                "required": ["expression"],
            },
        },
    }
]
# (expression, value): toy-calc's own worked episodes (runtime.envs.toy_calc.SHOTS), which are
# training-split expressions. Two, because SmolLM2 followed toy-calc's format from two examples and
# hardly ever from one (docs/models.md).
WORKED = (("123*45+6", 5541), ("402*17+88", 6922))
STOP = "</tool_call>"
_INTEGER = re.compile(r"-?\d+")


def question(expression: str) -> str:
    return f"What is {expression}?"


def worked_examples() -> list[dict]:
    """Earlier turns of the chat: a question, the assistant's call, the tool's reply, the answer."""
    messages = []
    for i, (expression, value) in enumerate(WORKED):
        call_id = f"call_example_{i}"
        messages += [
            {"role": "user", "content": question(expression)},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "calculate",
                            "arguments": json.dumps({"expression": expression}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": str(value)},
            {"role": "assistant", "content": f"The answer is {value}."},
        ]
    return messages


def opening(task) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        *worked_examples(),
        {"role": "user", "content": question(task.prompt)},
    ]


def run_tool(call) -> str:
    """The tool's reply to one call: the value, or an error text the model reads (never raises)."""
    if call.function.name != "calculate":
        return f"error: no tool named {call.function.name!r}"
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return "error: the arguments are not JSON"
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    if not isinstance(expression, str):
        return "error: expression must be a string"
    try:
        return str(evaluate_tool_code(expression))
    except ToolError as e:
        return f"error: {e}"


def final_answer(text: str | None) -> int | None:
    """The last integer of an answer, thousands separators allowed ("5,541")."""
    found = _INTEGER.findall((text or "").replace(",", ""))
    return int(found[-1]) if found else None


async def solve(client, task) -> float:
    messages = opening(task)
    calls = 0
    while True:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, stop=[STOP],
            extra_body={"include_stop_str_in_output": True},
        )  # fmt: skip
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # cut mid-turn: no answer, no whole call
            return 0.0
        message = choice.message
        if not message.tool_calls:
            return float(final_answer(message.content) == int(task.answer))
        calls += len(message.tool_calls)
        if calls > MAX_TOOL_CALLS:
            return 0.0
        # The reply as it came (its content and calls, ids included): the next call then extends
        # this episode's trajectory instead of starting a new segment.
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
