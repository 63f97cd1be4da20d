"""An in-memory network on trio's clock, for tests: :class:`SimNetwork`.

Theory of operation
-------------------
A :class:`SimNetwork` holds named hosts; ``net.host(name)`` is that host's view of the
network and implements :class:`gossip.network.Network`, so every dial and datagram knows
where it comes from. Nothing here starts a task or touches a socket: every delay is a
``trio.sleep`` or a deadline, so a whole swarm runs under ``trio.testing.MockClock`` with
autojump, and one virtual second costs no wall time.

Streams are lazy. A connection is two :class:`~gossip.testing.simhost._Pipe` objects, one per
direction, each a queue of byte strings stamped with the virtual time they *arrive*;
``receive_some`` returns the head once the clock has passed its stamp and otherwise parks
until then (or until something changes). No task carries bytes anywhere. Arrival is::

    serialized = max(now, link busy until) + len / bandwidth    # one queue per direction
    arrival    = max(serialized + latency (+ rto if lost), previous arrival on this pipe)

so order is kept and nothing is lost (TCP). ``send_all`` cuts its data into segments of
:data:`SEGMENT` bytes and draws one loss per segment: a lost segment arrives ``rto`` late.
Flow control: the bytes in flight plus unread on a pipe never exceed ``window``; ``send_all``
puts as much of a segment as fits and parks for the rest, so a stalled reader bounds memory.
Credit comes back the instant the reader consumes, not one latency later. ``send_all``
returns once its last byte is serialized.

Faults are state changes that wake every parked task, which then re-checks the state:

* ``partition(*groups)``: segments not yet arrived on a cut link are stamped "never" and are
  restamped, serialized again, when the link heals; dials across the cut wait for the heal
  (the caller's deadline ends them, as SYN retries would). Datagrams across it are lost.
  Hosts named in no group form one more group together, so ``partition(["a"])`` isolates a.
* ``pause(host)``: the host is frozen (a stopped VM, a long stall): every link between it and
  any other host is cut exactly as a partition cuts one, until ``resume(host)``. Its own
  tasks keep running; only what it sends and what is sent to it stops moving. Pauses and the
  partition are independent: a link carries data when no pause and no partition cuts it, so
  resuming inside a partition leaves the partition's cuts in place, and healing leaves a
  paused host cut off.
* ``crash(host)``: its streams are reset (``trio.BrokenResourceError`` at both ends), its
  datagram endpoints die (:class:`~gossip.errors.PeerGone`), its ``serve`` calls cancel their
  handlers and raise ``PeerGone``, and dials to or from it raise ``PeerGone``. ``restart``
  lets it bind and dial again; what the crash closed stays closed. Tasks the test runs "on"
  the host are the test's to cancel.
* ``reset(a, b)``: a connection-reset fault on every stream between a and b.
* ``slow(host, lag)``: the host's event loop is slow (CPU starved, swapping, a long GC): every
  datagram, stream segment and handshake packet it sends or receives is handled late by a
  random delay, exponential with mean ``lag`` seconds (drawn once at each end). Stream order
  is kept; datagrams may overtake each other, as they would.
* ``nat(host, udp_timeout=30.0, refuse=False)``: the host sits behind a NAT (or a stateful
  firewall) until ``unnat(host)``: what it opens works both ways, nothing from outside gets
  in. A dial to it reaches the NAT and is dropped there, so it waits as across a partition
  (for ``unnat``, or the caller's deadline, as SYN retries would); with ``refuse`` it is
  refused at once, exactly as at a closed port. A datagram gets through only if, when it
  arrives, the host sent one from the port it is addressed to, to the sender's exact
  ``host:port``, at most ``udp_timeout`` seconds before (endpoint-dependent filtering; each
  datagram sent refreshes its mapping, and addresses are not translated, so peers see the
  host's own). Others are lost and counted in ``nat_dropped``. A datagram is judged when it
  is sent, by the mapping as it stands then: a refresh sent while it is in flight does not
  save it. Sends from a paused host refresh nothing (they never leave it); sends across a
  partition do (the NAT is before the cut). The NAT is the host's network, not its
  process: a crash and restart keep it, mappings included, and it hides the crash (dials
  still hang or are refused). Connections open when ``nat`` is applied stay open both ways,
  as established state; the mappings start empty, so datagrams then in flight to the host
  are lost. Calling ``nat`` again changes the settings and keeps the mappings.

Randomness: each link direction draws from its own ``random.Random`` seeded from the
network's seed and the two names, so the faults a link sees depend only on the seed and the
operations on that link, not on how trio happened to interleave other links' tasks.
"""

