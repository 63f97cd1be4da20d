"""The TCP side of a :class:`~gossip.testing.proxy.FaultProxy`: one proxied connection.

Theory of operation
-------------------
A :class:`Connection` owns the client's socket, later upstream's, and two :class:`Pipe` s,
one per direction. A pipe is a reader task that queues chunks of at most MAX_CHUNK bytes,
stamped with their arrival time, and a writer task that forwards them in order once every
fault lets it (:meth:`Pipe._gate`): the chunk's delay has passed, the source is not
blocked, the throttle allows the next slice. Each slice is also charged to the connection's
byte budget (``cut_after``, ``reset_probability``, both directions together); a spent budget
resets the connection right after the last byte it allowed.

Upstream is dialled only once the source is not blocked, so a black-holed connection
reaches nobody, while the client's bytes are read and held. A reader stops reading while
its queue holds MAX_HELD_BYTES: the kernel's buffers fill and TCP flow control pushes back
on the sender, so a blocked, delayed or throttled connection costs bounded memory (at most
2 * (MAX_HELD_BYTES + MAX_CHUNK) per connection) and held bytes are never dropped.

A reset (asked for, a spent budget, an error on either side, upstream unreachable) closes
both sockets with SO_LINGER 0, so each peer sees ECONNRESET, as behind a crashed middlebox.
A clean end of stream is passed on as a half-close, and the connection ends when both
directions have ended.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import socket
import struct
from typing import TYPE_CHECKING

import trio

from .proxyfaults import flip_one_byte, seeded

if TYPE_CHECKING:
    from .proxy import FaultProxy

__all__ = ["Connection", "MAX_CHUNK", "MAX_HELD_BYTES", "RANDOM_RESET_MAX_BYTES"]

log = logging.getLogger(__name__)

MAX_CHUNK = 64 * 1024  # bytes read from a socket at once
MAX_HELD_BYTES = 4 * 1024 * 1024  # per direction of a connection: beyond it, stop reading
CONNECT_TIMEOUT = 10.0  # s to connect upstream before resetting the client
THROTTLE_TICK = 0.05  # s: a throttled pipe writes slices of rate * tick bytes
RANDOM_RESET_MAX_BYTES = 16 * 1024 * 1024  # reset_probability: budget log-uniform in [1, this)


def _close(sock: trio.socket.SocketType, *, abort: bool) -> None:
    if abort:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError as exc:  # already closed by the kernel: close() below is enough
            log.debug("cannot set SO_LINGER error=%s", exc)
    sock.close()


class Connection:
    """One proxied TCP connection: the client's stream, upstream's, and two pipes."""

    def __init__(self, proxy: FaultProxy, client: trio.SocketStream, source: str, index: int) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: trio.SocketStream | None = None
        self.source = source
        self.scope = trio.CancelScope()
        self.resetting = False
        faults = proxy.faults
        self.cut_budget = faults.cut_after
        self.random_budget: int | None = None
        rng = seeded(proxy.seed, "tcp", index)
        if faults.reset_probability and rng.random() < faults.reset_probability:
            self.random_budget = int(2 ** rng.uniform(0, math.log2(RANDOM_RESET_MAX_BYTES)))
        self.up = Pipe(self, "up", seeded(proxy.seed, "tcp", index, "up"))
        self.down = Pipe(self, "down", seeded(proxy.seed, "tcp", index, "down"))

    async def run(self) -> None:
        """Forward until both directions end or the connection is reset."""
        proxy = self.proxy
        proxy._connections.add(self)
        proxy._count()
        try:
            with self.scope:
                if self.budget() == 0:
                    self.reset()
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.up.read, self.client)
                    while self.source in proxy.faults.block:
                        await proxy._changed.park()
                    try:
                        with trio.fail_after(CONNECT_TIMEOUT):
                            self.upstream = await proxy._dial()
                    except (OSError, trio.TooSlowError) as exc:
                        log.debug("upstream unreachable proxy=%s error=%r", proxy.address, exc)
                        self.reset()
                        return
                    nursery.start_soon(self.up.write, self.upstream)
                    nursery.start_soon(self.down.read, self.upstream)
                    nursery.start_soon(self.down.write, self.client)
        finally:
            proxy._connections.discard(self)
            proxy._held -= self.up.held + self.down.held
            if self.resetting:
                proxy._resets += 1
            for stream in (self.client, self.upstream):
                if stream is not None:
                    _close(stream.socket, abort=self.resetting)
            proxy._count()

    def budget(self) -> int | None:
        """Bytes this connection may still forward before it is reset (None: no limit)."""
        budgets = [b for b in (self.cut_budget, self.random_budget) if b is not None]
        return min(budgets) if budgets else None

    def spend(self, nbytes: int) -> None:
        if self.cut_budget is not None:
            self.cut_budget -= nbytes
        if self.random_budget is not None:
            self.random_budget -= nbytes

    def reset(self) -> None:
        """Abort the connection: both sockets are closed with SO_LINGER 0."""
        self.resetting = True
        self.scope.cancel()

    def fail(self, direction: str, exc: BaseException) -> None:
        log.debug("connection failed proxy=%s source=%s direction=%s error=%r",
                  self.proxy.address, self.source, direction, exc)
        self.reset()


class Pipe:
    """One direction of a connection: a bounded queue between a reader and a writer."""

    def __init__(self, conn: Connection, direction: str, rng: random.Random) -> None:
        self.conn = conn
        self.direction = direction
        self.jitter_rng = rng  # reader's
        self.corrupt_rng = random.Random(rng.random())  # writer's
        self.queue: collections.deque[tuple[float, float, bytes]] = collections.deque()
        self.held = 0
        self.eof = False
        self.lot = trio.lowlevel.ParkingLot()  # reader and writer wake each other
        self.sent_at = -math.inf
        self.sent_len = 0

    async def read(self, src: trio.SocketStream) -> None:
        proxy = self.conn.proxy
        try:
            while True:
                while self.held >= MAX_HELD_BYTES:
                    await self.lot.park()  # backpressure: the sender's kernel buffers fill
                data = await src.receive_some(MAX_CHUNK)
                if not data:
                    self.eof = True
                    self.lot.unpark_all()
                    return
                self.queue.append((trio.current_time(), self.jitter_rng.uniform(-1.0, 1.0), data))
                self.held += len(data)
                proxy._held += len(data)
                self.lot.unpark_all()
                proxy._count()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.conn.fail(self.direction, exc)

    async def write(self, dst: trio.SocketStream) -> None:
        conn, proxy = self.conn, self.conn.proxy
        try:
            while True:
                while not self.queue:
                    if self.eof:
                        await dst.send_eof()
                        return
                    await self.lot.park()
                arrival, jitter, data = self.queue.popleft()
                size = len(data)
                faults = proxy.faults
                if faults.corrupt and self.corrupt_rng.random() < faults.corrupt:
                    data = flip_one_byte(data, self.corrupt_rng)
                    proxy._corrupted += 1
                view = memoryview(data)
                while view:
                    await self._gate(arrival, jitter)
                    piece = view[: min(self._slice(), _or_inf(conn.budget()))]
                    if piece:
                        # Charged before sending: the peer may read these bytes before this
                        # task runs again, and a cut_after set then must not count them.
                        conn.spend(len(piece))
                        await dst.send_all(piece)
                        self.sent_at, self.sent_len = trio.current_time(), len(piece)
                        proxy._bytes[self.direction] += len(piece)
                        view = view[len(piece):]
                        proxy._count()
                    if conn.budget() == 0:
                        log.debug("connection cut proxy=%s source=%s", proxy.address, conn.source)
                        conn.reset()
                        return
                self.held -= size
                proxy._held -= size
                self.lot.unpark_all()
                proxy._count()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.conn.fail(self.direction, exc)

    async def _gate(self, arrival: float, jitter: float) -> None:
        """Return once this pipe may send: source not blocked, delay over, throttle allows."""
        proxy = self.conn.proxy
        while True:
            faults = proxy.faults
            if self.conn.source in faults.block:
                wake = math.inf
            else:
                wake = arrival + max(0.0, faults.delay + jitter * faults.jitter)
                if faults.throttle is not None:
                    wake = max(wake, self.sent_at + self.sent_len / faults.throttle)
                if trio.current_time() >= wake:
                    return
            with trio.move_on_at(wake):
                await proxy._changed.park()

    def _slice(self) -> int:
        rate = self.conn.proxy.faults.throttle
        return MAX_CHUNK if rate is None else max(1, min(MAX_CHUNK, int(rate * THROTTLE_TICK)))


def _or_inf(value: int | None) -> float:
    return math.inf if value is None else value
