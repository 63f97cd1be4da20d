"""Swarms in one process on a virtual clock, for fault-injection tests: :func:`open_sim_swarm`.

Theory of operation
-------------------
:func:`open_sim_swarm` runs ``n`` nodes (:func:`gossip.open_swarm`), each on its own host of
one :class:`~gossip.testing.simnet.SimNetwork`, in a nursery it owns, and hands the test a
:class:`SimSwarm` that scripts faults in the words of the scenario: ``crash``, ``restart``,
``stop``, ``pause``, ``partition``, ``slow``, ``set_link``, ``nat``. Run it under
``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's ``autojump_clock``): every
delay is virtual, so a minute of swarm time costs only the CPU work done in it.

Nodes: node ``i`` is host ``n<i>``, listening on ``n<i>:7000``, with model ``model(i)`` and
an identity and rng derived from the seed. Node 0 starts the swarm, the others join through
it. With ``train``, each running node calls ``train(node)`` every ``step_time`` virtual
seconds once it is ready (compute is a virtual sleep: it runs inline, never in a thread),
then :meth:`SwarmNode.step`, which adds the deltas queued by exchanges. Without ``train`` a
node adds its deltas as each exchange ends.

Faults: ``crash`` first saves what a checkpoint written at that instant would hold (the
model's state, the counters, the optimizer's state; deltas not yet added are lost), then
crashes the host: no goodbye, sockets dead; ``crash(node, checkpoint=False)`` keeps the one
saved last instead (by ``checkpoint``, as a daemon saves one every ``checkpoint.interval``),
as a daemon killed between two of its checkpoints resumes the older one. ``restart`` brings
the node back from its checkpoint with the same identity, joining through the running nodes,
as a daemon resumes one: if they have trained past it, it takes one's state instead of the
checkpoint's weights (``averaging.start = "auto"`` for it, as for a joiner, unless ``config``
says ``"download"``; :mod:`gossip.node`, "Resuming"). ``stop`` is a graceful leave and
checkpoints too. ``pause`` freezes the host: its links carry nothing
(:meth:`SimNetwork.pause`) and its trainer waits, though its protocol timers still run, so on
``resume`` it has given up on everyone, as a process under SIGSTOP finds when continued. A
pause outlives a crash and composes with partitions. ``nat`` puts the host behind a NAT
(:meth:`SimNetwork.nat`): it dials out, nobody dials in. Everything else is the network's.

Each node's bookkeeping (:class:`SimNode`, the checkpoint a crash keeps, :class:`SimExchange`)
is in :mod:`gossip.testing.simnode`.

Joiners: the nodes named in ``late`` are not started with the others; ``join`` starts one
later, through the running nodes, and it downloads their state before it trains, as a
volunteer joining a swarm that has trained for a while does.

Waiting: every membership change any node sees, every exchange that ends anywhere, every
training step and every start or end of a node wakes :meth:`SimSwarm.wait_until`, which
re-checks its condition then; nothing polls on a timer. Bound waits with ``trio.fail_after``.

Reproducibility: every random choice comes from ``seed``: the network's draws, each node's
identity and rng, and :attr:`SimSwarm.rng` for the test's own choices, so the fault schedule
a test derives from ``sim.rng`` is the same on every run. The interleaving is not: trio runs
ready tasks in an unseeded order, so which of two offers wins a race, and so the exact
models, may differ between runs of one seed. Assertions must hold for every interleaving.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
import sys
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Collection, Iterable, Sequence, Union

import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ..averaging import Exchange
from ..config import NodeConfig
from ..errors import PeerGone
from ..groups import leaves, one_error
from ..handshake import Swarm
from ..identity import Identity, PeerId
from ..member import State
from ..node import SwarmNode, open_swarm
from ..replica import Counters
from .simnet import SimNetwork
from ..tensors import StateSchema, snapshot
from .simnode import SimExchange, SimNode, capture

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["open_sim_swarm", "SimSwarm", "SimNode", "SimExchange"]

NodeLike = Union[SimNode, int]  # a node, or its index


class _Signal:
    """Wakes every waiter once per :meth:`fire`, however many fires came in between."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self, *_: object) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():  # no checkpoint between the check and the wait: no lost wakeup
            await self._event.wait()


