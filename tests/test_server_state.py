"""The server life-cycle state machine: every legal move, every illegal one."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from swarmkit.swarm.state import TRANSITIONS, IllegalTransition, ServerState, StateMachine

S = ServerState
LEGAL = {
    (S.OFFLINE, S.BOOTING),
    (S.BOOTING, S.ROLLING),
    (S.BOOTING, S.OFFLINE),
    (S.ROLLING, S.ROLLING_POST),
    (S.ROLLING, S.OFFLINE),
    (S.ROLLING_POST, S.WEIGHT_SYNCING),
    (S.ROLLING_POST, S.OFFLINE),
    (S.WEIGHT_SYNCING, S.ROLLING),
    (S.WEIGHT_SYNCING, S.OFFLINE),
}


def machine_in(state: ServerState) -> StateMachine:
    m = StateMachine()
    path = {S.OFFLINE: [], S.BOOTING: [S.BOOTING], S.ROLLING: [S.BOOTING, S.ROLLING],
            S.ROLLING_POST: [S.BOOTING, S.ROLLING, S.ROLLING_POST],
            S.WEIGHT_SYNCING: [S.BOOTING, S.ROLLING, S.ROLLING_POST, S.WEIGHT_SYNCING]}[state]
    for s in path:
        m.transition(s)
    assert m.state is state
    return m


def test_new_server_is_offline():
    assert StateMachine().state is S.OFFLINE


def test_transition_table_is_the_documented_cycle():
    assert {(a, b) for a, bs in TRANSITIONS.items() for b in bs} == LEGAL


@pytest.mark.parametrize("old,new", sorted(LEGAL))
def test_legal_transition_is_allowed(old, new):
    m = machine_in(old)
    assert m.can(new)
    assert m.transition(new) is old
    assert m.state is new


@pytest.mark.parametrize("old,new", sorted(set(itertools.product(S, S)) - LEGAL))
def test_illegal_transition_raises_and_keeps_the_state(old, new):
    m = machine_in(old)
    with pytest.raises(IllegalTransition, match=f"cannot go from {old.value} to {new.value}"):
        m.transition(new)
    assert m.state is old


def test_stop_reaches_offline_from_every_state():
    for s in S:
        if s is S.OFFLINE:
            continue
        m = machine_in(s)
        m.transition(S.OFFLINE)
        assert m.state is S.OFFLINE


def test_three_training_cycles():
    m = machine_in(S.ROLLING)
    for _ in range(3):
        m.transition(S.ROLLING_POST)
        m.transition(S.WEIGHT_SYNCING)
        m.transition(S.ROLLING)
    assert [s for _, s in m.history][-3:] == [S.ROLLING_POST, S.WEIGHT_SYNCING, S.ROLLING]


def test_failed_boot_keeps_the_error_until_the_next_boot():
    m = machine_in(S.BOOTING)
    m.transition(S.OFFLINE, error="boot failed: OSError: no model")
    assert m.last_error == "boot failed: OSError: no model"
    m.transition(S.BOOTING)
    assert m.last_error is None


def test_listener_errors_do_not_block_transitions():
    m = StateMachine()
    seen = []
    m.add_listener(lambda old, new: 1 / 0)
    m.add_listener(lambda old, new: seen.append((old, new)))
    m.transition(S.BOOTING)
    assert seen == [(S.OFFLINE, S.BOOTING)] and m.state is S.BOOTING


def test_wait_for_wakes_on_transition_and_times_out():
    async def go():
        m = machine_in(S.WEIGHT_SYNCING)
        assert await m.wait_for([S.ROLLING], timeout=0.05) is False
        waiter = asyncio.create_task(m.wait_for([S.ROLLING], timeout=5))
        await asyncio.sleep(0.01)
        m.transition(S.ROLLING)
        assert await waiter is True

    asyncio.run(go())



def test_wait_for_keeps_a_cancellation_that_comes_with_the_transition():
    """A waiter cancelled in the loop turn the awaited state comes is cancelled (asyncio.wait_for on 3.11
    returned True instead: the cancelled call went on)."""
    async def go():
        m = machine_in(S.WEIGHT_SYNCING)
        waiter = asyncio.create_task(m.wait_for([S.ROLLING], timeout=5))
        await asyncio.sleep(0.01)
        m.transition(S.ROLLING)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(go())

def test_states_are_plain_strings():
    assert S.ROLLING_POST == "ROLLING_POST" and str(S.ROLLING) == "ROLLING"
