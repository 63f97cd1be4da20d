"""How nodes reach each other: the network seam.

Everything above this module talks to a :class:`Network`: dial an address and get a byte
stream, serve an address with a handler, or bind a datagram endpoint. Two implementations
pass the same conformance suite (``tests/conformance.py``, run by
``tests/unit/test_tcp_network.py`` and ``tests/sim/test_simnet.py``):

* :class:`TcpNetwork`: real sockets through trio.
* :class:`gossip.testing.simnet.SimNetwork`: an in-memory network on trio's clock (works under
  ``trio.testing.MockClock``) with per-link latency, bandwidth, loss, resets, partitions and
  crashes, all drawn from a seeded RNG.

Addresses are ``"host:port"`` strings (``"[::1]:7070"`` for IPv6). The network layer moves
bytes and nothing else: authentication and framing live in :mod:`gossip.channel`. Neither
:meth:`Network.dial` nor the stream reads take a timeout: callers wrap them in
:func:`~gossip.groups.phase_deadline` with the deadline of their phase.

Errors: a dial to an address with nobody listening, a reset connection, or a crashed host
raise :class:`~gossip.errors.PeerGone`; stream reads return ``b""`` at a clean end of stream
and raise ``trio.BrokenResourceError`` on a reset, as trio's own streams do.
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import struct
from typing import Awaitable, Callable, Protocol, runtime_checkable

import trio

from .address import format_address, parse_address
from .errors import GossipError, PeerGone
from .wire import MAX_DATAGRAM

__all__ = [
    "MAX_DATAGRAM",
    "Handler",
    "Network",
    "DatagramEndpoint",
    "TcpNetwork",
    "reset_on_close",
    "parse_address",
    "format_address",
    "peer_host",
]

log = logging.getLogger(__name__)

RESERVE_ATTEMPTS = 8  # ports tried by TcpNetwork.reserve for port 0 when the stream port is taken


Handler = Callable[[trio.abc.Stream], Awaitable[None]]


@runtime_checkable
class DatagramEndpoint(Protocol):
    """A bound datagram socket. Unreliable: datagrams may be lost, duplicated or reordered."""

    @property
    def local_address(self) -> str: ...

    async def send(self, data: bytes, address: str) -> None:
        """Send one datagram of at most :data:`MAX_DATAGRAM` bytes. Never blocks for long;
        a datagram that cannot be delivered is silently lost."""

    async def receive(self) -> tuple[bytes, str]:
        """Wait for the next datagram; returns ``(data, sender_address)``."""

    async def aclose(self) -> None: ...


@runtime_checkable
class Network(Protocol):
    """The seam between gossip and the wire."""

    async def dial(self, address: str) -> trio.abc.Stream:
        """Open a byte stream to ``address``.

        Raises:
            PeerGone: nobody listens there, or the host cannot be reached.
        """

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept connections on ``address`` forever, running ``handler(stream)`` for each in
        its own task. Calls ``task_status.started(bound_address)`` once listening (port 0
        picks a free port; the bound address names it). The stream is closed when the handler
        returns; a handler that raises :class:`~gossip.errors.GossipError` or
        ``trio.BrokenResourceError`` closes that connection only.
        """

    async def open_datagram(self, address: str) -> DatagramEndpoint:
        """Bind a datagram endpoint on ``address`` (port 0 picks a free port)."""


def peer_host(stream: trio.abc.Stream) -> str:
    """The host (IP address, or simulated host name) at the other end of ``stream``; "" if
    the stream cannot tell (a reset socket, a stream of another kind)."""
    if isinstance(stream, trio.SocketStream):
        try:
            name = stream.socket.getpeername()
        except OSError:
            return ""
        return name[0] if isinstance(name, tuple) else ""
    address = getattr(stream, "peer_address", None)
    return parse_address(address)[0] if isinstance(address, str) else ""


def reset_on_close(stream: trio.abc.Stream) -> None:
    """Make closing ``stream`` reset the connection instead of ending it, if it is a TCP
    socket: for a connection refused unread. A graceful close leaves the closing side's end in
    TIME_WAIT for a minute, kernel state that a flood of refusals would pile up by the hundred
    thousand (3,000 a second for a minute) and that every new connection to the port is then
    looked up against; a reset leaves none. The dialer sees its connection reset instead of
    closed, which it takes the same way (the connection is gone)."""
    if isinstance(stream, trio.SocketStream):
        try:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        except OSError:
            pass  # already gone


