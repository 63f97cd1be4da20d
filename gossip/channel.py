"""The secure channel: an authenticated, encrypted record stream between two nodes.

Theory of operation
-------------------
:func:`handshake` runs the Noise XXpsk0 handshake of :mod:`gossip.handshake` over any trio
stream, each handshake message framed by a 4-byte big-endian length. The result is a
:class:`SecureChannel` that carries *records*: up to :data:`MAX_RECORD` bytes of plaintext,
each sent as::

    length   u32 big-endian, = len(ciphertext) = len(plaintext) + 16
    ciphertext  AEAD(key, nonce = counter, ad = length bytes)

The AEAD is the swarm's cipher (:attr:`~gossip.handshake.Swarm.cipher`): AES-256-GCM (nonce
``0^32 || u64be(counter)``) by default, or ChaCha20-Poly1305 (``0^32 || u64le(counter)``).

The counter starts at 0 in each direction and counts records, so a replayed, reordered,
dropped or truncated record fails authentication; the length is authenticated as associated
data. Records are far larger than Noise transport messages (64 KiB) so bulk tensors move in
few system calls and few AEAD invocations.

Every read is bounded before allocation: a record header announcing more than
``MAX_RECORD + 16`` bytes is a protocol error, and the body is read into a buffer allocated
once per channel. Every read is bounded in time too: the wait for the *next* record is the
caller's phase deadline (:func:`~gossip.groups.phase_deadline` around the call), and once
a record has begun, the rest of it must arrive within ``Timeouts.record`` (the slowloris
guard). While a payload streams (:meth:`SecureChannel.stall_guard`), a stall deadline moves
with every byte received: ``stall`` seconds without one, inside a record or between two,
drop the peer however long the payload's own deadline is (:mod:`gossip.linkrate`).

Any failure to receive (bad length, failed authentication, truncation, a reset) breaks the
channel: the stream is closed, the error is raised, nothing from the bad record is delivered,
and every later call raises. A clean end of stream between records raises :class:`PeerGone`.
A failure to *send* (the peer reset or closed the connection) ends only the sending direction:
what the peer sent before it went may still be waiting to be read, and what a peer sent, not
whether our own send had finished, is what decides a verdict on it (an exchange's strike, say).
The stream is closed when the channel is, or when a receive fails.

:func:`connect` and :func:`serve` compose a :class:`~gossip.network.Network` with the
handshake under the connect and handshake deadlines of :class:`Timeouts`. :func:`serve` also
bounds what a dialer without the swarm key can hold: its first handshake message must come
within :data:`FIRST_MESSAGE_TIMEOUT`, and :class:`~gossip.limits.Admission` caps the
connections open at once and those of one host that have not proved the key yet.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable, Iterator

import trio
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from .errors import (
    BadMessage,
    ChannelClosed,
    GossipError,
    HandshakeClosed,
    HandshakeError,
    LocalProtocolError,
    PeerGone,
    PeerTimeout,
    RemoteProtocolError,
    WireError,
)
from .handshake import (
    MAX_HANDSHAKE_MESSAGE,
    TAGLEN,
    CipherState,
    NoiseHandshake,
    Swarm,
    x25519_public_bytes,
    check_hello,
    make_hello,
    read_first_message,
)
from .config import Limits, Timeouts
from .identity import Identity, PeerId
from .limits import Admission, FirstMessages
from .messages import Message
from .groups import phase_deadline
from .network import Network, peer_host
from .wire import FRAME_HEADER, decode, encode, encode_frame, frame_length

__all__ = [
    "MAX_RECORD",
    "FIRST_MESSAGE_TIMEOUT",
    "Timeouts",
    "ChannelStatistics",
    "SecureChannel",
    "handshake",
    "connect",
    "serve",
]

log = logging.getLogger(__name__)

MAX_RECORD = 1 << 20  # plaintext bytes in one record
# s from accepting a connection to a valid handshake message 1 (the proof of the swarm key;
# capped by Timeouts.handshake). An honest dialer sends its 52 bytes as soon as its connect
# completes, so they arrive about one round trip after our accept: 0.2 s on a 200 ms path,
# 1.2 s if the segment is lost once (Linux's first retransmission comes after 1 s). 2 s
# leaves that margin, and bounds what a silent connection holds to a tenth of what a
# whole handshake deadline would.
FIRST_MESSAGE_TIMEOUT = 2.0
CLOSE_GRACE = 1.0  # s a peer is given to take the last messages we send it (a Close)
_HEADER = FRAME_HEADER.size
_INITIAL_BUFFER = 4096


def _room(buf: bytearray, size: int) -> bytearray:
    """``buf``, or a larger one if it holds fewer than ``size`` bytes (doubling, so a stream of
    growing records reallocates only a few times; ``size`` is already bounded by the caller)."""
    if len(buf) >= size:
        return buf
    return bytearray(max(size, min(2 * len(buf), _HEADER + MAX_RECORD + TAGLEN)))


@dataclass(frozen=True)
class ChannelStatistics:
    records_sent: int
    records_received: int
    bytes_sent: int  # on the wire, headers and tags included
    bytes_received: int


@dataclass
class _Counts:
    """What a channel has carried so far: :class:`ChannelStatistics`, as it grows."""

    records_sent: int = 0
    records_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0


class _Reader:
    """Reads exact byte counts from a stream. On a trio socket stream it reads straight into
    the caller's buffer (``recv_into``), saving one copy of every byte received."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._sock = stream.socket if isinstance(stream, trio.SocketStream) else None
        self.last = -math.inf  # trio time of the latest byte read
        # While a record is read under a stall deadline: the record's scope, which every
        # byte moves on to min(end, now + stall).
        self._scope: trio.CancelScope | None = None
        self._end = self._stall = math.inf

    def watch(self, scope: trio.CancelScope | None, end: float = math.inf,
              stall: float = math.inf) -> None:
        """Move ``scope``'s deadline on with each byte read, to ``min(end, now + stall)``
        (None: stop)."""
        self._scope, self._end, self._stall = scope, end, stall

    async def read_some_into(self, view: memoryview) -> int:
        """Read at least one byte into ``view`` (at most ``len(view)``); 0 at end of stream."""
        if self._sock is not None:
            try:
                n = await self._sock.recv_into(view)
            except OSError as exc:
                raise trio.BrokenResourceError(str(exc)) from exc
        else:
            chunk = await self._stream.receive_some(len(view))
            n = len(chunk)
            view[:n] = chunk
        if n:
            self.last = trio.current_time()
            if self._scope is not None:
                self._scope.deadline = min(self._end, self.last + self._stall)
        return n

    async def read_into(self, view: memoryview) -> int:
        """Fill ``view``; returns the number of bytes read, less than ``len(view)`` only at
        end of stream."""
        got, size = 0, len(view)
        while got < size:
            n = await self.read_some_into(view[got:])
            if n == 0:
                break
            got += n
        return got


