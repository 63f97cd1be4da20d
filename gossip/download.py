"""State download: how a node with no checkpoint gets the swarm's current weights.

Theory of operation
-------------------
A joiner asks a ready peer for its whole state on a fresh secure channel::

    joiner                                   peer
    StateRequest(fingerprint, "fp32")  --->
                                       <---  StateInfo(step, samples, weight, meta)
                                             state payload (section 7, fp32: exact)
                                       <---  or Close(BUSY | REJECTED, reason)
                                       <---  or SchemaInfo, Close(REJECTED, reason)

It tries the alive, ready members in order of their announced step, highest first (ties in
random order), and falls back to the next on any failure; members announcing more than the
candidates' median step (:func:`~gossip.standing.step_ceiling`) come last, so that a liar
announcing a huge step is not everyone's first server. What arrives is checked (every
value finite) before the replica takes it, with the sender's step bounded by that same median,
counted over the candidates that proved their identity to the joiner (a handshake with a
sample of them first, :meth:`~gossip.roster.Roster.prove`: records invented in gossip, on
hosts of their own, would otherwise be the median); only then does the node announce itself
ready.

A node that resumes a checkpoint asks too, but takes the state only if it is newer than its
own: a sender whose step (its ``StateInfo``'s) is not past the checkpoint's has trained no
further than we had, and the node keeps its own weights; the request ends there, before the
state is sent. The claim is the sender's to make, as everything a joiner downloads is: a peer
that says it is behind keeps us on our own state, and one that says it is ahead gives us what
a joiner would take from it.

``meta`` is a canonical CBOR map ``{"buffers": {name: int}, "task": {...}}``: the model's
integer scalar buffers (``num_batches_tracked``), which are not part of the averaged state,
and the task's own metadata (whatever the application passed, JSON-like values). It is
decoded with the wire codec's limits (size, depth, no indefinite lengths, no duplicate keys)
and nothing in it is ever executed or unpickled.

A node serves at most :data:`MAX_SERVING` downloads at once (each holds a snapshot, one copy
of the model); more are answered ``Close(BUSY)``.

Deadlines follow the link, as an exchange's do (:mod:`gossip.linkrate`): an attempt may take
the request's answer plus the state at the rate the peer host's link is given (its measured
rate over a slack, never below ``min_rate``), the joiner times the transfer for the next one,
and drops a server whose state goes ``stall`` seconds without a byte and asks the
next candidate.

A request of another schema (another model, or other task options) is answered with the
server's own schema and task metadata (a bounded ``SchemaInfo``) before the ``Close``, and the
joiner logs which tensors and metadata differ (:mod:`gossip.mismatch`). It goes on asking, as
the swarm may change, but says each refusal out loud once per peer (:class:`Said`): a joiner
retries every second, and the same warning every second would bury everything else.

A node's side of both is one :class:`Downloads`, which its :class:`~gossip.node.SwarmNode`
owns: it answers joiners' requests, counting those in progress and those served, and fetches
the node's own initial state, remembering what it has said.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import cbor2
import trio

from .channel import SecureChannel
from .config import AveragingConfig
from .errors import (DownloadFailed, GossipError, PeerTimeout, RemoteProtocolError,
                     SchemaRefused, WireError)
from .groups import phase_deadline
from .identity import PeerId
from .linkrate import STALL, LinkRates
from .member import Member
from .messages import MAX_META, Close, SchemaInfo, StateInfo, StateRequest
from .mismatch import describe, explain
from .replica import Replica, offload
from .standing import step_ceiling
from .tensors import all_finite
from .transfer import receive_state, send_state
from .wire import MAX_DEPTH, decode_canonical

__all__ = ["Download", "Downloads", "Said", "encode_meta", "decode_meta", "download",
           "MAX_SERVING"]

log = logging.getLogger(__name__)

MAX_SERVING = 2  # downloads a node serves at once
CODEC = "fp32"  # a joiner starts from the exact state
MAX_SAID = 1024  # things a Said remembers; past that it forgets them all (and says each again)


class Said:
    """What a node has already said out loud: each thing once, later ones quietly."""

    def __init__(self) -> None:
        self._said: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """Whether ``key`` is said for the first time (and remember that it was)."""
        if key in self._said:
            return False
        if len(self._said) >= MAX_SAID:
            self._said.clear()
        self._said.add(key)
        return True

    def level(self, key: Hashable, loud: int = logging.WARNING) -> int:
        """``loud`` the first time ``key`` is said, DEBUG after."""
        return loud if self.first(key) else logging.DEBUG


@dataclass(frozen=True)
class Download:
    """Where a joiner's state came from."""

    peer: PeerId
    step: int  # the step we took: the sender's, bounded by the members' announced median
    samples: int  # the sender's, for information
    task: dict[str, Any]  # the task metadata the sender's application published


