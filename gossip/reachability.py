"""Whether other members can dial us: the dial-back check that a joining node runs.

Theory of operation
-------------------
A volunteer behind a NAT or a firewall can dial out but cannot be dialed. Such a node is a
member like any other except that it announces ``reachable = False``
(:class:`gossip.messages.Alive`): nobody picks it for an exchange, a download or a
push-pull, nobody probes it, and it keeps its own record alive by re-announcing itself
(:meth:`gossip.membership.Membership._keep_alive`). It still initiates all of that itself.

A node told to find out (``reachable=None``, the daemon's ``node.reachable = "auto"``)
announces itself unreachable, joins, then asks a member to dial it back:

1. it opens a channel to the member and sends ``DialBack(nonce)``, ``nonce`` fresh;
2. the member dials the host the request came from (the channel's source IP address), at the
   port in the requester's own member record (never the record's host, which is a claim,
   nor an address the request names: a member is not a dialer for hire, and never resolves
   a name for it) and expects the requester's identity in the handshake; on that new channel
   it sends the same ``DialBack`` and closes it;
3. the member then answers on the request's channel: ``DialBack(nonce)`` if its dial got
   through, ``Close(REJECTED, reason)`` if not, and then always at the dial's deadline
   (neither the reason nor the time says how it failed).

The requester asks the member it joined through first (it surely knows us), then reachable
members, then the others: in a swarm started all at once every node is unchecked, and a
member need only be dialable by us and able to dial out. Once found reachable, it push-pulls
with that member, since nobody gossips to a member held unreachable.

The requester believes only the channel that reached it, carrying its nonce: an answer
just ends its wait early (after :data:`GRACE` seconds for the new channel, whose first
message may be handled after the answer). So a lying member can make a reachable node
think it is not (it then merely is never dialed), never the reverse. A node that finds
itself unreachable asks again every :data:`RECHECK` seconds, so opening a port later
takes effect without a restart.

What a key holder can make of it: each member dials the address a requester announces for
itself, so a member is a dialer of any address, bounded three ways: at most
:data:`MAX_RUNNING` dial-backs at once, :data:`RATE` a second on average for all requesters
together, and one per requesting peer id and one per target address per :data:`GAP`
seconds (fresh identities are free; an address pins a host and a port). Not per host: nodes
that share an address's host (several daemons on one machine, or behind one NAT) each need
their own check. Its answer says only that the dial failed,
never how (refused, timed out, handshake failed), by its content or by its time, and it dials
only the requester's own source host, so a member is no port-scanning oracle: a key holder
can make it dial ports of its own host alone. A requester behind a NAT whose record names
another address than the one its connections come from is dialed at the latter, which is
where a forwarded port would be. A
request from a peer the member does not know yet is refused without dialing (``Close(BUSY)``:
no verdict; the requester asks another member, or later).

A roster runs both sides through one :class:`ReachabilityCheck`: its join loop calls
:meth:`ReachabilityCheck.run` after joining and whenever :meth:`ReachabilityCheck.due`, and
its channel server hands every channel that opens with a ``DialBack`` to
:meth:`ReachabilityCheck.on_dial_back`.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Awaitable, Callable

import trio

from .address import format_address, parse_address
from .channel import SecureChannel
from .endpoints import connect
from .config import NodeConfig, Timeouts
from .errors import GossipError, PeerTimeout
from .groups import one_error, phase_deadline
from .handshake import Swarm
from .identity import Identity, PeerId
from .limits import RateLimit
from .membership import Effect, Member, Membership
from .messages import DIAL_BACK_NONCE, Close, DialBack
from .network import Network

__all__ = ["Reachability", "ReachabilityCheck", "DialBacks", "ask", "answer",
           "dial_back_address", "GRACE", "RECHECK", "MAX_RUNNING", "GAP"]

log = logging.getLogger(__name__)
# The roster's log, for what ReachabilityCheck tells the operator: these lines were always
# the roster's, and operators filter on its name (docs/OPERATIONS.md quotes one).
roster_log = logging.getLogger("gossip.roster")

GRACE = 2.0  # s we wait for the member's channel once it says it got through
RECHECK = 600.0  # s between checks while we find ourselves unreachable
MAX_RUNNING = 8  # dial-backs this node runs for others at once; more are refused
RATE = 1.0  # dial-backs this node starts per second on average, for all requesters together
GAP = 10.0  # s between two dial-backs for one peer id, and for one target address (a node
# that restarts within it waits the rest: its check says "asked again", no verdict)
MAX_REMEMBERED = 1024  # peer ids, and target addresses, whose last dial-back we keep (LRU)


@dataclass(frozen=True)
class Reachability:
    """Whether others can dial us, as this node knows it, for logs and status."""

    reachable: bool
    mode: str  # "auto" (a dial-back decides) or "set" (configured)
    checked: bool  # auto: a dial-back check has run (False: not yet, or nobody to ask)
    detail: str  # what the last check found, for an operator


class DialBacks:
    """The member's side: admission (concurrency, rate, gaps) of dial-back requests."""

    def __init__(self) -> None:
        self._by_peer: OrderedDict[str, float] = OrderedDict()
        self._by_address: OrderedDict[str, float] = OrderedDict()
        self._rate = RateLimit(RATE, MAX_RUNNING, max_keys=1)
        self.running = 0

    def refusal(self, peer: str, address: str, now: float) -> str | None:
        """Why the request of ``peer`` to be dialed at ``address`` is refused now, or None:
        admitted (the caller then dials and calls :meth:`done`)."""
        if self.running >= MAX_RUNNING:
            return "busy with other dial-backs"
        target = "%s:%d" % parse_address(address)  # one spelling per host and port
        for table, key in ((self._by_peer, peer), (self._by_address, target)):
            last = table.get(key)
            if last is not None and now - last < GAP:
                return f"asked again within {GAP:g} s"
        if not self._rate.allow("", now):
            return "too many dial-backs just now"
        for table, key in ((self._by_peer, peer), (self._by_address, target)):
            table.pop(key, None)
            table[key] = now
            while len(table) > MAX_REMEMBERED:
                table.popitem(last=False)
        self.running += 1
        return None

    def done(self) -> None:
        self.running -= 1


