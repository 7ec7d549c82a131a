"""spopp/machine/wait.py: the waits every process uses, on a clock of their own (sync and async alike)."""

from __future__ import annotations

import asyncio

import pytest

from spopp.machine.wait import ProcessExited, WaitTimeout, wait_until, wait_until_async


def test_wait_until_answers_the_first_truthy_value_and_says_once_what_it_waits_for():
    calls, said = iter([0, None, "", "ready"]), []
    assert wait_until(lambda: next(calls), 5, "x", interval=0.001, on_wait=lambda: said.append(1)) == "ready"
    assert said == [1]
    with pytest.raises(WaitTimeout, match="timed out after 0.05 s waiting for the moon"):
        wait_until(lambda: False, 0.05, "the moon", interval=0.01)


def test_wait_until_ends_at_once_when_its_process_exits():
    class Exited:  # what wait_until asks of a process: poll() (a Popen's, here one that exited 3)
        def poll(self) -> int:
            return 3

    proc = Exited()
    with pytest.raises(ProcessExited, match="exited with code 3 while waiting for a port") as err:
        wait_until(lambda: False, 60, "a port", proc=proc)
    assert err.value.code == 3


def test_the_async_wait_takes_a_coroutine_predicate_and_lets_the_loop_serve():
    async def main() -> tuple[str, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.001)

        task = asyncio.create_task(ticker())
        answers = iter([None, None, "up"])

        async def probe() -> str | None:
            return next(answers)

        said: list[int] = []
        got = await wait_until_async(probe, 5, "the learner", interval=0.02, on_wait=lambda: said.append(1))
        task.cancel()
        return got, ticks, said

    got, ticks, said = asyncio.run(main())
    assert got == "up" and said == [1] and ticks > 2  # the loop ran the ticker while waiting
    with pytest.raises(WaitTimeout, match="waiting for nothing"):
        asyncio.run(wait_until_async(lambda: 0, 0.05, "nothing", interval=0.01))
