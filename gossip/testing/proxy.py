"""A fault-injection proxy for real processes: TCP and UDP on one port (toxiproxy's idea).

Theory of operation
-------------------
A :class:`FaultProxy` listens on one address for both TCP and UDP, as a daemon's single port
does, and forwards to one upstream address. A test puts a proxy in front of each daemon and
has the daemon advertise the proxy's address, so every byte to that daemon crosses it; each
daemon dials from its own ``127.0.0.x``, so a proxy tells the nodes apart by source IP and a
partition is "block these sources" on each proxy.

The faults in force are one frozen :class:`Faults` value, replaced as a whole by the
setters (all synchronous). Whatever waits on a fault (a delayed chunk, a blocked
connection) sleeps on a parking lot that every change unparks, so a change applies to open
connections and to bytes already queued: ``clear()`` releases held bytes at once. Counters
unpark another lot, so a test waits for a condition (:meth:`FaultProxy.wait_statistics`)
instead of sleeping.

The proxy owns the listening sockets and the tasks; :mod:`gossip.testing.proxytcp` forwards
one TCP connection (two pipes, held bytes bounded by TCP backpressure, resets with
SO_LINGER 0) and :mod:`gossip.testing.proxyudp` forwards datagrams NAT-style (a socket per
source, so upstream's answers to "the datagram's source" cross the proxy too).

Randomness: each connection, direction and UDP session draws from its own random.Random
seeded from ``(seed, kind, index)``: one seed gives the same choices whatever order trio
schedules the tasks in, as long as connections arrive in the same order.
"""

from __future__ import annotations

import errno
import logging
import socket
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Iterable

import trio

from ..address import format_address, parse_address
from ..groups import one_error
from .proxyfaults import FAULT_FIELDS, Faults, ProxyStatistics, normalize_ip
from .proxytcp import MAX_CHUNK, MAX_HELD_BYTES, RANDOM_RESET_MAX_BYTES, Connection
from .proxyudp import UdpForwarder

__all__ = [
    "FaultProxy",
    "Faults",
    "ProxyStatistics",
    "open_fault_proxy",
    "MAX_CHUNK",
    "MAX_HELD_BYTES",
    "RANDOM_RESET_MAX_BYTES",
]

log = logging.getLogger(__name__)


