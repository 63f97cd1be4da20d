"""Membership of whole swarms: rosters on a SimNetwork under MockClock (autojump).

Bounds are in protocol periods (``probe_interval`` = 1 virtual second with the LAN profile)
and are enforced with ``trio.fail_after`` in virtual time; conditions are re-checked after
every membership change any node sees. Every transition every node saw is in
``swarm.history``, so "never marked dead" is checked over the whole run, not at the end.
"""

from __future__ import annotations

import math

import pytest
import trio
from trio.testing import MockClock

from gossip.config import MembershipConfig
from gossip.membership import State
from gossip.suspicion import suspicion_bounds
from tests.sim.swarm import SimNode, SimSwarm, open_sim_swarm

CONFIG = MembershipConfig()
NODES_FOR_AN_HOUR = 32  # in the hour of loss and a slow node
PERIOD = CONFIG.probe_interval


def everyone_alive(swarm: SimSwarm) -> bool:
    running = swarm.running()
    return all(
        len(swarm.view(n)) >= len(running) - 1 for n in running
    ) and swarm.all_see(running, State.ALIVE)


def false_deaths(swarm: SimSwarm, gone: list[SimNode] = ()) -> list:  # type: ignore[assignment]
    """Every time some node saw a member that was never crashed go DEAD."""
    gone_peers = {n.peer for n in gone}
    return [s for s in swarm.history
            if s.member.state == State.DEAD and s.member.peer not in gone_peers]


async def test_64_nodes_join_through_one_bootstrap(autojump_clock: MockClock) -> None:
    async with open_sim_swarm(64, latency=0.005) as swarm:
        start = trio.current_time()
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        print(f"64 nodes converged in {(trio.current_time() - start) / PERIOD:.1f} periods")
        assert all(len(swarm.view(n)) == 63 for n in swarm.nodes)
        assert not false_deaths(swarm)


async def test_crash_5_of_64_is_detected_by_every_survivor(autojump_clock: MockClock) -> None:
    # Detection = waiting for some survivor's probe to reach the crashed node (each of the 59
    # probes it once per round of 63 periods, so about one probe per period arrives and the
    # wait is exponential), one period for that probe to fail, the suspicion's minimum once
    # confirmed, then the verdict's spread. Typically 9-12 periods for the worst of the five;
    # the 15 is about the 99th percentile of that worst (bench/membership.py gives
    # the distribution), so as a hard bound the first probe may take up to 12 periods
    # (P(all five later) < 1e-4), and the rest must follow within the minimum plus two.
    async with open_sim_swarm(64, seed=2, latency=0.005) as swarm:
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        await trio.sleep(5 * PERIOD)  # let the join's gossip settle: a steady swarm
        crashed = swarm.nodes[10:15]
        survivors = [n for n in swarm.nodes if n not in crashed]
        minimum, _ = suspicion_bounds(len(survivors), PERIOD, CONFIG.suspicion_mult,
                                      CONFIG.suspicion_max_mult)
        start = trio.current_time()
        for node in crashed:
            swarm.crash(node)
        with trio.fail_after((12 + 1) * PERIOD + minimum + 2 * PERIOD):
            await swarm.wait_until(lambda: swarm.all_see(crashed, State.DEAD, survivors))
        print(f"5 of 64 detected by all in {(trio.current_time() - start) / PERIOD:.1f} periods")
        for node in crashed:
            first_suspected = min(s.time for s in swarm.marked_down(node.peer, (State.SUSPECT,)))
            last_dead = max(s.time for s in swarm.marked_down(node.peer))
            assert last_dead - first_suspected <= minimum + 2 * PERIOD
        assert not false_deaths(swarm, crashed)
        assert all(swarm.view(n)[m.peer] == State.ALIVE for n in survivors for m in survivors
                   if m is not n)