class SimSwarm:
    """A swarm on a simulated network; get one from :func:`open_sim_swarm`.

    Attributes:
        nodes: every node, running or down, by index.
        net: the :class:`~gossip.testing.simnet.SimNetwork`, for anything this class does not say.
        rng: seeded from ``seed``, for the test's own choices (which node to crash, when).
        exchanges: every exchange that ended at any node, in order.
    """

    def __init__(self, net: SimNetwork, nursery: trio.Nursery, seed: int, *,
                 config: NodeConfig, train: Callable[[SimNode], float] | None,
                 step_time: float) -> None:
        self.net = net
        self.rng = random.Random(f"{seed}:test")
        self.nodes: list[SimNode] = []
        self.exchanges: list[SimExchange] = []
        self._nursery = nursery
        self._seed = seed
        self._swarm = Swarm("sim", _digest(seed, "swarm key"))
        self._config = config
        self._train, self._step_time = train, step_time
        self._changed = _Signal()
        self._by_peer: dict[PeerId, SimNode] = {}

    # ---- nodes ------------------------------------------------------------------------

    def running(self) -> list[SimNode]:
        """The nodes that run now (paused ones included)."""
        return [n for n in self.nodes if n.running]

    def crash(self, node: NodeLike, *, checkpoint: bool = True) -> None:
        """Crash the node's host: no goodbye, every connection reset. The node's model and
        counters are saved first, as a checkpoint written at this instant would hold them;
        with ``checkpoint=False`` the one :meth:`checkpoint` saved last is what a restart
        resumes.

        Raises:
            ValueError: the node is not running, or (``checkpoint=False``) it has no
                checkpoint to resume.
        """
        node = self._running(node, "crash")
        assert node.node is not None
        if checkpoint:
            node._checkpoint = capture(node, node.node)
        elif node._checkpoint is None:
            raise ValueError(f"cannot crash {node.name} without a checkpoint: it has none "
                             f"(checkpoint it first)")
        node._down, node.node = "crashed", None
        self.net.crash(node.name)
        self._changed.fire()

    def checkpoint(self, node: NodeLike) -> None:
        """Save what a checkpoint of the node written now would hold (its model, counters,
        step count, optimizer state, drift correction and outer state; deltas not yet added
        are not in it), for a restart after a :meth:`crash` that keeps it.

        Raises:
            ValueError: the node is not running.
        """
        node = self._running(node, "checkpoint")
        assert node.node is not None
        node._checkpoint = capture(node, node.node)

    async def restart(self, node: NodeLike) -> None:
        """Bring a crashed or stopped node back with its identity, its model and counters
        as they were when it went down; it joins through the running nodes (none: it starts
        the swarm anew) and, if they have trained past its checkpoint, takes one's state
        before it trains, keeping its counters and drift correction (:mod:`gossip.node`,
        "Resuming"). Returns once it runs; :meth:`wait_ready` waits until it is back.

        Raises:
            ValueError: the node is running or already restarting.
        """
        node = self._node(node)
        if node._down not in ("crashed", "stopped"):
            raise ValueError(f"cannot restart {node.name}: it is "
                             f"{node._down or 'running'} (crash or stop it first)")
        node._down = "restarting"
        await node._done.wait()
        checkpoint = node._checkpoint
        assert checkpoint is not None
        with torch.no_grad():
            node.model.load_state_dict(checkpoint.state)
        if node.optimizer is not None and checkpoint.optimizer is not None:
            node.optimizer.load_state_dict(checkpoint.optimizer)
        node.steps = checkpoint.steps
        node.restarts += 1
        self.net.restart(node.name)
        await self._start(node, [n.address for n in self.running()], self._resuming(),
                          checkpoint.counters, checkpoint.correction, checkpoint.outer)

    async def join(self, node: NodeLike) -> None:
        """Start a node held back at the start (``open_sim_swarm``'s ``late``), a newcomer
        to the running nodes: it joins through them and, unless the swarm's config says
        otherwise (``averaging.start = "own"``), downloads the state of one of them before it
        trains. Returns once it runs; :meth:`wait_ready` waits until it is ready.

        Raises:
            ValueError: the node is not one held back, or has already joined.
        """
        node = self._node(node)
        if node._down != "late":
            raise ValueError(f"cannot join {node.name}: it is {node._down or 'running'} "
                             f"(only a node of late= joins)")
        node._down = "starting"
        await self._start(node, [n.address for n in self.running()], self._resuming(), None)

    async def stop(self, node: NodeLike) -> None:
        """Stop the node gracefully (it announces that it leaves); returns once it has.

        Raises:
            ValueError: the node is not running.
        """
        node = self._running(node, "stop")
        swarm_node, scope = node.node, node._scope
        assert swarm_node is not None and scope is not None
        node._down = "stopping"
        scope.cancel()
        await node._done.wait()
        swarm_node.apply_pending()  # a trainer on its way out adds what it was owed
        node._checkpoint = capture(node, swarm_node)
        node._down = "stopped"

    def pause(self, node: NodeLike) -> None:
        """Freeze the node's host until :meth:`resume`: nothing it sends or should receive
        moves (stream data held, datagrams lost, dials waiting), and it does not train.

        Raises:
            ValueError: the node is already paused.
        """
        node = self._node(node)
        if node.paused:
            raise ValueError(f"{node.name} is already paused")
        node._resumed = trio.Event()
        self.net.pause(node.name)
        self._changed.fire()

    def resume(self, node: NodeLike) -> None:
        """Unfreeze a paused node: held data moves again where no partition cuts it.

        Raises:
            ValueError: the node is not paused.
        """
        node = self._node(node)
        if node._resumed is None:
            raise ValueError(f"{node.name} is not paused")
        resumed, node._resumed = node._resumed, None
        self.net.resume(node.name)
        resumed.set()
        self._changed.fire()

    # ---- the network ------------------------------------------------------------------

    def partition(self, *groups: Iterable[NodeLike]) -> None:
        """Cut the network between groups of nodes until :meth:`heal`; nodes in no group form
        one more group. Replaces an earlier partition (see :meth:`SimNetwork.partition`).

        Raises:
            ValueError: no group, or a node in two groups.
        """
        if not groups:
            raise ValueError("partition needs at least one group of nodes")
        self.net.partition(*[[self._node(n).name for n in group] for group in groups])

    def heal(self) -> None:
        """End the partition (paused nodes stay cut off)."""
        self.net.heal()

    def slow(self, node: NodeLike, lag: float) -> None:
        """Make the node slow to handle its traffic by a random delay with mean ``lag``
        seconds at its end of every packet (see :meth:`SimNetwork.slow`); 0 ends it."""
        self.net.slow(self._node(node).name, lag)

    def set_link(self, a: NodeLike, b: NodeLike, *, latency: float | None = None,
                 bandwidth: float | None = None, loss: float | None = None) -> None:
        """Change the link between two nodes, both ways (None: unchanged; see
        :meth:`SimNetwork.set_link`)."""
        a, b = self._pair(a, b)
        self.net.set_link(a.name, b.name, latency=latency, bandwidth=bandwidth, loss=loss)

    def nat(self, node: NodeLike, *, udp_timeout: float = 30.0, refuse: bool = False) -> None:
        """Put the node's host behind a NAT until :meth:`unnat`: it dials out and hears
        replies, but dials to it wait (``refuse``: are refused at once) and datagrams reach
        it only from addresses it sent to in the last ``udp_timeout`` seconds. Its open
        connections stay; a crash and restart keep the NAT (see :meth:`SimNetwork.nat`)."""
        self.net.nat(self._node(node).name, udp_timeout=udp_timeout, refuse=refuse)

    def unnat(self, node: NodeLike) -> None:
        """Take the node's host out from behind its NAT: dials waiting on it go on."""
        self.net.unnat(self._node(node).name)

    def reset(self, a: NodeLike, b: NodeLike) -> None:
        """Reset every connection between two nodes (exchanges on them fail)."""
        a, b = self._pair(a, b)
        self.net.reset(a.name, b.name)

    # ---- time and observation ---------------------------------------------------------

    async def run_for(self, seconds: float) -> None:
        """Let ``seconds`` of virtual time pass."""
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, not {seconds!r}")
        await trio.sleep(seconds)

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        """Return once ``condition()`` holds, checked now and after every membership change,
        exchange end, training step, and node start or end. The caller bounds the wait."""
        await self._changed.wait_until(condition)

    def all_ready(self, nodes: Sequence[NodeLike] | None = None) -> bool:
        """Every one of ``nodes`` (default: the running ones) runs, is ready, and sees every
        other one of them alive and ready."""
        group = self.running() if nodes is None else [self._node(n) for n in nodes]
        for observer in group:
            if observer.node is None or not observer.node.ready:
                return False
            seen = {m.peer for m in observer.node.roster.alive(ready=True)}
            if any(p.peer_id not in seen for p in group if p is not observer):
                return False
        return True

    async def wait_ready(self, nodes: Sequence[NodeLike] | None = None) -> None:
        """Wait until :meth:`all_ready` holds."""
        await self.wait_until(lambda: self.all_ready(nodes))

    def view(self, observer: NodeLike) -> dict[SimNode, State]:
        """How a running node sees the others: their membership state, for those it knows.

        Raises:
            ValueError: the observer is not running.
        """
        observer = self._running(observer, "ask the view of")
        assert observer.node is not None
        return {self._by_peer[m.peer]: m.state for m in observer.node.roster.members()
                if m.peer in self._by_peer}

    def spread(self, nodes: Sequence[NodeLike] | None = None) -> float:
        """The largest L2 distance between a model's flat state and the mean of them all,
        over ``nodes`` (default: the running ones).

        Raises:
            ValueError: no node to measure.
        """
        group = self.running() if nodes is None else [self._node(n) for n in nodes]
        if not group:
            raise ValueError("no node is running" if nodes is None else "spread of no node")
        states = torch.stack([snapshot(n.model, StateSchema.from_module(n.model))
                              for n in group])
        return float((states - states.mean(dim=0)).norm(dim=1).max())

    # ---- internals --------------------------------------------------------------------

    def _node(self, node: NodeLike) -> SimNode:
        if isinstance(node, SimNode):
            if node.index < len(self.nodes) and self.nodes[node.index] is node:
                return node
            raise ValueError(f"{node!r} is not a node of this swarm")
        if type(node) is int and 0 <= node < len(self.nodes):
            return self.nodes[node]
        raise ValueError(f"no node {node!r}: give a SimNode or an index below {len(self.nodes)}")

    def _resuming(self) -> NodeConfig:
        """The config of a node that joins a running swarm, late or from its checkpoint:
        the swarm's, but a ``start = "own"`` (the swarm's first nodes, each on its own model)
        is ``"auto"``: it takes the swarm's state if one is ready (a restart: if newer)."""
        config = self._config
        if config.averaging.start == "own":
            config = dataclasses.replace(
                config, averaging=dataclasses.replace(config.averaging, start="auto"))
        return config

    def _running(self, node: NodeLike, action: str) -> SimNode:
        node = self._node(node)
        if node._down is not None:
            raise ValueError(f"cannot {action} {node.name}: it is {node._down}")
        return node

    def _pair(self, a: NodeLike, b: NodeLike) -> tuple[SimNode, SimNode]:
        a, b = self._node(a), self._node(b)
        if a is b:
            raise ValueError(f"a link joins two nodes, not {a.name} and itself")
        return a, b

    async def _start(self, node: SimNode, bootstrap: list[str], config: NodeConfig,
                     counters: Counters | None,
                     correction: dict[str, torch.Tensor] | None = None,
                     outer: dict[str, torch.Tensor] | None = None) -> None:
        node._done = trio.Event()
        self._by_peer[node.peer_id] = node
        await self._nursery.start(self._run, node, bootstrap, config, counters, correction,
                                  outer)

    async def _run(self, node: SimNode, bootstrap: list[str], config: NodeConfig,
                   counters: Counters | None, correction: dict[str, torch.Tensor] | None,
                   outer: dict[str, torch.Tensor] | None, *, task_status: trio.TaskStatus[None]) -> None:
        # The addresses are the node's own; a node behind a NAT at its start is told that
        # it cannot be dialled, unless the swarm's nodes find out for themselves (None).
        reachable = config.reachable
        if reachable is not None and self.net.behind_nat(node.name):
            reachable = False
        config = dataclasses.replace(config, listen=node.address, advertise=None,
                                     bootstrap=tuple(bootstrap), reachable=reachable)
        try:
            with trio.CancelScope() as node._scope:
                async with open_swarm(
                    node.model, self._swarm, config, network=self.net.host(node.name),
                    identity=node.identity,
                    rng=random.Random(f"{self._seed}:{node.name}:{node.restarts}"),
                    counters=counters, optimizer=node.optimizer, correction=correction,
                    outer=outer,
                    on_change=self._changed.fire,
                    on_exchange=functools.partial(self._exchanged, node),
                ) as swarm_node:
                    node.node, node._down = swarm_node, None
                    self._changed.fire()
                    task_status.started()
                    if self._train is None:
                        await trio.sleep_forever()
                    await self._trainer(node, swarm_node)
        except (PeerGone, BaseExceptionGroup) as exc:
            # What a host crash does to its node; anything else is the test's to see. A
            # restart called right after the crash may already be waiting for this run.
            if not (node._down in ("crashed", "restarting") and _only(PeerGone, exc)):
                raise
        finally:
            node.node = None
            node._done.set()
            self._changed.fire()

    async def _trainer(self, node: SimNode, swarm_node: SwarmNode) -> None:
        assert self._train is not None
        await swarm_node.wait_ready()
        while True:
            await trio.sleep(self._step_time)
            while node._resumed is not None:
                await node._resumed.wait()
            if node.node is not swarm_node:
                await trio.sleep_forever()  # crashed: the crash is on its way to us
            node.loss = float(self._train(node))
            node.steps += 1
            swarm_node.step()
            self._changed.fire()

    def _exchanged(self, node: SimNode, exchange: Exchange) -> None:
        if self._train is None and node.node is not None:
            node.node.apply_pending()
        now = trio.current_time()
        self.exchanges.append(SimExchange(
            now, now - exchange.duration, node, self._by_peer.get(exchange.peer),
            exchange.initiated, exchange.result, exchange.distance, exchange.codec,
            exchange.nbytes))
        self._changed.fire()


