"""toy-calc written as an agent against the OpenAI client: what `make demo-agent` trains.

The rules are toy-calc's (runtime/envs/toy_calc.py), but the loop is here, in user code: ask the
model, read its turn, run the calculator, answer with the tool's output, decide the reward. Each
turn must be exactly one block, `<code>EXPR</code>` (the calculator's reply comes back as a `tool`
message `<out>VALUE</out>`, at most two calls) or `<ans>N</ans>` (reward 1 iff N is the answer);
anything else ends the episode with reward 0. `include_stop_str_in_output` (vLLM's extension)
keeps the stop string in the reply, so a block the model closed is told from one cut at `</`.
With the same seeds the episodes are token for token those of the built-in toy-calc.

This folder is a user's plug-in folder: nothing in spopp imports it. `make demo-agent` puts it on
PYTHONPATH, and the compose CPU flavour mounts it into the rollout and evaluator containers:

    env: toy_calc_agent:solve        # in a launch file, with env_options {max_calls: 3}
"""

from __future__ import annotations

import re

from runtime.envs.toy_calc import ToolError, evaluate_tool_code

ANSWER = re.compile(r"<ans>(.*?)</ans>", re.DOTALL)
CODE = re.compile(r"<code>(.*?)</code>", re.DOTALL)
INTEGER = re.compile(r"-?[0-9]+")
MAX_TOOL_CALLS = 2


async def solve(client, task) -> float:
    messages = [{"role": "user", "content": task.prompt}]
    tool_calls = 0
    while True:
        reply = await client.chat.completions.create(
            model="policy", messages=messages, stop=["</code>", "</ans>"],
            extra_body={"include_stop_str_in_output": True},
        )  # fmt: skip
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # a turn cut short: no answer
            return 0.0
        text = choice.message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = ANSWER.fullmatch(text.strip())
        if answer is not None and "<" not in answer.group(1):
            value = answer.group(1).strip()
            return float(bool(INTEGER.fullmatch(value)) and int(value) == int(task.answer))
        code = CODE.fullmatch(text.strip())
        if code is None or "<" in code.group(1) or tool_calls >= MAX_TOOL_CALLS:
            return 0.0
        tool_calls += 1
        try:
            out = str(evaluate_tool_code(code.group(1)))
        except ToolError:
            out = "error"
        messages.append({"role": "tool", "content": f"<out>{out}</out>"})
