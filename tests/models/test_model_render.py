"""`spopp model render`: the first task's opening through the model's chat template, as a replica
renders it; for an agent's episode, whose opening its agent writes call by call, the command says
so instead of rendering anything (the Playable's `opening` is None)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from runtime.envs.toy_calc import generate_toy_calc_tasks, write_toy_calc_tasks
from services.models.cli import group


def _render(*args: str):
    return CliRunner().invoke(group, ["render", *args, "--json"])


def test_an_environments_opening_is_rendered_and_an_agents_is_left_to_the_agent(
    tiny_model, tmp_path, monkeypatch
):
    train, _ = write_toy_calc_tasks(tmp_path, n_train=2, n_heldout=0)
    first = generate_toy_calc_tasks(2)[0]
    r = _render(str(tiny_model), "--tasks", str(train), "--env", "toy-calc")
    assert r.exit_code == 0, r.output
    shown = json.loads(r.output)
    assert shown["task_id"] == first.task_id and shown["tokens"] > 0 and first.prompt in shown["text"]

    (tmp_path / "render_agent.py").write_text("async def solve(client, task):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    options = json.dumps({"agent": "render_agent:solve"})
    r = _render(str(tiny_model), "--tasks", str(train), "--env", "agent", "--env-options", options)
    assert r.exit_code == 0, r.output
    shown = json.loads(r.output)
    assert shown["tokens"] == 0 and shown["text"].startswith("(an agent's episode: the agent writes its own")