class SecureChannel(trio.abc.AsyncResource):
    """An established channel to one peer. Use as ``async with channel:`` or call
    :meth:`aclose`. One task may send and another receive at the same time; two concurrent
    senders (or receivers) are a :class:`LocalProtocolError`.

    Attributes:
        peer: the remote node's peer id, authenticated by the handshake.
        host: the remote host (IP address, or simulated host name) the connection came
            from; "" if the stream could not tell. Not authenticated: for rate limits.
    """

    def __init__(
        self,
        stream: trio.abc.Stream,
        send_cipher: CipherState,
        receive_cipher: CipherState,
        peer: PeerId,
        *,
        record_timeout: float = Timeouts.record,
    ) -> None:
        self.peer = peer
        self.host = peer_host(stream)
        self._stream = stream
        self._reader = _Reader(stream)
        self._send_cipher = send_cipher
        self._receive_cipher = receive_cipher
        self._record_timeout = record_timeout
        # Grown on demand to the largest record seen: a channel that carries only messages
        # costs kilobytes, not the 2 MiB that two full-size buffers would pin.
        self._send_buf = bytearray(_INITIAL_BUFFER)
        self._receive_buf = bytearray(_INITIAL_BUFFER)
        self._sending = self._receiving = self._mid_record = False
        self._stall: float | None = None  # s without a byte, while a stall guard is on
        self._closed = False
        self._broken: GossipError | None = None
        self._send_lost = ""  # why sending failed (the peer went away); receiving may go on
        self._counts = _Counts()

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(**asdict(self._counts))

    @contextmanager
    def stall_guard(self, seconds: float) -> Iterator[None]:
        """Within the block, receiving may not go ``seconds`` without a byte, counted from
        the block's start and then from each byte received: between records as well as
        inside one (where the record deadline applies too). For a payload that streams
        record after record (:func:`gossip.transfer.receive_state`): a peer that stops
        sending is dropped after ``seconds``, however long the payload's own deadline, sized
        for the slowest link, still runs.

        Raises (from a receive inside the block):
            PeerTimeout: ``seconds`` passed without a byte; the channel is broken.
            ValueError: ``seconds`` is not positive.
        """
        if not seconds > 0:
            raise ValueError(f"a stall guard needs a positive number of seconds, not {seconds!r}")
        previous, self._stall = self._stall, float(seconds)
        self._reader.last = trio.current_time()
        try:
            yield
        finally:
            self._stall = previous

    def _check_usable(self) -> None:
        if self._closed:
            raise ChannelClosed(f"channel to {self.peer.short} was closed")
        if self._broken is not None:
            # Raised again with the same party at fault as the error that broke the channel.
            message = f"channel to {self.peer.short} was closed after an earlier error: {self._broken}"
            if isinstance(self._broken, (RemoteProtocolError, ChannelClosed)):
                raise type(self._broken)(message)
            raise PeerGone(message)

    async def _break(self, error: GossipError) -> GossipError:
        if self._broken is None:
            self._broken = error
        await trio.aclose_forcefully(self._stream)
        return error

    async def send(self, data: bytes | bytearray | memoryview) -> None:
        """Send one record of at most :data:`MAX_RECORD` bytes.

        Raises:
            PeerGone: the connection was reset or closed by the peer. The channel can still
                receive what the peer sent before that.
            ChannelClosed: we closed the channel.
            LocalProtocolError: record too large, or another task is sending.
        """
        self._check_usable()
        if self._send_lost:
            raise PeerGone(self._send_lost)
        data = memoryview(data).cast("B")  # sizes in bytes, whatever the buffer's format
        size = len(data)
        if size > MAX_RECORD:
            raise LocalProtocolError(f"record of {size} bytes exceeds MAX_RECORD={MAX_RECORD}")
        if self._sending:
            raise LocalProtocolError("another task is already sending on this channel")
        self._sending = True
        try:
            end = _HEADER + size + TAGLEN
            self._send_buf = _room(self._send_buf, end)
            view = memoryview(self._send_buf)
            FRAME_HEADER.pack_into(self._send_buf, 0, size + TAGLEN)
            self._send_cipher.encrypt_into(view[:_HEADER], data, view[_HEADER:end])
            try:
                await self._stream.send_all(view[:end])
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                if self._closed:
                    raise ChannelClosed(f"channel to {self.peer.short} was closed") from None
                self._check_usable()  # a receive broke the channel meanwhile: its error
                self._send_lost = f"connection to {self.peer.short} lost: {exc}"
                raise PeerGone(self._send_lost) from None
            except BaseException:
                # Cancelled half-way: the peer may hold part of a record, so the stream can
                # never carry another one.
                await self._break(ChannelClosed("a send was interrupted mid-record"))
                raise
        finally:
            self._sending = False
        self._counts.records_sent += 1
        self._counts.bytes_sent += end

    async def receive(self) -> bytes:
        """Wait for the next record and return its plaintext.

        Raises:
            PeerGone: the peer closed the connection between records, or reset it.
            RemoteProtocolError: oversized length, failed authentication, or a record cut
                short; the channel is closed.
            PeerTimeout: a record started but did not complete within the record deadline,
                or, under a stall guard, no byte came for its seconds.
            ChannelClosed: we closed the channel.
        """
        result = await self._receive_guarded(None)
        assert isinstance(result, bytes)
        return result

    async def receive_into(self, buffer: bytearray | memoryview) -> int:
        """Wait for the next record and decrypt it straight into ``buffer``; returns its
        length. For bulk data: it saves an allocation and a copy of every byte. If the record
        fails authentication, what ``buffer`` holds is undefined (and the channel broken).

        Raises:
            RemoteProtocolError: the record is longer than ``buffer`` (more than the caller's
                protocol allows at this point), or any error :meth:`receive` raises.
        """
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise ValueError("receive_into needs a writable buffer")
        result = await self._receive_guarded(view)
        assert isinstance(result, int)
        return result

    async def _receive_guarded(self, out: memoryview | None) -> bytes | int:
        self._check_usable()
        if self._receiving:
            raise LocalProtocolError("another task is already receiving on this channel")
        self._receiving = True
        try:
            return await self._receive(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if self._closed:
                raise ChannelClosed(f"channel to {self.peer.short} was closed") from None
            raise await self._break(PeerGone(f"connection to {self.peer.short} lost: {exc}")) from None
        except (RemoteProtocolError, PeerTimeout, PeerGone) as exc:
            raise await self._break(exc) from None
        except BaseException:
            if self._mid_record:  # cancelled inside a record: the stream is out of step
                await self._break(ChannelClosed("a receive was interrupted mid-record"))
            raise
        finally:
            self._receiving = False
            self._mid_record = False

    async def _receive(self, out: memoryview | None) -> bytes | int:
        header = bytearray(_HEADER)
        reader, stall = self._reader, self._stall
        # The wait for a record's first byte is the caller's deadline (and, under a stall
        # guard, at most `stall` after the last byte); from that byte on the record is in
        # progress, under the record deadline (and the stall deadline, which each byte
        # moves on), and cannot be abandoned half-read.
        with trio.CancelScope(deadline=math.inf if stall is None else reader.last + stall) as idle:
            got = await reader.read_some_into(memoryview(header))
        if idle.cancelled_caught:
            raise PeerTimeout(self.peer.short, f"a stall (no byte for {stall:g} s)")
        if got == 0:
            raise PeerGone(f"{self.peer.short} closed the connection")
        self._mid_record = True
        end = reader.last + self._record_timeout
        with trio.CancelScope(deadline=end if stall is None else min(end, reader.last + stall)
                              ) as scope:
            if stall is not None:
                reader.watch(scope, end, stall)
            try:
                if got < _HEADER:
                    got += await self._reader.read_into(memoryview(header)[got:])
                    if got < _HEADER:
                        raise RemoteProtocolError("connection closed inside a record header")
                try:
                    size = frame_length(header, MAX_RECORD + TAGLEN)
                except WireError as exc:
                    raise RemoteProtocolError(str(exc)) from None
                if size < TAGLEN:
                    raise RemoteProtocolError(f"record of {size} bytes is shorter than its tag")
                if out is not None and size - TAGLEN > len(out):
                    raise RemoteProtocolError(
                        f"record of {size - TAGLEN} bytes where at most {len(out)} were expected"
                    )
                self._receive_buf = _room(self._receive_buf, size)
                body = memoryview(self._receive_buf)[:size]
                if await self._reader.read_into(body) < size:
                    raise RemoteProtocolError("connection closed inside a record (truncated)")
            finally:
                reader.watch(None)
        if scope.cancelled_caught:
            if trio.current_time() >= end:
                raise PeerTimeout(self.peer.short, "record")
            raise PeerTimeout(self.peer.short, f"a stall (no byte for {stall:g} s)")
        result: bytes | int
        if out is None:
            result = self._receive_cipher.decrypt(bytes(header), body)
        else:
            result = size - TAGLEN
            self._receive_cipher.decrypt_into(bytes(header), body, out[:result])
        self._mid_record = False
        self._counts.records_received += 1
        self._counts.bytes_received += _HEADER + size
        return result

    async def send_message(self, message: Message) -> None:
        """Send one protocol message as one record."""
        await self.send(encode(message))

    async def send_closing(self, *messages: Message) -> None:
        """Send the last messages of a conversation (a :class:`Close`, and what explains it),
        giving the peer :data:`CLOSE_GRACE` seconds to take them; a peer that does not read
        them in that time is not waited for. The caller then closes the channel.

        Raises:
            GossipError: as :meth:`send`, when the channel breaks before the grace is over.
        """
        with trio.move_on_after(CLOSE_GRACE):
            for message in messages:
                await self.send_message(message)

    async def receive_message(self) -> Message:
        """Receive one record and decode it as a protocol message.

        Raises:
            BadMessage: the record is not a valid message (the channel is closed).
            GossipError: as :meth:`receive`.
        """
        data = await self.receive()
        try:
            return decode(data)
        except WireError as exc:
            raise await self._break(BadMessage(f"bad message from {self.peer.short}: {exc}")) from None

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        await trio.aclose_forcefully(self._stream)


async def _read_handshake_message(reader: _Reader) -> bytes:
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
    reader = _Reader(stream)

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
            outsider cannot hold the places of honest peers that share its address. None: no
            limits. (Its per-peer rate is the roster's to enforce, once a peer is known.)
        on_refused: called with the limit's name for each connection closed by a limit:
            ``"max_connections"`` (the new one, refused) or ``"max_handshakes_per_host"``
            (the oldest unproven one of its host, evicted).
    """
    admission: Admission[trio.CancelScope] = (
        Admission(limits.max_connections, limits.max_handshakes_per_host) if limits is not None
        else Admission(None, None))
    first_message = min(FIRST_MESSAGE_TIMEOUT, timeouts.handshake)
    firsts = FirstMessages()  # to know a replayed message 1

    def refused(limit: str) -> None:
        if on_refused is not None:
            on_refused(limit)

    async def on_stream(stream: trio.abc.Stream) -> None:
        host = peer_host(stream)
        if admission.full:
            refused("max_connections")
            return  # the network closes the stream
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
