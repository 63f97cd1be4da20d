"""What one host of a :class:`gossip.testing.simnet.SimNetwork` sees: :class:`SimHost` (a
:class:`gossip.network.Network`), its :class:`SimStream` connections and its
:class:`SimDatagramEndpoint` sockets.

Theory of operation
-------------------
These objects hold no timing or fault logic of their own: the network stamps every segment
and datagram with its arrival time and flips flags (``broken``, ``reader_gone``,
``eof_sent``) when a fault or a close happens. Each blocking call here is one loop: check the
flags and raise, return what has arrived, or park until the next arrival or the next wake-up,
then look again. So a fault never has to find the tasks it affects: it sets a flag and wakes
the parking lot, and the woken task raises.

Streams follow trio's conventions (they pass ``trio.testing.check_half_closeable_stream``):
every method is a checkpoint, two tasks sending (or receiving) at once get
``trio.BusyResourceError``, use after our own ``aclose`` is ``trio.ClosedResourceError``,
a reset or a peer that stopped reading is ``trio.BrokenResourceError``, and a clean end of
stream reads as ``b""``. Closing discards unread incoming data and sends EOF after what we
already sent (unlike Linux, which answers unread data with a reset).
"""

from __future__ import annotations

import errno
import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import trio

from ..errors import PeerGone
from ..network import MAX_DATAGRAM, Handler, format_address, parse_address, run_handler

if TYPE_CHECKING:
    from .simnet import SimNetwork, _HostState

__all__ = ["SimHost", "SimStream", "SimDatagramEndpoint", "SEGMENT"]

SEGMENT = 64 * 1024  # bytes: the unit in which streams are serialized, lost and delivered
_NEVER = math.inf


@dataclass(eq=False)
class _Segment:
    arrival: float  # virtual time; _NEVER while a partition or a pause holds it back
    data: bytes | None  # None marks the end of the stream


@dataclass(eq=False)
class _Pipe:
    """One direction of a connection: what ``src`` sent and ``dst`` has not read yet."""

    src: str
    dst: str
    segments: deque[_Segment] = field(default_factory=deque)
    offset: int = 0  # bytes of segments[0] already read
    unread: int = 0  # payload bytes in flight or buffered: what the window counts
    last_arrival: float = -_NEVER
    eof_sent: bool = False
    broken: bool = False  # reset: both ends fail
    reader_gone: bool = False  # the receiving end closed: further sends fail
    lot: trio.lowlevel.ParkingLot = field(default_factory=trio.lowlevel.ParkingLot)

    def wake(self) -> None:
        self.lot.unpark_all()

    def discard(self) -> int:
        dropped, self.unread, self.offset = self.unread, 0, 0
        self.segments.clear()
        return dropped


@dataclass(eq=False)
class _Connection:
    ends: list[SimStream] = field(default_factory=list)  # [dialer's end, server's end]
    open_ends: int = 2


@dataclass(eq=False)
class _Listener:
    handler: Handler
    nursery: trio.Nursery  # serve()'s; crash() cancels it


class _ConflictDetector:
    """Raise ``trio.BusyResourceError`` when two tasks use one side of a stream at once
    (trio's own is private)."""

    def __init__(self, message: str) -> None:
        self._message = message
        self._held = False

    def __enter__(self) -> None:
        if self._held:
            raise trio.BusyResourceError(self._message)
        self._held = True

    def __exit__(self, *exc_info: object) -> None:
        self._held = False