_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST


async def run_handler(handler: Handler, stream: trio.abc.Stream, peer: str) -> None:
    """Run one connection's handler; a failure of that connection never escapes it.

    A handler's deadline that passes counts as that connection's failure too: a peer that
    stalls must not take the server and every other connection down with it. gossip's own
    deadlines raise :class:`~gossip.errors.PeerTimeout` (a ``GossipError``); a bare
    ``trio.TooSlowError`` is caught as well, for handlers that are not gossip's (this is the
    seam: any stream handler may be served) and for any deadline left unconverted.
    """
    try:
        await handler(stream)
    except (GossipError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError) as exc:
        log.debug("connection closed peer=%s error=%s: %s", peer, type(exc).__name__, exc)
    finally:
        await trio.aclose_forcefully(stream)


class TcpNetwork:
    """Real TCP and UDP through trio. One instance serves any number of nodes; its only state
    is the sockets :meth:`reserve` bound ahead of time.

    Args:
        source: the local IP address dials come from (None: the system's choice). Set it to
            the listen address's IP on a multi-homed host, or to tell nodes that share a
            machine apart by source address (each on its own 127.0.0.x, behind a fault proxy).
    """

    def __init__(self, source: str | None = None) -> None:
        self.source = source
        self._datagrams: dict[str, socket.socket] = {}  # reserved, by the address asked for
        self._listeners: dict[str, list[socket.socket]] = {}  # reserved, by the bound address

    def reserve(self, address: str) -> str:
        """Bind ``address`` now, without trio, for the node that will listen there: the
        datagram socket the first ``open_datagram(address)`` takes, and the stream listeners
        that ``serve`` of the bound address takes (what :func:`gossip.open_swarm` asks for).

        A program calls it before its slow start-up work, so that an address in use is
        reported at once, not after that work, and nothing can take the address in between.

        Returns:
            The bound address; for port 0, a port free for both datagrams and streams.

        Raises:
            OSError: the address cannot be bound (``errno.EADDRINUSE``,
                ``errno.EADDRNOTAVAIL``, ``socket.gaierror`` for a host name that does not
                resolve, ...). Nothing stays bound.
        """
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for attempt in range(1, RESERVE_ATTEMPTS + 1):
            datagram = socket.socket(family, socket.SOCK_DGRAM)  # as open_datagram binds it
            try:
                datagram.bind((host, port))
                bound = format_address(*datagram.getsockname()[:2])
                listeners = _bind_listeners(*parse_address(bound))
            except OSError as exc:
                datagram.close()
                # Port 0: the system picked a datagram port that a stream socket holds.
                if port == 0 and exc.errno == errno.EADDRINUSE and attempt < RESERVE_ATTEMPTS:
                    continue
                raise
            break
        self._datagrams[address] = datagram
        self._listeners[bound] = listeners
        return bound

    def release(self) -> None:
        """Close the reserved sockets that no node has taken (a program that stops before
        its node opens)."""
        for sock in [*self._datagrams.values(), *itertools.chain(*self._listeners.values())]:
            sock.close()
        self._datagrams.clear()
        self._listeners.clear()

    async def dial(self, address: str) -> trio.abc.Stream:
        try:
            host, port = parse_address(address)
            stream = await trio.open_tcp_stream(host, port, local_address=self.source)
        except OSError as exc:
            raise PeerGone(f"cannot connect to {address}: {exc.strerror or exc}") from None
        except ValueError as exc:  # includes UnicodeError: a host name no resolver accepts
            raise PeerGone(f"cannot connect to {address}: {exc}") from None
        try:
            _tune(stream.socket)
        except OSError as exc:  # reset between connect and setsockopt
            await trio.aclose_forcefully(stream)
            raise PeerGone(f"connection to {address} lost at once: {exc.strerror or exc}") from None
        return stream

    async def serve(
        self,
        address: str,
        handler: Handler,
        *,
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        host, port = parse_address(address)
        reserved = self._listeners.pop(address, [])
        if reserved:
            listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock))
                         for sock in reserved]
        else:
            listeners = await trio.open_tcp_listeners(port, host=host or None)
        if port == 0 and len(listeners) > 1:
            # Port 0 gives each address family its own random port, and only one address can
            # be reported: listen on that one alone rather than on ports nobody knows.
            for extra in listeners[1:]:
                extra.socket.close()
            listeners = listeners[:1]
        try:
            sockname = listeners[0].socket.getsockname()
            task_status.started(format_address(sockname[0], sockname[1]))
            async with trio.open_nursery() as nursery:
                # A name like "localhost" can give one listener per address family on the
                # same port: accept on every one, or a dial that resolves to the other family
                # would connect and then hang with no handler.
                for listener in listeners:
                    nursery.start_soon(_accept_loop, listener, handler, nursery)
        finally:
            # Closed here, not left to the garbage collector: once serve returns, a dial to
            # this port must be refused, and a new serve must be able to bind it.
            for listener in listeners:
                listener.socket.close()

    async def open_datagram(self, address: str) -> DatagramEndpoint:
        reserved = self._datagrams.pop(address, None)
        if reserved is not None:
            await trio.lowlevel.checkpoint()
            return _UdpEndpoint(trio.socket.from_stdlib_socket(reserved))
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = trio.socket.socket(family, socket.SOCK_DGRAM)
        try:
            await sock.bind((host, port))
        except OSError:
            sock.close()
            raise
        return _UdpEndpoint(sock)