def budget(timeouts: Timeouts) -> float:
    """The whole check, seen from the requester: our dial and theirs, and the grace."""
    return 2 * (timeouts.connect + timeouts.handshake) + GRACE


async def ask(network: Network, member: str, address: str, *, identity: Identity, swarm: Swarm,
              timeouts: Timeouts, nonce: bytes, reached: trio.Event) -> tuple[bool, str]:
    """Ask ``member`` at ``address`` to dial us back, and wait until ``reached`` is set (by
    our channel handler, on the member's ``DialBack`` carrying ``nonce``) or it is clear it
    will not be. Returns whether the member tried (else ask another) and what happened, for
    the log; whether it got through is ``reached``.

    A member that took the request and then gave no answer within :func:`budget` counts as
    having tried (it may have dialed and failed more slowly than we wait): a verdict, as a
    refusal would be.

    Raises:
        PeerTimeout: not even the request got through within :func:`budget` (phase
            ``"dial-back request"``).
        GossipError: the request itself failed otherwise (the member is not to blame for our
            state: ask another).
    """
    short, sent = PeerId(member).short, False
    try:
        with trio.fail_after(budget(timeouts)):
            channel = await connect(network, address, identity=identity, swarm=swarm,
                                    allow=frozenset({PeerId(member)}), timeouts=timeouts)
            async with channel:
                await channel.send_message(DialBack(nonce))
                sent = True
                answer = await _first_of(channel, reached)
    except trio.TooSlowError:  # not phase_deadline: once the request is out, it is a verdict
        if not sent:
            raise PeerTimeout(short, "dial-back request") from None
        return True, f"{short} gave no answer within {budget(timeouts):g} s"
    if isinstance(answer, DialBack) and not reached.is_set():
        # It says it got through: give its channel a moment.
        with trio.move_on_after(GRACE):
            await reached.wait()
    if reached.is_set():
        return True, f"dialed back by {short}"
    if isinstance(answer, DialBack):
        return True, f"{short} says it got through, but no channel reached us"
    if isinstance(answer, Close) and answer.code == Close.REJECTED:
        return True, f"{short} could not dial us: {answer.reason}"
    if isinstance(answer, Close):
        return False, f"{short} did not try: {answer.reason}"
    return False, f"{short} answered {type(answer).__name__}"


