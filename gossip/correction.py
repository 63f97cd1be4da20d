"""Drift correction: gradient tracking between random pairs.

Theory of operation
-------------------
When nodes train on different data (label-skewed shards, say), each one's gradient pulls its
model towards its own data, and pairwise averaging only partly undoes that: between exchanges
every node walks off in its own direction, and the swarm ends far below synchronous training on
the same samples. The cure is to step along the *swarm's* gradient rather than one's own. Each
node keeps a correction ``c_i``, an estimate of (mean gradient over the swarm − own gradient),
and adds it to every gradient before the optimizer sees it::

    local step:   g = ∇f_i(x_i)        ĝ ← (1 − β)·ĝ + β·g        the optimizer steps on g + c_i

Every exchange carries, next to the weights, ``z_i = ĝ_i + c_i``: the node's recent raw gradient
(an exponential average over about the last ``1/β`` steps) plus its correction, which is its
estimate of the swarm's gradient. On commit both sides move their correction by the same
fraction ``κ·w`` of the difference of their estimates (``w`` is the fraction the weights move,
½ by default; ``κ`` = ½, below), and let it leak by ``λ``::

    c_i ← (1 − λ)·c_i + κw·(z_j − z_i)        c_j ← (1 − λ)·c_j + κw·(z_i − z_j)

Without the leak a pair's update keeps ``c_i + c_j``, so ``Σ c`` stays 0 and each ``c_i``
converges to (mean gradient − own gradient): at that point every node's ``g + c`` is the same
vector, the swarm's gradient, whatever its data. This is SCAFFOLD's control variate (and
gradient tracking with local steps, K-GT) adapted to random pairs and asynchronous deltas. Both
sides must apply the same update for the sum to hold. So each side's ``Commit`` carries the
fraction it would move by (its ``κw`` and the estimate's clipping, which follow its own spacing
and its own history), and both move by the smaller of the two (docs/PROTOCOL.md section 9.5): a
peer can make us move less than we judged, never more. And an exchange in which one side would
apply nothing (a newcomer's offer: :mod:`gossip.standing`) swaps no estimates at all; nor does
one with a node that has no estimate yet (it has not taken a step since it started or
downloaded a state: its ``ĝ`` is zero, which is no measurement, and a zero estimate would
also leave nothing to judge a peer's estimate against).

Noise is what this costs. ``ĝ`` is a few batches' worth of gradient, and whatever noise it
carries into ``c`` stays there until the next exchange, so momentum integrates it like a
gradient: on IID data, where the right correction is zero, a correction that took the whole
difference at each exchange (κ = 1) made a swarm twice as slow to a low loss. Moving half as
far (κ = ½) halves that noise and cost about one point of accuracy on label-sorted shards
(bench/efficiency.py), where the correction is worth forty.

Why an average rather than the sum of the gradients since the last exchange: a node exchanges
every step or two, so that sum would hold one or two batches, and their noise would go straight
into ``c``, where it stays; averaging over a few steps keeps the noise out at the price of a
gradient a few steps old. ``β`` = 0.2 (about five steps) did best on the skewed benchmarks. The
average starts at zero and is left so (not divided by ``1 − (1 − β)^t`` as Adam's moments
are): the first, largest and least reliable gradients then enter ``c`` damped, which measured
better than correcting them.

The leak is what makes it safe in a swarm that changes: a node that crashes or leaves takes its
``c`` with it, a joiner brings none, and an exchange that only one side applied (a lost final
message) moves one ``c`` and not the other; each leaves ``Σ c ≠ 0``, a bias that every node's
steps would carry for ever. With the leak, ``Σ c`` shrinks by ``(1 − λ)`` per exchange a node
takes part in, so such a bias fades within a few hundred exchanges. The price is an
under-correction at equilibrium, which grows quickly with ``λ`` (a node's correction falls
short by a few times ``λ/κw``): the default λ = 0.01 leaves it about a tenth short (measured on
a quadratic with known optimum), and a λ ten times larger cost several points on skewed data.

Where things live: ``c`` and ``ĝ`` are float32 tensors beside each parameter, on its device
(two extra model-sized buffers there). The correction is added by an optimizer *step
pre-hook*, not by hooks on the backward pass: the optimizer sees each parameter's final gradient
once per step, whatever the task does before it (accumulating micro-batches, unscaling a
mixed-precision loss scale, clipping the norm), and it works with any optimizer. Parameters that
do not require gradients, and float buffers such as BatchNorm's statistics, get no correction:
their place in the flat vector stays 0.

Many steps between exchanges: a correction is a fixed vector between two exchanges, and a
node's own data does not hold it back in every direction (a classifier's loss on two classes
does not care where the other eight classes' weights go). Added for dozens of steps between
exchanges it walks the model off along it, and measured so on the daemon's demo (three nodes
of the digits task, about sixty steps per exchange) the weights' norm went from 18 to 1,047 in
ten seconds and every node fell to chance. Gradient tracking is only stable with few local
steps per exchange at a given learning rate (SCAFFOLD's step-size bounds shrink with the
local steps). So a step adds ``c`` in full while the node updates it at least every
:data:`FULL_SPACING` steps, and ``FULL_SPACING / k`` of it when ``k`` steps pass between
updates (:meth:`Correction.strength`): a node whose link cannot keep up with its steps trains
mostly on its own gradient, as plain averaging does, and stays stable; with frequent
exchanges, the case the correction is for, nothing changes.

Per exchange (with the outer step, :mod:`gossip.outer`, the default): over real links hundreds
of local steps pass between exchanges, and at ``FULL_SPACING / k`` the correction is all but
off. There the correction is measured per exchange instead, as SCAFFOLD's option II measures it
from the progress of the local steps: ``ĝ`` averages the gradients of about the steps between
two exchanges (its weight per step is one over the spacing, when that is longer than ``1/β``),
so the estimate is the mean gradient along the path the node took, not the last few steps of
it; every step adds all of ``c``; and an exchange moves ``c`` by ``κ`` from ½ at
:data:`FULL_SPACING` steps between updates up to 1 from :data:`WIDE_SPACING` on, since an
estimate averaged over that many steps has little noise left to halve. Measured on the daemon's
digits task, eight nodes on label-sorted shards, 100 steps between exchanges, 3,000 steps each:
88.7% mean and 83.0% worst node held-out accuracy, against 41.1% and 29.3% with the per-step
measure and plain averaging, and 98.1% for all-reduce every step (the walk-off that set
``FULL_SPACING / k`` did not return: weight norms stayed at 15, against 12 without a
correction). Where it costs: on the byte-level language model with AdamW at 500 steps between
exchanges (bench/lowcomm.py), a correction added in full for 500 steps ended at loss 2.35 where
the per-step one ended at 2.20 (AdamW divides each direction by its own gradient scale, so a
constant offset where the gradient is small moves the weights far); weakening it past 16 steps
fixed that and gave back most of the digits' gain, so it stays whole. One more bound holds the
joins: an estimate's step is clipped to :data:`ESTIMATE_CLIP` x the median of the recent ones
(the state's clip is 5x). A joiner that trained alone on classes nobody else has brings, once
it is trusted, an estimate far from the others', and a correction that took it in one exchange
and added all of it at every step knocked the older nodes' held-out accuracy from 67% to 35-53%
at 10 steps between exchanges (tests/sim/test_join.py, four seeds); clipped so, the change
comes in over a few exchanges and no node fell more than 1 point in three of them (4 in the
fourth), while at 100 steps it cost 2 points (86.7% mean, 81.3% worst). ``κ`` depends on each
node's own spacing and the clip on each side's own history, so the two sides of an exchange
would move by different fractions; they take the smaller of the two (above). Before they did,
the sum on four nodes with no departure read up to a fifth of the corrections' size.

Departures: the leak alone takes hundreds of exchanges to fade what a crash or a departure
leaves (``−c`` of the node that went, about ``1/N`` of the corrections' size in a swarm of
``N``), and meanwhile every node's steps carry ``1/N`` of that node's skew. So the leak adapts:
a node that sees a member that took part in averaging go (dead or left), or one that went come
back (a restart brings the correction of its checkpoint), adds ``1/N`` to its estimate of the
sum's *stray share* (:class:`Stray`), and while that is above :data:`STRAY_FLOOR` its committed
exchanges leak by :data:`FADE_LEAK` instead of ``λ``, each taking that fraction off the share.
Measured on four nodes on skewed data (tests/sim/test_churn_sum.py, 10 runs), ``‖Σ c‖ /
Σ ‖c‖`` went from 0.23-0.44 at a crash to 0.01-0.02 within 500 steps of the others
declaring it dead, where the plain leak held it at 0.2-0.4 for 300 steps; after a departure,
0.06-0.16 (the departed node held more than its ``1/N``). The cost is that every ``c`` shrinks
with the sum for those exchanges (to a third of its size, regrown within about ten more, as each
exchange puts back the pair's difference); in a swarm of twenty or more a departure is below the
floor and changes nothing. Joins need none of it: a joiner brings ``c = 0`` and swaps no
estimates as a newcomer. With the outer step off it stays off too, so that ``outer = false`` is
the old path.

Checks: an estimate is checked like a state (:func:`gossip.mixing.judge`), but its norm
check cannot be against our own estimate alone. A node that has learned its own data has a
gradient near zero, while the swarm's, which its correction has to take on, is large: the
first exchanges of a node that trained alone for a while would all be refused, and its peers
quarantined. So the check's reference is at least :attr:`Correction.scale`, the largest
gradient norm of the node's first ``SCALE_STEPS`` steps (where it starts from, typically far
from anything's optimum), which no peer can change.

Bounds in sum: a peer's estimate moves ``c`` by a clipped step per exchange, but steps in
one direction add up, and the history that sets the clip grows as a poison spreads to the
peers whose distances fill it. Measured so with four identities taking turns to send an
estimate ``z + 30·‖z‖·e``: ``‖c‖`` went from 0.0008 to 7.5e10 in 50 s, one output bias to
-338,030. Two bounds hold whatever peers send, both in the node's own unit, the scale: the
median an estimate's clip is taken from is at most :data:`REACH` x ``scale``, and after every
exchange ``c`` is cut back to ``REACH × scale`` if longer (an honest ``c`` is the difference of
two gradients, the swarm's and ours, each at most about the scale: the longest in the drift and
join simulations on label-sorted digits was 1.54 × scale; :attr:`Correction.bounded` counts
the cuts). These bound the correction's length, not its effect: a correction as long as an
honest one but along a direction no node's data pulls on is a constant force there, and the
weights walk along it. Measured so (tests/sim/test_correction_poisoning.py), four identities
offering one fixed estimate, each step clipped and ``c`` never past a third of its bound,
took every honest node of a digits swarm from 96.9% held-out accuracy and loss 0.11 to 92.7%
and 0.58, still 93.1% and 0.55 long after the attack ended. Nothing in the estimates can
undo it: the pushes reach every node alike, exchanges between honest nodes keep the swarm's
sum of corrections, and only the leak fades it, by ``λ`` an exchange, so a push sustained at
a share ``p`` of a node's exchanges holds ``p / λ`` of them in ``c`` (a leak five times
larger contained that attack and cost 2.4 points on the skewed benchmark). What bounds it is
who gets to push: a responder swaps estimates only with a member it has picked for a round
of its own (:mod:`gossip.averaging`), so a key holder's estimates reach ``c`` at its share of
the hosts the node picks at random, as its states do when picked, and no longer as often as
its offers' budget allows; the identities of that test, which offer and are never picked,
left accuracy and loss as they were. docs/PROTOCOL.md section 12 says what remains.

Locking: :class:`~gossip.replica.Replica` takes its lock around every method here. The hook
runs in the trainer's thread once per optimizer step and costs three element-wise operations
over the parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from .config import DEFAULT_LEAK  # λ, declared with the averaging.leak setting
from .identity import PeerId
from .member import State
from .tensors import StateSchema, all_finite

__all__ = ["Correction", "CORRECTION_RATE", "DEFAULT_LEAK", "FULL_SPACING", "GRADIENT_AVERAGE",
           "WIDE_SPACING", "ESTIMATE_CLIP", "REACH", "FADE_LEAK", "STRAY_FLOOR", "Stray", "check_state",
           "corrected", "check_correction"]

GRADIENT_AVERAGE = 0.2  # β: the weight of each new gradient in the recent average ĝ
CORRECTION_RATE = 0.5  # κ: the correction moves by κ x the state's fraction of the difference
SCALE_STEPS = 16  # steps whose gradient norms give the scale an estimate's check starts from
FULL_SPACING = 4  # local steps between updates of c up to which every step adds all of it
WIDE_SPACING = 16  # per exchange: from this spacing on, the correction takes the whole difference
ESTIMATE_CLIP = 1.2  # per exchange: an estimate's step is at most this x the median of recent ones
REACH = 3.0  # x Correction.scale: the largest c, and the largest median an estimate's clip takes
FADE_LEAK = 0.3  # the leak while a departure's share of the sum of corrections is not faded
STRAY_FLOOR = 0.05  # the stray share below which the leak is back to λ
MAX_GONE = 4096  # members remembered as gone, to know one that comes back


def corrected(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The shapes of the parameters a correction of ``model`` covers, by name."""
    place = StateSchema.from_module(model).places()
    return {name: p.shape for name, p in model.named_parameters()
            if p.requires_grad and name in place}