def encode_meta(buffers: Mapping[str, int], task: Mapping[str, Any]) -> bytes:
    """The ``StateInfo.meta`` bytes.

    Raises:
        ValueError: the metadata is not CBOR-encodable, larger than ``MAX_META``, or
            something :func:`decode_meta` refuses (too deeply nested, a buffer that is not a
            64-bit int), which no joiner could take.
    """
    try:
        data = cbor2.dumps({"buffers": dict(buffers), "task": dict(task)}, canonical=True)
    except (cbor2.CBOREncodeError, TypeError) as exc:
        raise ValueError(f"task metadata is not CBOR-encodable: {exc}") from None
    if len(data) > MAX_META:
        raise ValueError(f"task metadata encodes to {len(data)} bytes, more than {MAX_META}")
    try:
        decode_meta(data)
    except RemoteProtocolError as exc:
        raise ValueError(f"joiners would refuse this metadata: {exc}") from None
    return data


def decode_meta(data: bytes) -> tuple[dict[str, int], dict[str, Any]]:
    """The integer buffers and the task metadata in ``StateInfo.meta``.

    Raises:
        RemoteProtocolError: not a canonical map of the expected shape.
    """
    try:
        obj = decode_canonical(data, max_depth=MAX_DEPTH)
    except WireError as exc:
        raise RemoteProtocolError(f"malformed state metadata: {exc}") from None
    if type(obj) is not dict or set(obj) != {"buffers", "task"}:
        raise RemoteProtocolError("state metadata is not a map of 'buffers' and 'task'")
    buffers, task = obj["buffers"], obj["task"]
    if type(buffers) is not dict or type(task) is not dict:
        raise RemoteProtocolError("state metadata 'buffers' and 'task' must be maps")
    _check_plain(task, "task")
    for name, value in buffers.items():
        if type(name) is not str or type(value) is not int or not -2**63 <= value < 2**63:
            raise RemoteProtocolError(f"state metadata: buffer {name!r} is not a 64-bit int")
    return buffers, task


