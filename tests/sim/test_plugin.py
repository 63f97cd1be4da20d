"""The ``sim_swarm`` fixture of the pytest plugin (daemon/pytest_plugin.py), as a user's
test suite gets it through the ``pytest11`` entry point."""

from __future__ import annotations

from gossip.member import State


async def test_a_crashed_node_is_seen_dead_and_comes_back(sim_swarm) -> None:
    sim = await sim_swarm(n=4, seed=7)
    await sim.wait_ready()
    victim = sim.nodes[3]
    sim.crash(victim)
    await sim.wait_until(lambda: all(sim.view(n).get(victim) is State.DEAD
                                     for n in sim.nodes[:3]))
    await sim.restart(victim)
    await sim.wait_ready()
    assert victim.running and victim.restarts == 1
