"""Outbound-only nodes in whole simulated swarms: real nodes (membership, channels,
averaging) on the simulated network, with some hosts behind a NAT (``SimNetwork.nat``:
dials to them wait, datagrams reach them only from addresses they recently sent to).

Each node finds out for itself whether it can be reached (``reachable=None``: a member
dials it back after it joins), nobody ever picks an outbound-only node, they still take part
in averaging by initiating every exchange, and nobody is declared dead for being unreachable.
"""

import dataclasses
import random

import torch
import trio

from gossip import AveragingConfig, Result, State, open_swarm
from gossip.testing.simnet import SimNetwork
from gossip.testing import open_sim_swarm
from tests.util import SWARM, local

REACHABLE = 2
N = 8
AVERAGING = local(averaging=AveragingConfig(every=None, interval=2.0, start="own"))
QUIET = local(averaging=AveragingConfig(every=None, interval=None, start="own"))  # membership


def views_agree(sim, n_reachable: int) -> bool:
    """Every node knows it, and every node sees every other alive with the right flag."""
    for observer in sim.nodes:
        node = observer.node
        if node is None or node.roster.me.reachable != (observer.index < n_reachable):
            return False
        seen = {m.peer: m.reachable for m in node.roster.alive()}
        expected = {o.peer_id: o.index < n_reachable for o in sim.nodes if o is not observer}
        if seen != expected:
            return False
    return True


def deaths(sim) -> int:
    return sum(n.node.roster.statistics().deaths for n in sim.nodes if n.node is not None)


async def test_outbound_only_nodes_find_out_average_and_stay_alive(autojump_clock):
    nat = range(REACHABLE, N)
    async with open_sim_swarm(N, seed=3, config=dataclasses.replace(AVERAGING, reachable=None),
                              nat=nat, latency=0.02) as sim:
        with trio.fail_after(120):
            await sim.wait_until(lambda: views_agree(sim, REACHABLE) and all(
                n.node.roster.reachability.checked for n in sim.nodes[1:]))
        for node in sim.nodes[REACHABLE:]:
            r = node.node.roster.reachability
            assert (r.mode, r.checked, r.reachable) == ("auto", True, False), r
            assert "could not dial us: no channel to" in r.detail, r.detail
        r = sim.nodes[1].node.roster.reachability
        assert (r.reachable, r.checked) == (True, True) and r.detail.startswith("dialed back by")
        start = trio.current_time()
        spread0 = sim.spread()
        await sim.run_for(4 * 60)
        assert views_agree(sim, REACHABLE)
        assert deaths(sim) == 0  # four virtual minutes: nobody thought an outbound node dead
        mine = [e for e in sim.exchanges if e.initiated and e.time > start]
        assert all(e.peer.index < REACHABLE for e in mine)  # nobody dialed an outbound node
        for node in sim.nodes:
            committed = [e for e in mine if e.node is node and e.result is Result.COMMITTED]
            assert len(committed) >= 40, (node, len(committed))  # a round every ~2.5 s
        assert sim.spread() < 1e-3 * spread0


async def test_a_crashed_outbound_node_times_out_and_a_stopped_one_leaves(autojump_clock):
    async with open_sim_swarm(4, seed=5, config=QUIET, nat=[2, 3], latency=0.01) as sim:
        with trio.fail_after(60):
            await sim.wait_until(lambda: views_agree(sim, 2))
        crashed, stopped = sim.nodes[2], sim.nodes[3]
        sim.crash(crashed)
        await sim.stop(stopped)
        with trio.fail_after(10):  # a Left travels at once
            await sim.wait_until(lambda: all(
                o.node.roster.get(stopped.peer_id).state == State.LEFT for o in sim.nodes[:2]))
        # The crashed one announces nothing more: 3 meta_intervals, then a suspicion.
        with trio.fail_after(4 * 30 + 60):
            await sim.wait_until(lambda: all(
                o.node.roster.get(crashed.peer_id).state == State.DEAD for o in sim.nodes[:2]))


async def test_a_firewalled_node_that_refuses_finds_itself_unreachable(autojump_clock):
    async with open_sim_swarm(3, seed=7, config=dataclasses.replace(QUIET, reachable=None)) as sim:
        with trio.fail_after(60):
            await sim.wait_until(lambda: views_agree(sim, 3))
        # A node that restarts behind a firewall that refuses: its check fails at once.
        await sim.stop(sim.nodes[2])
        sim.nat(sim.nodes[2], refuse=True)
        await sim.restart(sim.nodes[2])
        with trio.fail_after(60):
            await sim.wait_until(lambda: sim.nodes[2].node is not None
                                 and sim.nodes[2].node.roster.reachability.checked)
        assert not sim.nodes[2].node.roster.me.reachable
        # Once the port is opened, the next check (every RECHECK seconds) finds it reachable.
        sim.unnat(sim.nodes[2])
        with trio.fail_after(700):
            await sim.wait_until(lambda: views_agree(sim, 3))


async def test_nodes_started_together_with_auto_find_each_other_reachable(autojump_clock):
    # A StatefulSet or a compose file: every node has the same bootstrap list, itself
    # included, and starts announcing itself unreachable. Asking only reachable members
    # would leave them all outbound-only for ever, with nobody to exchange with; and a node
    # found reachable must tell someone, as nobody gossips to a member held unreachable.
    net = SimNetwork(11)
    addresses = [f"n{i}:7000" for i in range(3)]
    async with trio.open_nursery() as nursery:
        nodes = []
        for i, address in enumerate(addresses):
            nodes.append(await nursery.start(_run_node, net.host(f"n{i}"), address, addresses))
        with trio.fail_after(120):
            while not all(n.roster.me.reachable and len(n.roster.alive(reachable=True)) == 2
                          for n in nodes):
                await _any_change(nodes)
        nursery.cancel_scope.cancel()


async def _any_change(nodes) -> None:
    async with trio.open_nursery() as nursery:
        async def one(node) -> None:
            await node.roster.wait_changed()
            nursery.cancel_scope.cancel()
        for node in nodes:
            nursery.start_soon(one, node)


async def _run_node(network, address, bootstrap, *, task_status):
    config = dataclasses.replace(QUIET, listen=address, bootstrap=bootstrap, reachable=None)
    async with open_swarm(torch.nn.Linear(2, 2), SWARM, config, network=network,
                          rng=random.Random(address)) as node:
        task_status.started(node)
        await trio.sleep_forever()
