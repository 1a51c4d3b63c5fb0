"""The staleness bound of asynchronous training, as pure arithmetic on policy versions.

Step ``k`` updates the weights of version ``k - 1`` into version ``k``. A token
sampled by version ``v`` and trained in step ``k`` is ``(k - 1) - v`` versions
stale; the bound ``η`` (``trainer.max_staleness``) asks for ``(k - 1) - v <= η``.

The server paces instead of discarding: an episode that starts now samples with
the served version ``V`` (or newer), and the steps that can still train it
within the bound are those whose batch is not taken yet and that update a
version ``<= V + η``. With ``B`` training episodes per step, that leaves room
for ``steps × B`` episodes in flight (running, or waiting in the pool); a new
one waits (503 + Retry-After) while that room is full. Tokens that still end up
staler (a batching policy that waits for a whole group, a very long episode) are
left out of the loss when trained, and counted.
"""

from __future__ import annotations


def steps_within_bound(served_version: int, global_step: int, training: bool, max_staleness: int) -> int:
    """How many not-yet-started steps may train an episode that starts now.

    :param served_version: ``V``, the version the inference engine serves.
    :param global_step: the trainer's version (``>= V``; more while new weights are being pushed).
    :param training: a step is under way (its batch is taken; it updates ``global_step``).
    :param max_staleness: ``η``.
    :returns: ``max(0, V + η - first + 1)`` where ``first`` is the version the next untaken step
        updates: ``global_step + 1`` while a step is under way, else ``global_step``.
    """
    first = int(global_step) + (1 if training else 0)
    return max(0, int(served_version) + int(max_staleness) - first + 1)


def admission_capacity(served_version: int, global_step: int, training: bool, max_staleness: int,
                       episodes_per_step: int) -> int:
    """Training episodes that may be in flight (running or waiting in the pool) under the bound."""
    return steps_within_bound(served_version, global_step, training, max_staleness) * max(1, int(episodes_per_step))



def holds_step(weights_version: int, oldest_running_token: int | None, max_staleness: int) -> bool:
    """Whether a step should wait for a running episode before it starts.

    A step started now updates ``weights_version``; an episode still running is
    trained by a later step at the earliest, which updates ``weights_version + 1``,
    so its oldest token (``oldest_running_token``, sampled by that version) would be
    ``weights_version + 1 - oldest_running_token`` versions stale. While that
    exceeds ``max_staleness`` the trainer waits for the episode (pacing the trainer,
    as admission paces the clients) rather than train past it and drop its tokens.
    """
    if oldest_running_token is None:
        return False
    return int(weights_version) + 1 - int(oldest_running_token) > int(max_staleness)


def admits(in_flight: int, capacity: int, *, siblings: int = 0, group_size: int = 1, training: bool = True,
           running: int = 1) -> bool:
    """Whether a new training episode starts now under the bound.

    :param in_flight: training episodes running or waiting in the pool.
    :param capacity: :func:`admission_capacity`.
    :param siblings: episodes of the same task in flight. One that completes a group under way
        (``0 < siblings < group_size``) is always admitted, so pacing never splits a group across
        steps (its first members would wait in the pool and go stale); the first episode of a
        new group is admitted only when the whole group fits (``in_flight + group_size <=
        capacity``), so the groups' later members cannot overshoot the room.
    :param training: a step is under way; ``running``: training episodes running. With neither,
        only the pool is waiting and nothing else would free room: admit (never deadlock).
    """
    if 0 < siblings < group_size or in_flight + max(1, group_size - siblings) <= capacity:
        return True
    return not training and running == 0
