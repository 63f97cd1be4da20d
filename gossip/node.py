"""A node of a training swarm: membership, averaging and state download around one model.

Theory of operation
-------------------
:func:`open_swarm` opens a roster (:mod:`gossip.roster`) whose channel handler takes
``Offer`` messages to the averager (:mod:`gossip.averaging`: the scheduler and the exchange)
and ``StateRequest`` messages to the node's state downloads (a
:class:`~gossip.download.Downloads` that the node owns: it serves joiners and fetches the
node's own initial state), and runs two tasks in its own nursery:

* *start*: become ready. The first node of a swarm (no bootstrap addresses), or one started
  with ``averaging.start="own"``, is ready at once. Otherwise it joins, then downloads the
  full state from the alive, ready peer with the highest step not above the members' median
  (:func:`~gossip.download.download`; falling back to the next); with ``start="auto"`` a node
  that finds no ready peer within ``download_wait`` of joining starts from its own
  initialization (a swarm whose first nodes start together). Only then does it announce
  ``ready`` and take part in averaging.
* *rounds*: one averaging round every ``every`` local steps (or ``interval`` seconds
  without one), jittered (:meth:`~gossip.averaging.Averaging.run`).

Resuming a checkpoint (``counters`` given): the node does as a joiner does, but takes the
state only if the sender's step is past the checkpoint's, and with ``start="auto"`` looks for
``download_wait`` from its start (a node cut off from the swarm trains on its checkpoint). A
checkpoint is as old as the time since it was written (minutes, by default) plus the time the
node was down, and a swarm that trained on meanwhile has moved on from it. Its weights,
averaged in at the usual weight, pull the nodes back: in bench/efficiency.py's churn run a node
restarted from a checkpoint 28 steps old was 3.6 to 4.2 from the nodes it met first (5 to 8
times the median distance between them), and those nodes fell 15 to 40 points of held-out
accuracy (85% to 45%, say) by their next evaluation. The swarm's state already holds what the
node had contributed up to its last exchange, so the node takes that instead and keeps of its
checkpoint what is its own: its counters (its step, if the sender's is lower) and its drift
correction, whose sum over the swarm must stay 0 (:mod:`gossip.correction`: a restart brings
the checkpoint's back; reset as a joiner's, the sum in tests/sim/test_drift.py went past its
bound). The optimizer's state was for the old weights and is cleared: kept, its momentum
carried the node off the state it took (in one traced run from 68% to 20% held-out accuracy
in seven steps; over ten seeds of the bench, both with the correction reset, the worst fall
per seed was 3 to 30 points, median 11, against 0.6 to 21, median 4, with it cleared, and
0.2 to 8, median 3, with the correction kept too). The outer step's anchor and velocity go
as well, as the queued deltas do (:meth:`~gossip.replica.Replica.load`). A node whose
checkpoint is as far along as the sender's keeps it (a swarm that restarts together: the
freshest checkpoints stay, the others take them). The seniority ramp
(:func:`~gossip.standing.seniority`) does not cover this: it counts a peer's time alive in the
member table, which a quick restart need not even interrupt, and says nothing of how old the
state a peer brings is.

The trainer stays in charge of the model: :meth:`SwarmNode.step` counts a step and adds the
queued deltas, and never waits on the network. On exit the node stops averaging (an exchange
in flight is abandoned, which applies nothing) and leaves the swarm gracefully.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import torch
import trio

from .averaging import Averaging, AveragingStatistics, Exchange, Result
from .channel import SecureChannel
from .config import NodeConfig
from .download import Download, Downloads, encode_meta
from .endpoints import connect
from .errors import DownloadFailed
from .groups import one_error
from .handshake import Swarm
from .identity import Identity, PeerId
from .linkrate import LinkRates
from .member import Member
from .messages import Close, Message, Offer, StateRequest
from .network import Network, TcpNetwork
from .replica import Counters, Replica
from .roster import Roster, open_roster

__all__ = ["SwarmNode", "open_swarm"]

log = logging.getLogger(__name__)

RETRY = 1.0  # s between attempts to find a peer to download from


class SwarmNode:
    """A model taking part in a swarm. Get one from :func:`open_swarm`.

    Attributes:
        roster: the live membership view.
        replica: the model, its counters and its pending deltas.
        downloaded: where the initial state came from, or None if it is our own.
    """

    def __init__(self, roster: Roster, replica: Replica, averaging: Averaging,
                 downloads: Downloads, resumed: _Resumed | None = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
        self.roster = roster
        self.replica = replica
        self.downloaded: Download | None = None
        self._averaging = averaging
        self._downloads = downloads
        self._resumed = resumed
        self._optimizer = optimizer

    @property
    def peer_id(self) -> PeerId:
        return self.roster.me.peer

    @property
    def address(self) -> str:
        return self.roster.address

    @property
    def ready(self) -> bool:
        """Whether the node holds its initial state and averages."""
        return self._averaging.ready.is_set()

    async def wait_ready(self) -> None:
        """Return once the node holds its initial state (downloaded or its own)."""
        await self._averaging.ready.wait()

    @property
    def global_step(self) -> int:
        """The step the swarm agrees on: this node's optimizer steps, moved towards its
        peers' at each exchange and never back (:func:`~gossip.standing.step_move`). Use it
        for learning-rate schedules, so that the swarm's schedules line up."""
        return self.replica.counters().step

    def step(self, samples: int = 0) -> int:
        """Count one optimizer step over ``samples`` samples and add the next part of the
        deltas queued by exchanges to the model (each is spread over half the steps that
        come between two exchanges, at most 16: :mod:`gossip.replica`). Call it between
        steps; it takes a lock for a copy at most, never the network.

        Returns:
            The number of exchanges whose deltas began to apply.
        """
        self.replica.advance(1, samples)
        return self.replica.apply_step()

    def apply_pending(self) -> int:
        """Add all that the exchanges queued, at once, without counting a step (before a
        checkpoint, or when the trainer stops); returns how many exchanges' deltas began to
        apply."""
        return self.replica.apply_pending()

    def stop_averaging(self) -> None:
        """Start no more exchanges and answer offers busy, ahead of leaving; an exchange in
        flight goes on to its end (leaving abandons it)."""
        self._averaging.stop()

    async def average_now(self) -> Result:
        """Run one averaging round now (waits until the node is ready)."""
        return await self._averaging.round()

    def statistics(self) -> AveragingStatistics:
        return self._averaging.statistics(downloads_served=self._downloads.served)

    def codec_with(self, peer: PeerId | str) -> str | None:
        """The wire codec of our last committed exchange with ``peer`` (either side), if we
        remember one (``averaging.codec = "auto"`` picks one per peer)."""
        return self._averaging.codecs.last(str(peer))

    # ---- internals --------------------------------------------------------------------

    async def _handle(self, channel: SecureChannel, first: Message) -> None:
        allow = self._averaging.allow
        if allow is not None and channel.peer not in allow and isinstance(first, (Offer, StateRequest)):
            log.info("refused peer=%s reason=not-on-allow-list", channel.peer.short)
            await channel.send_closing(Close(Close.REJECTED, "not on the allow-list"))
        elif isinstance(first, Offer):
            await self._averaging.respond(channel, first)
        elif isinstance(first, StateRequest):
            await self._downloads.serve(channel, first, ready=self.ready)
        else:
            await channel.send_closing(Close(Close.REJECTED, f"unexpected {type(first).__name__}"))

    async def _start(self, bootstrap: bool) -> None:
        averaging, config = self._averaging, self._averaging.config
        if bootstrap and config.start != "own":
            await self._fetch_state()
        step = self.replica.counters().step
        averaging.ready.set()
        self.roster.set_meta(step=step, ready=True)
        log.info("ready to average peer=%s step=%d source=%s", self.peer_id.short, step,
                 self.downloaded.peer.short if self.downloaded else "own")

    async def _fetch_state(self) -> None:
        """Take a ready peer's state as ``averaging.start`` says: with ``"auto"``, if one is
        found within ``download_wait`` of joining (resuming a checkpoint, of starting: a node
        cut off from the swarm trains on its checkpoint), else keep our own weights; resuming,
        only a state newer than the checkpoint."""
        averaging, config = self._averaging, self._averaging.config
        auto, resuming = config.start == "auto", self._resumed is not None
        fallback = "our checkpoint" if resuming else "our own initialization"
        give_up = trio.current_time() + config.download_wait
        if auto and resuming:
            with trio.move_on_at(give_up):
                await self.roster.wait_joined()
        else:
            await self.roster.wait_joined()
            give_up = trio.current_time() + config.download_wait
        attempts = 0
        last = ""  # the last failure logged
        said = False
        while True:
            candidates = averaging.allowed(self.roster.alive(ready=True, reachable=True))
            if not candidates and not said:  # said once: what start-up waits for
                said = True
                log.info("waiting for a ready peer to download the swarm's state from%s",
                         f" (up to {config.download_wait:g} s, then {fallback})" if auto else "")
            if candidates:
                await self.roster.prove(candidates)  # only proven steps count
                try:
                    self.downloaded = await self._download(candidates)
                    self._took_state()
                    return
                except DownloadFailed as exc:
                    # Said once out loud: a refusal may mean this node's model is not the
                    # swarm's (another task or options), which retrying will not fix;
                    # then again only when it changes, not every second.
                    attempts += 1
                    level = (logging.WARNING if attempts == 1 else
                             logging.DEBUG if str(exc) == last else logging.INFO)
                    last = str(exc)
                    log.log(level, "%s; retrying every %g s", exc, RETRY)
            if auto and trio.current_time() >= give_up and (resuming or not candidates):
                log.info("no %s %.1f s after %s; starting from %s",
                         "state downloaded" if candidates else "ready peer",
                         config.download_wait, "starting" if resuming else "joining", fallback)
                return
            with trio.move_on_after(RETRY):
                await self.roster.wait_changed()

    async def _download(self, candidates: list[Member]) -> Download | None:
        """Load the state of a candidate that answers (:meth:`Downloads.fetch
        <gossip.download.Downloads.fetch>`); resuming a checkpoint, only one newer than it
        (None: ours is as far along). The step's ceiling counts only the candidates that
        proved their identity to us (:meth:`~gossip.roster.Roster.prove` some first)."""
        proven = {m.peer: self.roster.proven_host(m) for m in candidates
                  if self.roster.proven_since(m.peer) is not None}
        resumed = self._resumed
        return await self._downloads.fetch(candidates, proven,
                                           newer_than=None if resumed is None else resumed.step)

    def _took_state(self) -> None:
        """After a download over a resumed checkpoint: the drift correction comes back (the
        download reset it, as a joiner brings none), and the optimizer's state, which was
        for the weights replaced, goes (before the node is ready, so before any step)."""
        resumed, download = self._resumed, self.downloaded
        if resumed is None or download is None:
            return
        if resumed.correction is not None:
            self.replica.restore(self.replica.counters(), resumed.correction)
        if self._optimizer is not None:
            self._optimizer.state.clear()
        log.info("checkpoint superseded peer=%s checkpoint_step=%d step=%d", download.peer.short,
                 resumed.step, self.replica.counters().step)


