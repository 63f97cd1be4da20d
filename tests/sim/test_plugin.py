"""The ``sim_swarm`` fixture of the pytest plugin (daemon/pytest_plugin.py), as a user's
test suite gets it through the ``pytest11`` entry point."""

from __future__ import annotations

import pytest

from gossip.member import State


async def test_a_crashed_node_is_seen_dead_and_comes_back(sim_swarm, autojump_clock) -> None:
    sim = await sim_swarm(n=4, seed=7)
    await sim.wait_ready()
    victim = sim.nodes[3]
    sim.crash(victim)
    await sim.wait_until(lambda: all(sim.view(n).get(victim) is State.DEAD
                                     for n in sim.nodes[:3]))
    await sim.restart(victim)
    await sim.wait_ready()
    assert victim.running and victim.restarts == 1


async def test_a_partition_heals(sim_swarm, autojump_clock) -> None:
    """The README's example, as written there."""
    sim = await sim_swarm(n=8, seed=1)
    await sim.wait_ready()
    sim.partition(sim.nodes[:4], sim.nodes[4:])
    await sim.run_for(30)                 # virtual seconds
    sim.heal()
    await sim.wait_until(lambda: sim.spread() < 1e-3)


async def test_on_the_real_clock_the_fixture_says_what_is_missing(sim_swarm) -> None:
    with pytest.raises(RuntimeError, match="autojump_clock"):
        await sim_swarm(n=2)
