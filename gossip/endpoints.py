"""The endpoints that make secure channels: :func:`handshake`, :func:`connect`, :func:`serve`.

Theory of operation
-------------------
:func:`handshake` runs the Noise XXpsk0 handshake of :mod:`gossip.handshake` over any trio
stream, each handshake message framed by a 4-byte big-endian length, and returns the
:class:`~gossip.channel.SecureChannel` that carries records from then on. It takes no
deadline: its callers put it under one.

:func:`connect` and :func:`serve` compose a :class:`~gossip.network.Network` with the
handshake under the connect and handshake deadlines of :class:`Timeouts`. Mid-rotation of the
swarm key, :func:`connect` dials under the key the peer is believed to hold and falls back to
the other once when the peer closes after message 1 (how a node without that key answers).
:func:`serve` also bounds what a dialer without the swarm key can hold: its first handshake
message must come within :data:`FIRST_MESSAGE_TIMEOUT`, a replayed message 1 is closed at
once, and :class:`~gossip.limits.Admission` caps the connections open at once and those of
one host that have not proved the key yet; a :class:`~gossip.limits.RateLimit` keyed by host
caps how often one host may open one, before any cryptographic work is done for it.
"""

from __future__ import annotations

import logging
import math
from typing import Awaitable, Callable

import trio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .channel import Reader, SecureChannel
from .config import Limits, Timeouts
from .errors import (
    HandshakeClosed,
    HandshakeError,
    LocalProtocolError,
    PeerGone,
    PeerTimeout,
    WireError,
)
from .groups import phase_deadline
from .handshake import (
    MAX_HANDSHAKE_MESSAGE,
    NoiseHandshake,
    Swarm,
    check_hello,
    make_hello,
    read_first_message,
    x25519_public_bytes,
)
from .identity import Identity
from .limits import Admission, FirstMessages, RateLimit
from .network import Network, peer_host, reset_on_close
from .wire import FRAME_HEADER, encode_frame, frame_length

__all__ = ["FIRST_MESSAGE_TIMEOUT", "ChannelHandler", "handshake", "connect", "serve"]

log = logging.getLogger(__name__)

# s from accepting a connection to a valid handshake message 1 (the proof of the swarm key;
# capped by Timeouts.handshake). An honest dialer sends its 52 bytes as soon as its connect
# completes, so they arrive about one round trip after our accept: 0.2 s on a 200 ms path,
# 1.2 s if the segment is lost once (Linux's first retransmission comes after 1 s). 2 s
# leaves that margin, and bounds what a silent connection holds to a tenth of what a
# whole handshake deadline would.
FIRST_MESSAGE_TIMEOUT = 2.0
_HEADER = FRAME_HEADER.size


async def _read_handshake_message(reader: Reader) -> bytes:
    header = bytearray(_HEADER)
    if await reader.read_into(memoryview(header)) < _HEADER:
        # A responder that does not hold our swarm key closes right after message 1.
        raise HandshakeClosed(
            "connection closed during the handshake (as a peer with another swarm key or "
            "cipher does)")
    try:
        size = frame_length(header, MAX_HANDSHAKE_MESSAGE)
    except WireError as exc:
        raise HandshakeError(str(exc)) from None
    body = bytearray(size)
    if await reader.read_into(memoryview(body)) < size:
        raise PeerGone("connection closed during the handshake")
    return bytes(body)


