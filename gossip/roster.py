"""The live view of the swarm: the membership state machine run over a network.

Theory of operation
-------------------
:func:`open_roster` runs :meth:`Roster.run`, which binds a datagram endpoint and a channel
server on the same port (:func:`_bind`) and runs :class:`gossip.membership.Membership` over
them with three kinds of task, all in the roster's own nursery:

* the *receiver* opens each sealed datagram (:mod:`gossip.seal`), hands the plaintext to
  the state machine and sends what it answers at once (an Ack must not wait);
* the *ticker* sleeps until the machine's next deadline (or until woken because a datagram
  or a call moved it earlier), ticks it, and carries out the effects;
* *push-pulls* swap full member tables over a secure channel, one task each, at most
  :data:`MAX_PUSH_PULLS` at a time; joining is a push-pull with a bootstrap address, retried
  with exponential backoff while none answers (the join loop, :mod:`gossip.bootstrap`).

Two checks run beside them, each its own module that the roster gives only what it needs:
whether another process runs with our identity (:mod:`gossip.clash`), and whether others
can dial us (the dial-back check, :mod:`gossip.reachability`).

A push-pull is three steps: the initiator sends its table, the responder merges it and sends
its own (so the table the initiator gets already carries any refutation the responder had to
make), and the initiator merges that and sends its own record once more (so a refutation on
its side reaches the responder too). Both ends then hold the other alive at a fresh
incarnation even if each had declared the other dead, which is how the halves of a healed
partition find their way back. Tables travel in pages; cutting and reassembling them, and
refusing a table no honest sender sends, is pure protocol logic in :mod:`gossip.pushpull`
(sent and read by :mod:`gossip.tables`).

Who has proved its identity: every channel that completes its handshake, whichever side
dialled, is a proof that the peer holds its identity key (:mod:`gossip.proving` keeps them);
a record heard in gossip is only a claim. What counts identities (standing, the step's
estimate, the data shards) asks :meth:`Roster.alive` for ``proven`` members, and a joiner
proves a sample of the members it heard of by a handshake with each (:meth:`Roster.prove`:
a channel that carries only a ``Close(0)``, no table, so that nobody learns of the joiner any
sooner than gossip tells it) before it counts them.

Datagrams that fail to open or decode are dropped and counted; they never stop the roster.
Every effect's network wait is under a deadline; a deadline missed is a
:class:`~gossip.errors.PeerTimeout` from where it is set, so callers catch
:class:`~gossip.errors.GossipError` only.
"""

from __future__ import annotations

import errno
import logging
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import trio

from .address import parse_address
from .bootstrap import Joiner, JoinTrouble
from .channel import SecureChannel
from .clash import ClashWatch
from .config import NodeConfig
from .effects import Changed, Effect, PushPullWith, Send
from .endpoints import connect, serve
from .errors import GossipError
from .groups import one_error, phase_deadline
from .handshake import PROTOCOL_VERSION, Swarm
from .identity import Identity, PeerId
from .limits import RateLimit
from .membership import Member, Membership, State
from .messages import Close, DialBack, Message, PushPull
from .network import DatagramEndpoint, Network
from .proving import PROVE_SAMPLE, Proving
from .reachability import Reachability, ReachabilityCheck
from .seal import Sealer
from .tables import receive_table, send_table

__all__ = ["JoinTrouble", "Roster", "RosterStatistics", "open_roster", "MAX_PUSH_PULLS"]

log = logging.getLogger(__name__)

PORT_ATTEMPTS = 8  # ports tried for listen port 0 when the stream port is taken
MAX_PUSH_PULLS = 2  # outgoing push-pulls in flight at once; more are skipped, not queued
SEND_TIMEOUT = 0.1  # s one datagram send may take (a host name's lookup included)

# What a channel whose first message is not a PushPull is handed to (averaging, later).
ChannelHandler = Callable[[SecureChannel, Message], Awaitable[None]]


