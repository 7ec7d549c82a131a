"""Continuous batching in the transformers engine, and the engine hosted in a process of its own.

Requests that arrive while others decode join the running batch (their cache rows merged by left
padding), rows return the step they finish, a swap waits for running rows, a cancelled request is
dropped. Every generation is checked against a float64 forward pass of the weights it claims, so
a misaligned cache or mask shows up as wrong log-probs. The process-hosted engine: same answers
as in-process, errors of the same types, and a child that dies fails every waiting and later call
with its exit code instead of hanging.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_engines import check_against_reference, greedy

from runtime.engines.base import SamplingConfig
from runtime.engines.factory import make_engine
from runtime.engines.process import EngineProcessError

TOL = 1e-4


@pytest.fixture(scope="module")
def noisy_model(tiny_model, tmp_path_factory):
    """The tiny model with its weights drowned in noise: it seldom ends a turn, so rows run long
    (the trained tiny model answers in a few tokens)."""
    from tools.tiny_model import perturb_weights

    return perturb_weights(tiny_model, tmp_path_factory.mktemp("noisy") / "model", scale=3.0, seed=2)


@pytest.fixture(scope="module")
def engine(noisy_model, runner):
    e = make_engine("transformers", noisy_model, batch_window_s=0.0)
    yield e
    runner.run(e.close())


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    texts = ["12 + 7 =", "what is 3 * 4 ?", "hello", "a b c d e f g h i j k l m n o p", "(5 - 2) * 9"]
    return [tok.encode(t, add_special_tokens=False) for t in texts]


@pytest.fixture(scope="module")
def long_sampling(engine, runner, prompts):
    """A seeded T = 1 request on prompts[0] that runs its full 120 tokens (no end-of-sequence), so
    that it is still decoding when later requests arrive."""
    for seed in range(200):
        s = SamplingConfig(max_tokens=120, temperature=1.0, seed=seed)
        if runner.run(engine.generate(prompts[0], s)).finish_reason == "length":
            return s
    pytest.fail("no seed in 0..199 runs 120 tokens on the tiny model")


def test_late_requests_join_the_running_batch_and_rows_return_as_they_finish(
    engine, runner, prompts, reference, noisy_model, long_sampling
):
    model = reference(noisy_model)
    done: list[tuple[str, float]] = []

    async def one(name, prompt, sampling, late):
        if late:
            await decoding()
        g = await engine.generate(prompt, sampling)
        done.append((name, time.perf_counter()))
        return g

    async def decoding():
        # Until the decoding loop has admitted "long". Fixed delays (50 and 80 ms) raced the
        # machine: a fast CPU decodes its 120 tokens in 66 ms, before requests sent at 80 ms came.
        for _ in range(5000):
            if engine.scheduler.decoding:
                return
            await asyncio.sleep(0.001)

    async def scenario():
        return await asyncio.gather(
            one("long", prompts[0], long_sampling, False),
            # Arrive while "long" decodes; prompts of other lengths than the running row's.
            one("mid", prompts[3], SamplingConfig(max_tokens=40, temperature=1.0, seed=5), True),
            one("short", prompts[1], greedy(max_tokens=3), True),
            one("tiny", prompts[2], SamplingConfig(max_tokens=1, temperature=0.7, seed=9), True),
        )

    long, mid, short, tiny = runner.run(scenario())
    assert long.finish_reason == "length" and len(long.token_ids) == 120  # still running when the others came
    # They joined it rather than waiting for it: more than one row in their forward passes ...
    for g in (mid, short, tiny):
        assert g.timings["batch_size"] > 1.0, g.timings
    # ... and the short ones came back before the long one ended.
    order = [name for name, _ in sorted(done, key=lambda x: x[1])]
    assert order.index("short") < order.index("long") and order.index("tiny") < order.index("long")
    # Left padding and cache merging changed nothing a request can see.
    for g, p, t in (
        (long, prompts[0], 1.0),
        (mid, prompts[3], 1.0),
        (short, prompts[1], 0.0),
        (tiny, prompts[2], 0.7),
    ):
        check_against_reference(g, p, model, t, TOL)
    assert runner.run(engine.generate(prompts[0], long_sampling)).token_ids == long.token_ids


def test_many_staggered_requests_match_their_reference(engine, runner, prompts, reference, noisy_model):
    model = reference(noisy_model)

    async def one(i):
        await asyncio.sleep(0.004 * i)
        p = prompts[i % len(prompts)]
        return p, await engine.generate(
            p, SamplingConfig(max_tokens=10 + 7 * (i % 5), temperature=1.0, seed=i)
        )

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(24)))

    results = runner.run(all_of_them())
    assert max(g.timings["batch_size"] for _, g in results) > 4
    for p, g in results:
        check_against_reference(g, p, model, 1.0, TOL)


def test_a_swap_waits_for_running_rows_and_later_rows_see_the_new_weights(
    engine, runner, prompts, reference, noisy_model, perturbed_model, long_sampling
):
    old, new = reference(noisy_model), reference(perturbed_model)

    async def scenario():
        running = asyncio.create_task(engine.generate(prompts[0], long_sampling))
        # Wait until the decoding loop has admitted it (a fixed sleep lost that race under load: the
        # loop's batch window can outlast it, and a swap then goes first).
        for _ in range(500):
            await asyncio.sleep(0.01)
            if engine.scheduler.decoding:
                break
        swap = asyncio.create_task(engine.load_weights(perturbed_model))
        # Wait until the swap is registered (it reads and checks the file first, in a thread: a
        # fixed sleep lost that race under load, and the next request then ran before the swap).
        for _ in range(500):
            await asyncio.sleep(0.01)
            if engine.scheduler.swapping:
                break
        # Sent during the swap: waits for it, then runs on the new weights.
        after = asyncio.create_task(engine.generate(prompts[1], greedy(max_tokens=30)))
        await swap
        return await running, await after

    try:
        before_swap, after_swap = runner.run(scenario())
        assert len(before_swap.token_ids) == 120  # it was running when the swap came
        check_against_reference(before_swap, prompts[0], old, 1.0, TOL)  # every token from the old weights
        check_against_reference(after_swap, prompts[1], new, 0.0, TOL)
    finally:
        runner.run(engine.load_weights(noisy_model))


def test_a_cancelled_request_is_dropped_and_the_engine_goes_on(engine, runner, prompts, long_sampling):
    async def scenario():
        victim = asyncio.create_task(engine.generate(prompts[0], long_sampling))
        for _ in range(5000):  # admitted and decoding (not a fixed sleep: a fast CPU finishes first)
            await asyncio.sleep(0.001)
            if engine.scheduler.decoding:
                break
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        return await engine.generate(prompts[1], greedy(max_tokens=5))

    g = runner.run(scenario())
    assert len(g.token_ids) == 5
    for _ in range(100):  # the decoding loop lets the dropped row go and stops
        if not engine.scheduler.serving:
            break
        time.sleep(0.01)
    assert not engine.scheduler.serving


# -- the engine in a process of its own ----------------------------------------------------------


@pytest.fixture(scope="module")
def hosted(noisy_model, runner):
    e = make_engine("transformers", noisy_model, process=True, batch_window_s=0.0)
    yield e
    runner.run(e.close())


@pytest.mark.process
def test_hosted_engine_answers_like_the_in_process_one(hosted, engine, runner, prompts):
    async def both(e):
        return await asyncio.gather(*(e.generate(p, greedy(max_tokens=20)) for p in prompts))

    assert hosted.pid != os.getpid()
    mine, theirs = runner.run(both(engine)), runner.run(both(hosted))
    assert [g.token_ids for g in mine] == [g.token_ids for g in theirs]
    for a, b in zip(mine, theirs, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.process
def test_hosted_engine_raises_the_engines_own_errors(hosted, runner, prompts, tmp_path):
    with pytest.raises(ValueError, match="must not be empty"):
        runner.run(hosted.generate([], greedy()))
    with pytest.raises(ValueError, match="max_tokens"):
        runner.run(hosted.generate(prompts[0], SamplingConfig(max_tokens=0)))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        runner.run(hosted.load_weights(tmp_path))
    # Still serving afterwards.
    assert len(runner.run(hosted.generate(prompts[0], greedy(max_tokens=4))).token_ids) == 4


@pytest.mark.process
def test_a_model_the_child_cannot_load_fails_the_constructor_with_its_reason(
    tmp_path, tiny_model, monkeypatch
):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)  # the tokenizer loads in the parent; the weights do not
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a checkpoint")
    # The engine's socket folder goes under a temporary folder of this test's own (other tests,
    # on another xdist worker, make and remove theirs in the system's meanwhile); a short one in
    # /tmp, since a Unix socket's path must fit in 108 bytes (tmp_path under xdist does not).
    own_tmp = Path(tempfile.mkdtemp(prefix="spopp-t-"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(own_tmp))
        with pytest.raises(Exception, match="deserializing header") as err:
            make_engine("transformers", broken, process=True)
        assert not isinstance(err.value, EngineProcessError)  # the child's own error, not "it died"
        # Nothing of the failed start is left: its socket folder is gone (the child was waited for).
        assert list(own_tmp.iterdir()) == []
    finally:
        shutil.rmtree(own_tmp, ignore_errors=True)


@pytest.mark.process
def test_a_killed_engine_process_fails_waiting_and_later_calls(noisy_model, runner, prompts, long_sampling):
    e = make_engine("transformers", noisy_model, process=True)

    async def scenario():
        # The child is stopped before the request is sent, so the request is still waiting when
        # the child dies, however fast this machine decodes (a sleep of 0.2 s raced it: a fast CPU
        # had answered by then).
        os.kill(e.pid, signal.SIGSTOP)
        waiting = asyncio.create_task(
            e.generate(prompts[0], SamplingConfig(max_tokens=1000, temperature=1.0, seed=long_sampling.seed))
        )
        await asyncio.sleep(0.2)
        assert not waiting.done()
        os.kill(e.pid, signal.SIGKILL)
        with pytest.raises(EngineProcessError, match=r"code -9"):
            await asyncio.wait_for(waiting, 30)
        with pytest.raises(EngineProcessError, match=r"exited"):
            await e.generate(prompts[0], greedy(max_tokens=2))
        await e.close()

    runner.run(scenario())


@pytest.mark.process
def test_a_script_without_a_main_guard_can_host_the_engine(tiny_model, tmp_path):
    """The child is `python -m`, not a multiprocessing spawn: the caller's module is not re-run."""
    script = tmp_path / "plain.py"
    script.write_text(
        "import asyncio\n"
        "from runtime.engines.factory import make_engine\n"
        "from runtime.engines.base import SamplingConfig\n"
        "print('module body ran', flush=True)\n"
        f"e = make_engine('transformers', {str(tiny_model)!r}, process=True)\n"
        "async def main():\n"
        "    g = await e.generate([1, 2, 3], SamplingConfig(max_tokens=3, temperature=0.0))\n"
        "    print('tokens', len(g.token_ids))\n"
        "    await e.close()\n"
        "asyncio.run(main())\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, "PYTHONPATH": root},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("module body ran") == 1 and "tokens 3" in r.stdout