@pytest.mark.timeout(1800)  # 115k probes: 1.5 minutes on 2 quiet cores, 9 at load 8
async def test_no_false_death_under_loss_and_a_slow_node_for_an_hour(
    autojump_clock: MockClock,
) -> None:
    # 5% of datagrams lost everywhere, and one node whose event loop is ten times slower
    # than the network: every message it sends or receives waits an extra 0.25 s on average
    # (exponential), ten times the 25 ms link latency, so its round trips often miss the
    # 0.5 s probe timeout and it is suspected, and suspects others, again and again.
    # 32 nodes (not more: each adds 3,600 probes, about 3 s of CI's time budget); fewer
    # members also mean shorter suspicion timeouts (log N), so the slow node is judged faster.
    async with open_sim_swarm(NODES_FOR_AN_HOUR, seed=3, latency=0.025, loss=0.05) as swarm:
        with trio.fail_after(30 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        slow = swarm.nodes[7]
        swarm.net.slow(slow.name, 0.25)
        await trio.sleep(3600)
        assert not false_deaths(swarm)
        # Whole at the end: everyone up in everyone's eyes (some may be suspect this instant).
        for node in swarm.nodes:
            view = swarm.view(node)
            assert len(view) == NODES_FOR_AN_HOUR - 1 and all(s in (State.ALIVE, State.SUSPECT) for s in view.values())
        # The run did exercise the failure detector: the slow node was suspected and refuted
        # many times, and every suspicion was settled by a refutation, not by a verdict.
        stats = slow.roster.statistics()
        suspected = [s for s in swarm.history if s.member.state == State.SUSPECT]
        assert stats.refutations >= 50
        print(f"suspicions seen={len(suspected)} slow node refutations={stats.refutations} "
              f"awareness={stats.awareness}")


async def test_partitioned_halves_find_each_other_after_heal(autojump_clock: MockClock) -> None:
    async with open_sim_swarm(16, seed=4, latency=0.005) as swarm:
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        left, right = swarm.nodes[:8], swarm.nodes[8:]
        swarm.net.partition([n.name for n in left], [n.name for n in right])
        # Each half gives up on the other within: a full probe cycle (every node probes each
        # of its 15 members once per cycle, so someone probes each member of the other half
        # within 15 periods), one period for that probe to fail, up to two for the first
        # verification to go unanswered, and the suspicion timeout with that one confirmation
        # of the suspector's own (others' confirmations only shorten it).
        low, high = suspicion_bounds(16, PERIOD, CONFIG.suspicion_mult, CONFIG.suspicion_max_mult)
        expected = int(CONFIG.suspicion_mult) - 2
        one = high - (high - low) * math.log(2) / math.log(expected + 1)
        with trio.fail_after(15 * PERIOD + PERIOD + 2 * PERIOD + one):
            await swarm.wait_until(lambda: swarm.all_see(right, State.DEAD, left)
                                   and swarm.all_see(left, State.DEAD, right))
        # ... and on nobody in its own half.
        assert swarm.all_see(left, State.ALIVE, left) and swarm.all_see(right, State.ALIVE, right)
        swarm.net.heal()
        start = trio.current_time()
        with trio.fail_after(20 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        print(f"healed in {(trio.current_time() - start) / PERIOD:.1f} periods")


async def test_a_leave_reaches_everyone_in_log_n_periods(autojump_clock: MockClock) -> None:
    async with open_sim_swarm(64, seed=5, latency=0.005) as swarm:
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        await trio.sleep(5 * PERIOD)
        leaver = swarm.nodes[20]
        others = [n for n in swarm.nodes if n is not leaver]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(swarm.stop, leaver)
            with trio.fail_after(math.log2(64) * PERIOD):
                await swarm.wait_until(lambda: swarm.all_see([leaver], State.LEFT, others))
        print(f"leave seen by all in {(trio.current_time() - start) / PERIOD:.1f} periods")
        # Nobody took the departure for a failure.
        assert not swarm.marked_down(leaver.peer, (State.DEAD,))


async def test_a_restarted_node_is_alive_again(autojump_clock: MockClock) -> None:
    async with open_sim_swarm(16, seed=6, latency=0.005) as swarm:
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        crashed, left = swarm.nodes[3], swarm.nodes[4]
        others = [n for n in swarm.nodes if n not in (crashed, left)]
        swarm.crash(crashed)
        await swarm.stop(left)
        with trio.fail_after(20 * PERIOD):
            await swarm.wait_until(lambda: swarm.all_see([crashed], State.DEAD, others)
                                   and swarm.all_see([left], State.LEFT, others))
        old = {n.peer: swarm.view(others[0])[n.peer] for n in (crashed, left)}
        incarnations = {m.peer: m.incarnation for m in others[0].roster.members()}
        # Same identities, new processes: they start at incarnation 0, hear of their old
        # selves from the bootstrap node, and out-announce them.
        await swarm.restart(crashed, [swarm.nodes[0].address])
        await swarm.restart(left, [swarm.nodes[1].address])
        with trio.fail_after(10 * PERIOD):
            await swarm.wait_until(lambda: everyone_alive(swarm))
        for node in (crashed, left):
            assert node.roster.me.incarnation > incarnations[node.peer]
        assert old == {crashed.peer: State.DEAD, left.peer: State.LEFT}
        assert not false_deaths(swarm, [crashed])
