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
2. the member dials the address in the requester's own member record (never an address
   the request names: a member is not a dialer for hire) and expects the requester's
   identity in the handshake; on that new channel it sends the same ``DialBack`` and
   closes it;
3. the member then answers on the request's channel: ``DialBack(nonce)`` if its dial got
   through, ``Close(REJECTED, reason)`` if not (the reason never says how it failed).

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
never how (refused, timed out, handshake failed), so a member is no port-scanning oracle. A
request from a peer the member does not know yet is refused without dialing (``Close(BUSY)``:
no verdict; the requester asks another member, or later).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import trio

from .address import parse_address
from .channel import SecureChannel, connect, phase_deadline
from .config import Timeouts
from .errors import GossipError, PeerTimeout
from .groups import one_error
from .handshake import Swarm
from .identity import Identity, PeerId
from .limits import RateLimit
from .messages import Close, DialBack
from .network import Network

__all__ = ["Reachability", "DialBacks", "ask", "answer", "GRACE", "RECHECK", "MAX_RUNNING",
           "GAP"]

log = logging.getLogger(__name__)

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
    # The requester is waiting: it reads at once.
    with phase_deadline(timeouts.connect, peer.short, "dial-back answer"):
        await channel.send_message(request if reached else Close(
            Close.REJECTED, f"no channel to {address} within {limit:g} s"[:200]))
    return reached
