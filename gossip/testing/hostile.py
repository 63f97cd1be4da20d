"""Hostile peers and outsiders: attacks on a node, to test a swarm's robustness.

Theory of operation
-------------------
An :class:`Outsider` reaches a node's port without the swarm key; a :class:`HostilePeer` holds
the key and an identity, and misbehaves. Both are made of the library's own pieces (network,
handshake, messages, codecs, sealer): an attack sends the bytes a real attacker could, and no
production code is copied. Faults go in at the transport seam, a tap stream under each
connection that keeps the last bytes sent (to replay) and can cut the next send short.

Each attack is an async method against ``address`` returning an :class:`Outcome`: the target
``CLOSED`` the connection without a word (its answer to any protocol violation), ``REJECTED``
it with ``Close(REJECTED, reason)``, ``ACCEPTED`` what we sent (the attack got through) or
``HELD`` on past our ``patience``. Methods raise only if the target cannot be reached.

Replays. A record replayed on its channel must fail authentication: nonces count records per
direction (PROTOCOL.md section 5), keys are per connection. A sealed datagram replayed later
passes the seal, which remembers no nonces (section 12); the incarnation bounds it: a captured
``Suspect``/``Dead``/``Left`` is stale once its member announced a higher one, so a replay
must change no table nor make the member refute (it answers with its current ``Alive``).
"""

from __future__ import annotations

import enum
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

import torch
import trio

from ..address import parse_address
from ..channel import MAX_RECORD, SecureChannel
from ..endpoints import handshake
from ..config import Timeouts
from ..errors import GossipError, PeerTimeout
from ..groups import first_error, one_error
from ..handshake import MAX_HANDSHAKE_MESSAGE, Swarm
from ..identity import Identity
from ..claims import sign_left
from ..messages import (MAX_COUNT, Accept, Close, Commit, Dead, Left, MemberState, Message,
                        Offer, Packet, PushPull, StateHeader, Suspect)
from ..network import Network, TcpNetwork
from ..seal import Sealer
from ..tables import receive_table, send_table
from ..tensors import (StateSchema, TensorSpec, encode_chunks, encoded_nbytes, new_flat,
                       snapshot)
from ..transfer import receive_state, send_state
from ..wire import FRAME_HEADER, decode, encode, encode_frame

__all__ = ["Reaction", "Outcome", "Flood", "Outsider", "HostilePeer"]

MAX_TRANSCRIPT = 64 * 1024  # bytes of the target's answer an Outcome keeps
HUGE = 0xFFFFFFFF  # the largest 4-byte length: 4 GiB - 1
BUSY_TRIES = 40  # offers answered Close(BUSY) before an attack gives up


class Reaction(enum.Enum):
    """What the target did."""

    CLOSED = "closed"  # closed the connection without a word (end of stream or reset)
    REJECTED = "rejected"  # said Close(REJECTED, reason)
    BUSY = "busy"  # said Close(BUSY) to every offer
    ANSWERED = "answered"  # said something else (a handshake message 2, datagrams)
    ACCEPTED = "accepted"  # took what we sent: the attack got through
    HELD = "held"  # kept the connection open past our patience
    SILENT = "silent"  # sent no datagram back


@dataclass(frozen=True)
class Outcome:
    """One attack's result. ``seconds``: from the attack's decisive bytes to the reaction;
    ``answer``: the target's last message, if readable; ``received``: the raw bytes it sent
    (first 64 KiB), to check for anything an outsider must not learn; ``messages``: its
    datagram answers, opened (key holders only)."""

    attack: str
    reaction: Reaction
    seconds: float
    answer: Message | None = None
    received: bytes = b""
    messages: tuple[Message, ...] = ()
    detail: str = ""

    @property
    def reason(self) -> str:  # the reason of the target's Close, or ""
        return self.answer.reason if isinstance(self.answer, Close) else ""