from __future__ import annotations

import errno
import functools
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Union

import trio

from ..errors import PeerGone
from ..network import format_address, parse_address
from .simhost import (
    _NEVER,
    SEGMENT,
    SimDatagramEndpoint,
    SimHost,
    SimStream,
    _Connection,
    _Listener,
    _Pipe,
    _Segment,
)

__all__ = ["SimNetwork", "SimHost", "SimStream", "SimDatagramEndpoint", "SimStatistics"]
__all__ += ["SEGMENT", "MAX_DATAGRAM_QUEUE"]

MAX_DATAGRAM_QUEUE = 1024  # datagrams an endpoint holds (in flight + unread) before dropping
FIRST_EPHEMERAL_PORT = 49152  # ports handed out for port 0 and for the dialing side
MIN_NAT_PRUNE = 64  # NAT mappings a host holds before expired ones are swept

HostLike = Union[str, SimHost]  # faults and links accept a name or the host itself


@dataclass(frozen=True)
class SimStatistics:
    """Counters since the network was created (``bytes_buffered`` is a gauge)."""

    connections_opened: int
    connections_refused: int  # dials that found no listener, a crashed host or a firewall
    connections_reset: int  # by crash() or reset()
    bytes_sent: int  # stream payload handed to send_all
    bytes_buffered: int  # stream bytes sent but not yet read, over all open streams
    segments_retransmitted: int  # stream segments "lost" and delivered one rto late
    datagrams_sent: int
    datagrams_dropped: int  # lost, partitioned, unbound or crashed destination, queue full, NAT
    nat_dropped: int  # of those, datagrams that would have been delivered but a NAT filtered


@dataclass
class _Link:
    latency: float
    bandwidth: float | None  # bytes/s; None = unlimited
    loss: float


@dataclass
class _Direction:
    rng: random.Random
    busy_until: float = -_NEVER  # virtual time the link finishes serializing what it has


@dataclass(eq=False)
class _Nat:
    udp_timeout: float  # seconds a mapping lives after the last datagram through it
    refuse: bool  # dials are refused at once instead of dropped
    mappings: dict[tuple[int, str], float] = field(default_factory=dict)  # see map()
    prune_at: int = MIN_NAT_PRUNE  # sweep expired mappings once there are this many

    def map(self, port: int, remote: str, now: float) -> None:
        """Record a datagram sent from local ``port`` to ``remote`` (host:port) at ``now``."""
        self.mappings[(port, remote)] = now
        if len(self.mappings) >= self.prune_at:  # amortized O(1): the bound doubles
            live = {key: sent for key, sent in self.mappings.items()
                    if now - sent <= self.udp_timeout}
            self.mappings = live
            self.prune_at = max(MIN_NAT_PRUNE, 2 * len(live))

    def admits(self, port: int, sender: str, arrival: float) -> bool:
        sent = self.mappings.get((port, sender))
        return sent is not None and arrival - sent <= self.udp_timeout


@dataclass(eq=False)
class _HostState:
    up: bool = True
    listeners: dict[int, _Listener] = field(default_factory=dict)
    endpoints: dict[int, SimDatagramEndpoint] = field(default_factory=dict)
    next_port: int = FIRST_EPHEMERAL_PORT

    def ephemeral_port(self, taken: Iterable[int] = ()) -> int:
        taken = set(taken)
        for _ in range(65536 - FIRST_EPHEMERAL_PORT):
            port, self.next_port = self.next_port, self.next_port + 1
            if self.next_port > 65535:
                self.next_port = FIRST_EPHEMERAL_PORT
            if port not in taken:
                return port
        raise OSError(errno.EADDRINUSE, "no free ephemeral port")


