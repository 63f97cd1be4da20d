"""A swarm of rosters on one SimNetwork, for the membership tests and benchmark.

Each node runs :func:`gossip.roster.open_roster` on its own simulated host inside the test's
nursery. Every membership change any node sees is recorded in ``history`` (from the roster's
``on_change`` hook), so a test can assert on every transition, not only on the end state,
and waits on conditions through :meth:`SimSwarm.wait_until`, never by sleeping.
"""

from __future__ import annotations

import random
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import trio

from gossip.config import MembershipConfig, NodeConfig
from gossip.errors import PeerGone
from gossip.handshake import Swarm
from gossip.identity import Identity, PeerId
from gossip.membership import Member, State
from gossip.roster import Roster, open_roster
from gossip.testing.simnet import SimNetwork
from tests.util import SWARM

PORT = 7000


@dataclass(frozen=True)
class Seen:
    """One change as one node saw it."""

    time: float
    observer: PeerId
    member: Member


@dataclass(eq=False)
class SimNode:
    name: str
    identity: Identity
    address: str
    roster: Roster | None = None
    scope: trio.CancelScope | None = None
    done: trio.Event = field(default_factory=trio.Event)

    def __post_init__(self) -> None:
        self.peer: PeerId = self.identity.peer_id


class SimSwarm:
    def __init__(self, net: SimNetwork, nursery: trio.Nursery, config: MembershipConfig,
                 seed: int) -> None:
        self.net = net
        self.config = config
        self.nodes: list[SimNode] = []
        self.history: list[Seen] = []
        self._nursery = nursery
        self._seed = seed
        self._changed = trio.Event()

    # ---- nodes ------------------------------------------------------------------------

    def add(self, name: str | None = None, identity: Identity | None = None) -> SimNode:
        name = name or f"n{len(self.nodes)}"
        node = SimNode(name, identity or Identity.generate(), f"{name}:{PORT}")
        self.nodes.append(node)
        return node

    async def start(self, node: SimNode, bootstrap: list[str]) -> None:
        """Run ``node`` in the background; returns once its roster is open."""
        node.done = trio.Event()
        await self._nursery.start(self._run, node, bootstrap)

    def swarm_of(self, node: SimNode) -> Swarm:
        """The swarm name and key ``node`` runs with (the same for every node here)."""
        return SWARM

    async def _run(self, node: SimNode, bootstrap: list[str], *, task_status) -> None:
        rng = random.Random(f"{self._seed}:{node.name}:{len(self.history)}")
        try:
            with trio.CancelScope() as node.scope:
                async with open_roster(
                    self.net.host(node.name), node.identity, self.swarm_of(node),
                    NodeConfig(listen=node.address, bootstrap=bootstrap, membership=self.config),
                    rng=rng, on_change=lambda m: self._record(node, m),
                ) as roster:
                    node.roster = roster
                    task_status.started()
                    await trio.sleep_forever()
        except PeerGone:
            pass  # its host crashed under it: what a crash test asks for
        finally:
            node.roster = None
            node.done.set()

    def crash(self, node: SimNode) -> None:
        """Kill the node's host: no goodbye, its sockets die."""
        self.net.crash(node.name)

    async def stop(self, node: SimNode) -> None:
        """Shut the node down gracefully (it announces that it leaves); wait until it is."""
        assert node.scope is not None
        node.scope.cancel()
        await node.done.wait()

    async def restart(self, node: SimNode, bootstrap: list[str]) -> None:
        """Bring a crashed or stopped node back with the same identity."""
        await node.done.wait()
        self.net.restart(node.name)
        await self.start(node, bootstrap)

    # ---- observing --------------------------------------------------------------------

    def _record(self, node: SimNode, member: Member) -> None:
        self.history.append(Seen(trio.current_time(), node.peer, member))
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds; it is checked after every membership change."""
        while not condition():
            await self._changed.wait()

    def running(self) -> list[SimNode]:
        return [n for n in self.nodes if n.roster is not None]

    def view(self, node: SimNode) -> dict[PeerId, State]:
        assert node.roster is not None
        return {m.peer: m.state for m in node.roster.members()}

    def all_see(self, peers: list[SimNode], state: State, observers: list[SimNode] | None = None) -> bool:
        """Every running observer sees every one of ``peers`` (other than itself) in ``state``."""
        for observer in observers if observers is not None else self.running():
            view = self.view(observer)
            if any(view.get(p.peer) != state for p in peers if p is not observer):
                return False
        return True

    def marked_down(self, peer: PeerId, states=(State.DEAD,)) -> list[Seen]:
        """Every time some node saw ``peer`` go to one of ``states``."""
        return [s for s in self.history if s.member.peer == peer and s.member.state in states]


@asynccontextmanager
async def open_sim_swarm(
    n: int,
    *,
    seed: int = 1,
    config: MembershipConfig = MembershipConfig(),
    bootstrap_index: int | None = 0,
    **net_options: float,
) -> AsyncIterator[SimSwarm]:
    """``n`` nodes on a fresh SimNetwork; all but the bootstrap node join through it.
    Returns once every roster is open (not yet converged)."""
    net = SimNetwork(seed=seed, **net_options)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        swarm = SimSwarm(net, nursery, config, seed)
        nodes = [swarm.add() for _ in range(n)]
        if bootstrap_index is not None:
            first = nodes[bootstrap_index]
            await swarm.start(first, [])
            for node in nodes:
                if node is not first:
                    await swarm.start(node, [first.address])
        yield swarm
        nursery.cancel_scope.cancel()