async def handshake(
    stream: trio.abc.Stream,
    *,
    identity: Identity,
    swarm: Swarm,
    initiator: bool,
    allow: frozenset[str] | None = None,
    record_timeout: float = Timeouts.record,
    on_proved: Callable[[], None] | None = None,
    previous: bool = False,
    on_first: Callable[[bytes], bool] | None = None,
) -> SecureChannel:
    """Run the secure handshake over ``stream`` and return the channel. Takes no deadline:
    wrap it in :func:`~gossip.groups.phase_deadline` (``connect`` and ``serve`` do). On any
    failure the stream is closed.

    Args:
        allow: peer ids accepted on the other side; None accepts any holder of the swarm
            key. An initiator that knows whom it dials passes ``frozenset({peer_id})``: a
            different holder of the swarm key is then refused before we reveal who we are.
        on_first: responder only: called with the initiator's ephemeral key once message 1
            has authenticated under the swarm key (or its previous one), before we answer;
            False refuses it as a replay (``serve`` also lifts its first-message deadline
            then).
        on_proved: responder only: called once the handshake has completed (message 3
            checked): the initiator is a live holder of the key and of its identity.
        previous: initiator only: initiate under ``swarm.previous``, the key being rotated
            away from, instead of ``swarm.key`` (:func:`connect` decides). A responder
            accepts message 1 under either of its keys (:func:`read_first_message`).

    Raises:
        HandshakeError: a wrong swarm key (seen by the responder), bad signature, version or
            swarm mismatch, or a peer not on the allow-list.
        PeerGone: the connection closed or reset before the handshake completed; this is
            what an initiator sees when the responder does not hold its swarm key.
        LocalProtocolError: ``previous`` for a responder, or for a swarm without one.
    """
    static = X25519PrivateKey.generate()  # per connection: the Ed25519 identity is what lasts
    reader = Reader(stream)

    async def send(message: bytes) -> None:
        await stream.send_all(encode_frame(message))

    try:
        if initiator:
            if previous and swarm.previous is None:
                raise LocalProtocolError("initiating under the previous swarm key, but the "
                                         "swarm has none")
            psk = swarm.previous if previous and swarm.previous is not None else swarm.key
            hs = NoiseHandshake(initiator=True, psk=psk, static=static, cipher=swarm.cipher)
            await send(hs.write_message())
            payload = hs.read_message(await _read_handshake_message(reader))
            peer = check_hello(payload, hs.remote_static, swarm, allow)
            await send(hs.write_message(make_hello(identity, x25519_public_bytes(static), swarm)))
        else:
            if previous:
                raise LocalProtocolError("only an initiator chooses the key to initiate under")
            # Under the swarm key, or mid-rotation the previous one: whichever the dialer used.
            hs, answered_previous = read_first_message(await _read_handshake_message(reader),
                                                       swarm, static)
            if on_first is not None and not on_first(hs.remote_ephemeral or b""):
                raise HandshakeError("handshake message 1 replayed")
            # Signed only now: a dialer without the swarm key costs us no signature.
            await send(hs.write_message(make_hello(identity, x25519_public_bytes(static), swarm)))
            payload = hs.read_message(await _read_handshake_message(reader))
            peer = check_hello(payload, hs.remote_static, swarm, allow)
            if on_proved is not None:
                on_proved()
    except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
        await trio.aclose_forcefully(stream)
        raise PeerGone(f"connection lost during the handshake: {exc}") from None
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    if not initiator and swarm.previous is not None:
        swarm.peer_keys.answered(previous=answered_previous)
    send_cipher, receive_cipher = hs.split()
    return SecureChannel(stream, send_cipher, receive_cipher, peer, record_timeout=record_timeout)


async def connect(
    network: Network,
    address: str,
    *,
    identity: Identity,
    swarm: Swarm,
    allow: frozenset[str] | None = None,
    timeouts: Timeouts = Timeouts(),
) -> SecureChannel:
    """Dial ``address`` and run the handshake as initiator, each under its deadline.

    Mid-rotation (``swarm.previous`` set) the handshake is tried under the key the peer at
    ``address`` is believed to hold (:attr:`Swarm.peer_keys <gossip.handshake.Swarm>`; the
    swarm key if nothing is known), and if the peer closes the connection after message 1,
    which is how a node without that key answers, ``address`` is dialed once more under the
    other key. The outcome is remembered for the next dial. So a dial costs at most two
    connections, each under its own deadlines.

    Raises:
        PeerTimeout: the connect or handshake phase ran past its deadline.
        PeerGone, HandshakeError: as for :meth:`Network.dial` and :func:`handshake`;
            :class:`HandshakeClosed` mid-rotation means the peer refused both keys.
    """
    if swarm.previous is None:
        return await _connect(network, address, identity, swarm, allow, timeouts, False)
    first = swarm.peer_keys.dial_previous_first(address)
    try:
        channel = await _connect(network, address, identity, swarm, allow, timeouts, first)
    except HandshakeClosed:
        log.debug("handshake refused under the %s swarm key; trying the %s one address=%s",
                  "previous" if first else "current", "current" if first else "previous",
                  address)
        channel = await _connect(network, address, identity, swarm, allow, timeouts,
                                 not first)
        swarm.peer_keys.dialed(address, previous=not first, refused=True)
        return channel
    swarm.peer_keys.dialed(address, previous=first, refused=False)
    return channel