async def _first_of(channel: SecureChannel, reached: trio.Event) -> object | None:
    """The member's answer, or None as soon as ``reached`` is set.

    Raises:
        GossipError: the channel failed (as itself, not in a group).
    """
    answer: object | None = None

    async def receive(done: trio.CancelScope) -> None:
        nonlocal answer
        answer = await channel.receive_message()
        done.cancel()

    async def wait(done: trio.CancelScope) -> None:
        await reached.wait()
        done.cancel()

    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive, nursery.cancel_scope)
            nursery.start_soon(wait, nursery.cancel_scope)
    return answer


def dial_back_address(source: str, announced: str) -> str | None:
    """Where a dial-back goes: the host the request came from (an IP address, never a name
    to resolve), at the port of the requester's own member record; None if the channel
    cannot tell its host. Never the record's host: a record is a claim, and dialling what it
    names made every member a port scanner of any address a key holder announced."""
    if not source:
        return None
    return format_address(source, parse_address(announced)[1])


async def answer(channel: SecureChannel, request: DialBack, address: str, *,
                 network: Network, identity: Identity, swarm: Swarm, timeouts: Timeouts) -> bool:
    """Dial ``channel.peer`` back at ``address`` (its own record's), send it ``request``
    there, and tell it on ``channel`` how that went: ``DialBack`` if the dial got through,
    ``Close(REJECTED)`` with a fixed reason if not (how it failed is logged here, never
    told). Returns whether the dial got through.

    Raises:
        PeerTimeout: the requester did not take our answer in time (phase
            ``"dial-back answer"``).
        GossipError: ``channel`` itself failed otherwise while we answered.
    """
    peer, limit = channel.peer, timeouts.connect + timeouts.handshake
    started = trio.current_time()
    try:
        with phase_deadline(limit, address, "dial-back"):
            back = await connect(network, address, identity=identity, swarm=swarm,
                                 allow=frozenset({peer}), timeouts=timeouts)
            async with back:
                await back.send_message(request)
        reached = True
    except GossipError as exc:
        log.debug("dial-back failed peer=%s address=%s: %s", peer.short, address, exc)
        reached = False
        # How it failed must not show in when we answer either: a closed port fails in
        # milliseconds, one that takes the connection and says nothing at the deadline. Every
        # failure is answered at the deadline.
        await trio.sleep_until(started + limit)
    # The requester is waiting: it reads at once.
    with phase_deadline(timeouts.connect, peer.short, "dial-back answer"):
        await channel.send_message(request if reached else Close(
            Close.REJECTED, f"no channel to {address} within {limit:g} s"[:200]))
    return reached