_PLAIN = (str, bytes, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Refuse anything but maps with text keys, arrays and plain scalars: cbor2 turns CBOR
    tags into dates, decimals, regular expressions, sets and more, none of which metadata
    needs (the depth is already bounded by the decoder)."""
    if type(value) is dict:
        for key, item in value.items():
            if type(key) is not str:
                raise RemoteProtocolError(f"state metadata: a key in {where} is not text")
            _check_plain(item, f"{where}.{key}")
    elif type(value) is list:
        for item in value:
            _check_plain(item, where)
    elif type(value) not in _PLAIN:
        raise RemoteProtocolError(f"state metadata: {where} holds a {type(value).__name__}")
    elif type(value) is int and not -2**63 <= value < 2**64:
        # CBOR's bignums decode to ints of any size; no metadata needs one, and a huge one
        # makes even printing it fail (Python refuses str() of 4,300 digits and more).
        raise RemoteProtocolError(f"state metadata: {where} holds an integer beyond 64 bits")


class Downloads:
    """A node's state downloads, both ways: it serves joiners, at most :data:`MAX_SERVING` at
    once, and fetches its own initial state (:func:`download`).

    Args:
        replica: the model: copied for a joiner, loaded from a download.
        dial: opens a fresh secure channel to a member, and to nobody else.
        config: ``offer_timeout`` and ``transfer_timeout`` size each attempt's deadline
            (:meth:`deadline`); ``stall_timeout`` drops a silent server.
        rates: what each peer host's link carried, shared with the node's exchanges.
        rng: orders the candidates of one step.
        task: returns the task metadata, to publish with each download served and to
            compare with a refusing peer's.

    Attributes:
        serving: downloads being served now.
        served: downloads whose whole state was sent.
    """

    def __init__(self, replica: Replica, dial: Callable[[Member], Awaitable[SecureChannel]],
                 config: AveragingConfig, rates: LinkRates, rng: random.Random,
                 task: Callable[[], Mapping[str, Any]]) -> None:
        self._replica = replica
        self._dial = dial
        self._config = config
        self._rates = rates
        self._rng = rng
        self._task = task
        self._said = Said()  # download failures logged so far: each once out loud
        self.serving = 0
        self.served = 0

    def deadline(self, host: str) -> float:
        """Seconds a state download with ``host`` may take once connected: the request's
        answer, and the state at the rate its link is given (:mod:`gossip.linkrate`)."""
        return self._config.offer_timeout + self._rates.deadline(
            host, self._config.transfer_timeout, self._replica.schema.encoded_size(CODEC))

    async def fetch(self, candidates: list[Member], proven: Mapping[str, str], *,
                    newer_than: int | None = None) -> Download | None:
        """Load the state of a candidate that answers: :func:`download`, with ``proven``
        the candidates that proved their identity to us, each with the host it proved
        itself from, and ``newer_than`` the step of the checkpoint we resume, if any.

        Raises:
            DownloadFailed: every candidate failed (each failure is logged).
        """
        return await download(self._replica, candidates, self._dial, deadline=self.deadline,
                              rng=self._rng, task=self._task, said=self._said,
                              rates=self._rates, stall=self._config.stall_timeout,
                              proven=proven, newer_than=newer_than)

    async def serve(self, channel: SecureChannel, request: StateRequest, *,
                    ready: bool) -> None:
        """Answer a :class:`StateRequest` on ``channel``: our state, or Close with the reason
        (``ready``: whether we hold a state worth copying, not fetching our own)."""
        replica, peer = self._replica, channel.peer
        refusal, before = None, []
        if request.fingerprint != replica.schema.fingerprint:
            # Close.reason is for logs and never carries our fingerprint (PROTOCOL.md section
            # 7.1 says how a client computes its own); our log does.
            log.debug("state request of another schema peer=%s theirs=%s ours=%s", peer.short,
                      request.fingerprint.hex(), replica.schema.fingerprint_hex)
            # for the joiner to say what differs
            before = [describe(replica.schema, _task_meta(self._task))]
            refusal = Close(Close.REJECTED, "schema differs from ours (another model, or "
                                            "other task options)")
        elif request.codec != CODEC:
            refusal = Close(Close.REJECTED, f"downloads use {CODEC}, not {request.codec!r}")
        elif not ready or self.serving >= MAX_SERVING:
            refusal = Close(Close.BUSY, "not ready" if not ready else "serving other downloads")
        if refusal is not None:
            await channel.send_closing(*before)  # its own grace, as the refusal has
            await channel.send_closing(refusal)
            return
        try:
            meta = encode_meta(replica.int_buffers(), self._task())
        except ValueError as exc:  # the application's metadata: our fault, not the joiner's
            log.error("cannot serve a state download: %s", exc)
            await channel.send_closing(Close(Close.REJECTED,
                                             "this node's task metadata is invalid"))
            return
        self.serving += 1
        buffer = replica.buffer()
        flat = buffer[:replica.schema.numel]  # the state alone: a joiner starts with no correction
        try:
            counters = await offload(replica, replica.snapshot, buffer, 1)
            with phase_deadline(self.deadline(channel.host), peer.short, "serving a download"):
                await channel.send_message(StateInfo(counters.step, counters.samples,
                                                     counters.weight, meta))
                await send_state(channel, flat, replica.schema, CODEC, step=counters.step,
                                 samples=counters.samples)
            log.info("state served peer=%s step=%d", peer.short, counters.step)
            self.served += 1
        except PeerTimeout:  # only ours: sending raises none
            log.info("state download by peer=%s timed out", peer.short)
        finally:
            self.serving -= 1
            replica.release(buffer)


def _task_meta(task: Callable[[], Mapping[str, Any]]) -> bytes:
    """The task metadata for a SchemaInfo; empty when the application's will not encode (it
    cannot serve downloads then either, and says so when asked for one it could serve)."""
    try:
        return encode_meta({}, task())
    except ValueError:
        return b""


async def download(replica: Replica, candidates: list[Member],
                   dial: Callable[[Member], Awaitable[SecureChannel]], *,
                   deadline: Callable[[str], float], rng: random.Random,
                   task: Callable[[], Mapping[str, Any]] | None = None,
                   said: Said | None = None, rates: LinkRates | None = None,
                   stall: float = STALL, proven: Mapping[str, str] | None = None,
                   newer_than: int | None = None) -> Download | None:
    """Fetch the state of the most advanced candidate (not above the median) that answers,
    and load it; or, resuming a checkpoint (``newer_than``), learn that the swarm has trained
    no further than it.

    Args:
        candidates: alive, ready members; tried by announced step, highest first, those
            above their median step (:func:`~gossip.standing.step_ceiling`) last. The step
            we take is bounded by that median.
        dial: opens a fresh secure channel to a candidate, and to nobody else.
        deadline: seconds one attempt may take once connected, given the peer's host.
        task: our task metadata, to compare with a refusing peer's.
        said: what earlier calls logged: a peer that fails the same way again is logged at
            DEBUG (a joiner retries every second). None: log everything.
        rates: where each transfer's time is counted towards its peer's link (None: not).
        stall: seconds the state may go without a byte before the next candidate is tried.
        proven: the candidates that proved their identity to us, each with the host it
            proved itself from: only their steps count towards the ceiling, by those hosts
            (none proven: the ceiling is 0, and the step comes from exchanges). None: every
            candidate's counts, by its address's host.
        newer_than: the step of the checkpoint the node resumes (None: none). The first
            candidate that answers decides: a state whose step is past it is loaded, and
            otherwise nothing is (the request ends before the state is sent).

    Returns:
        Where the state came from; None if the first candidate to answer was at or behind
        ``newer_than`` (our weights are left as they were).

    Raises:
        DownloadFailed: every candidate failed (each failure is logged).
    """
    if proven is None:
        ceiling = first = step_ceiling(candidates)
    else:
        counted = [m for m in candidates if m.peer in proven]
        ceiling = step_ceiling(counted, lambda m: proven[m.peer])
        # None proven: no step is taken (0), and the order is by everyone's median, so
        # that a liar's huge claim is still not the first server.
        first = ceiling if counted else step_ceiling(candidates)
    order = sorted(candidates, key=lambda m: (m.step > first, -m.step, rng.random()))
    last: BaseException | None = None
    said = said if said is not None else Said()
    for member in order:
        log.log(said.level(member.peer, logging.INFO), "downloading state peer=%s address=%s "
                "step=%d", member.peer.short, member.address, member.step)
        try:
            result = await _fetch(replica, member, dial, deadline, ceiling, task, rates, stall,
                                  newer_than)
        except SchemaRefused as exc:
            # Keyed by peer alone: the text is the peer's to vary, and one that changed
            # its schema every second must not get a fresh warning every second.
            log.log(said.level((member.peer, SchemaRefused)), "state download refused peer=%s: "
                    "its model is not ours (another model, or other task options): %s",
                    member.peer.short, exc)
            last = exc
            continue
        except GossipError as exc:
            log.log(said.level((member.peer, type(exc)), logging.INFO),
                    "state download failed peer=%s: %s", member.peer.short, exc)
            last = exc
            continue
        if result is None:
            log.info("state not downloaded peer=%s reason=no-newer-than-our-checkpoint "
                     "step=%d", member.peer.short, newer_than)
        else:
            log.info("state downloaded peer=%s step=%d", member.peer.short, result.step)
        return result
    raise DownloadFailed(f"no state download succeeded ({len(order)} peers tried; "
                          f"the last said: {last})")


async def _fetch(replica: Replica, member: Member,
                 dial: Callable[[Member], Awaitable[SecureChannel]],
                 deadline: Callable[[str], float], ceiling: int,
                 task: Callable[[], Mapping[str, Any]] | None, rates: LinkRates | None,
                 stall: float, newer_than: int | None) -> Download | None:
    channel = await dial(member)
    async with channel:
        buffer = replica.buffer()
        flat = buffer[:replica.schema.numel]
        started = trio.current_time()
        try:
            try:
                # The answer comes after the server's snapshot (seconds for the largest
                # models), the state right after it: a server silent for `stall` is dropped.
                with (phase_deadline(deadline(channel.host), member.peer.short, "download"),
                      channel.stall_guard(stall)):
                    await channel.send_message(StateRequest(replica.schema.fingerprint, CODEC))
                    info = await channel.receive_message()
                    if isinstance(info, SchemaInfo):
                        raise SchemaRefused(_differences(replica, info, task))
                    if isinstance(info, Close):
                        raise DownloadFailed(f"peer refused: code={info.code} {info.reason}")
                    if not isinstance(info, StateInfo):
                        raise RemoteProtocolError(f"expected StateInfo, got {type(info).__name__}")
                    if newer_than is not None and info.step <= newer_than:
                        return None  # hanging up is all the sender needs to hear
                    await receive_state(channel, replica.schema, CODEC, flat)
            except PeerTimeout as exc:
                if exc.phase in ("download", "record"):  # not a stall: the link's rate at most
                    _time_link(rates, channel, started, complete=False)
                raise
            _time_link(rates, channel, started, complete=True)
            buffers, task = decode_meta(info.meta)
            if not await offload(replica, all_finite, flat):
                raise RemoteProtocolError("downloaded state holds non-finite values")
            step = min(info.step, ceiling)
            await offload(replica, lambda: replica.load(flat, step=step, buffers=buffers))
        finally:
            replica.release(buffer)
    return Download(member.peer, step, info.samples, task)


def _time_link(rates: LinkRates | None, channel: SecureChannel, started: float, *,
               complete: bool) -> None:
    """Count what ``channel`` carried since ``started`` towards its peer's link."""
    if rates is not None:
        stats = channel.statistics()
        rates.observe(channel.host, max(stats.bytes_sent, stats.bytes_received),
                      trio.current_time() - started, complete=complete)


def _differences(replica: Replica, info: SchemaInfo,
                 task: Callable[[], Mapping[str, Any]] | None) -> str:
    """What a refusing server's SchemaInfo says differs from us. Its task metadata is
    decoded as strictly as a StateInfo's, and left out of the text when it does not decode."""
    theirs = None
    if info.meta:
        try:
            theirs = decode_meta(info.meta)[1]
        except RemoteProtocolError:
            pass  # the tensors still say what differs
    ours = None if task is None or theirs is None else dict(task())
    return explain(replica.schema, info, ours, theirs)
