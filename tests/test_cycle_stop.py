"""A stop ends the training cycle's loop whatever loop turn it comes in (CI: ``POST /api/v1/admin/stop``
answered nothing for 300 s after a reported episode).

The report's ``accept`` wakes the cycle's loop; a stop cancelling that loop in the same loop turn, or the
next, lost its cancellation in Python 3.11's ``asyncio.wait_for`` (CPython gh-86296): the loop ran on and
``before_stop`` awaited it forever. Over HTTP the stop lands in that window about one run in 30-80."""

from __future__ import annotations

import asyncio

import pytest

from swarmkit.models import build_tiny_tokenizer
from swarmkit.swarm.cycle import TrainingCycle
from swarmkit.swarm.server import SwarmServer
from swarmkit.swarm.state import ServerState
from swarmkit.testing.scripted import ScriptedBackend


@pytest.mark.parametrize("turns", [0, 1, 2])
def test_a_stop_just_after_an_accepted_episode_ends_the_cycle(train_cfg, tmp_path, turns):
    async def go() -> None:
        cycle = TrainingCycle(tmp_path, step_fn=lambda records, step: {})
        srv = SwarmServer({"run_dir": str(tmp_path), "admin_token": "t" * 24}, config=train_cfg, cycle=cycle,
                          backend_factory=lambda cfg: ScriptedBackend(build_tiny_tokenizer(), replies=["ok"]))
        srv.start()
        assert await srv.state.wait_for([ServerState.ROLLING], timeout=20)
        await asyncio.sleep(0.05)  # the loop waits for its wake-up
        loop_task = cycle._task
        cycle._wake.set()  # what accepting a reported episode does
        for _ in range(turns):
            await asyncio.sleep(0)  # the stop comes this many loop turns later
        stop = asyncio.ensure_future(srv.stop("test"))
        done, _ = await asyncio.wait([stop], timeout=5)
        assert done, f"the stop hung: the cycle's loop ran on ({loop_task})"
        assert loop_task is not None and loop_task.done() and cycle._task is None
        assert srv.state.state is ServerState.OFFLINE

    asyncio.run(go())


def test_the_cycle_runs_again_after_a_restart(train_cfg, tmp_path):
    """before_stop's stop flag is cleared by the next boot: the loop runs again after a restart."""
    async def go() -> None:
        cycle = TrainingCycle(tmp_path, step_fn=lambda records, step: {}, poll_s=0.02)
        srv = SwarmServer({"run_dir": str(tmp_path), "admin_token": "t" * 24}, config=train_cfg, cycle=cycle,
                          backend_factory=lambda cfg: ScriptedBackend(build_tiny_tokenizer(), replies=["ok"]))
        for _ in range(2):
            srv.start()
            assert await srv.state.wait_for([ServerState.ROLLING], timeout=20)
            await asyncio.sleep(0.1)
            assert cycle._task is not None and not cycle._task.done()
            async with asyncio.timeout(5):
                await srv.stop("test")

    asyncio.run(go())