class ReachabilityCheck:
    """Both sides of the check, as a roster runs them: whether we are reachable (configured,
    or what the last check found), the check of our own in flight and when to run it again,
    and the admission of the dial-backs we run for others (:class:`DialBacks`).

    Args:
        config: the node's settings: ``reachable`` (None: find out), ``bootstrap`` (none:
            the swarm's first node, taken to be reachable) and ``timeouts``.
        alive: the roster's :meth:`~gossip.roster.Roster.alive`: whom to ask.
        queue: carries out effects of the roster's machine (the announcement that we are
            reachable).
        push_pull: push-pulls with a member (address, peer id) once we are found reachable.
        changed: tells the roster's waiters that :attr:`reachability` changed.
    """

    def __init__(self, network: Network, identity: Identity, swarm: Swarm, config: NodeConfig,
                 *, alive: Callable[..., list[Member]], queue: Callable[[list[Effect]], None],
                 push_pull: Callable[[str, PeerId], Awaitable[object]],
                 changed: Callable[[], None]) -> None:
        self._network = network
        self._identity = identity
        self._swarm = swarm
        self._timeouts = config.timeouts
        self._alive = alive
        self._queue = queue
        self._push_pull = push_pull
        self._changed = changed
        if config.reachable is not None:
            self._reachability = Reachability(config.reachable, "set", False, "configured")
        elif not config.bootstrap:
            self._reachability = Reachability(True, "auto", False, "the swarm's first node (no "
                                              "bootstrap address): taken to be reachable")
        else:
            self._reachability = Reachability(False, "auto", False, "not checked yet")
        self._pending: tuple[bytes, trio.Event] | None = None  # our check in flight
        self._dial_backs = DialBacks()  # the checks we run for others
        self._next = math.inf  # when to check again (auto, while unreachable)

    @property
    def reachability(self) -> Reachability:
        return self._reachability

    def due(self, now: float) -> bool:
        """Whether to check again now (a check without a verdict, or :data:`RECHECK` after
        one that found us unreachable)."""
        return now >= self._next

    async def run(self, m: Membership, first: PeerId | None) -> None:
        """In auto mode, until one check has found us reachable: ask up to three members, in
        turn, to dial us back, until one gives a verdict; announce the outcome.

        Args:
            m: the roster's machine: its rng, and our own record.
            first: the member we joined through, asked first.
        """
        if self._reachability.mode != "auto" or self._reachability.reachable:
            return
        # The member we joined through first: it surely knows us, and we could dial it. Then
        # reachable members, then the others, which may only be unchecked yet (every node of
        # a swarm started together with "auto" announces itself unreachable at first): a
        # dial-back needs only that we can dial the member, and it us.
        rng = m.rng
        reachable, others = self._alive(reachable=True), self._alive(reachable=False)
        head = [member for member in reachable + others if member.peer == first]
        asked = head + [member for member in (rng.sample(reachable, len(reachable))
                                              + rng.sample(others, len(others)))
                        if member not in head]
        asked = asked[:3]
        detail, verdict = "no member to ask yet", False
        for member in asked:
            nonce = secrets.token_bytes(DIAL_BACK_NONCE)
            reached = trio.Event()
            self._pending = (nonce, reached)
            tried = False
            try:
                tried, detail = await ask(
                    self._network, member.peer, member.address, identity=self._identity,
                    swarm=self._swarm, timeouts=self._timeouts, nonce=nonce, reached=reached)
            except GossipError as exc:
                detail = f"asking {member.peer.short} failed: {exc}"
            finally:
                self._pending = None
            verdict = reached.is_set() or tried
            if verdict:
                break  # a request that failed, or was refused, is none: ask the next
            roster_log.info("dial-back check got no verdict: %s", detail)
        reachable = verdict and reached.is_set()
        # No verdict (nobody to ask, or nobody tried): ask again at the join loop's next turn.
        self._next = (math.inf if reachable else trio.current_time()
                      + (RECHECK if verdict else 0.0))
        self._verdict(m.myself().address, reachable, detail, checked=verdict)
        if reachable:
            self._queue(m.set_meta(trio.current_time(), reachable=True))
            # Tell the member we asked at once, by push-pull: gossip goes to reachable members
            # only, and in a swarm started together, with every node checking, it may hold
            # no member reachable yet, nor anyone us.
            try:
                await self._push_pull(member.address, member.peer)
            except GossipError as exc:
                roster_log.debug("push-pull after the dial-back failed peer=%s: %s",
                                 member.peer.short, exc)

    def _verdict(self, address: str, reachable: bool, detail: str, *, checked: bool) -> None:
        self._reachability = Reachability(reachable, "auto",
                                          checked or self._reachability.checked, detail)
        if reachable:
            roster_log.info("reachable: other members can dial us at %s (%s)", address, detail)
        elif checked:
            roster_log.warning("not reachable at %s (%s): this node trains and averages "
                               "outbound only, and nobody dials it; to be a full member, let "
                               "TCP and UDP in to that address (forward the port) or set "
                               "node.advertise; checking again in %.0f s", address, detail,
                               RECHECK)
        self._changed()

    async def on_dial_back(self, channel: SecureChannel, first: DialBack,
                           record: Member | None) -> None:
        """A ``DialBack`` opening a channel: the answer to our own check (its nonce), or a
        member's request that we dial it back (``record``: the requester's own member
        record, None if it is not in our table).

        Raises:
            GossipError: the channel failed while we answered (see :func:`answer`).
        """
        pending = self._pending
        if pending is not None and first.nonce == pending[0]:
            pending[1].set()
            return
        target = None if record is None else dial_back_address(channel.host, record.address)
        refusal = ("you are not in my member table yet" if record is None
                   else "your address cannot be told from this channel" if target is None
                   else self._dial_backs.refusal(str(channel.peer), target, trio.current_time()))
        if refusal is not None:  # Close(BUSY): no verdict, the requester asks elsewhere
            await channel.send_closing(Close(Close.BUSY, refusal))
            return
        assert record is not None and target is not None
        try:
            await answer(channel, first, target, network=self._network,
                         identity=self._identity, swarm=self._swarm, timeouts=self._timeouts)
        finally:
            self._dial_backs.done()
