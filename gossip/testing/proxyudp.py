"""The UDP side of a :class:`~gossip.testing.proxy.FaultProxy`: NAT-style forwarding.

Theory of operation
-------------------
A datagram from source S arrives on the proxy's listening socket and leaves for upstream
from a socket of S's own *session*, bound on the proxy's host; whatever upstream sends to
that socket goes back to S from the listening socket. Upstream therefore sees one address
per source and answers it as it answers any sender, and its answers cross the proxy too.
Datagrams from anywhere but upstream to a session socket are dropped (a port-restricted
NAT). At most MAX_UDP_SESSIONS sessions exist; opening one more closes the least recently
used.

Faults apply in both directions, decided when a datagram arrives: a blocked source (sender
or addressee) or a lost draw drops it, corruption flips one byte, and a delay parks it in a
heap served by one task (at most MAX_DELAYED_DATAGRAMS wait; beyond, datagrams are dropped).
Throttle, cut_after, reset and reset_probability are TCP-only.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import random
import socket
from typing import TYPE_CHECKING

import trio

from .proxyfaults import flip_one_byte, normalize_ip, seeded

if TYPE_CHECKING:
    from .proxy import FaultProxy

__all__ = ["UdpForwarder", "MAX_UDP_SESSIONS", "MAX_DELAYED_DATAGRAMS"]

log = logging.getLogger(__name__)

MAX_DATAGRAM_SIZE = 65535  # bytes: the largest datagram read (IPv4's limit)
MAX_UDP_SESSIONS = 256  # sources with a socket of their own; the least recently used goes
MAX_DELAYED_DATAGRAMS = 4096  # datagrams waiting out a delay, all sessions together

_SOCKET_GONE = (OSError, trio.ClosedResourceError)


class _Session:
    def __init__(self, source: tuple, sock: trio.socket.SocketType, rng: random.Random) -> None:
        self.source = source
        self.source_ip = normalize_ip(source[0])
        self.sock = sock
        self.rng = rng
        self.scope = trio.CancelScope()


class UdpForwarder:
    """Forwards the datagrams of one proxy. Owned by the proxy's nursery (:meth:`run`)."""

    def __init__(self, proxy: FaultProxy, sock: trio.socket.SocketType, upstream: tuple) -> None:
        self.proxy = proxy
        self.sock = sock
        self.upstream = upstream
        self.sessions: collections.OrderedDict[tuple, _Session] = collections.OrderedDict()
        self.forwarded = 0
        self.dropped = 0
        self.corrupted = 0
        self._opened = 0
        self._rng = seeded(proxy.seed, "udp")
        self._delayed: list[tuple[float, int, trio.socket.SocketType, bytes, tuple]] = []
        self._order = itertools.count()
        self._delay_lot = trio.lowlevel.ParkingLot()

    async def run(self) -> None:
        """Forward until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_delayed)
            while True:
                try:
                    data, source = await self.sock.recvfrom(MAX_DATAGRAM_SIZE)
                except (ConnectionRefusedError, ConnectionResetError):
                    continue  # an ICMP error about an earlier send: nothing to read
                session = self.sessions.get(source)
                if session is not None:
                    self.sessions.move_to_end(source)
                if not self._admit(normalize_ip(source[0]), self._rng):
                    continue
                if session is None:
                    session = await self._open_session(source, nursery)
                    if session is None:
                        continue
                await self._emit(session.sock, data, self.upstream, self._rng)

    async def _open_session(self, source: tuple, nursery: trio.Nursery) -> _Session | None:
        while len(self.sessions) >= MAX_UDP_SESSIONS:
            _, old = self.sessions.popitem(last=False)
            old.scope.cancel()
            log.debug("udp session evicted proxy=%s source=%s", self.proxy.address, old.source)
        sock = trio.socket.socket(self.sock.family, socket.SOCK_DGRAM)
        try:
            await sock.bind((self.sock.getsockname()[0], 0))
        except OSError as exc:
            sock.close()
            log.warning("udp session not opened proxy=%s error=%s", self.proxy.address, exc)
            self._drop()
            return None
        self._opened += 1
        session = _Session(source, sock, seeded(self.proxy.seed, "udp", self._opened))
        self.sessions[source] = session
        nursery.start_soon(self._serve_session, session)
        self.proxy._count()
        return session

    async def _serve_session(self, session: _Session) -> None:
        try:
            with session.scope:
                while True:
                    try:
                        data, sender = await session.sock.recvfrom(MAX_DATAGRAM_SIZE)
                    except (ConnectionRefusedError, ConnectionResetError):
                        continue
                    if sender[:2] != self.upstream[:2]:
                        self._drop()
                        continue
                    if self.sessions.get(session.source) is session:
                        self.sessions.move_to_end(session.source)
                    if self._admit(session.source_ip, session.rng):
                        await self._emit(self.sock, data, session.source, session.rng)
        finally:
            session.sock.close()
            if self.sessions.get(session.source) is session:
                del self.sessions[session.source]
            self.proxy._count()

    def _admit(self, source_ip: str, rng: random.Random) -> bool:
        faults = self.proxy.faults
        if source_ip in faults.block or (faults.loss and rng.random() < faults.loss):
            self._drop()
            return False
        return True

    def _drop(self) -> None:
        self.dropped += 1
        self.proxy._count()

    async def _emit(self, sock: trio.socket.SocketType, data: bytes, to: tuple,
                    rng: random.Random) -> None:
        faults = self.proxy.faults
        if data and faults.corrupt and rng.random() < faults.corrupt:
            data = flip_one_byte(data, rng)
            self.corrupted += 1
        delay = faults.delay + (rng.uniform(-1.0, 1.0) * faults.jitter if faults.jitter else 0.0)
        if delay <= 0:
            await self._send(sock, data, to)
        elif len(self._delayed) >= MAX_DELAYED_DATAGRAMS:
            self._drop()
        else:
            due = trio.current_time() + delay
            heapq.heappush(self._delayed, (due, next(self._order), sock, data, to))
            self._delay_lot.unpark_all()

    async def _send_delayed(self) -> None:
        while True:
            if not self._delayed:
                await self._delay_lot.park()
            elif trio.current_time() < self._delayed[0][0]:
                with trio.move_on_at(self._delayed[0][0]):
                    await self._delay_lot.park()
            else:
                _, _, sock, data, to = heapq.heappop(self._delayed)
                await self._send(sock, data, to)

    async def _send(self, sock: trio.socket.SocketType, data: bytes, to: tuple) -> None:
        try:
            await sock.sendto(data, to)
        except _SOCKET_GONE as exc:  # UDP is fire and forget; an evicted session's socket too
            log.debug("datagram lost proxy=%s to=%s error=%r", self.proxy.address, to, exc)
            self._drop()
            return
        self.forwarded += 1
        self.proxy._count()