class FaultProxy:
    """Forwards TCP and UDP from ``listen`` to ``upstream``, with faults set at any time.

    Run it with ``await nursery.start(proxy.serve)`` or :func:`open_fault_proxy`. The fault
    setters are synchronous and apply to open connections and queued bytes at once.

    Args:
        listen: ``"host:port"`` to listen on, TCP and UDP (port 0 picks one free for both).
        upstream: ``"host:port"`` to forward to.
        seed: seeds every random choice (jitter, corruption, resets, loss).

    Raises:
        ValueError: an address is not ``host:port``.
    """

    def __init__(self, listen: str, upstream: str, *, seed: int = 0) -> None:
        self._listen = parse_address(listen)
        self._upstream = parse_address(upstream)
        self.upstream = upstream
        self.seed = seed
        self.address: str | None = None  # the bound "host:port" once serving
        self._faults = Faults()
        self._changed = trio.lowlevel.ParkingLot()  # unparked when faults change
        self._progress = trio.lowlevel.ParkingLot()  # unparked when statistics change
        self._connections: set[Connection] = set()
        self._accepted = 0
        self._bytes = {"up": 0, "down": 0}
        self._held = 0
        self._resets = 0
        self._corrupted = 0
        self._scope: trio.CancelScope | None = None
        self._udp: UdpForwarder | None = None
        self._source: tuple[str, int] | None = None  # where upstream connections come from
        self._upstream_addr: tuple = ()
        self._upstream_family = socket.AF_INET

    # ---- faults --------------------------------------------------------------------------

    @property
    def faults(self) -> Faults:
        """The faults in force now."""
        return self._faults

    def configure(self, **changes: object) -> Faults:
        """Change some faults, keep the others (the HTTP API's partial update).

        Giving ``cut_after`` (re)arms the budget of every open connection.

        Returns:
            The faults now in force.

        Raises:
            ValueError: an unknown fault or a bad value; nothing is changed then.
        """
        unknown = sorted(set(changes) - set(FAULT_FIELDS))
        if unknown:
            raise ValueError(f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_FIELDS)}")
        new = Faults(**{**self._faults.as_dict(), **changes})
        self._faults = new
        log.info("faults changed proxy=%s %s", self.address,
                 " ".join(f"{key}={value}" for key, value in changes.items()))
        if "cut_after" in changes:
            for conn in list(self._connections):
                conn.cut_budget = new.cut_after
                if new.cut_after == 0:
                    conn.reset()
        self._changed.unpark_all()
        return new

    def delay(self, seconds: float, jitter: float = 0.0) -> None:
        """Forward each chunk and datagram ``seconds`` late, give or take up to ``jitter``
        (uniform, never below zero). TCP keeps the order of each direction."""
        self.configure(delay=seconds, jitter=jitter)

    def throttle(self, bytes_per_second: float | None) -> None:
        """Limit each direction of each TCP connection to this rate (None: unlimited)."""
        self.configure(throttle=bytes_per_second)

    def cut_after(self, nbytes: int | None) -> None:
        """Reset each TCP connection, open or new, once it has forwarded ``nbytes`` more
        bytes, counting both directions together (None: never)."""
        self.configure(cut_after=nbytes)

    def corrupt(self, probability: float) -> None:
        """Flip one random byte of each forwarded chunk or datagram with this probability."""
        self.configure(corrupt=probability)

    def reset_probability(self, probability: float) -> None:
        """Reset each *new* TCP connection with this probability after a random number of
        bytes (log-uniform between 1 and RANDOM_RESET_MAX_BYTES, 16 MiB)."""
        self.configure(reset_probability=probability)

    def loss(self, probability: float) -> None:
        """Drop each UDP datagram, either direction, with this probability."""
        self.configure(loss=probability)

    def block(self, sources: str | Iterable[str]) -> None:
        """Black-hole these source IPs (replacing the blocked set): their datagrams are
        dropped, their new connections are accepted and go nowhere, and their open
        connections freeze; bytes are held, not dropped, until :meth:`unblock`."""
        self.configure(block=[sources] if isinstance(sources, str) else list(sources))

    def unblock(self) -> None:
        """Let every source through again; held bytes flow on."""
        self.configure(block=[])

    def clear(self) -> None:
        """Remove every fault."""
        self.configure(**Faults().as_dict())

    def reset(self) -> int:
        """Reset every open TCP connection now (each peer sees ECONNRESET).

        Returns:
            How many connections were reset.
        """
        connections = list(self._connections)
        for conn in connections:
            conn.reset()
        log.info("connections reset proxy=%s count=%d", self.address, len(connections))
        return len(connections)

    # ---- statistics ----------------------------------------------------------------------

    def statistics(self) -> ProxyStatistics:
        """Counters since the proxy started."""
        udp = self._udp
        return ProxyStatistics(
            connections_accepted=self._accepted,
            connections_open=len(self._connections),
            bytes_upstream=self._bytes["up"],
            bytes_downstream=self._bytes["down"],
            bytes_held=self._held,
            resets=self._resets,
            corrupted=self._corrupted + (udp.corrupted if udp else 0),
            datagrams_forwarded=udp.forwarded if udp else 0,
            datagrams_dropped=udp.dropped if udp else 0,
            udp_sessions=len(udp.sessions) if udp else 0,
        )

    async def wait_statistics(self, predicate: Callable[[ProxyStatistics], bool]) -> ProxyStatistics:
        """Wait until ``predicate(self.statistics())`` holds; no polling.

        Returns:
            The statistics that satisfied it.
        """
        await trio.lowlevel.checkpoint()
        while not predicate(stats := self.statistics()):
            await self._progress.park()
        return stats

    def _count(self) -> None:
        self._progress.unpark_all()

    # ---- serving -------------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and forward until cancelled or closed (:meth:`close`); calls
        ``task_status.started(address)`` with the bound ``"host:port"`` once listening.

        Raises:
            OSError: the address cannot be bound or upstream's name does not resolve.
            RuntimeError: the proxy was served before.
        """
        if self._scope is not None:
            raise RuntimeError("a FaultProxy serves once")
        self._scope = trio.CancelScope()
        infos = await trio.socket.getaddrinfo(*self._upstream, type=socket.SOCK_STREAM)
        self._upstream_family, _, _, _, self._upstream_addr = infos[0]
        tcp, udp_sock = await self._bind()
        try:
            host, port = tcp.getsockname()[:2]
            self.address = format_address(host, port)
            if host not in ("0.0.0.0", "::") and tcp.family == self._upstream_family:
                self._source = (host, 0)  # upstream sees the proxy's own IP
            self._udp = UdpForwarder(self, udp_sock, self._upstream_addr)
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._accept_loop, trio.SocketListener(tcp), nursery)
                    nursery.start_soon(self._udp.run)
                    log.info("proxy listening address=%s upstream=%s", self.address, self.upstream)
                    task_status.started(self.address)
        finally:
            tcp.close()
            udp_sock.close()
            log.info("proxy stopped address=%s", self.address)

    def close(self) -> None:
        """Stop serving: close the listening sockets and every connection."""
        if self._scope is not None:
            self._scope.cancel()

    async def _bind(self) -> tuple[trio.socket.SocketType, trio.socket.SocketType]:
        host, port = self._listen
        infos = await trio.socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                              flags=socket.AI_PASSIVE)
        family, _, _, _, sockaddr = infos[0]
        for attempt in range(50):
            tcp = trio.socket.socket(family, socket.SOCK_STREAM)
            udp = trio.socket.socket(family, socket.SOCK_DGRAM)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                await tcp.bind(sockaddr)
                tcp.listen(128)
                await udp.bind(tcp.getsockname())
                return tcp, udp
            except OSError as exc:
                tcp.close()
                udp.close()
                # Port 0 gave a port free for TCP only: try another.
                if port != 0 or exc.errno != errno.EADDRINUSE or attempt == 49:
                    raise
        raise AssertionError("unreachable")

    async def _accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            try:
                client = await listener.accept()
            except OSError as exc:  # out of file descriptors: wait and retry (serve_listeners)
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS):
                    raise
                log.warning("accept failed proxy=%s error=%s; retrying in 0.1 s", self.address, exc)
                await trio.sleep(0.1)
                continue
            try:
                client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                source = normalize_ip(client.socket.getpeername()[0])
            except OSError as exc:  # reset before we got to it: that connection only is gone
                log.debug("accepted connection already gone proxy=%s error=%s", self.address, exc)
                client.socket.close()
                continue
            self._accepted += 1
            nursery.start_soon(Connection(self, client, source, self._accepted).run)

    async def _dial(self) -> trio.SocketStream:
        sock = trio.socket.socket(self._upstream_family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._source is not None:
                await sock.bind(self._source)
            await sock.connect(self._upstream_addr)
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)


@asynccontextmanager
async def open_fault_proxy(listen: str, upstream: str, *, seed: int = 0) -> AsyncIterator[FaultProxy]:
    """A started :class:`FaultProxy`; closed (every connection with it) on exit.

    Args:
        listen: ``"host:port"`` for TCP and UDP; port 0 picks one (see ``proxy.address``).
        upstream: ``"host:port"`` to forward to.
        seed: seeds every random choice.

    Raises:
        OSError: the address cannot be bound.
    """
    proxy = FaultProxy(listen, upstream, seed=seed)
    with one_error():
        async with trio.open_nursery() as nursery:
            await nursery.start(proxy.serve)
            try:
                yield proxy
            finally:
                nursery.cancel_scope.cancel()


if __name__ == "__main__":  # python -m gossip.testing.proxy: the control server
    import sys

    from gossip.testing.proxyctl import main

    sys.exit(main())
