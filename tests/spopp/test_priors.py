"""The prior file (spopp/files/priors.py): built in closed form, written atomically, read back strictly.

`build_prior` counts successes (reward >= 1; partial rewards fail) and gives each task the Jeffreys
prior of its counts; `write_prior` leaves either the old file or the whole new one; `read_prior`
refuses every malformed or hand-edited file with a message naming the file and what is wrong.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from spopp.api.tracker_api import MAX_TASKS_PER_CALL, PutTasks
from spopp.evidence import jeffreys_init
from spopp.files.priors import FORMAT, PriorFile, PriorTask, build_prior, read_prior, write_prior

META = {"model": "/m", "tasks_file": "/t.jsonl", "env": "toy-calc", "temperature": 1.0, "seed": 0,
        "created": 1.7e9, "seconds": 1.5}  # fmt: skip


def _closed_form(s: int, n: int, m: float) -> tuple[float, float]:
    return m * (s + 0.5) / (n + 1), m * (n - s + 0.5) / (n + 1)


def _prior() -> PriorFile:
    outcomes = {
        "q-b": [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0],
        "q-a": [0.0] * 8,
        "q:c.1": [1.0] * 8,
        "q-d": [0.5, 0.99, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # partial rewards are failures
    }
    return build_prior(outcomes, 8.0, META)


def test_build_prior_is_the_jeffreys_prior_of_the_counts():
    prior = _prior()
    assert [t.task_id for t in prior.tasks] == ["q-b", "q-a", "q:c.1", "q-d"]  # the order given
    assert [t.successes for t in prior.tasks] == [3, 0, 8, 1]
    for t in prior.tasks:
        assert t.rollouts == 8
        a, b = _closed_form(t.successes, 8, 8.0)
        assert (t.alpha0, t.beta0) == pytest.approx((a, b), rel=1e-12)
        assert t.alpha0 + t.beta0 == pytest.approx(8.0)
    assert prior.tasks[0] == PriorTask(
        task_id="q-b",
        successes=3,
        rollouts=8,
        **dict(zip(("alpha0", "beta0"), jeffreys_init(3, 8, 8.0), strict=True)),
    )
    assert prior.prior_mass == 8.0
    assert prior.meta["format"] == FORMAT and prior.meta["rollouts"] == 8
    assert prior.meta["success_rate"] == pytest.approx(12 / 32)
    assert prior.meta["model"] == "/m" and prior.meta["seconds"] == 1.5
    bodies = prior.task_bodies()
    assert bodies[1] == {"task_id": "q-a", "alpha0": 8 * 0.5 / 9, "beta0": 8 * 8.5 / 9}
    PutTasks.model_validate({"tasks": bodies})  # what the tracker's PUT /tasks takes
    assert len(bodies) <= MAX_TASKS_PER_CALL


def test_build_prior_with_varying_counts_and_another_mass():
    prior = build_prior({"x": [1.0], "y": [0.0, 1.0, 1.0]}, 2.0, {})
    assert prior.meta["rollouts"] is None  # not one count for every task
    assert [(t.successes, t.rollouts) for t in prior.tasks] == [(1, 1), (2, 3)]
    assert (prior.tasks[1].alpha0, prior.tasks[1].beta0) == pytest.approx(_closed_form(2, 3, 2.0))


@pytest.mark.parametrize(
    "outcomes, match",
    [
        ({"ok": [1.0], "empty": []}, "'empty' has no outcomes"),
        ({"nan": [0.0, math.nan]}, "'nan' has non-finite"),
        ({"inf": [math.inf]}, "'inf' has non-finite"),
        ({"text": ["1"]}, "'text' has non-finite or non-numeric"),
        ({"a b": [1.0]}, "task id 'a b' is not one the tracker accepts"),
        ({}, "no tasks"),
    ],
)
def test_build_prior_refuses_what_gives_no_prior(outcomes, match):
    with pytest.raises(ValueError, match=match):
        build_prior(outcomes, 8.0, {})


def test_build_prior_refuses_a_mass_the_tracker_refuses():
    with pytest.raises(ValueError, match="prior_mass"):
        build_prior({"x": [1.0]}, 0.0, {})
    with pytest.raises(ValueError, match="prior_mass"):
        build_prior({"x": [1.0]}, math.inf, {})


def test_write_and_read_round_trip(tmp_path):
    prior = _prior()
    path = tmp_path / "sub" / "prior.json"
    write_prior(path, prior)
    data = json.loads(path.read_text())
    assert list(data)[0] == "format" and data["format"] == FORMAT and list(data)[-1] == "tasks"
    assert data["tasks"][0] == {"task_id": "q-b", "successes": 3, "rollouts": 8,
                                "alpha0": prior.tasks[0].alpha0, "beta0": prior.tasks[0].beta0}  # fmt: skip
    back = read_prior(path)
    assert back == prior
    assert back.task_bodies() == prior.task_bodies()
    assert [p.name for p in path.parent.iterdir()] == ["prior.json"]  # no temp file left


def test_write_is_atomic_and_refuses_what_it_could_not_read_back(tmp_path):
    path = tmp_path / "prior.json"
    good = _prior()
    write_prior(path, good)
    before = path.read_bytes()
    bad_meta = good.model_copy(update={"seconds": math.nan})
    with pytest.raises(ValueError, match="cannot be written as JSON"):
        write_prior(path, bad_meta)
    assert path.read_bytes() == before  # the old file, whole
    fresh = tmp_path / "fresh.json"
    with pytest.raises(ValueError, match="cannot be written as JSON"):
        write_prior(fresh, good.model_copy(update={"x": object()}))
    task = PriorTask(task_id="t", successes=1, rollouts=8, alpha0=1.0, beta0=7.0)
    inconsistent = good.model_copy(update={"tasks": [task]})  # model_copy skips the checks
    with pytest.raises(ValueError, match="not the Jeffreys prior"):
        write_prior(fresh, inconsistent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prior.json"]  # no partial, no temp file


def test_write_without_overwrite_keeps_an_existing_file(tmp_path):
    path = tmp_path / "prior.json"
    path.write_text("{}")
    with pytest.raises(FileExistsError, match="exists"):
        write_prior(path, _prior(), overwrite=False)
    assert path.read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["prior.json"]
    write_prior(tmp_path / "new.json", _prior(), overwrite=False)
    assert read_prior(tmp_path / "new.json") == _prior()


def test_read_prior_names_a_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"prior file {tmp_path / 'nope.json'} does not exist"):
        read_prior(tmp_path / "nope.json")


def _good() -> dict:
    return _prior().to_json()


def _task(data: dict, **kw) -> dict:
    data["tasks"][0].update(kw)
    return data


def _drop(d: dict, key: str) -> dict:
    d.pop(key)
    return d


MALFORMED = {
    "not JSON": ("{not json", "not JSON"),
    "NaN literal": ('{"format": "spopp-prior/1", "prior_mass": NaN}', "not JSON"),
    "not an object": ("[1, 2]", "expected a JSON object, got list"),
    "no format": (lambda: _drop(_good(), "format"), ": format: missing"),
    "wrong format": (
        lambda: {**_good(), "format": "spopp-prior/2"},
        "format: Input should be 'spopp-prior/1'",
    ),
    "no prior_mass": (lambda: _drop(_good(), "prior_mass"), ": prior_mass: missing"),
    "no tasks": (lambda: _drop(_good(), "tasks"), ": tasks: missing"),
    "no rollouts": (lambda: _drop(_good(), "rollouts"), ": rollouts: missing"),
    "bad mass": (
        lambda: {**_good(), "prior_mass": -1},
        "prior_mass: Input should be greater than or equal to 0.000001",
    ),
    "empty tasks": (lambda: {**_good(), "tasks": []}, "tasks: List should have at least 1 item"),
    "task missing key": (
        lambda: {**_good(), "tasks": [_drop(_good()["tasks"][0], "beta0")]},
        r"tasks\[0\]\.beta0: missing",
    ),
    "task extra key": (lambda: _task(_good(), value=0.5), r"tasks\[0\]\.value: unknown field"),
    # 1e999 is valid JSON that parses to inf (json.dumps would write the non-JSON `Infinity`).
    "alpha0 infinite": (
        lambda: json.dumps(_task(_good(), alpha0=12345.5)).replace("12345.5", "1e999"),
        r"tasks\[0\]\.alpha0: Input should be a finite number",
    ),
    "alpha0 zero": (
        lambda: _task(_good(), alpha0=0),
        r"tasks\[0\]\.alpha0: Input should be greater than or equal to 0.000001",
    ),
    "beta0 negative": (
        lambda: _task(_good(), beta0=-2.0),
        r"tasks\[0\]\.beta0: Input should be greater than or equal",
    ),
    "beta0 text": (lambda: _task(_good(), beta0="4.8"), r"tasks\[0\]\.beta0: Input should be a valid number"),
    "duplicate id": (lambda: _task(_good(), task_id="q-a"), "duplicate task_id 'q-a'"),
    "bad id": (lambda: _task(_good(), task_id="a b"), r"tasks\[0\]\.task_id: String should match pattern"),
    "successes > rollouts": (
        lambda: _task(_good(), successes=9, rollouts=8),
        r"tasks\[0\]: successes 9 > rollouts 8",
    ),
    "float successes": (
        lambda: _task(_good(), successes=3.0),
        r"tasks\[0\]\.successes: Input should be a valid integer",
    ),
    "rollouts differ": (lambda: _task(_good(), rollouts=9), "rollouts 9 differs from the file's rollouts 8"),
    "hand-edited alpha0": (lambda: _task(_good(), alpha0=3.2), "not the Jeffreys prior of 3/8"),
    "hand-edited successes": (lambda: _task(_good(), successes=4), "not the Jeffreys prior of 4/8"),
    "mass edited": (lambda: {**_good(), "prior_mass": 16.0}, "not the Jeffreys prior.*prior_mass 16.0"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_read_prior_refuses_malformed_files(tmp_path, case):
    content, match = MALFORMED[case]
    path = tmp_path / "prior.json"
    if callable(content):
        content = content()
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match) as info:
        read_prior(path)
    assert str(path) in str(info.value)  # the message names the file


def test_read_prior_tolerates_rounding_but_not_more(tmp_path):
    path = tmp_path / "prior.json"
    data = _good()
    a = data["tasks"][0]["alpha0"]
    path.write_text(json.dumps(_task(data, alpha0=a * (1 + 1e-12))))
    assert read_prior(path).tasks[0].alpha0 == pytest.approx(a)
    path.write_text(json.dumps(_task(_good(), alpha0=a * (1 + 1e-7))))
    with pytest.raises(ValueError, match="not the Jeffreys prior"):
        read_prior(path)


def test_read_prior_refuses_a_directory(tmp_path: Path):
    with pytest.raises(ValueError, match="is a directory"):
        read_prior(tmp_path)