@asynccontextmanager
async def open_sim_swarm(
    n: int,
    *,
    seed: int = 0,
    model: Callable[[int], torch.nn.Module] | None = None,
    optimizer: Callable[[int], torch.optim.Optimizer] | None = None,
    train: Callable[[SimNode], float] | None = None,
    step_time: float = 0.05,
    config: NodeConfig = NodeConfig.local(),
    latency: float = 0.001,
    bandwidth: float | None = None,
    loss: float = 0.0,
    nat: Collection[int] = (),
    late: Collection[int] = (),
) -> AsyncIterator[SimSwarm]:
    """Run ``n`` nodes on a fresh simulated network; returns once every node runs (not yet
    ready: see :meth:`SimSwarm.wait_ready`). On exit every running node leaves.

    Args:
        n: how many nodes.
        seed: seeds every random choice (see the module docstring).
        model: ``model(i)`` builds node i's model; default: a 4x4 linear layer initialized
            from the seed and i.
        optimizer: ``optimizer(i)`` gives node i's optimizer (over ``model(i)``'s
            parameters), so that the node keeps a drift correction (see
            :func:`gossip.open_swarm`); ``train`` steps it. None: weights alone.
        train: ``train(node)`` runs one training step on ``node.model`` and returns the
            loss; each running node calls it every ``step_time`` virtual seconds. None: no
            training, and deltas are added as exchanges end.
        step_time: virtual seconds a training step takes.
        config: every node's settings (:class:`~gossip.config.NodeConfig`), but for its
            addresses: the sim sets ``listen``, ``advertise`` and ``bootstrap`` per node.
            The default, ``NodeConfig.local()``, starts every node from its own model
            (``averaging.start="own"``; ``"auto"`` lets the joiners download node 0's) and
            averages every step, or every second idle. A restart starts from its
            checkpoint, or from a ready peer's state if that is newer. ``config.reachable``
            is what each node tells
            :func:`gossip.open_swarm`: None lets every node but node 0 find out with a
            dial-back check after joining; True (the default) says every node is
            reachable, except a node behind a NAT when it starts, which is told False.
        latency, bandwidth, loss: every link's defaults (see :class:`SimNetwork`).
        nat: the indices of the nodes whose hosts are behind a NAT from the start
            (:meth:`SimSwarm.nat`), outbound-only volunteers. Node 0, which the others join
            through, cannot be one of them.
        late: the indices of the nodes that do not start with the others: each starts when
            the test calls :meth:`SimSwarm.join`, and downloads the swarm's state then
            (``averaging.start = "auto"`` for it, whatever ``config`` says). Not node 0.

    Raises:
        ValueError: a bad argument (the message says which).
    """
    if type(n) is not int or n < 1:
        raise ValueError(f"n must be an integer >= 1, not {n!r}")
    if not isinstance(config, NodeConfig):
        raise ValueError(f"config must be a gossip.NodeConfig, not {config!r}")
    if not (isinstance(step_time, (int, float)) and math.isfinite(step_time) and step_time > 0):
        raise ValueError(f"step_time must be a positive number of seconds, not {step_time!r}")
    nat = sorted(set(nat))
    if any(type(i) is not int or not 0 < i < n for i in nat):
        raise ValueError(f"nat must name nodes 1..{n - 1} (node 0 is the bootstrap), not {nat!r}")
    late = sorted(set(late))
    if any(type(i) is not int or not 0 < i < n for i in late):
        raise ValueError(f"late must name nodes 1..{n - 1} (node 0 starts the swarm), not "
                         f"{late!r}")
    if train is not None and not callable(train):
        raise ValueError(f"train must be a function of a SimNode, not {train!r}")
    make = functools.partial(_default_model, seed) if model is None else model
    if not callable(make):
        raise ValueError(f"model must be a function of the node's index, not {model!r}")
    net = SimNetwork(seed, latency=latency, bandwidth=bandwidth, loss=loss)
    models = [make(i) for i in range(n)]
    for i, m in enumerate(models):
        if not isinstance(m, torch.nn.Module):
            raise ValueError(f"model({i}) returned {type(m).__name__}, not a torch.nn.Module")
    with one_error():
        async with trio.open_nursery() as nursery:
            sim = SimSwarm(net, nursery, seed, config=config, train=train,
                           step_time=step_time)
            for i, m in enumerate(models):
                key = Ed25519PrivateKey.from_private_bytes(_digest(seed, f"identity n{i}"))
                sim.nodes.append(SimNode(i, m, Identity(key),
                                         None if optimizer is None else optimizer(i)))
            first = sim.nodes[0]
            for i in nat:
                net.nat(sim.nodes[i].name)
            for node in sim.nodes:
                if node.index in late:
                    node._down = "late"
                    continue
                await sim._start(node, [] if node is first else [first.address], config, None)
            try:
                yield sim
            finally:
                nursery.cancel_scope.cancel()


def _default_model(seed: int, index: int) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int.from_bytes(_digest(seed, f"model {index}")[:8], "big"))
        return torch.nn.Linear(4, 4)  # 20 parameters


def _digest(seed: int, what: str) -> bytes:
    return hashlib.sha256(f"gossip.testing.sim:{seed}:{what}".encode()).digest()


def _only(kind: type[BaseException], exc: BaseException) -> bool:
    """Whether ``exc`` is ``kind`` or a group of nothing else."""
    if isinstance(exc, BaseExceptionGroup):
        return all(isinstance(e, kind) for e in leaves(exc))
    return isinstance(exc, kind)