async def _connect(network: Network, address: str, identity: Identity, swarm: Swarm,
                   allow: frozenset[str] | None, timeouts: Timeouts,
                   previous: bool) -> SecureChannel:
    with phase_deadline(timeouts.connect, address, "connect"):
        stream = await network.dial(address)
    with phase_deadline(timeouts.handshake, address, "handshake"):
        return await handshake(
            stream, identity=identity, swarm=swarm, initiator=True, allow=allow,
            record_timeout=timeouts.record, previous=previous,
        )


ChannelHandler = Callable[[SecureChannel], Awaitable[None]]


async def serve(
    network: Network,
    address: str,
    handler: ChannelHandler,
    *,
    identity: Identity,
    swarm: Swarm,
    allow: frozenset[str] | None = None,
    timeouts: Timeouts = Timeouts(),
    limits: Limits | None = None,
    on_refused: Callable[[str], None] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept connections on ``address``; run the handshake as responder under its deadline,
    then ``handler(channel)`` in a task of its own. A connection that fails the handshake, or
    whose handler raises a :class:`GossipError`, is closed and logged; the server goes on.
    Calls ``task_status.started(bound_address)`` once listening.

    Until its handshake completes, a connection is *unproven*, and it can be evicted; its
    message 1 must authenticate under the swarm key within :data:`FIRST_MESSAGE_TIMEOUT` (or
    ``timeouts.handshake``, if shorter), and one that repeats an earlier message 1 (a
    replay) is closed at once. See :mod:`gossip.limits` for why.

    Args:
        limits: ``max_connections``, connections open at once, handshakes included: one
            more is closed as soon as it is accepted, before a byte is read; and
            ``max_handshakes_per_host``, unproven connections at once from one remote host
            (IP address): one more from it closes the host's oldest unproven one, so that an
            outsider cannot hold the places of honest peers that share its address; and
            ``host_rate`` / ``host_burst``, connections one host may open, as a token bucket
            spent at accept: one over it is closed before a byte is read, so a flood from
            one address costs no cryptography past the bucket. None: no limits. (Its
            per-peer rate is the roster's to enforce, once a peer is known.)
        on_refused: called with the limit's name for each connection closed by a limit:
            ``"max_connections"`` or ``"host_rate"`` (the new one, refused) or
            ``"max_handshakes_per_host"`` (the oldest unproven one of its host, evicted).
    """
    admission: Admission[trio.CancelScope] = (
        Admission(limits.max_connections, limits.max_handshakes_per_host) if limits is not None
        else Admission(None, None))
    hosts = RateLimit(limits.host_rate, limits.host_burst) if limits is not None else None
    first_message = min(FIRST_MESSAGE_TIMEOUT, timeouts.handshake)
    firsts = FirstMessages()  # to know a replayed message 1

    def refused(limit: str) -> None:
        if on_refused is not None:
            on_refused(limit)

    async def on_stream(stream: trio.abc.Stream) -> None:
        host = peer_host(stream)
        if admission.full:
            refused("max_connections")
            reset_on_close(stream)
            return  # the network closes the stream
        if hosts is not None and not hosts.allow(host, trio.current_time()):
            refused("host_rate")
            reset_on_close(stream)
            return  # before a byte is read: no AEAD, no Diffie-Hellman, no signature
        # One scope per connection: its deadline is the first-message deadline, and
        # cancelling it evicts the connection (only while unproven: see proved()).
        scope = trio.CancelScope(deadline=trio.current_time() + first_message)
        evicted = admission.admit(host, scope)
        if evicted is not None:
            evicted.cancel()
            refused("max_handshakes_per_host")
            log.debug("unproven connection evicted host=%s", host)

        def first(ephemeral: bytes) -> bool:
            if not firsts.fresh(ephemeral):
                log.debug("replayed handshake message 1 closed host=%s", host)
                return False
            scope.deadline = math.inf  # the handshake's own deadline goes on
            return True

        def proved() -> None:
            admission.proved(host, scope)

        try:
            with phase_deadline(timeouts.handshake, "incoming", "handshake"), scope:
                channel = await handshake(
                    stream, identity=identity, swarm=swarm, initiator=False, allow=allow,
                    record_timeout=timeouts.record, on_proved=proved, on_first=first,
                )
            if scope.cancelled_caught:  # the handshake closed the stream
                if trio.current_time() >= scope.deadline:
                    raise PeerTimeout("incoming", "handshake message 1")
                return  # evicted (counted and logged above)
            async with channel:
                await handler(channel)
        finally:
            admission.release(host, scope)

    await network.serve(address, on_stream, task_status=task_status)
