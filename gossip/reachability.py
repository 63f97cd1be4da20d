"""Whether other members can dial us: the dial-back check that a joining node runs.

Theory of operation
-------------------
A volunteer behind a NAT or a firewall can dial out but cannot be dialed. Such a node is a
member like any other except that it announces ``reachable = False``
(:class:`gossip.messages.Alive`): nobody picks it for an exchange, a download or a
push-pull, nobody probes it, and it keeps its own record alive by re-announcing itself
(:meth:`gossip.membership.Membership._keep_alive`). It still initiates all of that itself.

A node told to find out (``reachable=None``, the daemon's ``node.reachable = "auto"``)
announces itself unreachable, joins, then asks a reachable member to dial it back:

1. it opens a channel to the member and sends ``DialBack(nonce)``, ``nonce`` fresh;
2. the member dials the address in the requester's own member record (never an address
   the request names: a member is not a dialer for hire) and expects the requester's
   identity in the handshake; on that new channel it sends the same ``DialBack`` and
   closes it;
3. the member then answers on the request's channel: ``DialBack(nonce)`` if its dial got
   through, ``Close(REJECTED, why)`` if not.

The requester believes only the channel that reached it, carrying its nonce: an answer
just ends its wait early (after :data:`GRACE` seconds for the new channel, whose first
message may be handled after the answer). So a lying member can make a reachable node
think it is not (it then merely is never dialed), never the reverse. A node that finds
itself unreachable asks again every :data:`RECHECK` seconds, so opening a port later
takes effect without a restart.

A member runs at most :data:`MAX_RUNNING` dial-backs at once and one per peer per
:data:`PEER_GAP` seconds: a key holder can make members dial the address it announces, at
that pace, and no faster.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from .channel import SecureChannel, Timeouts, connect
from .errors import GossipError
from .handshake import Swarm
from .identity import Identity, PeerId
from .messages import Close, DialBack
from .network import Network

__all__ = ["Reachability", "DialBacks", "ask", "answer", "GRACE", "RECHECK", "MAX_RUNNING",
           "PEER_GAP"]

log = logging.getLogger(__name__)

GRACE = 2.0  # s we wait for the member's channel once it says it got through
RECHECK = 600.0  # s between checks while we find ourselves unreachable
MAX_RUNNING = 8  # dial-backs this node runs for others at once; more are refused
PEER_GAP = 60.0  # s between two dial-backs for one peer
MAX_REMEMBERED = 1024  # peers whose last dial-back time we keep (the oldest go first)


@dataclass(frozen=True)
class Reachability:
    """Whether others can dial us, as this node knows it, for logs and status."""

    reachable: bool
    mode: str  # "auto" (a dial-back decides) or "set" (configured)
    checked: bool  # auto: a dial-back check has run (False: not yet, or nobody to ask)
    detail: str  # what the last check found, for an operator


class DialBacks:
    """The member's side: admission (rate and concurrency) of dial-back requests."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self.running = 0

    def refusal(self, peer: str, now: float) -> str | None:
        """Why the request of ``peer`` is refused now, or None: admitted (the caller then
        runs it and calls :meth:`done`)."""
        if self.running >= MAX_RUNNING:
            return "busy with other dial-backs"
        last = self._last.get(peer)
        if last is not None and now - last < PEER_GAP:
            return f"asked again within {PEER_GAP:g} s"
        self._last.pop(peer, None)
        self._last[peer] = now
        while len(self._last) > MAX_REMEMBERED:
            self._last.pop(next(iter(self._last)))
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

    Raises:
        GossipError: the request itself failed (the member is not to blame for our state:
            ask another).
        trio.TooSlowError: no answer within :func:`budget`.
    """
    with trio.fail_after(budget(timeouts)):
        channel = await connect(network, address, identity=identity, swarm=swarm,
                                allow=frozenset({PeerId(member)}), timeouts=timeouts)
        async with channel:
            await channel.send_message(DialBack(nonce))
            answer = await _first_of(channel, reached)
    short = PeerId(member).short
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
    """The member's answer, or None as soon as ``reached`` is set."""
    answer: object | None = None
    async with trio.open_nursery() as nursery:
        async def receive() -> None:
            nonlocal answer
            answer = await channel.receive_message()
            nursery.cancel_scope.cancel()

        async def wait() -> None:
            await reached.wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(receive)
        nursery.start_soon(wait)
    return answer


async def answer(channel: SecureChannel, request: DialBack, address: str | None, *,
                 network: Network, identity: Identity, swarm: Swarm, timeouts: Timeouts) -> bool:
    """Dial ``channel.peer`` back at ``address`` (its own record's; None: we do not know
    it), send it ``request`` there, and tell it on ``channel`` how that went. Returns
    whether the dial got through. Errors of the dial are the answer, not raised.

    Raises:
        GossipError: ``channel`` itself failed while we answered.
    """
    peer = channel.peer
    if address is None:
        why = "you are not in my member table yet"
    else:
        try:
            with trio.fail_after(timeouts.connect + timeouts.handshake):
                back = await connect(network, address, identity=identity, swarm=swarm,
                                     allow=frozenset({peer}), timeouts=timeouts)
                async with back:
                    await back.send_message(request)
            why = ""
        except trio.TooSlowError:
            why = f"no connection to {address} within {timeouts.connect + timeouts.handshake:g} s"
        except GossipError as exc:
            why = f"{address}: {exc}"
    with trio.fail_after(timeouts.connect):  # the requester is waiting: it reads at once
        if why:
            log.debug("dial-back failed peer=%s: %s", peer.short, why)
            await channel.send_message(Close(Close.REJECTED, why[:200]))
        else:
            await channel.send_message(request)
    return not why
