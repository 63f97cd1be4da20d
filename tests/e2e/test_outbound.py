"""Real sockets: a node that nobody can dial finds it out, and averages anyway.

Three in-process nodes on 127.0.0.1 (real TCP and UDP, real clock). Node ``u`` advertises the
address of a fault proxy that black-holes everything (TCP connections held, datagrams
dropped), as a NAT with no port forwarded does, while its own dials and datagrams leave from
its real socket and the answers to its datagrams come back to that socket, as they would
through a NAT. It runs with ``reachable=None``: the dial-back check must find it
unreachable, the others must never dial it or send it a datagram unasked, and it must still
commit exchanges it starts, and stay alive on its heartbeats. About 5 seconds.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import trio

from gossip import AveragingConfig, MembershipConfig, Result, State, open_swarm
from gossip.config import NodeConfig, Timeouts
from gossip.identity import Identity
from gossip.network import TcpNetwork
from gossip.testing import open_fault_proxy
from tests.util import SWARM

pytestmark = pytest.mark.slow

FAST = MembershipConfig(probe_interval=0.2, probe_timeout=0.1, gossip_interval=0.05,
                        meta_interval=0.5, push_pull_interval=2.0, reconnect_interval=1.0,
                        push_pull_timeout=3.0, leave_timeout=0.2)
TIMEOUTS = Timeouts(connect=0.5, handshake=0.5)
AVERAGING = AveragingConfig(every=None, interval=0.2, start="own")


async def test_an_unreachable_node_finds_out_and_averages_through_its_own_offers() -> None:
    exchanges: list[tuple[str, object]] = []
    seen_u: list[tuple[str, State]] = []  # every change of u's record at a and b
    ended = [trio.Event()]

    def record(name: str, exchange) -> None:
        exchanges.append((name, exchange))
        ended[0].set()
        ended[0] = trio.Event()

    async with contextlib.AsyncExitStack() as stack:
        proxy = await stack.enter_async_context(open_fault_proxy("127.0.0.1:0", "127.0.0.1:9"))
        proxy.block("127.0.0.1")  # everything sent to u's advertised address vanishes

        u_id = Identity.generate()

        def changed(name: str, member) -> None:
            if member.peer == u_id.peer_id:
                seen_u.append((name, member.state))

        def node(name: str, identity: Identity | None = None, **settings):
            config = NodeConfig(listen="127.0.0.1:0", averaging=AVERAGING, membership=FAST,
                                timeouts=TIMEOUTS, **settings)
            return open_swarm(torch.nn.Linear(4, 4), SWARM, config,
                              network=TcpNetwork("127.0.0.1"), identity=identity,
                              on_exchange=lambda e: record(name, e),
                              on_change=lambda m: changed(name, m))

        a = await stack.enter_async_context(node("a"))
        b = await stack.enter_async_context(node("b", bootstrap=[a.address], reachable=None))
        u = await stack.enter_async_context(node("u", u_id, bootstrap=[a.address], reachable=None,
                                                 advertise=proxy.address))
        with trio.fail_after(20):
            while not (u.roster.reachability.checked and b.roster.reachability.checked):
                await u.roster.wait_changed()
        assert b.roster.me.reachable and b.roster.reachability.detail.startswith("dialed back")
        assert not u.roster.me.reachable, u.roster.reachability
        assert "could not dial us: no channel to" in u.roster.reachability.detail
        connections = proxy.statistics().connections_accepted  # the dial-back, and no more
        assert connections >= 1

        def committed_by_u() -> int:
            return sum(1 for name, e in exchanges
                       if name == "u" and e.initiated and e.result is Result.COMMITTED)

        with trio.fail_after(20):
            while committed_by_u() < 10:
                await ended[0].wait()
        # Several heartbeat timeouts (3 x meta_interval) have passed: nobody suspected u.
        for observer in (a, b):
            member = observer.roster.get(u.peer_id)
            assert member is not None and member.state == State.ALIVE and not member.reachable
        assert seen_u and all(state == State.ALIVE for _, state in seen_u), seen_u
        assert not any(e.peer == u.peer_id for name, e in exchanges if e.initiated and name != "u")
        stats = proxy.statistics()
        assert stats.connections_accepted == connections  # nobody dialed u again
        assert stats.datagrams_dropped == 0 and stats.datagrams_forwarded == 0  # nor sent to it