class SimHost:
    """Host ``name`` of a :class:`~gossip.testing.simnet.SimNetwork`; get it from ``net.host(name)``.

    Implements :class:`gossip.network.Network`. Binds only ``"<name>:port"``; others raise
    ``OSError(EADDRNOTAVAIL)``, a port in use ``OSError(EADDRINUSE)``.
    """

    def __init__(self, net: SimNetwork, name: str) -> None:
        self._net = net
        self.name = name

    def __repr__(self) -> str:
        return f"<SimHost {self.name}>"

    async def dial(self, address: str) -> SimStream:
        """Connect after one round trip (the handler starts after the first half).

        Raises:
            PeerGone: nobody listens there, the target or this host crashed, a firewall
                refuses (``nat(..., refuse=True)``), or the host name is unknown. Across a
                cut (a partition or a pause), or to a host behind a NAT, the dial waits.
        """
        host, port = parse_address(address)
        net = self._net
        await trio.lowlevel.checkpoint()
        net._check_up(self.name)
        if host not in net._hosts:
            raise PeerGone(f"cannot connect to {address}: unknown host")
        while True:
            await net._travel(self.name, host, self.name)  # SYN
            nat = net._nat_before(self.name, host)
            if nat is None or nat.refuse:
                break
            await net._topology.park()  # dropped at the NAT; a retry may pass after unnat
            net._check_up(self.name)
        target = net._hosts[host]
        listener = target.listeners.get(port) if target.up and nat is None else None
        if listener is None:
            net._stats["connections_refused"] += 1
            await trio.sleep(net._link(host, self.name).latency)  # the refusal comes back
            raise PeerGone(f"cannot connect to {address}: connection refused")
        client, server = net._connect(self.name, host, port)
        listener.nursery.start_soon(run_handler, listener.handler, server, client.local_address)
        try:
            await net._travel(host, self.name, self.name)  # SYN-ACK
        except BaseException:
            net._reset_where(lambda conn: conn is client._conn)
            raise
        if client._in.broken:
            raise PeerGone(f"connection to {address} was reset during the handshake")
        return client

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """As :meth:`gossip.network.Network.serve`; raises PeerGone when this host crashes
        (its handlers are cancelled first)."""
        await trio.lowlevel.checkpoint()
        state, port = self._bind(address, "listeners")
        listener = None
        try:
            async with trio.open_nursery() as nursery:
                listener = _Listener(handler, nursery)
                state.listeners[port] = listener
                task_status.started(format_address(self.name, port))
                await trio.sleep_forever()
        finally:
            if listener is not None and state.listeners.get(port) is listener:
                del state.listeners[port]
        # Only crash() cancels that nursery; any other cancellation propagated above.
        raise PeerGone(f"host {self.name} crashed while serving {address}")

    async def open_datagram(self, address: str) -> SimDatagramEndpoint:
        await trio.lowlevel.checkpoint()
        state, port = self._bind(address, "endpoints")
        endpoint = SimDatagramEndpoint(self._net, self.name, port)
        state.endpoints[port] = endpoint
        return endpoint

    def _bind(self, address: str, table: str) -> tuple[_HostState, int]:
        """Claim ``address`` in this host's ``table`` (``"listeners"`` or ``"endpoints"``):
        its port, or a free one for port 0."""
        host, port = parse_address(address)
        if host != self.name:
            raise OSError(errno.EADDRNOTAVAIL, f"cannot bind {address} on host {self.name}")
        self._net._check_up(self.name)
        state = self._net._hosts[self.name]
        taken = getattr(state, table)
        if port == 0:
            port = state.ephemeral_port(taken)
        elif port in taken:
            raise OSError(errno.EADDRINUSE, f"cannot bind {address}: address in use")
        return state, port


class SimStream(trio.abc.HalfCloseableStream):
    """One end of a simulated TCP connection. ``local_address`` and ``peer_address`` are
    ``"host:port"`` strings."""

    def __init__(
        self,
        net: SimNetwork,
        conn: _Connection,
        out: _Pipe,
        inbound: _Pipe,
        local_address: str,
        peer_address: str,
    ) -> None:
        self._net = net
        self._conn = conn
        self._out = out
        self._in = inbound
        self.local_address = local_address
        self.peer_address = peer_address
        self._closed = False
        self._send_conflict = _ConflictDetector("another task is sending on this stream")
        self._receive_conflict = _ConflictDetector("another task is receiving on this stream")

    @property
    def host(self) -> str:
        return self._out.src

    def _check_send(self) -> None:
        if self._closed or self._out.eof_sent:
            raise trio.ClosedResourceError("this end of the stream was closed for sending")
        if self._out.broken:
            raise trio.BrokenResourceError("connection reset")
        if self._out.reader_gone:
            raise trio.BrokenResourceError("the peer closed the stream")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_conflict:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._check_send()
            net, out = self._net, self._out
            with memoryview(data) as view, view.cast("B") as octets:
                # Segment boundaries depend only on the data, so the loss draws do too; a
                # segment enters the window in pieces as the reader makes room.
                for start in range(0, len(octets), SEGMENT):
                    segment = octets[start : start + SEGMENT]
                    lost = net._lost_segment(out)
                    while segment:
                        self._check_send()
                        room = net.window - out.unread
                        if room <= 0:
                            await out.lot.park()
                            continue
                        serialized = net._transmit(out, bytes(segment[:room]), lost)
                        segment = segment[room:]
                        if serialized > trio.current_time():
                            await trio.sleep_until(serialized)
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def wait_send_all_might_not_block(self) -> None:
        with self._send_conflict:
            await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                self._check_send()
                if self._out.unread < self._net.window:
                    break
                await self._out.lot.park()
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def send_eof(self) -> None:
        with self._send_conflict:
            await trio.lowlevel.checkpoint_if_cancelled()
            if self._closed:
                raise trio.ClosedResourceError("this end of the stream was closed")
            if self._out.broken:
                raise trio.BrokenResourceError("connection reset")
            if not self._out.eof_sent:
                self._out.eof_sent = True
                self._net._transmit(self._out, None, lost=False)
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        with self._receive_conflict:
            await trio.lowlevel.checkpoint_if_cancelled()
            pipe = self._in
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("this end of the stream was closed")
                if pipe.broken:
                    raise trio.BrokenResourceError("connection reset")
                head = pipe.segments[0] if pipe.segments else None
                if head is not None and head.arrival <= trio.current_time():
                    data = self._take(head, max_bytes)
                    await trio.lowlevel.cancel_shielded_checkpoint()
                    return data
                if head is None:
                    await pipe.lot.park()  # no deadline: saves a cancel scope per wait
                else:
                    with trio.move_on_at(head.arrival):
                        await pipe.lot.park()

    def _take(self, head: _Segment, max_bytes: int | None) -> bytes:
        pipe = self._in
        if head.data is None:
            return b""  # the EOF marker stays: every later read sees it too
        start = pipe.offset
        n = len(head.data) - start if max_bytes is None else min(len(head.data) - start, max_bytes)
        data = head.data if n == len(head.data) else head.data[start : start + n]
        pipe.offset += n
        if pipe.offset == len(head.data):
            pipe.segments.popleft()
            pipe.offset = 0
        pipe.unread -= n
        self._net._stats["bytes_buffered"] -= n
        pipe.wake()  # window credit for a parked sender
        return data

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._net._close_end(self)
        await trio.lowlevel.checkpoint()