@dataclass
class Flood:
    """A running flood (:meth:`Outsider.open_flood`), updated live. ``held_seconds``: how long
    the target kept each connection it closed (a connection limit closes extras at once, the
    handshake deadline later). ``all_closed``: all closed or failed, when none reopen;
    ``all_opened``: as many accepted as there are slots."""

    slots: int  # connections the flood tries to hold at once
    reopen: bool = False
    opened: int = 0  # TCP connections the target's port accepted
    failed: int = 0  # dials that failed or timed out
    open_now: int = 0
    held_seconds: list[float] = field(default_factory=list)
    all_closed: trio.Event = field(default_factory=trio.Event)
    all_opened: trio.Event = field(default_factory=trio.Event)  # ``slots`` accepted so far

    def _done(self, held: float | None) -> None:  # None: the dial failed
        if held is None:
            self.failed += 1
        else:
            self.open_now -= 1
            self.held_seconds.append(held)
        if not self.reopen and self.failed + len(self.held_seconds) == self.slots:
            self.all_closed.set()


class _Tap(trio.abc.Stream):
    """The transport seam: keeps the last bytes sent and the first received; cuts sends."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner, self.last, self.received = inner, b"", bytearray()
        self.cut: int | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self.last = bytes(data)
        data, self.cut = (self.last if self.cut is None else self.last[: self.cut]), None
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(max_bytes)
        self.received += data[: max(0, MAX_TRANSCRIPT - len(self.received))]
        return bytes(data)

    async def aclose(self) -> None:
        await self.inner.aclose()


class Outsider:
    """Attacks by anyone who reaches a node's port, without the swarm key. ``network`` reaches
    the target (TCP by default); ``timeouts`` bound our dials and handshakes; ``patience``:
    how long we wait for a reaction before calling it ``HELD``; ``rng``: garbage, backoffs."""

    def __init__(self, *, network: Network | None = None, timeouts: Timeouts = Timeouts(),
                 patience: float = 30.0, rng: random.Random | None = None) -> None:
        self.network, self.timeouts = network or TcpNetwork(), timeouts
        self.patience, self.rng = patience, rng or random.Random()

    async def handshake(self, address: str) -> Outcome:
        """The whole handshake with a random swarm key. psk0: the responder must close after
        message 1 having sent nothing (``received`` empty, no identity learned)."""
        tap, started = await self._dial(address), trio.current_time()
        reaction, detail, swarm = Reaction.HELD, "", Swarm("outsider", self.rng.randbytes(32))
        with trio.move_on_after(self.patience):
            try:
                channel = await handshake(tap, identity=Identity.generate(), swarm=swarm, initiator=True)
                reaction, detail = Reaction.ACCEPTED, f"handshake completed: {channel.peer}"
            except GossipError as exc:
                reaction, detail = Reaction.CLOSED, f"{type(exc).__name__}: {exc}"
        await trio.aclose_forcefully(tap)
        return Outcome("wrong-key handshake", reaction, trio.current_time() - started,
                       received=bytes(tap.received), detail=detail)

    async def probe(self, address: str, data: bytes | None = None, attack: str = "probe") -> Outcome:
        """Send ``data`` (default: random bytes shaped like message 1) where message 1 goes."""
        data = encode_frame(self.rng.randbytes(48)) if data is None else data
        return await self._until_closed(await self._dial(address), attack, data)

    async def huge_prefix(self, address: str) -> Outcome:
        """A 4 GiB length prefix where handshake message 1 goes: refused unallocated."""
        return await self.probe(address, FRAME_HEADER.pack(HUGE), "4 GiB prefix (handshake)")

    async def replay_datagram(self, address: str, datagram: bytes, *, times: int = 10,
                              listen: float = 1.0, attack: str = "replayed datagram") -> Outcome:
        """Send ``datagram`` ``times`` to the node's UDP port (the TCP port's number); collect
        answers until ``listen`` s after. Random bytes as ``datagram`` make a forgery."""
        host, _ = parse_address(address)
        endpoint = await self.network.open_datagram("[::]:0" if ":" in host else "0.0.0.0:0")
        answers: list[bytes] = []
        started = trio.current_time()
        try:
            for _ in range(times):
                await endpoint.send(datagram, address)
            with trio.move_on_after(listen):
                while True:
                    answers.append((await endpoint.receive())[0])
        finally:
            await endpoint.aclose()
        return Outcome(attack, Reaction.ANSWERED if answers else Reaction.SILENT,
                       trio.current_time() - started, received=b"".join(answers),
                       messages=self._open(answers))

    @asynccontextmanager
    async def open_flood(self, address: str, count: int = 500, *, first_bytes: bytes | None = None,
                         reopen_after: float | None = None) -> AsyncIterator[Flood]:
        """Hold ``count`` connections that never finish a handshake while the body runs. Each
        sends ``first_bytes`` (default: a length announcing the largest handshake message, and
        32 of its bytes, so that the target allocates its largest buffer) and holds. With
        ``reopen_after``, a closed one is dialled again that much later (a sustained flood)."""
        first = (FRAME_HEADER.pack(MAX_HANDSHAKE_MESSAGE) + self.rng.randbytes(32)
                 if first_bytes is None else first_bytes)
        flood = Flood(count, reopen=reopen_after is not None)
        with one_error():  # the body's own error, not a group around it
            async with trio.open_nursery() as nursery:
                for _ in range(count):
                    nursery.start_soon(self._hold, address, first, flood, reopen_after)
                try:
                    yield flood
                finally:
                    nursery.cancel_scope.cancel()

    def _open(self, datagrams: list[bytes]) -> tuple[Message, ...]:
        return ()  # without the swarm key, nothing

    async def _dial(self, address: str) -> _Tap:
        try:
            with trio.fail_after(self.timeouts.connect):
                return _Tap(await self.network.dial(address))
        except trio.TooSlowError:
            raise PeerTimeout(address, "connect") from None

    async def _hold(self, address: str, first: bytes, flood: Flood, again: float | None) -> None:
        while True:
            try:
                tap = await self._dial(address)
            except GossipError:
                flood._done(None)
            else:
                flood.opened, flood.open_now = flood.opened + 1, flood.open_now + 1
                if flood.opened >= flood.slots:
                    flood.all_opened.set()
                flood._done((await self._until_closed(tap, "flood", first, forever=True)).seconds)
            if again is None:
                return
            await trio.sleep(again)

    async def _until_closed(self, tap: _Tap, attack: str, data: bytes = b"", *,
                            forever: bool = False) -> Outcome:
        """Send ``data``; drain the connection until the target closes it or patience ends."""
        reaction, started = Reaction.HELD, trio.current_time()
        try:
            with trio.move_on_after(float("inf") if forever else self.patience):
                try:
                    await tap.send_all(data)
                    while await tap.receive_some(65536):
                        pass
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                reaction = Reaction.CLOSED
        finally:
            await trio.aclose_forcefully(tap)
        return Outcome(attack, reaction, trio.current_time() - started, received=bytes(tap.received))


class HostilePeer(Outsider):
    """A holder of the swarm key that misbehaves. ``model``: a module shaped like the target's,
    whose state is the honest state the attacks distort (or the target's
    :class:`~gossip.tensors.StateSchema`: the honest state is then all ones). ``codec`` and
    ``weight`` go in our offers (0.0: fixed-weight mixing, > 0: push-sum), and ``step`` (a
    liar's, up to the protocol's largest counter); with ``correction`` our offers say we keep
    a drift correction, and a target that takes it gets an estimate after our state (zeros,
    or the one an attack names). ``identity`` is fresh by default; a new
    one (:meth:`renew`) escapes quarantine. ``busy_tries``: offers answered busy before an
    exchange attack gives up (``BUSY``). ``options``: as for :class:`Outsider`."""

    def __init__(self, swarm: Swarm, model: torch.nn.Module | StateSchema, *, codec: str = "fp32",
                 weight: float = 0.0, step: int = 0, identity: Identity | None = None,
                 correction: bool = False, busy_tries: int = BUSY_TRIES,
                 **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.swarm, self.codec, self.weight = swarm, codec, weight
        self.busy_tries = busy_tries
        self.identity = identity or Identity.generate()
        self.schema = model if isinstance(model, StateSchema) else StateSchema.from_module(model)
        self.honest = (new_flat(self.schema).fill_(1.0) if isinstance(model, StateSchema)
                       else snapshot(model, self.schema))
        self._offer_message = Offer(self.schema.fingerprint, codec, step, 0, weight, correction)
        self.seen: dict[str, torch.Tensor] = {}  # by address: the state it sent us last
        self.seen_estimate: dict[str, torch.Tensor] = {}  # and its correction's estimate

    def renew(self) -> None:
        """Take a fresh identity: no strikes, no quarantine, no standing with anyone."""
        self.identity = Identity.generate()

    async def send_nan(self, address: str) -> Outcome:
        """An exchange whose payload is the honest state with NaNs in it."""
        return await self._exchange(address, "NaN weights", self._spoil(float("nan")))

    async def send_inf(self, address: str) -> Outcome:
        """An exchange whose payload is the honest state with infinities in it."""
        return await self._exchange(address, "Inf weights", self._spoil(float("inf")))

    async def send_scaled(self, address: str, factor: float = 1e6) -> Outcome:
        """The honest state times ``factor``: finite, but far beyond the norm bound."""
        return await self._exchange(address, f"{factor:g} x norm", self.honest * factor)

    async def send_noise(self, address: str, ratio: float = 30.0) -> Outcome:
        """Random noise ``ratio`` times as long as the target's state (a fresh draw from
        ``rng`` each time): finite and within a 100 x norm check, the poison that only a
        bound on each step, and on the steps' influence, can stop. The target's norm is the
        one of the state it sent us in our last exchange with it (the honest state's before
        the first), so the noise grows with whatever it did to the target: the attack that
        a bound measured against the target's own norm cannot stop."""
        reference = self.seen.get(address, self.honest)
        noise = torch.randn(self.honest.numel(), generator=torch.Generator().manual_seed(
            self.rng.getrandbits(63)))
        noise *= ratio * float(torch.linalg.vector_norm(reference)) / float(
            torch.linalg.vector_norm(noise))
        return await self._exchange(address, f"noise at {ratio:g} x norm", noise)

    async def send_correction(self, address: str, estimate: torch.Tensor,
                              attack: str = "bad correction") -> Outcome:
        """An exchange with the honest state and ``estimate`` as our drift correction's (the
        target must take a correction: make this peer with ``correction=True``)."""
        return await self._exchange(address, attack, self.honest, estimate)

    async def send_state(self, address: str, flat: torch.Tensor,
                         attack: str = "chosen state") -> Outcome:
        """A whole exchange with ``flat``, any state of our schema's size, as our payload."""
        return await self._exchange(address, attack, flat)

    async def bad_commit(self, address: str, answer: bytes) -> Outcome:
        """An honest exchange whose ``Commit`` from the target we answer with ``answer``, one
        record of raw bytes (a ``Commit`` out of range, encoded by hand: the message class
        makes none). We hold the target's ``Commit`` and could apply the exchange; the
        target, holding no valid one of ours, applies nothing."""
        return await self._exchange(address, "bad Commit", self.honest, commit=answer)

    async def small_records(self, address: str, size: int = 1) -> Outcome:
        """An honest exchange whose payload comes in data records of ``size`` bytes (the
        last shorter), each an AEAD open for the target: for a ``mod`` codec, whose records
        may cut the payload anywhere."""
        return await self._exchange(address, f"{size}-byte records", self.honest, record=size)

    async def send_wrong_schema(self, address: str) -> Outcome:
        """An honest offer, then a payload header for another schema (of the same size)."""
        other = StateSchema((TensorSpec("hostile", (self.schema.numel,), "float32"),))
        return await self._stall(address, "wrong schema", other.fingerprint, False)

    async def send_instead_of_header(self, address: str, message: Message) -> Outcome:
        """Once accepted, ``message`` where our payload's header is due (a ``StateHeader``
        announcing the wrong size, an ``Offer``, a ``Commit``...), then hang up at once, with
        the target's payload unread (a reset, typically). What the target makes of it must
        depend on what we sent, not on how far its own send had got."""
        offered = await self._offer(address, f"{type(message).__name__} for a header")
        if isinstance(offered, Outcome):
            return offered
        channel, tap, started, _ = offered
        try:
            await channel.send_message(message)
        except GossipError as exc:
            return Outcome(f"{type(message).__name__} for a header", Reaction.CLOSED, 0.0,
                           detail=f"{type(exc).__name__}: {exc}")
        await trio.aclose_forcefully(tap)
        return Outcome(f"{type(message).__name__} for a header", Reaction.CLOSED,
                       trio.current_time() - started)

    def header(self, *, nbytes: int | None = None) -> StateHeader:
        """A header for our payload, announcing ``nbytes`` (the right size by default)."""
        size = self.schema.encoded_size(self.codec) if nbytes is None else nbytes
        return StateHeader(self.schema.fingerprint, self.codec, 0, 0, size)

    async def slowloris(self, address: str, *, mid_record: bool = True) -> Outcome:
        """Start a payload, then hold the connection: half of the first data record sent
        (the record deadline applies) or, with ``mid_record=False``, nothing after the
        header (the transfer deadline applies). ``seconds``: how long the target held on."""
        return await self._stall(address, "slowloris " + ("mid-record" if mid_record else
                                 "between records"), self.schema.fingerprint, mid_record)

    async def garbage(self, address: str, nbytes: int = 4096) -> Outcome:
        """After the handshake, a valid length and ``nbytes`` random bytes: a bad tag."""
        _, tap = await self._connect(address)
        data = FRAME_HEADER.pack(nbytes) + self.rng.randbytes(nbytes)
        return await self._until_closed(tap, "garbage record", data)

    async def huge_record(self, address: str) -> Outcome:
        """After the handshake, a record announcing 4 GiB: refused unallocated."""
        _, tap = await self._connect(address)
        return await self._until_closed(tap, "4 GiB prefix (record)", FRAME_HEADER.pack(HUGE))

    async def replay_record(self, address: str) -> Outcome:
        """A push-pull page that is not the last, then its exact ciphertext again: accepted,
        the target would wait for more pages (its push-pull deadline); refused, ``CLOSED``
        at once (``seconds`` near 0)."""
        channel, tap = await self._connect(address)
        await channel.send_message(PushPull(False, False, ()))
        return await self._until_closed(tap, "replayed record", tap.last)

    async def push_pull(self, address: str, records: list[MemberState]) -> list[MemberState]:
        """One push-pull announcing ``records`` as our table (our own record, invented
        members: any peer, address, step or shard, none of it proved), and the table the
        target answers with."""
        channel, _ = await self._connect(address)
        async with channel:
            await send_table(channel, records, join=False)
            table = await receive_table(channel, await channel.receive_message())
            await send_table(channel, records[:1], join=False)
        return table

    def stale_updates(self, peer: str, incarnation: int = 0) -> bytes:
        """A sealed datagram, as captured, saying ``peer`` is suspect, dead and gone at
        ``incarnation``: stale once ``peer`` announced a higher one (0 is, for a ready node).
        (The Left is ours, forged: :meth:`forged_left`.)"""
        by, inc = self.identity.peer_id, incarnation
        parts = (Suspect(peer, inc, by), Dead(peer, inc, by), self.forged_left(peer, inc))
        return self.datagram(parts)

    def forged_left(self, peer: str, incarnation: int = MAX_COUNT) -> Left:
        """``peer`` left at ``incarnation``, as a key holder can write it: proven by our own
        key (gossip.claims), since only ``peer`` holds its own."""
        mine = sign_left(self.identity, incarnation)
        return Left(peer, incarnation, key=mine.key, signature=mine.signature)

    def datagram(self, parts: tuple[Message, ...]) -> bytes:
        """``parts`` in one datagram from us, sealed with the swarm key."""
        packet = Packet(self.identity.peer_id, tuple(encode(p) for p in parts))
        return Sealer(self.swarm).seal(encode(packet))

    def _open(self, datagrams: list[bytes]) -> tuple[Message, ...]:
        packets = [decode(Sealer(self.swarm).open(d)) for d in datagrams]
        return tuple(decode(part) for p in packets if isinstance(p, Packet) for part in p.parts)

    def _spoil(self, value: float) -> torch.Tensor:  # every 7th value replaced
        return torch.where(torch.arange(self.honest.numel()) % 7 == 0, value, self.honest)

    async def _connect(self, address: str) -> tuple[SecureChannel, _Tap]:
        tap = await self._dial(address)
        try:
            with trio.fail_after(self.timeouts.handshake):
                return await handshake(tap, identity=self.identity, swarm=self.swarm,
                                       initiator=True, record_timeout=self.timeouts.record), tap
        except trio.TooSlowError:
            raise PeerTimeout(address, "handshake") from None

    async def _offer(self, address: str,
                     attack: str) -> tuple[SecureChannel, _Tap, float, Accept] | Outcome:
        """Offer (again while the target is busy): the accepted channel, or the answer."""
        for attempt in range(self.busy_tries):
            channel, tap = await self._connect(address)
            started = trio.current_time()
            answer: Message | GossipError | None = None
            with trio.move_on_after(self.patience):
                try:
                    await channel.send_message(self._offer_message)
                    answer = await channel.receive_message()
                except GossipError as exc:
                    answer = exc
            if isinstance(answer, Accept):
                return channel, tap, started, answer
            await channel.aclose()
            if not isinstance(answer, Close) or answer.code != Close.BUSY:
                break
            if attempt + 1 < self.busy_tries:
                await trio.sleep(self.rng.uniform(0.05, 0.25))  # as an honest node backs off
        if isinstance(answer, Message):
            return self._verdict(attack, answer, started)
        return Outcome(attack, Reaction.CLOSED if answer else Reaction.HELD,
                       trio.current_time() - started, detail=f"offer: {answer!r}")

    async def _exchange(self, address: str, attack: str, flat: torch.Tensor,
                        estimate: torch.Tensor | None = None, *, record: int = MAX_RECORD,
                        commit: bytes | None = None) -> Outcome:
        """A whole exchange with ``flat`` (and, if the target takes one, ``estimate``, zeros
        by default) as our payload, in data records of ``record`` bytes: the target's
        verdict on it. ``commit``: the raw record we answer its ``Commit`` with."""
        offered = await self._offer(address, attack)
        if isinstance(offered, Outcome):
            return offered
        channel, _, started, accept = offered
        parts = 1 + accept.correction
        if parts == 2:
            flat = torch.cat([flat, torch.zeros_like(flat) if estimate is None else estimate])
        async with channel:
            with trio.move_on_after(self.patience):
                try:
                    with first_error():
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._send, channel, flat, record)
                            _, theirs = await receive_state(channel, self.schema, self.codec,
                                                            parts=parts, reference=flat)
                    self.seen[address] = theirs[:self.schema.numel]
                    if parts == 2:
                        self.seen_estimate[address] = theirs[self.schema.numel:]
                    answer = await channel.receive_message()
                    if isinstance(answer, Commit) and commit is not None:
                        await channel.send(commit)
                    elif isinstance(answer, Commit):  # an attacker wants it all applied
                        await channel.send_message(Commit(correction=1.0 if parts == 2 else 0.0))
                except GossipError as exc:
                    return Outcome(attack, Reaction.CLOSED, trio.current_time() - started,
                                   detail=f"{type(exc).__name__}: {exc}")
                return self._verdict(attack, answer, started)
        return Outcome(attack, Reaction.HELD, trio.current_time() - started)

    async def _send(self, channel: SecureChannel, flat: torch.Tensor, record: int) -> None:
        """Our payload, in data records of ``record`` bytes (the last shorter)."""
        if record >= MAX_RECORD:
            await send_state(channel, flat, self.schema, self.codec)
            return
        parts = flat.numel() // self.schema.numel
        await channel.send_message(self.header(
            nbytes=encoded_nbytes(self.codec, self.schema.numel, parts)))
        for chunk in encode_chunks(flat, self.codec, record, parts=parts):
            await channel.send(chunk)

    async def _stall(self, address: str, attack: str, fingerprint: bytes, half: bool) -> Outcome:
        """Once accepted, a header for ``fingerprint``, maybe half a record, and hold on."""
        offered = await self._offer(address, attack)
        if isinstance(offered, Outcome):
            return offered
        channel, tap, _, _ = offered
        header = replace(self.header(), fingerprint=fingerprint)
        try:
            await channel.send_message(header)
            if half:
                record = next(iter(encode_chunks(self.honest, self.codec, MAX_RECORD)))
                tap.cut = (FRAME_HEADER.size + len(record) + 16) // 2
                await channel.send(record)
        except GossipError as exc:  # it hung up already (the channel closed the stream)
            return Outcome(attack, Reaction.CLOSED, 0.0, detail=f"{type(exc).__name__}: {exc}")
        return await self._until_closed(tap, attack)

    @staticmethod
    def _verdict(attack: str, answer: Message, started: float) -> Outcome:
        code = answer.code if isinstance(answer, Close) else None
        reaction = {None: Reaction.ACCEPTED if isinstance(answer, Commit) else Reaction.ANSWERED,
                    Close.REJECTED: Reaction.REJECTED, Close.BUSY: Reaction.BUSY}.get(code)
        return Outcome(attack, reaction or Reaction.ANSWERED, trio.current_time() - started,
                       answer=answer, detail=getattr(answer, "reason", type(answer).__name__))