@dataclass(frozen=True)
class _Resumed:
    """What a node resuming a checkpoint brings besides its weights: the step a downloaded
    state must be past to replace them, and the drift correction it keeps if one does."""

    step: int
    correction: Mapping[str, torch.Tensor] | None


@asynccontextmanager
async def open_swarm(
    model: torch.nn.Module,
    swarm: Swarm,
    config: NodeConfig = NodeConfig(),
    *,
    identity: Identity | None = None,
    network: Network | None = None,
    task: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
    rng: random.Random | None = None,
    counters: Counters | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    correction: Mapping[str, torch.Tensor] | None = None,
    outer: Mapping[str, torch.Tensor] | None = None,
    on_change: Callable[[Member], None] | None = None,
    on_exchange: Callable[[Exchange], None] | None = None,
) -> AsyncIterator[SwarmNode]:
    """Join (or start) a swarm and average ``model`` with it in the background.

    Args:
        model: the live module (CPU or CUDA). The node only reads it (snapshots) until the
            caller applies deltas with :meth:`SwarmNode.step`; a download replaces it.
        swarm: the swarm's name and key.
        config: every setting: where to listen, whom to join, whom to trust, and how to
            average (:class:`~gossip.config.NodeConfig`; ``NodeConfig.local()`` for nodes on
            one machine or a simulated network). The rest are objects and callbacks.
        identity: the node key; a fresh one if omitted.
        network: real TCP by default; a :class:`~gossip.testing.simnet.SimNetwork` host in tests.
        task: metadata published to joiners with the state (JSON-like values), or a
            function returning it at each download.
        rng: the node's only source of randomness (seed it in tests).
        counters: the step, samples and weight to resume from (saved with a checkpoint): the
            node resumes, and unless ``averaging.start`` is ``"own"`` it takes a ready peer's
            state instead of the model's weights if that is newer (see "Resuming" above).
        optimizer: the model's optimizer. With ``config.averaging.correction`` (the default)
            the node keeps a drift correction and adds it to the gradients before each of
            this optimizer's steps (:mod:`gossip.correction`); without an optimizer it
            averages the weights alone. Its state never leaves the node; resuming a
            checkpoint, a download clears it (it was for the weights replaced).
        correction: the correction to resume from (saved with a checkpoint, from
            :meth:`~gossip.replica.Replica.correction_state`).
        outer: the outer step's state to resume from (saved with a checkpoint, from
            :meth:`~gossip.replica.Replica.outer_state`).
        on_change: called with every membership change (see :func:`~gossip.roster.open_roster`).
        on_exchange: called with every exchange as it ends, in the node's event loop
            (synchronously, so keep it quick): for logs, metrics, or a test waiting on one.

    Raises:
        SchemaMismatch, ValueError: the model cannot be averaged (unsupported dtype).
        TypeError: ``config`` is not a :class:`~gossip.config.NodeConfig`.
        GossipError: a background task failed (as one typed error).
    """
    if not isinstance(config, NodeConfig):  # say, the AveragingConfig that goes inside it
        raise TypeError(f"config must be a gossip.NodeConfig, not {type(config).__name__}: "
                        f"put averaging settings in NodeConfig(averaging=...)")
    identity = identity or Identity.generate()
    network = network or TcpNetwork()
    rng = rng or random.Random()
    averaging_config = config.averaging
    replica = Replica(model, by_samples=averaging_config.by_samples, leak=averaging_config.leak,
                      optimizer=optimizer if averaging_config.correction else None,
                      outer=averaging_config.outer_setting)
    if counters is not None:
        replica.restore(counters, correction, outer)
    task_fn: Callable[[], Mapping[str, Any]]
    if task is None:
        task_fn = dict
    elif callable(task):
        task_fn = task
    else:
        fixed = dict(task)
        encode_meta({}, fixed)  # a ValueError now, not at the first joiner's request
        task_fn = lambda: fixed  # noqa: E731
    node: SwarmNode | None = None

    async def handle(channel: SecureChannel, first: Message) -> None:
        if node is None:  # a peer that is quick off the mark
            await channel.send_closing(Close(Close.BUSY, "starting"))
            return
        await node._handle(channel, first)

    try:
        def changed(member: Member) -> None:
            replica.member_changed(member)  # a departure fades what it left of Σ c
            if on_change is not None:
                on_change(member)

        async with open_roster(network, identity, swarm, config,
                               rng=random.Random(rng.getrandbits(64)), handler=handle,
                               on_change=changed) as roster:
            async def dial(member: Member) -> SecureChannel:
                return await connect(network, member.address, identity=identity, swarm=swarm,
                                     allow=frozenset({member.peer}), timeouts=config.timeouts)

            rates = LinkRates(averaging_config.min_rate)  # exchanges and downloads alike
            averaging = Averaging(replica, roster, dial, rates, averaging_config, rng,
                                  on_exchange, allow=config.allow, limits=config.limits)
            downloads = Downloads(replica, dial, averaging_config, rates, rng, task_fn)
            resumed = None if counters is None else _Resumed(counters.step, correction)
            node = SwarmNode(roster, replica, averaging, downloads, resumed, optimizer)
            with one_error():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(node._start, bool(config.bootstrap))
                    nursery.start_soon(averaging.run)
                    try:
                        yield node
                    finally:
                        # Offers that come while the roster announces the departure are
                        # answered busy: a node that the others already count as gone must
                        # not move their corrections (gossip.correction, "Departures").
                        averaging.stop()
                        nursery.cancel_scope.cancel()
    finally:
        replica.close()  # the optimizer goes on without our hook