class SimDatagramEndpoint:
    """A bound simulated UDP socket; see :class:`gossip.network.DatagramEndpoint`.

    After our ``aclose``: ``trio.ClosedResourceError``; after our host crashed: PeerGone.
    """

    def __init__(self, net: SimNetwork, host: str, port: int) -> None:
        self._net = net
        self._host = host
        self._port = port
        self._local = format_address(host, port)
        # (arrival, sequence, data, sender address, sender host), a heap by arrival
        self._inbox: list[tuple[float, int, bytes, str, str]] = []
        self._sequence = 0
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False
        self._crashed = False

    @property
    def local_address(self) -> str:
        return self._local

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("datagram endpoint was closed")
        if self._crashed:
            raise PeerGone(f"host {self._host} crashed")

    def _deliver(self, arrival: float, data: bytes, sender: str, sender_host: str) -> None:
        self._sequence += 1
        item = (arrival, self._sequence, data, sender, sender_host)
        heapq.heappush(self._inbox, item)
        if self._inbox[0] is item:
            self._lot.unpark_all()  # a new head: the reader's deadline moved earlier

    def _drop_in_flight(self, now: float, cut: Callable[[str], bool]) -> int:
        """Drop datagrams not yet arrived from the hosts that ``cut(sender host)`` names (a
        new partition, pause or NAT stops them); returns how many."""
        kept = [d for d in self._inbox if d[0] <= now or not cut(d[4])]
        dropped = len(self._inbox) - len(kept)
        if dropped:
            heapq.heapify(kept)
            self._inbox = kept
        return dropped

    async def send(self, data: bytes, address: str) -> None:
        if len(data) > MAX_DATAGRAM:
            raise ValueError(f"datagram of {len(data)} bytes exceeds MAX_DATAGRAM={MAX_DATAGRAM}")
        parse_address(address)
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check()
        self._net._send_datagram(self, bytes(data), address)
        await trio.lowlevel.cancel_shielded_checkpoint()

    async def receive(self) -> tuple[bytes, str]:
        await trio.lowlevel.checkpoint_if_cancelled()
        parked = False
        while True:
            self._check()
            if self._inbox and self._inbox[0][0] <= trio.current_time():
                _, _, data, sender, _ = heapq.heappop(self._inbox)
                if not parked:  # parking was this call's schedule point already
                    await trio.lowlevel.cancel_shielded_checkpoint()
                return data, sender
            parked = True
            with trio.move_on_at(self._inbox[0][0] if self._inbox else _NEVER):
                await self._lot.park()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.clear()
            endpoints = self._net._hosts[self._host].endpoints
            if endpoints.get(self._port) is self:
                del endpoints[self._port]
            self._lot.unpark_all()
        await trio.lowlevel.checkpoint()
