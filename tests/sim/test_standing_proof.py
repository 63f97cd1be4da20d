"""Standing is earned by the identity itself, and what members may do is budgeted by host.

A key holder announces its own record and 50 invented members (outbound-only, so nobody dials
them) in one push-pull to an honest node of a pair, over a SimNetwork under MockClock
(autojump). Before standing needed a proof, all 52 were listed at once and, ``trust_after``
later, every invented identity's offer was a member's: its state moved the node, and its
correction's estimate was swapped. Now standing counts from the identity's first channel with
the node: an offer ``trust_after`` after the announcement is a newcomer's (it commits, and
moves the node by nothing), and so is every offer until ``trust_after`` after that first one.
Once they do stand, the identities behind the key holder's one address share one host's
budget of members' offers: hammered with offers from all of them, the node takes about twice
as many as its one honest peer brings it, and answers the rest busy.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from typing import Callable

import torch
import trio
from trio.testing import MockClock

from gossip.averaging import Exchange, Result
from gossip.config import AveragingConfig, NodeConfig
from gossip.errors import GossipError
from gossip.handshake import PROTOCOL_VERSION
from gossip.identity import Identity
from gossip.messages import MemberState
from gossip.node import SwarmNode, open_swarm
from gossip.testing.simnet import SimNetwork
from gossip.standing import MEMBER_BURST, MEMBER_SHARE, by_host
from gossip.testing.hostile import HostilePeer, Reaction
from gossip.claims import alive_row, sign_alive
from tests.util import SWARM, Signal

INVENTED = 50
TRIED = 10  # invented identities that offer
INTERVAL = 1.0  # s between the honest nodes' rounds (x U(0.75, 1.25), after the last ends)
HAMMER = 20.0  # s of offers from every standing identity at once


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def record(identity: Identity, address: str, *, reachable: bool) -> MemberState:
    return alive_row(sign_alive(identity, 1, address, PROTOCOL_VERSION, 0, True,
                                reachable=reachable))


async def pair(stack: AsyncExitStack, net: SimNetwork,
               on_exchange: Callable[[Exchange], None]) -> list[SwarmNode]:
    """Two honest nodes; the first reports its exchanges to ``on_exchange``."""
    config = AveragingConfig(every=None, interval=INTERVAL, start="own")
    nodes: list[SwarmNode] = []
    for i in range(2):
        nodes.append(await stack.enter_async_context(open_swarm(
            model(i), SWARM, NodeConfig(listen=f"n{i}:7000", averaging=config,
                                        bootstrap=[nodes[0].address] if nodes else []),
            network=net.host(f"n{i}"), rng=random.Random(i),
            on_exchange=None if nodes else on_exchange)))
    with trio.fail_after(60):
        for node in nodes:
            await node.wait_ready()
        while len(nodes[0].roster.alive(ready=True)) < 1:
            await nodes[0].roster.wait_changed()
    return nodes


async def test_identities_heard_in_gossip_stand_only_after_proving_themselves(
        autojump_clock: MockClock) -> None:
    net = SimNetwork(seed=3, latency=0.005)
    answered: list[str] = []  # the peers of the target's committed answers, in order
    ended = Signal()

    def on_exchange(exchange: Exchange) -> None:
        if not exchange.initiated and exchange.result is Result.COMMITTED:
            answered.append(exchange.peer)
        ended.fire()

    def settled(identities: list[Identity], count: int) -> bool:
        """The target has tallied ``count`` commits with ``identities`` in all."""
        peers = {identity.peer_id for identity in identities}
        return sum(peer in peers for peer in answered) >= count

    async with AsyncExitStack() as stack:
        target, _ = await pair(stack, net, on_exchange)
        trust_after = AveragingConfig().trust_after
        hostile = HostilePeer(SWARM, target.replica.schema, network=net.host("attacker"),
                              rng=random.Random(7), patience=10.0)
        invented = [Identity.generate() for _ in range(INVENTED)]
        table = [record(hostile.identity, "attacker:7000", reachable=True)] + [
            record(identity, f"attacker:{7001 + i}", reachable=False)
            for i, identity in enumerate(invented)]
        await hostile.push_pull(target.address, table)
        assert len(target.roster.alive()) == 2 + INVENTED  # listed at once: gossip is a claim
        assert not target.roster.alive(proven=True, reachable=False)  # none has proved itself

        await trio.sleep(trust_after + 1.5)  # members of our table for longer than trust_after
        before = target.statistics()
        for identity in invented[:TRIED]:
            hostile.identity = identity
            outcome = await hostile.send_noise(target.address, 0.5)
            assert outcome.reaction is Reaction.ACCEPTED, outcome
        with trio.fail_after(10):
            await ended.wait_until(lambda: settled(invented, TRIED))
        after = target.statistics()
        # Every one of them a newcomer's: committed, and moved the node by nothing.
        assert after.newcomers - before.newcomers == TRIED
        assert len(target.roster.alive(proven=True, reachable=False)) == TRIED

        # trust_after after their first channel they stand; all ten offer as fast as they
        # are answered, for HAMMER seconds.
        await trio.sleep(trust_after + 1.0)
        before = target.statistics()
        taken = busy = 0
        deadline = trio.current_time() + HAMMER

        async def offer(identity: Identity) -> None:
            nonlocal taken, busy
            peer = HostilePeer(SWARM, target.replica.schema, network=net.host("attacker"),
                               identity=identity, rng=random.Random(str(identity.peer_id)),
                               patience=10.0, busy_tries=1)
            while trio.current_time() < deadline:
                try:
                    outcome = await peer.send_noise(target.address, 0.5)
                except GossipError:  # over the address's limit of handshakes at once
                    continue
                finally:
                    await trio.sleep(0.05)
                taken += outcome.reaction is Reaction.ACCEPTED
                busy += outcome.reaction is Reaction.BUSY

        async with trio.open_nursery() as nursery:
            for identity in invented[:TRIED]:
                nursery.start_soon(offer, identity)
        with trio.fail_after(10):
            await ended.wait_until(lambda: settled(invented, TRIED + taken))
        after = target.statistics()
        members = taken - (after.newcomers - before.newcomers)
        # Each host earns MEMBER_SHARE over the hosts that take offers and proved themselves
        # (its honest peer: the attacker's own record, which answers no probe, is dead by
        # now) per round of the target's, at most one round per 0.75 x INTERVAL.
        hosts = len(by_host(target.roster.alive(ready=True, reachable=True, proven=True),
                            target.roster.proven_host))
        most = MEMBER_BURST + (HAMMER / (0.75 * INTERVAL) + 1) * MEMBER_SHARE / hosts
        print(f"\nmember offers taken {members} of {taken + busy} in {HAMMER:g} s, at most "
              f"{most:.0f} (busy {busy}, members_limited "
              f"{after.members_limited - before.members_limited})")
        assert after.newcomers == before.newcomers  # they do stand now
        assert hosts == 1 and 0 < members <= most
        assert after.members_limited - before.members_limited > 10 * members  # answered busy


async def test_a_proof_in_flight_is_waited_for_by_a_second_caller(
        autojump_clock: MockClock) -> None:
    # A joiner proves members for its download and for its shard choice at once. The second
    # caller used to skip the members whose proof the first had in flight (marked as not to
    # be tried again), counted them unproven, and a daemon took the shard of the node it was
    # downloading from.
    net = SimNetwork(seed=4, latency=0.05)
    config = AveragingConfig(every=None, interval=None, start="own")
    async with AsyncExitStack() as stack:
        nodes: list[SwarmNode] = []
        for i in range(3):
            nodes.append(await stack.enter_async_context(open_swarm(
                model(i), SWARM, NodeConfig(listen=f"n{i}:7000", averaging=config,
                                            bootstrap=[nodes[0].address] if nodes else []),
                network=net.host(f"n{i}"), rng=random.Random(i))))
        first, _, last = nodes
        with trio.fail_after(30):
            while len(first.roster.alive()) < 2 or len(last.roster.alive()) < 2:
                await last.roster.wait_changed()
        (other,) = [m for m in last.roster.alive() if m.peer == nodes[1].peer_id]
        def proven() -> bool:
            return other.peer in {m.peer for m in last.roster.alive(proven=True)}

        assert not proven()
        seen: list[bool] = []

        async def prove() -> None:
            await last.roster.prove([other])
            seen.append(proven())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(prove)
            await trio.sleep(0.01)  # the first caller's handshake is under way
            nursery.start_soon(prove)
        assert seen == [True, True]