@dataclass(frozen=True)
class RosterStatistics:
    """A snapshot of the roster's view and counters since it opened."""

    alive: int  # members ALIVE, ourselves excluded
    suspect: int
    dead: int
    left: int
    incarnation: int  # our own
    awareness: int  # Lifeguard's local health score; 0 is healthy
    probes: int
    probes_failed: int
    suspicions: int  # members we started suspecting
    refutations: int  # suspicions of ourselves we refuted
    deaths: int  # members we declared dead
    datagrams_sent: int
    bytes_sent: int
    datagrams_received: int
    bytes_received: int
    datagrams_rejected: int  # failed to open or decode, or could not be sent
    claims_refused: int  # Alive or Left whose signature failed, or sent after one that did
    push_pulls: int  # completed, either side
    push_pulls_failed: int
    connections_refused: int  # inbound, closed at accept: over max_connections
    connections_evicted: int  # inbound, unproven, closed for a newer one: max_handshakes_per_host
    connections_throttled: int  # inbound, closed at accept: their host over Limits.host_rate
    channels_limited: int  # inbound channels closed for a peer over its Limits.peer_rate


class Roster:
    """Who is in the swarm, as this node sees it. Get one from :func:`open_roster`, which
    runs it (:meth:`run`) for as long as its ``async with`` block lasts."""

    # Set by run() once the port is bound, before any task or channel can use it: the
    # machine's address is the bound one, known only then.
    _m: Membership

    def __init__(self, network: Network, identity: Identity, swarm: Swarm, config: NodeConfig,
                 *, rng: random.Random | None = None, handler: ChannelHandler | None = None,
                 on_change: Callable[[Member], None] | None = None) -> None:
        """See :func:`open_roster` for the arguments."""
        self._settings = config
        self._identity = identity
        self._swarm = swarm
        self._network = network
        self._rng = rng or random.Random()
        self._handler = handler
        self._on_change = on_change
        self._sealer = Sealer(swarm)
        self._config = config.membership
        self._timeouts = config.timeouts
        self._nursery: trio.Nursery | None = None  # run()'s own, for the tasks it starts
        # Bound by run(); closed by _aclose(), after run() is over: the departure is sent on
        # it while run() unwinds (open_roster leaves even when cancelled from outside).
        self._endpoint: DatagramEndpoint | None = None
        self._wake = trio.Event()
        self._drained = trio.Event()  # set by the ticker whenever no update is left to gossip
        self._pending: list[Effect] = []  # effects of calls from other tasks, for the ticker
        self._changed = trio.Event()
        self._left = False
        self._dead = False
        self._push_pulls = 0
        self._rejected = 0
        self._push_pulls_done = 0
        self._push_pulls_failed = 0
        self._rate = RateLimit(config.limits.peer_rate, config.limits.peer_burst)
        self._over_limit = {"max_connections": 0, "max_handshakes_per_host": 0,  # by serve
                            "host_rate": 0}
        self._channels_limited = 0
        self._proving = Proving(network, identity, swarm, config, self._rng)
        # The checks beside the machine, each given what it needs (the machine itself only
        # exists once run() has bound the port: hence the lambdas).
        self._clash = ClashWatch(network, identity, swarm, config,
                                 own_state=lambda: self._m.own_state(),
                                 start_soon=self._start_soon, changed=self._notify_changed)
        self._reach = ReachabilityCheck(
            network, identity, swarm, config, alive=self.alive, queue=self._queue,
            push_pull=lambda address, peer: self._push_pull(address, peer, join=False),
            changed=self._notify_changed)
        self._joiner = Joiner(config.bootstrap, config.membership,
                              push_pull=lambda address: self._push_pull(address, None, join=True),
                              wake=self._wake_ticker, reach=self._reach)

    # ---- the averager's API -----------------------------------------------------------

    @property
    def me(self) -> Member:
        return self._m.myself()

    @property
    def address(self) -> str:
        return self._m.myself().address

    def members(self) -> list[Member]:
        """Every member known, in any state, ourselves excluded."""
        return self._m.members()

    def get(self, peer: str) -> Member | None:
        """What we know of ``peer``, in any state; None if it is not in our table."""
        return self._m.get(peer)

    def alive(self, *, ready: bool | None = None, reachable: bool | None = None,
              proven: bool | None = None) -> list[Member]:
        """Members in state ALIVE (not suspect), optionally only those (not) ready, only
        those that do (not) accept connections (``reachable=True``: whom we may dial), and
        only those that have (not) proved their identity to us (``proven=True``: a channel
        with them completed its handshake; what counts identities counts only these)."""
        return [m for m in self._m.members()
                if m.state == State.ALIVE and (ready is None or m.ready == ready)
                and (reachable is None or m.reachable == reachable)
                and (proven is None or (m.peer in self._proving) == proven)]

    def proved(self, channel: SecureChannel) -> None:
        """``channel`` completed its handshake: its peer proved its identity (the roster
        records its own channels; the averager reports those it dials)."""
        self._proving.proved(channel)

    def proven_since(self, peer: str) -> float | None:
        """When ``peer`` first proved its identity to us, or None if it has not."""
        return self._proving.since(peer)

    def proven_host(self, member: Member) -> str:
        """The host ``member`` last proved itself from, or its address's if it never did:
        what counts once, whatever addresses its identities claim."""
        return self._proving.host(member)

    async def prove(self, members: list[Member], most: int = PROVE_SAMPLE) -> None:
        """Complete a handshake with up to ``most`` of ``members`` not yet proven, so that what
        counts identities can count them; returns when every attempt has ended, all within
        one push-pull deadline (:meth:`gossip.proving.Proving.prove`)."""
        await self._proving.prove(members, most)

    def random_alive(self, *, ready: bool | None = None, reachable: bool | None = None,
                     rng: random.Random | None = None) -> Member | None:
        """A member chosen uniformly among :meth:`alive`; None if there is none."""
        candidates = self.alive(ready=ready, reachable=reachable)
        return (rng or self._m.rng).choice(candidates) if candidates else None

    async def wait_changed(self) -> None:
        """Return at the next change of any member's state, address or metadata."""
        await self._changed.wait()

    @property
    def clash(self) -> str | None:
        """The address of another node that runs with our identity: a copied identity key,
        which the operator must resolve (:class:`IdentityClash`). Only ever set by a
        channel from that address authenticated with our own identity key, which no other
        key holder can forge: claims in gossip only make us dial the address to check (see
        :mod:`gossip.clash`). Cleared once that address no longer proves our identity."""
        return self._clash.address

    @property
    def reachability(self) -> Reachability:
        """Whether others can dial us: configured, or what the last dial-back check found
        (:mod:`gossip.reachability`)."""
        return self._reach.reachability

    @property
    def trouble(self) -> JoinTrouble | None:
        """Why no bootstrap address has let us in, while that lasts: set after a round of
        failed attempts, cleared when one answers (:mod:`gossip.bootstrap`)."""
        return self._joiner.trouble

    @property
    def joined(self) -> bool:
        """Whether a bootstrap address has answered (always, if there were none)."""
        return self._joiner.joined

    async def wait_joined(self) -> None:
        """Return once a bootstrap address answered (at once if there were none)."""
        await self._joiner.wait_joined()

    def report_failure(self, peer: str) -> None:
        """Evidence that ``peer`` may be down (say, an exchange with it failed): probe it out
        of turn. Never a verdict: only the probe can lead to a suspicion."""
        self._queue(self._m.report_failure(trio.current_time(), peer))

    def set_meta(self, *, step: int | None = None, ready: bool | None = None,
                 shard: int | None = None, shards: int | None = None) -> None:
        """Update what we announce: our training step, whether we average now, and the data
        shard we train on (``shard`` of ``shards``; ``shards`` 0: none).

        Raises:
            ValueError: not a shard (see :meth:`Membership.set_meta`).
        """
        self._queue(self._m.set_meta(trio.current_time(), step=step, ready=ready, shard=shard,
                                     shards=shards))

    def statistics(self) -> RosterStatistics:
        counts = {state: 0 for state in State}
        for member in self._m.members():
            counts[member.state] += 1
        c = self._m.counters
        return RosterStatistics(
            alive=counts[State.ALIVE], suspect=counts[State.SUSPECT], dead=counts[State.DEAD],
            left=counts[State.LEFT], incarnation=self._m.incarnation,
            awareness=self._m.awareness, probes=c.probes, probes_failed=c.probes_failed,
            suspicions=c.suspicions, refutations=c.refutations, deaths=c.deaths,
            datagrams_sent=c.datagrams_sent, bytes_sent=c.bytes_sent,
            datagrams_received=c.datagrams_received, bytes_received=c.bytes_received,
            datagrams_rejected=c.malformed + self._rejected,
            claims_refused=self._m.claims.refused, push_pulls=self._push_pulls_done,
            push_pulls_failed=self._push_pulls_failed,
            connections_refused=self._over_limit["max_connections"],
            connections_evicted=self._over_limit["max_handshakes_per_host"],
            connections_throttled=self._over_limit["host_rate"],
            channels_limited=self._channels_limited,
        )

    async def leave(self) -> None:
        """Announce that we leave, and gossip it for up to ``leave_timeout``. Afterwards the
        roster still answers probes but never refutes; close it to go quiet."""
        if self._left:
            return
        self._left = True
        self._joiner.stop()
        log.info("leaving swarm peer=%s", self._identity.peer_id.short)
        await self._execute(self._m.leave(trio.current_time()))
        self._drained = trio.Event()
        self._wake.set()
        with trio.move_on_after(self._config.leave_timeout):
            await self._drained.wait()

    # ---- tasks ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                  ) -> None:
        """Bind the port, then run until cancelled: the channel server, the receiver, the
        ticker, the join loop (given bootstrap addresses), and the push-pulls and clash
        checks they start, all in a nursery of its own. Calls ``task_status.started()`` once
        every one of them runs. :func:`open_roster` runs it, leaves before cancelling it, and
        closes the endpoint (:meth:`_aclose`) after it.

        Raises:
            OSError: the address cannot be bound (see :func:`_bind`).
            GossipError: our own endpoint failed (its host crashed, say).
        """
        settings = self._settings
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            endpoint = await _bind(nursery, self._network, settings.listen, self._serve)
            # No checkpoint from here to started(): no channel is handled before the machine
            # exists (a handshake takes round trips anyway).
            self._endpoint = endpoint
            # auto: unreachable until a check says otherwise, but the first node of a swarm
            # is taken to be reachable, as others must dial it to join at all.
            reachable = settings.reachable
            self._m = Membership(
                self._identity, settings.advertise or endpoint.local_address,
                trio.current_time(), self._config, self._rng, version=PROTOCOL_VERSION,
                reachable=reachable if reachable is not None else not settings.bootstrap)
            nursery.start_soon(self._receiver)
            nursery.start_soon(self._ticker)
            if settings.bootstrap:
                nursery.start_soon(self._joiner.run, self._m)
            log.info("roster open peer=%s address=%s bootstrap=%d",
                     self._identity.peer_id.short, self.address, len(settings.bootstrap))
            task_status.started()

    async def _aclose(self) -> None:
        """Close the endpoint :meth:`run` bound, once run is over and the departure sent."""
        if self._endpoint is not None:
            with trio.CancelScope(shield=True):
                await self._endpoint.aclose()

    async def _serve(self, address: str, *,
                     task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """The channel server on ``address``: push-pulls, dial-backs, and the handler's."""
        settings = self._settings
        await serve(self._network, address, self._on_channel, identity=self._identity,
                    swarm=self._swarm, timeouts=settings.timeouts, limits=settings.limits,
                    on_refused=self._refused, task_status=task_status)

    def _refused(self, limit: str) -> None:
        self._over_limit[limit] += 1

    def _queue(self, effects: list[Effect]) -> None:
        self._pending.extend(effects)
        self._wake.set()

    def _wake_ticker(self) -> None:
        """The machine's next deadline moved earlier: the ticker looks again."""
        self._wake.set()

    def _notify_changed(self) -> None:
        """Wake every :meth:`wait_changed`."""
        self._changed.set()
        self._changed = trio.Event()

    def _start_soon(self, task: Callable[..., Awaitable[object]], *args: object) -> None:
        """Start ``task`` in run()'s nursery (a clash watch); before run() there is none."""
        if self._nursery is not None:
            self._nursery.start_soon(task, *args)

    async def _receiver(self) -> None:
        m, endpoint, sealer = self._m, self._endpoint, self._sealer
        while True:
            try:
                data, source = await endpoint.receive()
            except (GossipError, trio.ClosedResourceError):
                self._dead = True  # our own endpoint is gone (the host crashed)
                raise
            try:
                effects = m.receive(trio.current_time(), source, sealer.open(data, source))
            except GossipError as exc:
                self._rejected += 1
                log.debug("datagram rejected source=%s: %s", source, exc)
                continue
            before = m.next_deadline()
            await self._execute(effects)
            if m.next_deadline() < before:
                self._wake.set()

    async def _ticker(self) -> None:
        m = self._m
        while True:
            with trio.move_on_at(m.next_deadline()):
                await self._wake.wait()
            self._wake = trio.Event()
            effects, self._pending = self._pending, []
            effects += m.tick(trio.current_time())
            await self._execute(effects)
            if not m.pending_broadcasts:
                self._drained.set()

    async def _execute(self, effects: list[Effect]) -> None:
        claimed = self._m.take_clash()
        if claimed is not None:
            self._clash.check(claimed)
        # Changes first, before any await: effects from other tasks must not overtake them,
        # so on_change sees the changes in the order the machine made them.
        changes = [e.member for e in effects if isinstance(e, Changed)]
        for member in changes:
            _log_change(member)
            if self._on_change is not None:
                self._on_change(member)
        if changes:
            self._notify_changed()
        for effect in effects:
            if isinstance(effect, Send):
                # Bounded: a send may resolve a host name, and a slow resolver must not
                # hold up the Acks behind it. A datagram that misses the deadline is lost.
                with trio.move_on_after(SEND_TIMEOUT):
                    try:
                        # Mid-rotation, maybe two: one under each swarm key (gossip.rotation).
                        for datagram in self._sealer.seal_for(effect.data, effect.address):
                            await self._endpoint.send(datagram, effect.address)
                    except (OSError, ValueError) as exc:  # unroutable or invalid address
                        self._rejected += 1
                        log.debug("datagram not sent address=%s: %s", effect.address, exc)
            elif isinstance(effect, PushPullWith):
                if self._push_pulls < MAX_PUSH_PULLS and self._nursery is not None:
                    self._push_pulls += 1
                    self._nursery.start_soon(self._push_pull_task, effect.address, effect.peer)

    async def _push_pull_task(self, address: str, peer: PeerId | None) -> None:
        try:
            await self._push_pull(address, peer, join=False)
        except GossipError as exc:
            self._push_pulls_failed += 1
            log.debug("push-pull failed address=%s: %s", address, exc)
        finally:
            self._push_pulls -= 1

    async def _push_pull(self, address: str, peer: PeerId | None, *, join: bool) -> PeerId:
        """Swap tables with whoever is at ``address`` (``peer``, if given). Returns its id.

        Raises:
            PeerTimeout: the whole exchange ran past ``push_pull_timeout``.
            GossipError: the channel failed or the peer misbehaved; nothing was merged from
                a table that did not arrive whole.
        """
        allow = frozenset({peer}) if peer is not None else None
        with phase_deadline(self._config.push_pull_timeout, address, "push-pull"):
            channel = await connect(self._network, address, identity=self._identity,
                                    swarm=self._swarm, allow=allow, timeouts=self._timeouts)
            self.proved(channel)
            async with channel:
                if channel.peer == self._identity.peer_id:
                    await self._clash.meet(channel, address, join=join)  # always raises
                await send_table(channel, self._m.full_state(), join=join)
                first = await channel.receive_message()
                records = await receive_table(channel, first)
                await self._execute(self._m.merge(trio.current_time(), records, channel.peer))
                await send_table(channel, [self._m.full_state()[0]], join=False)
        self._push_pulls_done += 1
        return channel.peer

    async def _on_channel(self, channel: SecureChannel) -> None:
        self.proved(channel)
        if not self._rate.allow(str(channel.peer), trio.current_time()):
            # Closed unread: whatever the peer asked for, it asks too often.
            self._channels_limited += 1
            log.debug("channel over the peer's rate limit peer=%s", channel.peer.short)
            return
        with phase_deadline(self._config.push_pull_timeout, channel.peer.short,
                            "first message"):
            first = await channel.receive_message()
        if isinstance(first, DialBack):
            await self._reach.on_dial_back(channel, first, self._m.get(channel.peer))
            return
        if isinstance(first, Close):  # a channel only to prove the peer's identity (prove)
            return
        if not isinstance(first, PushPull):
            if self._handler is not None:
                await self._handler(channel, first)
            else:
                await channel.send_message(Close(Close.REJECTED, "this node only does membership"))
            return
        with phase_deadline(self._config.push_pull_timeout, channel.peer.short, "push-pull"):
            records = await receive_table(channel, first)
            if channel.peer == self._identity.peer_id:  # ourselves: see gossip.clash
                await self._clash.answer(channel, records)
                return
            if first.join:
                log.info("join request peer=%s", channel.peer.short)
            await self._execute(self._m.merge(trio.current_time(), records, channel.peer))
            await send_table(channel, self._m.full_state(), join=False)
            last = await receive_table(channel, await channel.receive_message())
            await self._execute(self._m.merge(trio.current_time(), last, channel.peer))
        self._push_pulls_done += 1


@asynccontextmanager
async def open_roster(
    network: Network,
    identity: Identity,
    swarm: Swarm,
    config: NodeConfig,
    *,
    rng: random.Random | None = None,
    handler: ChannelHandler | None = None,
    on_change: Callable[[Member], None] | None = None,
) -> AsyncIterator[Roster]:
    """Join (or start) a swarm and keep a live view of its members.

    Binds datagrams and a channel server on ``config.listen`` (the same port serves both;
    port 0 picks one that is free for both), starts a new swarm if ``config.bootstrap`` is
    empty and otherwise joins through any of its addresses in the background
    (:meth:`Roster.wait_joined`). On exit it leaves gracefully, gossiping the departure for up
    to ``config.membership.leave_timeout``.

    Args:
        config: the node's settings; the roster reads ``listen``, ``advertise`` (the address
            others should use, if not the bound one: ``0.0.0.0`` is not), ``bootstrap``
            (some members' addresses; one answering is enough), ``membership``,
            ``timeouts``, ``limits`` (inbound connections at once, and how often one peer
            may open one) and ``reachable`` (False: behind a NAT or a firewall that lets
            nothing in, so we initiate every exchange ourselves; None: find out with a
            dial-back check after joining, :mod:`gossip.reachability`, announcing ourselves
            unreachable until one succeeds; a node that starts a swarm, with no
            ``bootstrap``, is taken to be reachable, as others must dial it to join).
        handler: gets channels whose first message is not a push-pull (averaging traffic);
            without one, such channels are refused with Close(REJECTED).
        rng: the roster's only source of randomness (seed it in tests).
        on_change: called (synchronously, so keep it quick) with every member whose state,
            address or metadata changed, in the order the changes happened.
    """
    roster = Roster(network, identity, swarm, config, rng=rng, handler=handler,
                    on_change=on_change)
    try:
        with one_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(roster.run)
                try:
                    yield roster
                finally:
                    if not roster._dead:
                        with trio.move_on_after(config.membership.leave_timeout + 1,
                                                shield=True):
                            await roster.leave()
                    nursery.cancel_scope.cancel()
    finally:
        await roster._aclose()


async def _bind(nursery: trio.Nursery, network: Network, address: str,
                serve_at: Callable[..., Awaitable[object]]) -> DatagramEndpoint:
    """Open a datagram endpoint on ``address`` and start ``serve_at(bound, task_status=...)``
    (a channel server) in ``nursery`` on the same port. Returns the endpoint, the caller's to
    close.

    For port 0 the system picks the datagram port, which a stream socket (say, a connection's
    local end) may hold already: then another port will do, up to :data:`PORT_ATTEMPTS`.

    Raises:
        OSError: a fixed port that is taken (``EADDRINUSE``), or any other failure to bind;
            the endpoint is closed then.
    """
    any_port = parse_address(address)[1] == 0
    endpoint = await network.open_datagram(address)
    try:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                await nursery.start(serve_at, endpoint.local_address)
                return endpoint
            except OSError as exc:
                if not (any_port and exc.errno == errno.EADDRINUSE and attempt < PORT_ATTEMPTS):
                    raise
            await endpoint.aclose()
            endpoint = await network.open_datagram(address)
        raise AssertionError("unreachable: the last attempt returns or raises")
    except BaseException:
        with trio.CancelScope(shield=True):
            await endpoint.aclose()
        raise


def _log_change(member: Member) -> None:
    level = logging.INFO if member.state != State.SUSPECT else logging.DEBUG
    log.log(level, "member %s peer=%s incarnation=%d address=%s", member.state.name.lower(),
            member.peer.short, member.incarnation, member.address)
