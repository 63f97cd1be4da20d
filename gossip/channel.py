"""The secure channel: an authenticated, encrypted record stream between two nodes.

Theory of operation
-------------------
A :class:`SecureChannel` is what the handshake of :mod:`gossip.endpoints` leaves on a trio
stream: the two cipher states of :mod:`gossip.handshake` and the peer it authenticated. It
carries *records*: up to :data:`MAX_RECORD` bytes of plaintext, each sent as::

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

The endpoints that make channels (:func:`~gossip.endpoints.handshake`,
:func:`~gossip.endpoints.connect`, :func:`~gossip.endpoints.serve`) are in
:mod:`gossip.endpoints`, and importable from here too, as they were before it existed.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import trio

from .errors import (
    BadMessage,
    ChannelClosed,
    GossipError,
    LocalProtocolError,
    PeerGone,
    PeerTimeout,
    RemoteProtocolError,
    WireError,
)
from .config import Timeouts
from .handshake import TAGLEN, CipherState
from .identity import PeerId
from .messages import Message
from .network import peer_host
from .wire import FRAME_HEADER, decode, encode, frame_length

__all__ = [
    "MAX_RECORD", "CLOSE_GRACE", "Timeouts", "ChannelStatistics", "SecureChannel", "Reader",
]

MAX_RECORD = 1 << 20  # plaintext bytes in one record
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


class Reader:
    """Reads exact byte counts from a stream, for a channel's records and for the handshake
    messages before it (:mod:`gossip.endpoints`). On a trio socket stream it reads straight
    into the caller's buffer (``recv_into``), saving one copy of every byte received."""

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
        self._reader = Reader(stream)
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