def check_correction(model: torch.nn.Module, state: object) -> None:
    """Check a correction saved with a checkpoint (from
    :meth:`~gossip.replica.Replica.correction_state`) against ``model``, before resuming from
    it: the same check :func:`gossip.open_swarm` makes when it takes it, made early.

    Raises:
        ValueError: as :func:`check_state`.
    """
    check_state(corrected(model), state)


def check_state(shapes: Mapping[str, torch.Size], state: object) -> None:
    """Check a saved correction (from :meth:`Correction.state_dict`) against the shapes of
    the parameters it must cover (:func:`corrected`).

    Raises:
        ValueError: not a table of tensors, a name or shape that is not the model's, or a
            value that is not finite (a damaged or foreign checkpoint).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"a correction is a table of tensors, not {type(state).__name__}")
    if set(state) != set(shapes):
        missing = sorted(set(shapes) - set(state))
        extra = sorted(map(str, set(state) - set(shapes)))
        raise ValueError(f"correction does not fit the model: missing {missing[:3]}, "
                         f"unknown {extra[:3]}")
    for name, shape in shapes.items():
        value = state[name]
        if not isinstance(value, torch.Tensor) or value.shape != shape:
            raise ValueError(f"correction {name}: expected a tensor of shape {tuple(shape)}")
        if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
            raise ValueError(f"correction {name}: values are not all finite floats")


class Correction:
    """A node's drift correction ``c``, its recent average gradient ``ĝ``, and the estimate
    it sends. Not thread-safe: the replica's lock guards every call.

    Args:
        model: the live module; its parameters that require gradients are corrected.
        schema: the module's state schema (where each parameter lies in the flat vector).
        per_exchange: measure per exchange (with the outer step; see "Per exchange" above):
            ``ĝ`` averages the steps between updates, every step adds all of ``c``, and
            :meth:`rate` grows with the spacing. False: as without an outer step.
    """

    def __init__(self, model: torch.nn.Module, schema: StateSchema,
                 per_exchange: bool = False) -> None:
        self.per_exchange = per_exchange
        place = schema.places()
        self._slots: list[tuple[torch.nn.Parameter, slice]] = []
        self._names: list[str] = []
        for name, param in model.named_parameters():
            if param.requires_grad and name in place:
                self._slots.append((param, place[name]))
                self._names.append(name)
        self._c = [torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                   for p, _ in self._slots]
        self._average = [torch.zeros_like(c) for c in self._c]  # ĝ
        self.scale = 0.0  # the largest gradient norm of the first SCALE_STEPS steps
        self._scaled = 0  # steps taken since the start (or a reset), up to SCALE_STEPS
        self._since = 0  # steps since c was last updated by an exchange
        self._spacing = 1.0  # the steps between its updates, on average (recent ones weigh most)
        self._updated = False  # whether an exchange has updated c yet (its gap is a measure)
        self._uncovered = _gaps([where for _, where in self._slots], schema.numel)
        self.bounded = 0  # exchanges after which c was longer than REACH x scale, and cut
        # The node's rounds exchange no estimates (gossip.plan: wide spacing): c, which
        # nothing updates then, is kept but not added, so that a correction frozen when the
        # plan changed (or restored from a checkpoint) is no bias on every step. ``hold`` is
        # what the averaging asks; a node of several processes latches it into ``held`` at a
        # step boundary, in every process at once (gossip.nodegroup); None: ``hold`` as is.
        self.hold = False
        self.held: bool | None = None

    @property
    def measured(self) -> bool:
        """Whether ``ĝ`` holds a gradient yet: only then is ``z`` an estimate."""
        return self._scaled > 0

    # ---- the trainer's side ---------------------------------------------------------------

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Fold every parameter's raw gradient into ``ĝ``, then add ``c`` to it (called by
        the optimizer's step pre-hook).

        A fused optimizer stepped by a mixed-precision ``GradScaler`` gets its gradients
        still scaled, with the scale as ``optimizer.grad_scale`` (it unscales inside its
        kernel): ``ĝ`` takes them unscaled, and ``c`` is added scaled to match.
        """
        grads, averages, cs = [], [], []
        for (param, _), average, c in zip(self._slots, self._average, self._c):
            grad = param.grad
            if grad is None or grad.is_sparse:
                continue
            grads.append(grad)
            averages.append(average)
            cs.append(c)
        if not grads:
            return
        loss_scale = getattr(optimizer, "grad_scale", None)
        raw = grads if loss_scale is None else torch._foreach_div(grads, loss_scale)
        if self._scaled < SCALE_STEPS:  # a few reductions at the start, then no more syncs
            norm = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(raw)))
            if math.isfinite(norm):
                self.scale = max(self.scale, norm)
        self._scaled = min(self._scaled + 1, SCALE_STEPS)
        rate = self._gradient_rate()
        torch._foreach_mul_(averages, 1.0 - rate)
        torch._foreach_add_(averages, raw, alpha=rate)
        self._since += 1
        if loss_scale is not None:
            cs = torch._foreach_mul(cs, loss_scale)
        torch._foreach_add_(grads, cs, alpha=self.strength())

    def _gradient_rate(self) -> float:
        """The weight of a new gradient in ``ĝ``: :data:`GRADIENT_AVERAGE`, or per exchange
        one over the spacing (when that is longer), so that ``ĝ`` is the mean gradient of
        about the steps between two exchanges."""
        if not self.per_exchange:
            return GRADIENT_AVERAGE
        return min(GRADIENT_AVERAGE, 1.0 / self._spacing)

    def strength(self) -> float:
        """The fraction of ``c`` a step adds: 1 while the node updates ``c`` at least every
        :data:`FULL_SPACING` steps, ``FULL_SPACING / k`` when it takes ``k`` steps between
        updates (on average, or since the last one if that is longer); per exchange, 1;
        held, 0."""
        if self.hold if self.held is None else self.held:
            return 0.0
        if self.per_exchange:
            return 1.0
        return min(1.0, FULL_SPACING / max(self._spacing, self._since))

    def rate(self) -> float:
        """``κ``, the fraction of the estimates' difference a committed exchange moves ``c``
        by (times the state's weight): :data:`CORRECTION_RATE`, or per exchange from it at
        :data:`FULL_SPACING` steps between updates up to 1 at :data:`WIDE_SPACING` and more,
        where an estimate averages enough steps that its noise no longer needs halving."""
        if not self.per_exchange:
            return CORRECTION_RATE
        wide = (self._spacing - FULL_SPACING) / (WIDE_SPACING - FULL_SPACING)
        return CORRECTION_RATE + (1.0 - CORRECTION_RATE) * min(1.0, max(0.0, wide))

    def apply(self, delta: torch.Tensor, scale: float, decay: float) -> None:
        """``c ← decay·c + scale·delta`` (``delta`` a flat host vector of the schema; copied
        to the device before this returns, so its buffer may be reused at once)."""
        if scale:
            if self.per_exchange and not self._updated:  # the first gap is all we know
                self._spacing = max(1.0, float(self._since))
            else:
                self._spacing += 0.2 * (self._since - self._spacing)
            self._since, self._updated = 0, True
        with torch.no_grad():
            for (_, where), c in zip(self._slots, self._c):
                if decay != 1.0:
                    c.mul_(decay)
                if scale:
                    c.add_(delta[where].view(c.shape).to(c.device), alpha=scale)
            if scale and self.scale > 0 and self._c:
                self._bound(REACH * self.scale)

    def _bound(self, radius: float) -> None:
        """Shorten ``c`` to ``radius`` if it is longer (one reduction: a sync on a GPU, once
        per exchange)."""
        norm = math.sqrt(sum(float(n) ** 2 for n in torch._foreach_norm(self._c)))
        if norm > radius:
            torch._foreach_mul_(self._c, radius / norm)
            self.bounded += 1

    # ---- the network's side ---------------------------------------------------------------

    def estimate_into(self, out: torch.Tensor, decay: float = 1.0) -> None:
        """Write ``z = ĝ + decay·c`` into the flat host vector ``out`` (0 where no parameter
        is corrected).

        A gradient that was not finite (a loss that blew up, a mixed-precision step that
        overflowed) would leave ``ĝ`` so for good, and with it every exchange: it is
        forgotten instead, and ``z`` is ``c`` alone until the next step measures again.
        """
        self.clear_uncovered(out)
        for (_, where), c, average in zip(self._slots, self._c, self._average):
            part = out[where]
            part.copy_(average.view(-1))
            part.add_(c.view(-1).to(part.device), alpha=decay)
        if not all_finite(out):
            self._forget_average()
            for (_, where), c in zip(self._slots, self._c):
                out[where].copy_(c.view(-1)).mul_(decay)

    def estimates(self, decay: float, pending: torch.Tensor | None,
                  scale: float) -> Iterator[tuple[torch.Tensor, slice]]:
        """``z = ĝ + decay·c`` (plus ``scale`` x a pending correction part, a flat vector on
        the parameters' device, when given) for each corrected parameter, on its device and
        flattened, with where it lies in a flat vector: :meth:`estimate_into`'s arithmetic,
        for a snapshot made on the device. Does not check finiteness (the caller does)."""
        for (_, where), c, average in zip(self._slots, self._c, self._average):
            z = torch.add(average.view(-1), c.view(-1), alpha=decay)
            if pending is not None:
                z.add_(pending[where], alpha=scale)
            yield z, where

    def clear_uncovered(self, estimate: torch.Tensor) -> None:
        """Zero what a flat estimate holds outside the corrected parameters (a peer's
        estimate may hold anything there; ours holds zeros)."""
        for start, stop in self._uncovered:
            estimate[start:stop].zero_()

    def reset(self) -> None:
        """Forget everything: a node that just took another model's state (a download)."""
        for c, average in zip(self._c, self._average):
            c.zero_()
            average.zero_()
        self.scale, self._scaled = 0.0, 0

    # ---- a node of several processes (gossip.nodegroup) ----------------------------------

    def tensors(self) -> list[torch.Tensor]:
        """``c``, one tensor per corrected parameter: what a follower process takes."""
        return list(self._c)

    def named(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, c, ĝ)`` of each corrected parameter: what a pipeline stage publishes
        (:mod:`gossip.stages`)."""
        return list(zip(self._names, self._c, self._average))

    def bind(self, tensors: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``c`` and ``ĝ`` in the given tensors from now on (by parameter name; their
        values copied in first): a pipelined node's host copy keeps them in memory its stages
        share (:mod:`gossip.stages`)."""
        with torch.no_grad():
            for i, name in enumerate(self._names):
                c, average = tensors[name]
                c.copy_(self._c[i])
                average.copy_(self._average[i])
                self._c[i], self._average[i] = c, average

    def forget_unfinite(self) -> None:
        """Forget ``ĝ`` if it is not finite, as :meth:`estimate_into` does (a pipeline
        stage, whose ``ĝ`` the node's estimate reads through shared memory)."""
        if not all(all_finite(average.view(-1)) for average in self._average):
            self._forget_average()

    def _forget_average(self) -> None:
        """``ĝ`` zero, measured again from the next step."""
        for average in self._average:
            average.zero_()
        self._scaled = 0

    @property
    def counts(self) -> tuple[float, int]:
        """The gradient scale measured and the steps it was measured over (0: none yet)."""
        return self.scale, self._scaled

    @counts.setter
    def counts(self, value: tuple[float, int]) -> None:
        self.scale, self._scaled = value

    @property
    def timing(self) -> tuple[int, float]:
        """The steps since ``c`` was last updated and the average spacing of its updates:
        with ``c``, all that decides what a step adds (:meth:`strength`)."""
        return self._since, self._spacing

    @timing.setter
    def timing(self, value: tuple[int, float]) -> None:
        self._since, self._spacing = value

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """``c`` by parameter name, copied to the CPU."""
        return {name: c.detach().to("cpu", copy=True) for name, c in zip(self._names, self._c)}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take ``c`` from :meth:`state_dict`'s output.

        Raises:
            ValueError: as :func:`check_state`.
        """
        check_state(dict(zip(self._names, (c.shape for c in self._c))), state)
        with torch.no_grad():
            for name, c in zip(self._names, self._c):
                c.copy_(state[name])


class Stray:
    """How much of the swarm's sum of corrections a departure has left stray, as this node
    estimates it, and the leak that fades it (see "Departures" above). Not thread-safe: the
    replica's lock guards it.

    Args:
        on: False: never stray (the plain path, ``outer = false``).
    """

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.share = 0.0  # the stray share of the sum, relative to the corrections' size
        self._taking_part: set[PeerId] = set()  # members alive and ready
        self._gone: dict[PeerId, None] = {}  # members that took part and went, oldest first

    def seen(self, peer: PeerId, state: State, ready: bool) -> None:
        """Take a member's new record: a member that took part and is now dead or left, or
        one such that is back, adds ``1 / N`` to the share, ``N`` the members taking part
        (this node with them)."""
        if not self.on:
            return
        if state in (State.DEAD, State.LEFT):
            if peer in self._taking_part:
                self._taking_part.discard(peer)
                self._gone[peer] = None
                if len(self._gone) > MAX_GONE:
                    del self._gone[next(iter(self._gone))]
                self._disturbed()
        elif ready and peer not in self._taking_part:
            self._taking_part.add(peer)
            if peer in self._gone:  # it went, and is back
                del self._gone[peer]
                self._disturbed()

    def _disturbed(self) -> None:
        self.share = min(1.0, self.share + 1.0 / (len(self._taking_part) + 1))

    def leak(self, base: float) -> float:
        """The leak of a committed exchange: :data:`FADE_LEAK` while the share is above
        :data:`STRAY_FLOOR` (the exchange takes that fraction off it), else ``base``."""
        if self.share <= STRAY_FLOOR or base >= FADE_LEAK:
            return base
        self.share *= 1.0 - FADE_LEAK
        return FADE_LEAK


def _gaps(covered: list[slice], total: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, total)`` that no slice of ``covered`` holds."""
    gaps, at = [], 0
    for where in sorted(covered, key=lambda w: w.start):
        if where.start > at:
            gaps.append((at, where.start))
        at = max(at, where.stop)
    if at < total:
        gaps.append((at, total))
    return gaps
