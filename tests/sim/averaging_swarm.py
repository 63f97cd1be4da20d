"""Swarms of averaging nodes on one SimNetwork, for the averaging tests.

Each node is :func:`gossip.node.open_swarm` on its own simulated host, run in the test's
nursery. Every membership change any node sees, and every exchange that ends anywhere, wakes
:meth:`AveragingSwarm.wait_until`, so tests wait on conditions ("everyone sees everyone
ready", "the responder has committed"), never by sleeping or polling. Rounds are driven by
the test (``every=None, interval=None``): :meth:`AveragingSwarm.round` has every given node
call ``average_now()`` at the same virtual instant, then add what each committed.
"""

from __future__ import annotations

import dataclasses
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Collection, Sequence

import torch
import trio

from gossip.averaging import Result
from gossip.config import AveragingConfig, MembershipConfig, NodeConfig, Timeouts
from gossip.errors import PeerGone
from gossip.identity import Identity
from gossip.node import SwarmNode, open_swarm
from gossip.testing.simnet import SimNetwork
from gossip.tensors import StateSchema, snapshot
from tests.util import SWARM, Signal

PORT = 7000
# Rounds only when the test asks, and every member trusted at once (trust_after=0): these
# tests are about exchanges and the swarm's arithmetic; the newcomer rule has its own.
# Plain averaging (no outer step): what these swarms pin is the exchange's arithmetic, which
# keeps the swarm's mean exactly; the outer step's consensus has its own test.
ROUNDS = AveragingConfig(every=None, interval=None, trust_after=0.0, outer=False)