async def _accept_loop(
    listener: trio.SocketListener, handler: Handler, nursery: trio.Nursery
) -> None:
    while True:
        stream = await _accept(listener)
        try:
            _tune(stream.socket)
            peer = format_address(*stream.socket.getpeername()[:2])
        except OSError as exc:
            # The peer reset the connection between the kernel's accept and ours (a port
            # scanner, a crashed client): that connection is gone, the server is not.
            log.debug("accepted connection already gone error=%s", exc)
            await trio.aclose_forcefully(stream)
            continue
        nursery.start_soon(run_handler, handler, stream, peer)


async def _accept(listener: trio.SocketListener) -> trio.SocketStream:
    while True:
        try:
            return await listener.accept()
        except OSError as exc:
            # Running out of file descriptors must not kill the server: wait and retry, as
            # trio.serve_listeners does.
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                log.warning("accept failed error=%s; retrying in 0.1 s", errno.errorcode[exc.errno])
                await trio.sleep(0.1)
            else:
                raise


def _bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Listening stream sockets on every address ``host`` resolves to, bound as
    ``trio.open_tcp_listeners`` binds them (synchronously: for :meth:`TcpNetwork.reserve`)."""
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, sockaddr in socket.getaddrinfo(
                host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            listeners.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(socket.SOMAXCONN)
    except OSError:
        for sock in listeners:
            sock.close()
        raise
    return listeners


def _tune(sock: trio.socket.SocketType) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _UdpEndpoint:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock
        self._closed = False
        host, port = sock.getsockname()[:2]
        self._local = format_address(host, port)

    @property
    def local_address(self) -> str:
        return self._local

    async def send(self, data: bytes, address: str) -> None:
        if len(data) > MAX_DATAGRAM:
            raise ValueError(f"datagram of {len(data)} bytes exceeds MAX_DATAGRAM={MAX_DATAGRAM}")
        if self._closed:
            # Checked first: the OSError a closed socket raises would be taken for a lost
            # datagram below, and the caller would never learn it used a closed endpoint.
            raise trio.ClosedResourceError("datagram endpoint was closed")
        try:
            await self._sock.sendto(data, parse_address(address))
        except OSError as exc:
            # UDP is fire and forget: an unreachable destination is a lost datagram.
            log.debug("datagram lost to=%s error=%s", address, exc)

    async def receive(self) -> tuple[bytes, str]:
        while True:
            if self._closed:
                raise trio.ClosedResourceError("datagram endpoint was closed")
            try:
                # Bounded read: anything beyond MAX_DATAGRAM + 1 is truncated by the kernel,
                # and an oversized datagram is dropped rather than delivered in part.
                data, sender = await self._sock.recvfrom(MAX_DATAGRAM + 1)
            except ConnectionResetError:
                continue  # ICMP port unreachable from an earlier send: not for the reader
            if len(data) <= MAX_DATAGRAM:
                return data, format_address(sender[0], sender[1])

    async def aclose(self) -> None:
        self._closed = True
        self._sock.close()
        await trio.lowlevel.checkpoint()
