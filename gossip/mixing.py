"""The arithmetic of one averaging step, and the rules for trusting what a peer sent. Pure.

Theory of operation
-------------------
Two nodes A and B hold snapshots ``s_A`` and ``s_B``. After an exchange each moves towards the
other by a fraction of the difference::

    delta_A = c_A · (s_B − s_A)        delta_B = c_B · (s_A − s_B)

and adds its delta to its *live* parameters over the trainer's next steps
(:mod:`gossip.replica`), so local steps taken meanwhile are kept. Why this is sound: with plain SGD, averaging two states that each took
local steps from a common start ``x`` equals applying the average of the two deltas to ``x``
(``(x − Δ_A + x − Δ_B) / 2 = x − (Δ_A + Δ_B) / 2``).

Two mixing modes:

* **fixed** (the default): ``c_A = c_B = w`` (``w = ½`` lands both on the midpoint and keeps
  the swarm's mean exactly).
* **push-sum, by samples**: each node carries a weight ``ω`` that starts at 1 and grows by the
  samples it trains on. ``c_A = ω_B / (ω_A + ω_B)``, so both land on the ``ω``-weighted mean,
  and both then carry ``(ω_A + ω_B) / 2``. ``Σ ω`` and ``Σ ω·s`` are preserved by every
  exchange, so the swarm converges to the sample-weighted mean of its members.

The difference is computed in place in the buffer the payload arrived in, and the fraction
``c`` is not multiplied in: it travels with the difference as its ``scale`` and is applied by
the add that applies the delta (``torch.add(alpha=c)``), which saves a pass over the model.

Trusting a payload (:func:`make_delta`), in order:

1. every value finite, else refused;
2. the distance ``‖s_B − s_A‖`` at most ``max_norm_ratio × r``, else refused, where ``r`` is
   our norm or, if smaller, the median of our norms at the exchanges in the history (below):
   no honest replica of the same model is a hundred times larger than ours, and the
   reference cannot be inflated by first pushing our own norm up;
3. *self-centred clipping*: the difference is scaled down to at most ``clip ×`` the median
   of the history (:data:`OFFER_CLIP` x for an offer, below), so one wild peer moves us by a
   bounded step. A median of 0 (a node that
   only met identical states, say right after a download) bounds nothing: clipping to it
   would freeze the node;
4. the exchange's :class:`~gossip.standing.Standing`: a newcomer's state is checked and
   committed but applied with a scale of 0.

The history is what keeps the bound from growing under attack. It holds the distances of the
last ``clip_window`` exchanges *we initiated*, to a peer we picked at random (an attacker's
share of them is its share of the member table's hosts, not its offer rate), and each enters
*clipped* (what we accepted, not what was sent), so even a window full of poison cannot raise
the median by more than a factor ``clip`` per half window, and a minority of poisoned entries
cannot raise it at all. A swarm whose spread really grows (two halves of a healed partition)
still raises the median, by up to ``clip`` times per half window, and meanwhile converges by
clipped steps.

The checks and the difference are one pass over the model, chunk by chunk, so that each chunk
is still in cache for the next operation on it: the exchange is CPU-bound, and memory traffic
is most of the cost of the arithmetic. For the state, that pass runs as the payload arrives
(:class:`Difference`, fed after each record is decoded, while the record is still in cache and
while the rest is on the wire), so the check after the transfer is left with a few sums.

Bounds per exchange do not bound a sum. Members of standing that push the same way at every
exchange (the state plus thirty norms along one fixed direction) took a digits swarm's weight
norm from 11 to 280 and its accuracy down 4.7 points, though each push was clipped: a step
clipped to ``clip`` (5) x the median is five honest steps, and steps in one direction add up
where honest ones, each a little off in its own direction, mostly cancel. A peer we chose is
a random member (its share is its hosts' share); an offer comes whenever its sender likes. So
an offer's state is clipped to :data:`OFFER_CLIP` x the median, the size of a typical honest
step (the caller passes that ``clip``), and the offers of one host are budgeted
(:mod:`gossip.standing`): with both, the same attack left the swarm within half a point and
3% of its unattacked norm (tests/sim/test_influence.py), and the unattacked swarm did not
change. A young node (its history not yet full) keeps the usual clip for the offers of peers
that were members, and proved to it, before it started: a joiner is the one far from the
swarm, and clipped, the pulls of the members it joined left it far for longer, while its own
weight at their nodes grew; their held-out accuracy fell to 28% where it had dipped to 53%
(tests/sim/test_join.py, 60 steps per exchange). What remains is a rate: a host's offers move
a node by at most one median each, and about twice what an honest host sends of them per
round of the node's (docs/PROTOCOL.md section 12).

Refusals are strikes against the sender (:class:`Quarantine`); enough strikes in a row put it
in quarantine for a while. Nothing here imports trio or does I/O; time is passed in.
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from .correction import REACH
from .standing import Standing
from .tensors import REDUCE_CHUNK, sum_of_squares

__all__ = ["coefficient", "merged_weight", "DeltaHistory", "Delta", "Verdict", "Difference",
           "make_delta", "judge", "Quarantine", "OFFER_CLIP"]

ADVANCE_CHUNKS = 2  # REDUCE_CHUNKs one Difference.advance does at most (two fp32 records)
MAX_QUARANTINED = 4096  # peers remembered by a Quarantine; the oldest entry goes first
OFFER_CLIP = 1.0  # x the history's median: the most an offer's state moves us (see above)


def coefficient(weight: float, by_samples: bool, mine: float, theirs: float) -> float:
    """The fraction of the difference to the peer's state that this node moves.

    Args:
        weight: the fixed mixing weight (used when ``by_samples`` is false).
        by_samples: push-sum mode.
        mine, theirs: the two push-sum weights (positive in push-sum mode).
    """
    if not by_samples:
        return weight
    return theirs / (mine + theirs)


def merged_weight(mine: float, theirs: float) -> float:
    """The push-sum weight each side carries after an exchange."""
    return (mine + theirs) / 2


class _Window:
    """The last ``size`` values added, with their median, in O(log n) per add."""

    def __init__(self, size: int) -> None:
        self._recent: collections.deque[float] = collections.deque(maxlen=size)
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, value: float) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
        self._recent.append(value)
        bisect.insort(self._sorted, value)

    def median(self) -> float | None:
        n = len(self._sorted)
        if n == 0:
            return None
        mid = n // 2
        return self._sorted[mid] if n % 2 else (self._sorted[mid - 1] + self._sorted[mid]) / 2


class DeltaHistory:
    """The last ``window`` exchanges this node initiated: the distance it accepted in each
    (clipped) and its own norm at the time, for clipping and the norm check.

    ``bound(clip)`` is ``clip`` times the median distance once ``min_history`` are known,
    else None (no clipping while there is nothing to compare with).
    """

    def __init__(self, window: int = 32, min_history: int = 8) -> None:
        if window < 1 or not 1 <= min_history <= window:
            raise ValueError("need window >= 1 and 1 <= min_history <= window")
        self._distances = _Window(window)
        self._norms = _Window(window)
        self._min = min_history

    def __len__(self) -> int:
        return len(self._distances)

    def add(self, distance: float, own_norm: float) -> None:
        self._distances.add(distance)
        self._norms.add(own_norm)

    def record(self, delta: Delta) -> None:
        """Add an accepted delta: the distance it moved us by (clipped) and our norm."""
        self.add(delta.accepted, delta.own_norm)

    def median(self) -> float | None:
        return self._distances.median()

    def bound(self, clip: float, reach: float | None = None) -> float | None:
        """``clip`` times the median distance (the median at most ``reach``, if given);
        None while fewer than ``min_history`` are known or the median is 0."""
        if clip <= 0 or len(self) < self._min:
            return None
        median = self.median()
        if median and reach is not None and reach > 0:
            median = min(median, reach)
        return clip * median if median else None

    def norm_reference(self, own_norm: float) -> float:
        """Our norm, or the median of our norms in the window if that is smaller."""
        median = self._norms.median()
        return own_norm if median is None else min(own_norm, median)


@dataclass(frozen=True)
class Delta:
    """The verdict on one received state.

    Attributes:
        distance: ``‖received − own‖`` before any scaling (nan if not computed).
        refused: why the state was refused, or None if the delta is ready to queue.
        clipped: whether self-centred clipping shortened the step.
        scale: the fraction of ``received − own`` to apply (0 when refused, or for a
            newcomer, whose state is not applied).
    """

    distance: float
    refused: str | None = None
    clipped: bool = False
    scale: float = 0.0
    # For the history (not part of the verdict): the distance as accepted, clipped to the
    # bound, and our own norm.
    accepted: float = field(default=math.nan, compare=False)
    own_norm: float = field(default=math.nan, compare=False)


@dataclass(frozen=True)
class Verdict:
    """The verdict on a whole payload: its state and, if it carried one, the correction's
    estimate (:func:`judge`)."""

    state: Delta
    correction: Delta | None = None

    @property
    def refused(self) -> str | None:
        """Why the payload is refused, or None."""
        if self.state.refused is not None:
            return self.state.refused
        if self.correction is not None and self.correction.refused is not None:
            return f"correction: {self.correction.refused}"
        return None

    @property
    def clipped(self) -> bool:
        return self.state.clipped or (self.correction is not None and self.correction.clipped)

    @property
    def fraction(self) -> float:
        """The fraction of the estimates' difference the correction moves by (clipping
        included): what our ``Commit`` offers; 0.0 with no estimate."""
        return 0.0 if self.correction is None else min(1.0, max(0.0, self.correction.scale))


class Difference:
    """``received − own`` over the first ``numel`` elements, computed in place as a payload
    arrives: :meth:`advance` after each record, with how many leading elements of
    ``received`` are final. The sums of :func:`make_delta`'s checks add up on the way; a
    non-finite value stops the subtraction (the payload is refused anyway).

    Each :meth:`advance` does bounded work, whole chunks of :data:`ADVANCE_CHUNKS` ×
    ``REDUCE_CHUNK`` elements at most: records of a few bytes cost nothing until a chunk has
    come, and a backlog (what arrived while our snapshot was still being copied) is left to
    :meth:`sums`, which runs in a worker thread, rather than stalling the caller's loop.

    Not thread-safe: advance it from one thread, then hand it to :func:`judge`.
    """

    def __init__(self, received: torch.Tensor, own: torch.Tensor, numel: int,
                 own_ready: Callable[[], bool] = lambda: True) -> None:
        if not 0 <= numel <= min(received.numel(), own.numel()):
            raise ValueError(f"numel {numel} is outside both buffers")
        self._received, self._own, self.numel = received, own, numel
        self._own_ready = own_ready  # false while our snapshot is still being copied
        self._done = 0
        self._distance_sq = self._own_sq = 0.0
        self._finite = True

    def advance(self, decoded: int, *, limit: int | None = ADVANCE_CHUNKS) -> None:
        """Subtract towards element ``decoded`` (elements past :attr:`numel` are not ours):
        whole chunks, at most ``limit`` of them (None: everything up to ``decoded``), or
        nothing yet if ``own`` is still being written (a later call catches up)."""
        stop = min(decoded, self.numel)
        if limit is not None:
            chunks = min((stop - self._done) // REDUCE_CHUNK, limit)
            stop = self._done + max(chunks, 0) * REDUCE_CHUNK
        if self._finite and stop > self._done and self._own_ready():
            d, o, finite = _subtract(self._received[self._done : stop],
                                     self._own[self._done : stop])
            self._distance_sq += d
            self._own_sq += o
            self._finite = finite
            self._done = stop

    def covers(self, received: torch.Tensor, own: torch.Tensor) -> bool:
        """Whether this is the pass over exactly ``received`` and ``own``."""
        return (received.numel() == own.numel() == self.numel
                and received.data_ptr() == self._received.data_ptr()
                and own.data_ptr() == self._own.data_ptr())

    def sums(self) -> tuple[float, float, bool]:
        """``‖received − own‖²``, ``‖own‖²`` and whether every value was finite, over all
        :attr:`numel` elements (whatever :meth:`advance` has not covered is done now: ``own``
        must be whole by then)."""
        if not self._own_ready():
            raise RuntimeError("the difference is asked for before our snapshot is whole")
        self.advance(self.numel, limit=None)
        if not self._finite:
            return math.nan, math.nan, False
        return self._distance_sq, self._own_sq, True


def make_delta(
    received: torch.Tensor,
    own: torch.Tensor,
    coefficient: float,
    history: DeltaHistory,
    *,
    clip: float,
    max_norm_ratio: float,
    standing: Standing = Standing.CHOSEN,
    record: bool = True,
    floor: float = 0.0,
    difference: Difference | None = None,
    reach: float | None = None,
    coverage: float = 1.0,
) -> Delta:
    """Check a received flat state and turn it, in place, into the difference to queue.

    On success ``received`` holds ``received − own`` and the step to take is
    ``verdict.scale`` times that: ``coefficient``, shortened by clipping, or 0 for a
    newcomer. A ``CHOSEN`` exchange's distance, clipped, has entered ``history`` (unless
    ``record`` is false: then the caller records it with :meth:`DeltaHistory.record` once
    it takes the delta). On refusal ``received`` holds garbage and ``history`` is unchanged.
    ``own`` is never modified. ``floor``: the norm check's reference is at least this (for
    a vector whose own norm may legitimately be near zero). ``difference``: the same pass,
    already under way as the payload arrived (over ``received`` and ``own`` exactly).
    ``reach``: the most the history's median counts for in the clip bound (None: no limit).
    ``coverage``: the fraction of the values the payload carried (a fragment's, in (0, 1]:
    the others are our own); its distance counts as ``‖received − own‖ / √coverage``, what
    the whole vector would likely have given, so that fragments and whole payloads share
    one history and one bound.
    """
    if difference is not None and not difference.covers(received, own):
        raise ValueError("the difference is not over these buffers")
    distance_sq, own_sq, finite = (_subtract(received, own) if difference is None
                                   else difference.sums())
    if not finite:
        return Delta(math.nan, "non-finite values")
    distance, own_norm = math.sqrt(distance_sq / coverage), math.sqrt(own_sq)
    if not math.isfinite(distance):
        return Delta(distance, "difference overflows float32")
    reference = max(history.norm_reference(own_norm), floor)
    if reference > 0 and distance > max_norm_ratio * reference:
        return Delta(distance, f"distance {distance:.3g} is over {max_norm_ratio:g}x "
                               f"our norm {reference:.3g}")
    if standing is Standing.NEWCOMER:
        return Delta(distance, None, False, 0.0, distance, own_norm)
    bound = history.bound(clip, reach)
    if bound is not None and distance > bound:
        delta = Delta(distance, None, True, coefficient * bound / distance, bound, own_norm)
    else:
        delta = Delta(distance, None, False, coefficient, distance, own_norm)
    if standing is Standing.CHOSEN and record:
        history.record(delta)
    return delta


def judge(
    received: torch.Tensor,
    own: torch.Tensor,
    parts: int,
    coefficient: float,
    histories: tuple[DeltaHistory, DeltaHistory],
    *,
    clip: float,
    max_norm_ratio: float,
    standing: Standing = Standing.CHOSEN,
    correction: float = 0.0,
    gradient_scale: float = 0.0,
    difference: Difference | None = None,
    estimate_clip: float | None = None,
    coverage: float = 1.0,
) -> Verdict:
    """:func:`make_delta` for each part of a payload: the state, then (``parts`` 2) the
    correction's estimate, each against its own history, so that neither bound is driven by
    the other's scale. The estimate's fraction is ``correction``, the same on both sides
    whatever the mixing mode, so that the pair's corrections keep their sum
    (:mod:`gossip.correction`). A ``CHOSEN`` exchange's distances enter the histories only if
    every part passes.

    The estimate's norm check needs a floor: a node whose own data it has learned has a
    gradient near zero, and the swarm's, which its correction must take on, may be a hundred
    times that. Its reference is therefore at least ``gradient_scale`` (the node's own
    gradients as it started: :attr:`~gossip.correction.Correction.scale`) and the median
    distance of the estimates it accepted. That median grows as a poison spreads to the
    peers whose distances fill the history, so for the estimate it counts, in the check and
    in the clip, for at most :data:`~gossip.correction.REACH` x ``gradient_scale``, which no
    peer can change.

    ``difference``: the state's pass (the first part), already under way as it arrived.
    ``estimate_clip``: the estimate's own clip, when it is tighter than ``clip`` (see
    :data:`gossip.correction.ESTIMATE_CLIP`); None: ``clip``. ``coverage``: the fraction of
    each vector the payload carried (:func:`make_delta`)."""
    n = received.numel() // parts
    state = make_delta(received[:n], own[:n], coefficient, histories[0], clip=clip,
                       max_norm_ratio=max_norm_ratio, standing=standing, record=False,
                       difference=difference, coverage=coverage)
    estimate = None
    if parts == 2 and state.refused is None:
        reach = REACH * gradient_scale if gradient_scale > 0 else None
        median = histories[1].median() or 0.0
        floor = max(gradient_scale, median if reach is None else min(median, reach))
        estimate = make_delta(received[n:], own[n:2 * n], correction, histories[1],
                              clip=clip if estimate_clip is None else estimate_clip,
                              max_norm_ratio=max_norm_ratio, standing=standing,
                              record=False, floor=floor, reach=reach, coverage=coverage)
    verdict = Verdict(state, estimate)
    if standing is Standing.CHOSEN and verdict.refused is None:
        histories[0].record(state)
        if estimate is not None:
            histories[1].record(estimate)
    return verdict


def _subtract(received: torch.Tensor, own: torch.Tensor) -> tuple[float, float, bool]:
    """``received -= own`` chunk by chunk; returns ``‖received − own‖²``, ``‖own‖²`` and whether
    every received value was finite (if not, ``received`` is left part-way).

    The sums are :func:`~gossip.tensors.sum_of_squares` of each chunk; a received chunk whose
    float32 sum of squares is not finite gets the exact elementwise test first."""
    distance_sq = own_sq = 0.0
    for start in range(0, received.numel(), REDUCE_CHUNK):
        r, o = received[start : start + REDUCE_CHUNK], own[start : start + REDUCE_CHUNK]
        if not math.isfinite(float(torch.dot(r, r))) and not bool(r.isfinite().all()):
            return math.nan, math.nan, False
        r.sub_(o)
        distance_sq += sum_of_squares(r)
        own_sq += sum_of_squares(o)
    return distance_sq, own_sq, True


class Quarantine:
    """Strikes against peers that sent invalid state, and who is barred until when.

    ``strikes`` refusals in a row (a valid exchange clears the count) bar a peer for
    ``duration`` seconds; :meth:`bar` does so at once (a peer whose model we cannot use).
    """

    def __init__(self, strikes: int = 3, duration: float = 600.0) -> None:
        if strikes < 1 or duration < 0:
            raise ValueError("need strikes >= 1 and duration >= 0")
        self._strikes_needed = strikes
        self._duration = duration
        self._strikes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._until: collections.OrderedDict[str, float] = collections.OrderedDict()

    def strike(self, peer: str, now: float) -> bool:
        """Count one refusal; True if it put ``peer`` in quarantine."""
        count = self._strikes.pop(peer, 0) + 1
        if count >= self._strikes_needed:
            self.bar(peer, now)
            return True
        self._strikes[peer] = count
        _trim(self._strikes)
        return False

    def bar(self, peer: str, now: float) -> None:
        """Quarantine ``peer`` from ``now`` for the configured duration."""
        self._strikes.pop(peer, None)
        self._until.pop(peer, None)
        self._until[peer] = now + self._duration
        _trim(self._until)

    def clear(self, peer: str) -> None:
        """A valid exchange with ``peer``: its strikes are forgiven."""
        self._strikes.pop(peer, None)

    def barred(self, peer: str, now: float) -> bool:
        until = self._until.get(peer)
        if until is None:
            return False
        if now >= until:
            del self._until[peer]
            return False
        return True

    def count(self, now: float) -> int:
        """Peers in quarantine at ``now``."""
        return sum(1 for until in self._until.values() if until > now)


def _trim(table: collections.OrderedDict) -> None:
    while len(table) > MAX_QUARANTINED:
        table.popitem(last=False)