class Flat(torch.nn.Module):
    """A model that is one flat float32 parameter vector."""

    def __init__(self, values: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(values.detach().to(torch.float32).clone())


def constant(n: int, value: float) -> Flat:
    """A vector whose ``n`` elements all equal ``value``: an exchange that applied part of a
    payload (or a delta built from part of one) would leave it non-constant."""
    return Flat(torch.full((n,), value, dtype=torch.float32))


def state(model: torch.nn.Module) -> torch.Tensor:
    """The model's state as one flat float32 tensor (a copy)."""
    return snapshot(model, StateSchema.from_module(model))


@dataclass(eq=False)
class Peer:
    """One node of the swarm as the test sees it."""

    name: str
    model: torch.nn.Module
    identity: Identity
    node: SwarmNode | None = None
    applied: int = 0  # deltas added to the model through apply()

    @property
    def address(self) -> str:
        return f"{self.name}:{PORT}"

    @property
    def swarm_node(self) -> SwarmNode:
        assert self.node is not None, f"{self.name} is not running"
        return self.node

    def apply(self) -> int:
        """Add the deltas queued so far; returns how many."""
        count = self.swarm_node.apply_pending()
        self.applied += count
        return count


class AveragingSwarm:
    def __init__(self, net: SimNetwork, nursery: trio.Nursery, seed: int,
                 membership: MembershipConfig, timeouts: Timeouts) -> None:
        self.net = net
        self.peers: list[Peer] = []
        self._nursery = nursery
        self._seed = seed
        self._membership = membership
        self._timeouts = timeouts
        self._changed = Signal()
        self.committed_rounds = 0  # rounds run through average() that ended COMMITTED

    # ---- nodes ------------------------------------------------------------------------

    async def start(self, model: torch.nn.Module, *, name: str | None = None,
                    bootstrap: Sequence[Peer] = (), config: AveragingConfig = ROUNDS,
                    membership: MembershipConfig | None = None,
                    allow: Collection[str] | None = None, **objects: Any) -> Peer:
        """Run a node on host ``name`` in the background; returns once it is open (not
        necessarily ready: see :meth:`SwarmNode.wait_ready`). ``config`` is its averaging
        settings, ``membership`` (default: the swarm's) and ``allow`` go into its
        :class:`NodeConfig` too; ``objects`` go to :func:`open_swarm` (``counters``,
        ``task``)."""
        peer = Peer(name or f"n{len(self.peers)}", model, Identity.generate())
        self.peers.append(peer)
        node_config = NodeConfig(listen=peer.address, bootstrap=[p.address for p in bootstrap],
                                 allow=allow, averaging=config,
                                 membership=membership or self._membership,
                                 timeouts=self._timeouts)
        await self._nursery.start(self._run, peer, node_config, objects)
        return peer

    async def restart(self, peer: Peer, *, bootstrap: Sequence[Peer],
                      config: AveragingConfig = ROUNDS) -> None:
        """Bring a crashed node back on its host, with its identity and its model as they
        are: a new run, whose incarnation starts at 0 again."""
        self.net.restart(peer.name)
        node_config = NodeConfig(listen=peer.address, bootstrap=[p.address for p in bootstrap],
                                 averaging=config, membership=self._membership,
                                 timeouts=self._timeouts)
        await self._nursery.start(self._run, peer, node_config, {})

    async def _run(self, peer: Peer, config: NodeConfig, objects: dict[str, Any], *,
                   task_status) -> None:
        rng = random.Random(f"{self._seed}:{peer.name}")
        try:
            async with open_swarm(
                peer.model, SWARM, config, network=self.net.host(peer.name),
                identity=peer.identity, rng=rng, on_change=self._changed.fire,
                on_exchange=self._changed.fire, **objects,
            ) as node:
                peer.node = node
                task_status.started()
                await trio.sleep_forever()
        except PeerGone:
            pass  # its host crashed under it
        finally:
            peer.node = None
            self._changed.fire()  # a node that stopped is a change tests wait on

    def crash(self, peer: Peer) -> None:
        """Kill the node's host (no goodbye): its node fails with PeerGone and stops."""
        self.net.crash(peer.name)

    # ---- observing --------------------------------------------------------------------

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds; checked after every membership change and every
        exchange that ends, at any node."""
        await self._changed.wait_until(condition)

    def running(self) -> list[Peer]:
        return [p for p in self.peers if p.node is not None]

    def sees_ready(self, observers: Sequence[Peer] | None = None,
                   peers: Sequence[Peer] | None = None) -> bool:
        """Every observer is ready and sees every one of ``peers`` (but itself) alive and
        ready (default: every running node, both ways)."""
        running = self.running()
        observers = running if observers is None else observers
        peers = running if peers is None else peers
        for observer in observers:
            if observer.node is None or not observer.node.ready:
                return False
            seen = {m.peer for m in observer.node.roster.alive(ready=True)}
            if any(p.identity.peer_id not in seen for p in peers if p is not observer):
                return False
        return True

    # ---- averaging --------------------------------------------------------------------

    async def average(self, peer: Peer) -> Result:
        """``peer`` runs one round now; its result is counted for :meth:`settle`."""
        result = await peer.swarm_node.average_now()
        self.committed_rounds += result is Result.COMMITTED
        return result

    async def settle(self) -> None:
        """Return once every exchange committed by a round run through :meth:`average` has
        committed at its responder too (the caller bounds the wait). Without faults: with
        them an exchange may commit at one end only, and this could wait forever.

        An initiator returns on the responder's Commit, which may arrive a little before
        the responder reads ours: until then the responder's delta is not queued."""
        await self.wait_until(lambda: sum(p.swarm_node.statistics().committed
                                          for p in self.running()) == 2 * self.committed_rounds)

    async def round(self, peers: Sequence[Peer] | None = None,
                    during: Callable[[], Awaitable[object]] | None = None) -> list[Result]:
        """Every one of ``peers`` (default: all running) runs a round at the same instant;
        once all have returned (and, without ``during``, once the swarm has settled), every
        running node adds what it committed. ``during``, if given, is an async function run
        alongside (faults), cancelled once the rounds have returned; the settling is then
        skipped, and a responder's late delta is added after a later round.

        Returns:
            Each peer's round result, in order.
        """
        peers = self.running() if peers is None else list(peers)
        results: list[Result | None] = [None] * len(peers)

        async def one(i: int) -> None:
            results[i] = await self.average(peers[i])

        async with trio.open_nursery() as outer:
            if during is not None:
                outer.start_soon(during)
            async with trio.open_nursery() as nursery:
                for i in range(len(peers)):
                    nursery.start_soon(one, i)
            outer.cancel_scope.cancel()
        if during is None:
            await self.settle()
        for peer in self.running():
            peer.apply()
        return [r for r in results if r is not None]


@asynccontextmanager
async def open_averaging_swarm(
    *,
    seed: int = 1,
    membership: MembershipConfig = MembershipConfig(),
    timeouts: Timeouts = Timeouts(),
    **net_options: float,
) -> AsyncIterator[AveragingSwarm]:
    """An empty swarm on a fresh SimNetwork; add nodes with :meth:`AveragingSwarm.start`."""
    net = SimNetwork(seed=seed, **net_options)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        yield AveragingSwarm(net, nursery, seed, membership, timeouts)
        nursery.cancel_scope.cancel()


async def start_all(swarm: AveragingSwarm, models: Sequence[torch.nn.Module], *,
                    config: AveragingConfig = ROUNDS) -> list[Peer]:
    """Start a node per model, each from its own state (``start="own"``), all joining
    through the first; returns once every node sees every other alive and ready."""
    own = dataclasses.replace(config, start="own")
    first = await swarm.start(models[0], config=own)
    peers = [first] + [await swarm.start(m, bootstrap=[first], config=own) for m in models[1:]]
    await swarm.wait_until(lambda: swarm.sees_ready(peers, peers))
    return peers