class SimNetwork:
    """A simulated network of named hosts. See the module docstring.

    Args:
        seed: seeds every random choice (loss draws).
        latency: one-way delay of every link, seconds.
        bandwidth: bytes/s of each direction of every link; None or ``math.inf`` = unlimited.
        loss: probability that a datagram is lost, or that a stream segment needs one
            retransmission (arrives ``rto`` late).
        window: most bytes a stream direction holds in flight plus unread before
            ``send_all`` waits for the reader.
        rto: extra delay of a retransmitted stream segment, seconds.
    """

    def __init__(
        self,
        seed: int = 0,
        *,
        latency: float = 0.001,
        bandwidth: float | None = None,
        loss: float = 0.0,
        window: int = 256 * 1024,
        rto: float = 0.2,
    ) -> None:
        if window < 1 or rto < 0:
            raise ValueError("window must be >= 1 and rto >= 0")
        self.seed = seed
        self.window = window
        self.rto = rto
        self._default = _check_link(_Link(latency, bandwidth, loss))
        self._links: dict[frozenset[str], _Link] = {}
        self._directions: dict[tuple[str, str], _Direction] = {}
        self._hosts: dict[str, _HostState] = {}
        self._views: dict[str, SimHost] = {}
        self._groups: dict[str, int] = {}  # host -> partition group; absent = group 0
        self._paused: set[str] = set()  # hosts cut off from every other host
        self._lag: dict[str, float] = {}  # host -> mean extra handling delay, seconds
        self._nats: dict[str, _Nat] = {}  # hosts behind a NAT or firewall
        self._connections: dict[_Connection, None] = {}  # insertion-ordered set
        self._topology = trio.lowlevel.ParkingLot()  # woken on any change of who reaches whom
        self._stats = dict.fromkeys(SimStatistics.__dataclass_fields__, 0)

    # ---- configuration and faults -------------------------------------------------------

    def host(self, name: str) -> SimHost:
        """The host called ``name`` (created on first use), as a :class:`Network`."""
        if name not in self._views:
            if not name or any(c in name for c in ":[] \t\n"):
                raise ValueError(f"bad host name {name!r}")
            self._hosts[name] = _HostState()
            self._views[name] = SimHost(self, name)
        return self._views[name]

    def set_link(
        self,
        a: HostLike,
        b: HostLike,
        *,
        latency: float | None = None,
        bandwidth: float | None = None,
        loss: float | None = None,
    ) -> None:
        """Override the defaults on the link between a and b, both ways (None = unchanged;
        ``bandwidth=math.inf`` = unlimited). Applies to what is sent from now on."""
        key = frozenset((_name(a), _name(b)))
        old = self._links.get(key, self._default)
        latency = old.latency if latency is None else latency
        bandwidth = old.bandwidth if bandwidth is None else bandwidth
        loss = old.loss if loss is None else loss
        self._links[key] = _check_link(_Link(latency, bandwidth, loss))

    def partition(self, *groups: Iterable[HostLike]) -> None:
        """Cut the network: hosts in different groups exchange nothing until :meth:`heal`.
        Hosts named in no group form one group together. Replaces any earlier partition."""
        new: dict[str, int] = {}
        for index, group in enumerate(groups, start=1):
            for host in group:
                name = _name(host)
                if name in new:
                    raise ValueError(f"host {name!r} is in more than one group")
                new[name] = index
        self._change_reachability(lambda: setattr(self, "_groups", new))

    def heal(self) -> None:
        """Remove the partition; stalled stream data resumes, dials waiting on it go on
        (except to and from paused hosts)."""
        self._change_reachability(lambda: setattr(self, "_groups", {}))

    def pause(self, host: HostLike) -> None:
        """Freeze ``host``: cut it off from every other host as a partition would (stream
        data held, datagrams lost, dials waiting) until :meth:`resume`. Pausing a paused host
        changes nothing."""
        name = self.host(_name(host)).name
        self._change_reachability(lambda: self._paused.add(name))

    def resume(self, host: HostLike) -> None:
        """Undo :meth:`pause`: held stream data resumes on every link that no partition
        cuts. Resuming a host that is not paused changes nothing."""
        name = self.host(_name(host)).name
        self._change_reachability(lambda: self._paused.discard(name))

    def paused(self, host: HostLike) -> bool:
        """Whether ``host`` is paused."""
        return _name(host) in self._paused

    def crash(self, host: HostLike) -> None:
        """Crash ``host``: reset its streams, stop its servers and datagram endpoints, and
        refuse dials to and from it until :meth:`restart`."""
        name = _name(host)
        state = self._hosts[self.host(name).name]
        state.up = False
        self._reset_where(lambda conn: name in (conn.ends[0].host, conn.ends[1].host))
        for listener in state.listeners.values():
            listener.nursery.cancel_scope.cancel()  # its serve() then raises PeerGone
        for endpoint in state.endpoints.values():
            endpoint._crashed = True
            endpoint._inbox.clear()
            endpoint._lot.unpark_all()
        state.listeners.clear()
        state.endpoints.clear()
        self._topology.unpark_all()

    def restart(self, host: HostLike) -> None:
        """Let a crashed host bind and dial again."""
        self._hosts[self.host(_name(host)).name].up = True
        self._topology.unpark_all()

    def slow(self, host: HostLike, lag: float) -> None:
        """Make ``host`` slow to handle what it sends and receives: a random extra delay,
        exponential with mean ``lag`` seconds, at its end of every transfer. 0 makes it
        normal again."""
        if lag < 0:
            raise ValueError("lag must be >= 0")
        if lag:
            self._lag[_name(host)] = lag
        else:
            self._lag.pop(_name(host), None)

    def nat(self, host: HostLike, *, udp_timeout: float = 30.0, refuse: bool = False) -> None:
        """Put ``host`` behind a NAT until :meth:`unnat`: its own dials and the replies to its
        datagrams work, dials to it wait (``refuse``: are refused at once), and a datagram
        reaches it only within ``udp_timeout`` seconds of one it sent from that port to the
        sender's address. Open connections are kept. Again on a host behind a NAT: new
        settings, same mappings.

        Raises:
            ValueError: ``udp_timeout`` is not > 0 (``math.inf``: mappings never expire).
        """
        if not udp_timeout > 0:
            raise ValueError(f"udp_timeout must be > 0 seconds, not {udp_timeout!r}")
        name = self.host(_name(host)).name
        nat = self._nats.get(name)
        if nat is not None:
            nat.udp_timeout, nat.refuse = udp_timeout, refuse
        else:
            self._nats[name] = _Nat(udp_timeout, refuse)
            now = trio.current_time()
            for endpoint in self._hosts[name].endpoints.values():
                # What is in flight to the host was sent before any mapping: unsolicited.
                dropped = endpoint._drop_in_flight(now, lambda sender: sender != name)
                self._stats["datagrams_dropped"] += dropped
                self._stats["nat_dropped"] += dropped
        self._topology.unpark_all()  # waiting dials look again (refuse may have changed)

    def unnat(self, host: HostLike) -> None:
        """Undo :meth:`nat`: dials waiting at the NAT go on, and every datagram gets in.
        A host not behind a NAT is left as it is."""
        self._nats.pop(_name(host), None)
        self._topology.unpark_all()

    def behind_nat(self, host: HostLike) -> bool:
        """Whether ``host`` is behind a NAT (or a firewall: :meth:`nat` with ``refuse``)."""
        return _name(host) in self._nats

    def reset(self, a: HostLike, b: HostLike) -> None:
        """Reset every open stream between a and b (either direction of dial)."""
        pair = {_name(a), _name(b)}
        self._reset_where(lambda conn: {conn.ends[0].host, conn.ends[1].host} == pair)

    def statistics(self) -> SimStatistics:
        return SimStatistics(**self._stats)

    # ---- internals shared by hosts, streams and endpoints ------------------------------

    def _link(self, src: str, dst: str) -> _Link:
        return self._links.get(frozenset((src, dst)), self._default)

    def _direction(self, src: str, dst: str) -> _Direction:
        key = (src, dst)
        if key not in self._directions:
            self._directions[key] = _Direction(random.Random(f"{self.seed}:{src}->{dst}"))
        return self._directions[key]

    def _blocked(self, src: str, dst: str) -> bool:
        """Whether a pause or the partition cuts the link from src to dst."""
        if src == dst:
            return False
        if src in self._paused or dst in self._paused:
            return True
        return self._groups.get(src, 0) != self._groups.get(dst, 0)

    def _nat_before(self, src: str, dst: str) -> _Nat | None:
        """dst's NAT, which what src sends to dst must cross (none from a host to itself)."""
        return None if src == dst else self._nats.get(dst)

    def _check_up(self, name: str) -> None:
        if not self._hosts[name].up:
            raise PeerGone(f"host {name} has crashed")

    def _serialize(self, src: str, dst: str, nbytes: int) -> tuple[float, float]:
        """Put ``nbytes`` on the link; returns (when serialized, when it arrives)."""
        link, direction = self._link(src, dst), self._direction(src, dst)
        start = max(trio.current_time(), direction.busy_until)
        done = start + (nbytes / link.bandwidth if link.bandwidth else 0.0)
        direction.busy_until = done
        return done, done + link.latency + self._lag_delay(src, dst, direction.rng)

    def _lag_delay(self, src: str, dst: str, rng: random.Random) -> float:
        if not self._lag:
            return 0.0
        delay = 0.0
        for host in (src, dst):
            mean = self._lag.get(host)
            if mean:
                delay += rng.expovariate(1.0 / mean)
        return delay

    def _lost(self, src: str, dst: str) -> bool:
        loss = self._link(src, dst).loss
        return loss > 0 and self._direction(src, dst).rng.random() < loss

    def _lost_segment(self, pipe: _Pipe) -> bool:
        if self._lost(pipe.src, pipe.dst):
            self._stats["segments_retransmitted"] += 1
            return True
        return False

    def _transmit(self, pipe: _Pipe, data: bytes | None, lost: bool) -> float:
        """Queue bytes (``None`` = end of stream) on ``pipe``, ``rto`` late if ``lost``;
        returns when the link has serialized them."""
        done, arrival = self._serialize(pipe.src, pipe.dst, len(data or b""))
        if lost:
            arrival += self.rto
        if self._blocked(pipe.src, pipe.dst):
            arrival = _NEVER
        pipe.last_arrival = arrival = max(arrival, pipe.last_arrival)
        pipe.segments.append(_Segment(arrival, data))
        if data is not None:
            pipe.unread += len(data)
            self._stats["bytes_sent"] += len(data)
            self._stats["bytes_buffered"] += len(data)
        if len(pipe.segments) == 1:
            pipe.wake()  # a new head: the reader's deadline changed (a writer gains nothing)
        return done

    async def _travel(self, src: str, dst: str, owner: str) -> None:
        """Carry one handshake packet from src to dst: wait out any partition, then the
        link's latency (plus ``rto`` if lost). Raises PeerGone if ``owner`` crashes."""
        while True:
            while self._blocked(src, dst):
                await self._topology.park()
                self._check_up(owner)
            lost = self._lost(src, dst)
            lag = self._lag_delay(src, dst, self._direction(src, dst).rng)
            await trio.sleep(self._link(src, dst).latency + lag + (self.rto if lost else 0.0))
            self._check_up(owner)
            if not self._blocked(src, dst):
                return

    def _connect(self, client: str, server: str, port: int) -> tuple[SimStream, SimStream]:
        client_address = format_address(client, self._hosts[client].ephemeral_port())
        server_address = format_address(server, port)
        up, down = _Pipe(client, server), _Pipe(server, client)
        conn = _Connection()
        conn.ends = [
            SimStream(self, conn, up, down, client_address, server_address),
            SimStream(self, conn, down, up, server_address, client_address),
        ]
        self._connections[conn] = None
        self._stats["connections_opened"] += 1
        return conn.ends[0], conn.ends[1]

    def _send_datagram(self, source: SimDatagramEndpoint, data: bytes, address: str) -> None:
        self._stats["datagrams_sent"] += 1
        host, port = parse_address(address)
        src = source._host
        own_nat = self._nat_before(host, src)
        if own_nat is not None and src not in self._paused:
            own_nat.map(source._port, format_address(host, port), trio.current_time())
        state = self._hosts.get(host)
        if state is not None:
            _, arrival = self._serialize(src, host, len(data))
            target = state.endpoints.get(port)
            if (
                target is not None
                and not self._blocked(src, host)
                and not self._lost(src, host)
                and len(target._inbox) < MAX_DATAGRAM_QUEUE
            ):
                # Judged last, so a NAT leaves the link's loss draws as they were.
                nat = self._nat_before(src, host)
                if nat is None or nat.admits(port, source.local_address, arrival):
                    target._deliver(arrival, data, source.local_address, src)
                    return
                self._stats["nat_dropped"] += 1
        self._stats["datagrams_dropped"] += 1

    def _change_reachability(self, change: Callable[[], None]) -> None:
        """Apply ``change`` (to the partition or the pauses), then bring every stream and
        datagram in flight in line: links it cuts hold back what has not arrived yet, links
        it heals send what they held back, and waiting dials look again."""
        pipes = [end._out for conn in self._connections for end in conn.ends]
        before = [self._blocked(pipe.src, pipe.dst) for pipe in pipes]
        change()
        now = trio.current_time()
        for pipe, was_blocked in zip(pipes, before):
            blocked = self._blocked(pipe.src, pipe.dst)
            if blocked and not was_blocked:
                for segment in pipe.segments:
                    if segment.arrival > now:
                        segment.arrival = pipe.last_arrival = _NEVER
            elif was_blocked and not blocked:
                self._restamp(pipe)
        for name, state in self._hosts.items():
            for endpoint in state.endpoints.values():
                cut = functools.partial(self._blocked, dst=name)
                self._stats["datagrams_dropped"] += endpoint._drop_in_flight(now, cut)
        self._topology.unpark_all()

    def _restamp(self, pipe: _Pipe) -> None:
        """A healed link retransmits what the partition held back, in order."""
        pipe.last_arrival = -_NEVER
        for segment in pipe.segments:
            if segment.arrival == _NEVER:
                _, arrival = self._serialize(pipe.src, pipe.dst, len(segment.data or b""))
                segment.arrival = max(arrival, pipe.last_arrival)
            pipe.last_arrival = segment.arrival
        pipe.wake()

    def _reset_where(self, predicate: Callable[[_Connection], bool]) -> None:
        for conn in [c for c in self._connections if predicate(c)]:
            self._stats["connections_reset"] += 1
            for end in conn.ends:
                end._out.broken = True
                self._stats["bytes_buffered"] -= end._out.discard()
                end._out.wake()
            del self._connections[conn]

    def _close_end(self, end: SimStream) -> None:
        out, inbound = end._out, end._in
        if not (out.eof_sent or out.broken):
            out.eof_sent = True
            self._transmit(out, None, lost=False)
        inbound.reader_gone = True
        self._stats["bytes_buffered"] -= inbound.discard()
        out.wake()
        inbound.wake()
        end._conn.open_ends -= 1
        if end._conn.open_ends == 0:
            self._connections.pop(end._conn, None)


def _check_link(link: _Link) -> _Link:
    if link.bandwidth == math.inf:
        link.bandwidth = None
    if link.latency < 0 or not 0.0 <= link.loss <= 1.0:
        raise ValueError("latency must be >= 0 and loss in [0, 1]")
    if link.bandwidth is not None and link.bandwidth <= 0:
        raise ValueError("bandwidth must be > 0 (None or math.inf for unlimited)")
    return link


def _name(host: HostLike) -> str:
    return host.name if isinstance(host, SimHost) else host

