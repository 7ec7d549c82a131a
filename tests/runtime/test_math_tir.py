"""The Math-TIR environment, its verifier and task files (the sandbox runs for real, with bwrap)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from runtime.envs.base import Task
from runtime.envs.math_tir import MathTIREnv, find_tool_call
from runtime.sandbox.bubblewrap import SandboxConfig
from runtime.tasks import (
    DAPO_PREFIX,
    DAPO_SUFFIX,
    generate_arithmetic_tasks,
    load_tasks,
    prompt_task_id,
    write_jsonl,
)
from runtime.verify import extract_boxed, verify_answer

CONFIG = SandboxConfig(wall_seconds=3, cpu_seconds=2)
TASK = Task(task_id="t1", prompt="What is 123456 * 654321?", answer=str(123456 * 654321))


# ---- verify ----------------------------------------------------------------------------------


def test_extract_boxed_takes_the_last_box_with_nested_braces():
    assert extract_boxed(r"first \boxed{1}, then \boxed{\frac{1}{\sqrt{2}}}.") == r"\frac{1}{\sqrt{2}}"
    assert extract_boxed(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert extract_boxed(r"so $\boxed 7$") == "7"
    assert extract_boxed("no box here") is None
    assert extract_boxed(r"\boxed{3} and a cut \boxed{4") is None  # the last box never closed


# math-verify runs in a worker process (runtime.sandbox.check_pool; tests/runtime/test_check_pool.py has its limits).
@pytest.mark.process
@pytest.mark.parametrize(
    ("response", "reference"),
    [
        (r"The answer is \boxed{\frac{1}{2}}.", "0.5"),
        (r"The answer is \boxed{\frac{1}{2}}.", "1/2"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"\boxed{1+x^2}", "x^2+1"),
        (r"\boxed{80779853376}", "80779853376"),
        (r"\boxed{\dfrac{\pi}{2}}", r"\pi/2"),
    ],
)
def test_verify_accepts_equivalent_forms(response, reference):
    assert verify_answer(response, reference) == 1.0


@pytest.mark.process
@pytest.mark.parametrize(
    ("response", "reference"),
    [
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"\boxed{80779853377}", "80779853376"),  # off by one in the last of 11 digits
        (r"\boxed{x^2-1}", "x^2+1"),
        ("The answer is 0.5", "0.5"),  # no box
        ("", "0.5"),
    ],
)
def test_verify_rejects_wrong_or_unboxed_answers(response, reference):
    assert verify_answer(response, reference) == 0.0


@pytest.mark.process
def test_strict_mode_is_a_normalized_string_match():
    assert verify_answer(r"\boxed{\frac{1}{2}}", "0.5", strict=True) == 0.0
    assert verify_answer(r"\boxed{\frac{1}{2}}", "0.5", strict=False) == 1.0
    assert verify_answer(r"\boxed{ \text{12}. }", "12", strict=True) == 1.0
    assert verify_answer(r"$\boxed{1 2}$", "12", strict=True) == 1.0
    assert verify_answer(r"\boxed{13}", "12", strict=True) == 0.0
    assert verify_answer("12", "12", strict=True) == 0.0


# ---- the environment -------------------------------------------------------------------------


def test_find_tool_call_takes_the_last_complete_block():
    text = "<code>\nprint(1)\n</code> then ```python\nprint(2)\n```\n"
    assert find_tool_call(text)[0].strip() == "print(2)"
    assert find_tool_call("```python\nprint(1)\n```\n<code>print(3)</code>")[0] == "print(3)"
    assert find_tool_call("<code>\n```python\nprint(4)\n```\n</code>")[0].strip() == "print(4)"
    assert find_tool_call("<code>\nprint(5)\n") is None  # never closed
    assert find_tool_call("```\nprint(6)\n```\n") is None  # not a python block


def test_reset_gives_system_and_user_messages():
    env = MathTIREnv(CONFIG)
    msgs = env.reset(TASK)
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert msgs[1]["content"] == TASK.prompt
    assert "\\boxed" in msgs[0]["content"] and "<code>" in msgs[0]["content"]
    assert env.name == "math-tir" and "</code>" in env.stop


@pytest.mark.process
@pytest.mark.parametrize(("answer", "reward"), [(str(123456 * 654321), 1.0), ("80779853377", 0.0)])
def test_episode_with_code_then_answer(answer, reward):
    env = MathTIREnv(CONFIG)
    env.reset(TASK)
    r1 = env.step("Let me compute.\n<code>\nprint(123456 * 654321)\n</code>")
    assert not r1.done
    assert len(r1.messages) == 1 and r1.messages[0]["role"] == "tool"
    content = r1.messages[0]["content"]
    assert content.startswith("<output>\n") and content.endswith("\n</output>")
    assert str(123456 * 654321) in content
    assert r1.info["tool_calls"] == 1 and r1.info["sandbox_failures"] == 0
    r2 = env.step(f"So the product is \\boxed{{{answer}}}.")
    assert r2.done and r2.reward == reward
    assert r2.info["finish"] == "answer" and r2.info["tool_calls"] == 1
    with pytest.raises(RuntimeError):
        env.step("again")


@pytest.mark.process
def test_fenced_python_block_is_a_tool_call():
    env = MathTIREnv(CONFIG)
    env.reset(TASK)
    r = env.step("```python\nimport sys\nprint('out'); print('err', file=sys.stderr)\n```\n")
    assert not r.done
    assert "out" in r.messages[0]["content"] and "err" in r.messages[0]["content"]


@pytest.mark.process
@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("print(sorted(__import__('os').listdir('/root')))", "PermissionError"),
        ("print(open('/root/.bashrc').read())", "Error"),
        ("while True:\n    pass", "limit"),
        ("raise SystemExit(3)", "exit code 3"),
    ],
)
def test_hostile_code_gives_an_error_observation(code, expected):
    env = MathTIREnv(SandboxConfig(wall_seconds=1.5, cpu_seconds=1))
    env.reset(TASK)
    r = env.step(f"<code>\n{code}\n</code>")
    assert not r.done
    assert expected in r.messages[0]["content"]
    assert r.info["sandbox_failures"] == 1 and r.info["tool_calls"] == 1
    final = env.step(f"\\boxed{{{TASK.answer}}}")
    assert final.done and final.reward == 1.0 and final.info["sandbox_failures"] == 1


@pytest.mark.process
def test_tool_budget_ends_the_episode_with_zero_reward():
    env = MathTIREnv(CONFIG, max_tool_calls=2)
    env.reset(TASK)
    for i in range(2):
        r = env.step(f"<code>print({i})</code>")
        assert not r.done and r.info["tool_calls"] == i + 1
    r = env.step(f"\\boxed{{{TASK.answer}}} wait, <code>print(99)</code>")
    assert r.done and r.reward == 0.0
    assert r.info["finish"] == "tool_budget" and r.info["tool_calls"] == 2


@pytest.mark.process  # the answer check runs in a worker process
def test_answer_without_tool_call_and_wrong_answer():
    env = MathTIREnv(CONFIG)
    env.reset(TASK)
    r = env.step("I think it is \\boxed{42}")
    assert r.done and r.reward == 0.0 and r.info["tool_calls"] == 0


@pytest.mark.process  # the answer check runs in a worker process
def test_strict_env_uses_string_match():
    task = Task(task_id="h", prompt="half?", answer="0.5")
    loose, strict = MathTIREnv(CONFIG), MathTIREnv(CONFIG, strict=True)
    loose.reset(task)
    strict.reset(task)
    assert loose.step(r"\boxed{\frac{1}{2}}").reward == 1.0
    assert strict.step(r"\boxed{\frac{1}{2}}").reward == 0.0


# ---- tasks -----------------------------------------------------------------------------------


def test_load_tasks_round_trips_jsonl_and_parquet(tmp_path):
    tasks = generate_arithmetic_tasks(5, seed=3) + [Task(task_id="x", prompt="1+1?", answer="2")]
    path = tmp_path / "tasks.jsonl"
    write_jsonl(tasks, path)
    assert load_tasks(path) == tasks
    rows = [{"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer} for t in tasks]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "tasks.parquet")
    assert [(t.task_id, t.prompt, t.answer) for t in load_tasks(tmp_path / "tasks.parquet")] == [
        (t.task_id, t.prompt, t.answer) for t in tasks
    ]


def test_missing_task_id_gets_a_stable_hash(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4}) + "\n")
    (task,) = load_tasks(path)
    assert task.task_id == prompt_task_id("What is 2+2?") and len(task.task_id) == 16
    assert task.answer == "4"
    assert load_tasks(path)[0].task_id == task.task_id


@pytest.mark.parametrize(
    ("bad_row", "message"),
    [
        ({"answer": "1"}, "prompt"),
        ({"prompt": "p2"}, "answer"),
        ({"prompt": "", "answer": "1"}, "prompt"),
        ({"task_id": "a", "prompt": "other", "answer": "1"}, "duplicate task_id 'a'"),
    ],
)
def test_bad_rows_are_rejected_naming_the_line(tmp_path, bad_row, message):
    path = tmp_path / "bad.jsonl"
    good = {"task_id": "a", "prompt": "p1", "answer": "1"}
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad_row) + "\n")
    with pytest.raises(ValueError, match=message) as err:
        load_tasks(path)
    assert str(path) in str(err.value) and "line 3" in str(err.value)


def test_bad_parquet_row_names_the_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "p1", "answer": "1"}, {"prompt": "p2", "answer": None}]), path
    )
    with pytest.raises(ValueError, match="row 2.*answer"):
        load_tasks(path)


def test_dapo_layout(tmp_path):
    problem = "Find the sum of all integers $n$ with $n^2 < 10$."
    content = DAPO_PREFIX + problem + DAPO_SUFFIX
    row = {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "0", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "abc-123"},
    }
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist([row, row]), path)
    with pytest.raises(ValueError, match="duplicate.*dedupe=True"):
        load_tasks(path)
    (task,) = load_tasks(path, dedupe=True)
    assert task.prompt == problem and task.answer == "0"
    assert task.task_id == prompt_task_id(problem)
    assert task.meta["original_prompt"] == content and task.meta["extra_info"] == {"index": "abc-123"}


def test_arithmetic_tasks_are_deterministic_and_correct():
    a, b = generate_arithmetic_tasks(40, seed=7), generate_arithmetic_tasks(40, seed=7)
    assert a == b
    assert a != generate_arithmetic_tasks(40, seed=8)
    assert len({t.task_id for t in a}) == 40 and a[0].task_id == "arith-7-0"
    assert len({t.meta["kind"] for t in a}) >= 4
    for t in a:
        assert str(eval(t.meta["expression"])) == t.answer  # noqa: S307 - our own expressions
        assert "\\boxed{}" in t.prompt
        assert abs(int(t.answer)) > 10_000 or t.meta["kind"] == "mod"


@pytest.mark.process
def test_verify_and_env_work_outside_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    def episode(answer):
        env = MathTIREnv(CONFIG)
        env.reset(TASK)
        env.step("<code>print(123456 * 654321)</code>")
        return env.step(f"\\boxed{{{answer}}}").reward, verify_answer(r"\boxed{\frac{2}{4}}", "0.5")

    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(episode, [TASK.answer, "1"]))
    assert got == [(1.0, 1.0), (0.0, 1.0)]
