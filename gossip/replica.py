"""The local replica: a live model shared by the trainer and the network side.

Theory of operation
-------------------
The trainer owns the live parameters and writes them on every optimizer step; the network side
only ever *reads* them (a snapshot, under :attr:`Replica.lock`) and *queues* deltas. The
trainer adds what is queued at its step boundaries (:meth:`Replica.apply_step`, under the
same lock; below: a delta is spread over several). So the network never waits for the
trainer for longer than a copy, and the trainer never waits for the network at all.

A queued delta is a difference and the fraction of it to take (``scale``); the add that
applies it multiplies, so the network side never makes a pass over the model just to scale.

Deltas over several steps: the trainer's step boundary (:meth:`Replica.apply_step`) does not
add a committed delta at once but spreads it over half the steps that come between two of them
(measured in this replica's own steps, an average that favours the recent gaps) and at most
:data:`MAX_SPREAD`, a like part at each step; a delta that arrives meanwhile is merged with
what is left, and the whole starts over. Why: a delta that lands at once is a step change of
the weights, and the optimizer's momentum turns a step change into an overshoot. Measured on
the daemon's digits task (SGD with momentum 0.9, label-sorted data): after an exchange with a
joiner that brought classes nobody else had, a node's own loss rose from 0.002 to 1.7, the
three steps that repaired it built a velocity hundreds of times the usual one, and the steps
after it carried the model far past the repair, from 94% held-out accuracy down to 40% within
twenty steps, 27 points under where the node stood before the join (tests/sim/test_join.py
holds the line). Why so few steps: the live model lags by what is left to add, and the lag
costs. With half the gap and no bound, three demos (``gossipd demo``, 45 s on a CPU, ~60 steps
between exchanges, 30 steps of spread) ended 2.5, 3.1 and 6.7 points below the central
baseline, against 0.8, 1.1 and 1.4 with no spread (and dips); bounded at 16 steps, about the
memory of a momentum of 0.9 to 0.95 (1 / (1 − β) steps), 2.2, 2.8 and 1.7. At 10, 25 and 60
steps between exchanges the bound of 16 held every join of the test within 1.3 points over 60
virtual seconds (four seeds), as half the gap did; a third or a quarter of the gap did not at
10 steps, where they leave one or two steps. What an exchange sees is unchanged: a snapshot is
the live state plus all that is left to apply. The drift correction's part is applied at once
(it is a gradient offset, not weights). A checkpoint, a stopping trainer or a chunk of no
steps applies the rest at once (:meth:`Replica.apply_pending`), and a download drops it.

A model on a GPU keeps a device copy of the delta being spread, uploaded on a side stream as
soon as the exchange commits, and a snapshot's sums are made on the device
(:mod:`gossip.staging`): the trainer waits for neither copy.

Parts: a replica given its optimizer keeps a drift correction (:mod:`gossip.correction`), and
then every flat buffer holds two parts of the schema's size, the state and the correction's
estimate ``z``; without one, only the state. An exchange may still swap only the state (a peer
that keeps no correction): the second part of its buffers is then unused, and its commit only
lets the correction leak.

Memory: the flat buffers (``parts`` float32 copies of the model each) are the snapshot being
sent, the state being received, and the pending delta (held while it is spread). The
received buffer *becomes* the pending delta when nothing is pending, and applied deltas go
back to a spare slot for the next exchange, so a node holds at most three buffers however
many exchanges it makes. On a CUDA model the buffers are page-locked, so device copies are
fast. With the outer step (:mod:`gossip.outer`) two more host vectors of the state's size are
kept for good: the anchor and the velocity.

Counters: ``step`` is the step the swarm schedules by (see :mod:`gossip.standing`): this
node's optimizer steps, moved on each exchange towards the swarm's by a signed ``step_move``.
It never goes back: a move down becomes a *debt* that the node's next optimizer steps pay off
instead of counting, so a node ahead of the swarm holds its step while the others catch up
(learning-rate schedules never reverse, and checkpoints, named by step, stay in order).
Moves up are bounded in sum, by the node's own pace (:class:`~gossip.counters.Lead`).
``samples`` counts samples this node trained on; ``weight`` is the push-sum weight (see
:mod:`gossip.mixing`). Counting saturates at the protocol's range
(:data:`~gossip.messages.MAX_COUNT`), so every counter stays one a peer would accept.
:attr:`Replica.local_steps` counts this process's own optimizer steps, for the scheduler that
starts a round every so many of them (:meth:`Replica.watch`).

Threads: any thread may call any method; each takes :attr:`lock` for as long as it touches the
model or the buffers. A trainer that wants snapshots that never straddle an optimizer step
holds :attr:`lock` around ``optimizer.step()`` too: the lock is re-entrant, since the drift
correction's optimizer hook takes it inside that step.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, Callable

import torch
import trio

from . import tensors
from .correction import DEFAULT_LEAK, Correction, Stray
from .counters import Counters, Lead
from .member import Member
from .messages import MAX_COUNT, MAX_WEIGHT
from .outer import Outer
from .staging import Staging, device_of
from .tensors import StateSchema

__all__ = ["Replica", "Counters", "offload", "offload_for", "MAX_SPREAD", "OFFLOAD_NUMEL"]

OFFLOAD_NUMEL = 1 << 18  # models this large (1 MiB of float32) copy and mix in a thread
MAX_SPREAD = 16  # steps a committed delta is spread over at most: momentum's memory
SPACING_WEIGHT = 0.2  # the weight of the newest gap in the average steps between deltas


class Replica:
    """A model, its schema and counters, its drift correction, and the deltas queued for it.

    Args:
        model: the live module, on any device (on the device it will train on: the
            correction is kept beside each parameter).
        by_samples: push-sum mode: the weight grows by the samples trained on.
        optimizer: the model's optimizer, to keep a drift correction (added to the
            gradients by a step pre-hook); None: no correction.
        leak: the fraction of the correction that fades at each committed exchange (more at
            a few after a departure, with the outer step: :class:`~gossip.correction.Stray`).
        outer: the outer step's learning rate and momentum (:mod:`gossip.outer`); None, or
            lr 1 with momentum 0: plain averaging, with no anchor kept.
    """

    def __init__(self, model: torch.nn.Module, *, by_samples: bool = False,
                 optimizer: torch.optim.Optimizer | None = None,
                 leak: float = DEFAULT_LEAK,
                 outer: tuple[float, float] | None = None) -> None:
        self.model = model
        self.schema = StateSchema.from_module(model)
        self.lock = threading.RLock()  # re-entrant: the optimizer hook runs under a held lock
        self.by_samples = by_samples
        self.leak = leak
        self._step = 0
        self._debt = 0  # optimizer steps still to take without counting (a move down)
        self._samples = 0
        self._weight = 1.0
        self._local = 0  # this process's optimizer steps
        self._lead = Lead()  # how far moves up may still take the step (gossip.counters)
        self._revision = 0  # changes of the state made outside the optimizer
        self.loads = 0  # states taken whole (downloads): a pipelined node's stages take them
        self._watch: tuple[int, Callable[[], None]] | None = None
        self._pending: torch.Tensor | None = None
        self._scales = [0.0, 0.0]  # the delta to apply is scale[k] x part k of _pending
        self._decay = 1.0  # what the correction is multiplied by before the pending part
        self._pending_count = 0
        self._spare: list[torch.Tensor] = []
        self._pin = any(t.is_cuda for t in model.state_dict().values()
                        if isinstance(t, torch.Tensor))
        self._spread = 0  # steps left to apply the pending state delta over (0: not begun)
        self._apart: float | None = None  # local steps between queued deltas, on average
        self._queued_at: int | None = None  # local step of the last queued delta
        self.correction: Correction | None = None
        # Called unlocked before a snapshot: a pipelined node's stages write their parts.
        self.refresh: Callable[[], None] | None = None
        # The network side's alone (one exchange at a time), but for a download's reset.
        plain = outer is None or outer == (1.0, 0.0)  # lr 1, no momentum: plain averaging
        self._per_exchange = not plain
        self.outer = None if outer is None or plain else Outer(self.schema.numel, *outer)
        self._hook: Any = None
        self.stray = Stray(on=False)  # what departures leave of the corrections' sum
        if optimizer is not None:
            self.stray.on = self._per_exchange
            self.correction = Correction(model, self.schema, per_exchange=self._per_exchange)
            self._hook = optimizer.register_step_pre_hook(self._before_step)
        device = device_of(tensors.live(model, self.schema))
        self._staging = (None if device is None
                         else Staging(device, self.parts * self.schema.numel))

    def member_changed(self, member: Member) -> None:
        """Take a member's new record (from the roster): a departure, or a return, starts
        fading what it left of the swarm's sum of corrections (:class:`Stray`)."""
        with self.lock:
            self.stray.seen(member.peer, member.state, member.ready)

    @property
    def per_exchange(self) -> bool:
        """Whether the outer step is on, and with it the correction measured per exchange."""
        return self._per_exchange

    @property
    def estimating(self) -> bool:
        """Whether this replica can swap a drift correction's estimate: it keeps a correction
        and has taken a step since it started (or downloaded a state)."""
        with self.lock:
            return self.correction is not None and self.correction.measured

    def clear_uncovered(self, estimate: torch.Tensor) -> None:
        """Zero a received estimate outside the corrected parameters (no lock: the ranges
        never change)."""
        if self.correction is not None:
            self.correction.clear_uncovered(estimate)

    @property
    def gradient_scale(self) -> float:
        """The correction's :attr:`~gossip.correction.Correction.scale` (0 without one)."""
        with self.lock:
            return 0.0 if self.correction is None else self.correction.scale

    @property
    def parts(self) -> int:
        """Parts of the schema's size in each flat buffer: 2 with a correction, else 1."""
        return 1 if self.correction is None else 2

    def close(self) -> None:
        """Stop correcting the optimizer's gradients (the node is closing)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    # ---- trainer side -----------------------------------------------------------------

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        with self.lock:
            if self.correction is not None:
                self.correction.before_step(optimizer)

    def advance(self, steps: int = 1, samples: int = 0) -> None:
        """Count ``steps`` optimizer steps over ``samples`` training samples."""
        if steps < 0 or samples < 0:
            raise ValueError("steps and samples must be non-negative")
        fire = None
        with self.lock:
            paid = min(self._debt, steps)
            self._debt -= paid
            self._step = min(self._step + steps - paid, MAX_COUNT)
            self._samples = min(self._samples + samples, MAX_COUNT)
            self._local += steps
            self._lead.earn(steps)
            if self.by_samples:
                self._weight = min(self._weight + samples, MAX_WEIGHT)
            if self._watch is not None and self._local >= self._watch[0]:
                fire, self._watch = self._watch[1], None
        if fire is not None:
            fire()

    def restore(self, counters: Counters,
                correction: Mapping[str, torch.Tensor] | None = None,
                outer: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take the counters (and correction, and outer state) saved with a checkpoint, before
        the node starts averaging.

        Raises:
            ValueError: a counter out of the protocol's range, or a correction or outer state
                that is not this model's (a damaged or foreign file).
        """
        if not (0 <= counters.step <= MAX_COUNT and 0 <= counters.samples <= MAX_COUNT
                and 0 < counters.weight <= MAX_WEIGHT):
            raise ValueError(f"bad counters {counters}: each must be in the protocol's range, "
                             f"0 to {MAX_COUNT} (a weight above 0)")
        with self.lock:
            self._step, self._samples = counters.step, counters.samples
            self._weight = counters.weight if self.by_samples else 1.0
            if correction is not None and self.correction is not None:
                self.correction.load_state_dict(correction)
                self._revision += 1
            if outer is not None and self.outer is not None:
                self.outer.load_state_dict(outer)

    def apply_step(self) -> int:
        """At a step boundary: begin applying the deltas queued since the last one, and add
        the next part of the delta being applied (see the module docstring: a delta is spread
        over half the steps that come between two of them, at most :data:`MAX_SPREAD`).
        Returns how many exchanges' deltas began to apply."""
        with self.lock:
            if self._pending is None:
                return 0
            began = 0
            if self._spread == 0:
                began = self._begin()
                self._spread = max(1, min(MAX_SPREAD, round((self._apart or 1) / 2)))
            self._add_state(1.0 / self._spread)
            self._spread -= 1
            if self._spread == 0:
                self._retire()
            return began

    def apply_pending(self) -> int:
        """Add all that is queued to the live parameters (and the correction) at once, the
        rest of a delta being spread included (a checkpoint, a node that stops); returns how
        many exchanges' deltas began to apply."""
        with self.lock:
            if self._pending is None:
                return 0
            began = self._begin() if self._spread == 0 else 0
            self._add_state(1.0)
            self._retire()
            return began

    def _source(self) -> torch.Tensor:
        """The pending buffer where the model is: its device copy for a model on a GPU."""
        assert self._pending is not None
        return self._pending if self._staging is None else self._staging.staged()

    def _begin(self) -> int:
        """Apply the correction's part of what is pending (all of it: only the state is
        spread), and count the exchanges that begin."""
        if self.correction is not None:
            n = self.schema.numel
            self.correction.apply(self._source()[n:], self._scales[1], self._decay)
            if self._staging is not None:
                self._staging.done()
            self._scales[1], self._decay = 0.0, 1.0
        began, self._pending_count = self._pending_count, 0
        return began

    def _add_state(self, fraction: float) -> None:
        """Add ``fraction`` of what is left of the pending state delta to the model."""
        n = self.schema.numel
        tensors.add_(self.model, self.schema, self._source()[:n], self._scales[0] * fraction)
        if self._staging is not None:
            self._staging.done()
        self._scales[0] *= 1.0 - fraction
        self._revision += 1

    def _retire(self) -> None:
        """The pending delta is all applied: its buffer becomes a spare."""
        assert self._pending is not None
        if self._staging is not None:
            self._staging.wait_upload()  # a spare is written to: no copy may still read it
        self._spare.append(self._pending)
        self._pending, self._spread = None, 0

    @property
    def offloads(self) -> bool:
        """Whether whole-state work runs in a worker thread (:func:`offload`): a large
        model's, and a pipelined node's (its snapshot waits for the stages: :attr:`refresh`)."""
        return self.schema.numel >= OFFLOAD_NUMEL or self.refresh is not None

    @property
    def revision(self) -> int:
        """How many times the state changed other than by an optimizer step (deltas applied,
        a download, a checkpoint's correction): a node of several processes broadcasts its
        state when this moves (:mod:`gossip.nodegroup`)."""
        return self._revision

    def correction_tensors(self) -> list[torch.Tensor]:
        """The correction's ``c`` tensors (none without a correction)."""
        return [] if self.correction is None else self.correction.tensors()

    def correction_rate(self) -> float:
        """The correction's :meth:`~gossip.correction.Correction.rate` (0 without one)."""
        with self.lock:
            return 0.0 if self.correction is None else self.correction.rate()

    def correction_timing(self) -> tuple[int, float]:
        """The correction's :attr:`~gossip.correction.Correction.timing` ((0, 1.0) without
        one)."""
        with self.lock:
            return (0, 1.0) if self.correction is None else self.correction.timing

    def set_correction_timing(self, since: int, spacing: float) -> None:
        with self.lock:
            if self.correction is not None:
                self.correction.timing = (since, spacing)

    @property
    def pending(self) -> int:
        """Deltas queued that have not begun to apply."""
        return self._pending_count

    @property
    def spreading(self) -> bool:
        """Whether part of a delta is still to be applied at the coming steps."""
        return self._pending is not None and self._spread > 0

    @property
    def local_steps(self) -> int:
        """Optimizer steps counted by this process (not moved by exchanges)."""
        return self._local

    def counters(self) -> Counters:
        with self.lock:
            return Counters(self._step, self._samples, self._weight, self._debt, self._local)

    def outer_state(self) -> dict[str, torch.Tensor] | None:
        """The outer step's anchor and velocity for a checkpoint (None: no outer step; empty:
        no exchange has set them yet)."""
        return None if self.outer is None else self.outer.state_dict()

    def correction_state(self) -> dict[str, torch.Tensor] | None:
        """The correction, by parameter name on the CPU, for a checkpoint (None: none kept).
        Call it after :meth:`apply_pending`, as a checkpoint does."""
        with self.lock:
            return None if self.correction is None else self.correction.state_dict()

    # ---- network side -----------------------------------------------------------------

    def watch(self, steps: int, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once :attr:`local_steps` reaches ``steps``: at once if it has,
        else from the thread whose :meth:`advance` gets there. Replaces an earlier watch."""
        with self.lock:
            if self._local < steps:
                self._watch = (steps, callback)
                return
            self._watch = None
        callback()

    def buffer(self) -> torch.Tensor:
        """A flat buffer of :attr:`parts` parts to snapshot or receive into (a spare one if
        there is one)."""
        with self.lock:
            if self._spare:
                return self._spare.pop()
        return torch.zeros(self.parts * self.schema.numel, dtype=torch.float32,
                           pin_memory=self._pin and torch.cuda.is_available())

    def release(self, flat: torch.Tensor) -> None:
        """Give back a buffer from :meth:`buffer` that is no longer needed. Spares and the
        pending delta together are at most the three buffers the module promises."""
        with self.lock:
            if len(self._spare) + (self._pending is not None) < 3:
                self._spare.append(flat)

    def snapshot(self, out: torch.Tensor, parts: int | None = None,
                 on_counters: Callable[[Counters], None] | None = None) -> Counters:
        """Copy the state into ``out``: the live state plus the deltas committed and not yet
        applied, so that an exchange starts from the state the node has (and the push-sum
        weight, merged at commit, goes with it); returns the counters at that instant.

        With ``parts`` 2 (the default when the replica keeps a correction) the second part
        gets the correction's estimate ``z``; a download asks for 1.

        ``on_counters`` is called with the counters before the copy starts: the lock is held
        from then to the end of the copy, so they are the copy's (an exchange sends them in
        its Offer or Accept while the copy runs).
        """
        parts = self.parts if parts is None else parts
        n = self.schema.numel
        if self.refresh is not None:  # a pipelined node's host copy: made current first
            self.refresh()
        with self.lock:
            if on_counters is not None:
                on_counters(Counters(self._step, self._samples, self._weight, self._debt,
                                     self._local))
            pending = self._pending is not None
            if self._staging is not None:
                self._snapshot_staged(out, parts, pending)
            else:
                state = out[:n]
                tensors.snapshot(self.model, self.schema, state)
                if pending:
                    state.add_(self._pending[:n], alpha=self._scales[0])
                if parts == 2 and self.correction is not None:
                    self._estimate(out[n:2 * n], pending)
            return Counters(self._step, self._samples, self._weight, self._debt, self._local)

    def _estimate(self, estimate: torch.Tensor, pending: bool) -> None:
        """The correction's estimate and its pending part, on the host."""
        assert self.correction is not None
        self.correction.estimate_into(estimate, self._decay if pending else 1.0)
        if pending and self._scales[1]:
            assert self._pending is not None
            estimate.add_(self._pending[self.schema.numel:], alpha=self._scales[1])

    def _snapshot_staged(self, out: torch.Tensor, parts: int, pending: bool) -> None:
        """:meth:`snapshot` of a model on a GPU: the sums on the device, the copies started
        together and waited for once (:mod:`gossip.staging`)."""
        assert self._staging is not None
        n = self.schema.numel
        delta = self._staging.staged() if pending else None
        estimates = None
        estimate = out[n:2 * n]
        if parts == 2 and self.correction is not None:
            extra = delta[n:] if delta is not None and self._scales[1] else None
            estimates = ((z, estimate[where]) for z, where in self.correction.estimates(
                self._decay if pending else 1.0, extra, self._scales[1]))
        finite = self._staging.snapshot(tensors.live(self.model, self.schema),
                                        iter(tensors.views(out[:n], self.schema)), delta,
                                        self._scales[0], estimates)
        if delta is not None:
            self._staging.done()
        if estimates is not None:
            assert self.correction is not None
            if finite:
                self.correction.clear_uncovered(estimate)
            else:  # a gradient that was not finite: the host's path forgets it
                self._estimate(estimate, pending)

    def queue(self, delta: torch.Tensor, *, scale: float = 1.0, correction: float = 0.0,
              step_move: int = 0, weight: float | None, sent_weight: float) -> None:
        """Queue a committed delta: ``scale ×`` its state part for the model and, with a
        correction, ``correction ×`` its second part for the correction, which first leaks
        (``delta`` is handed over: do not use it afterwards).

        Args:
            scale: the fraction of the state difference to apply; positive.
            correction: the fraction of the estimates' difference to add to the correction;
                0 when the exchange swapped no estimates (it still leaks).
            step_move: how far to move our step (see :func:`gossip.standing.step_move`); a
                move down is taken from the steps to come.
            weight: the merged push-sum weight, or None in fixed mode.
            sent_weight: the weight we offered (samples trained since then are kept).
        """
        if not scale > 0:
            raise ValueError(f"scale must be positive, not {scale!r}")
        n = self.schema.numel
        with self.lock:
            decay = 1.0 if self.correction is None else 1.0 - self.stray.leak(self.leak)
            self._move_step(step_move)
            if weight is not None:
                self._weight = min(self._weight + weight - sent_weight, MAX_WEIGHT)
            self._pending_count += 1
            if self._queued_at is not None:
                gap = self._local - self._queued_at
                self._apart = (gap if self._apart is None
                               else self._apart + SPACING_WEIGHT * (gap - self._apart))
            self._queued_at = self._local
            self._spread = 0  # what is left of a delta being spread starts over with this one
            if self._staging is not None:
                self._staging.wait_upload()  # an upload may still read the pending buffer
            if self._pending is None:
                self._pending, self._scales, self._decay = delta, [scale, correction], decay
            else:
                self._merge(delta, scale, correction, decay)
            if self._staging is not None:
                self._staging.upload(self._pending)

    def _merge(self, delta: torch.Tensor, scale: float, correction: float,
               decay: float) -> None:
        """Fold ``delta`` into the pending one (under the lock)."""
        assert self._pending is not None
        n = self.schema.numel
        self._decay *= decay
        # pending = s1·p + s2·d = s1·(p + (s2/s1)·d): one pass, s1 stays. The correction's
        # pending part leaks with the correction (its scale shrinks, and is folded in before
        # 1/s could overflow when the trainer applies nothing for long).
        self._pending[:n].add_(delta[:n], alpha=scale / self._scales[0])
        if self.correction is not None:
            self._scales[1] *= decay
            if 0 < self._scales[1] < 1e-6:
                self._pending[n:].mul_(self._scales[1])
                self._scales[1] = 1.0
            if correction and self._scales[1]:
                self._pending[n:].add_(delta[n:], alpha=correction / self._scales[1])
            elif correction:
                self._pending[n:].copy_(delta[n:])
                self._scales[1] = correction
        if len(self._spare) < 2:
            self._spare.append(delta)

    def _move_step(self, move: int) -> None:
        if move < 0:
            self._debt = min(self._debt - move, MAX_COUNT)
            return
        paid = min(self._debt, move)
        self._debt -= paid
        self._step = min(self._step + self._lead.spend(move - paid), MAX_COUNT)

    def load(self, flat: torch.Tensor, *, step: int, buffers: dict[str, int]) -> None:
        """Replace the live state by a downloaded one (parameters, float buffers, integer
        scalar buffers such as ``num_batches_tracked``) and take ``step`` (the sender's, as
        far as the caller allows) if it is ahead. Our sample count and push-sum weight stay
        ours: a copy of a peer's state is one more replica, and a small weight disturbs the
        swarm's weighted mean least. Anything pending is dropped, since it was relative to the
        state being replaced, and the correction starts from nothing (a joiner brings none)."""
        with self.lock:
            tensors.load_(self.model, self.schema, flat[:self.schema.numel])
            live = self.model.state_dict()
            with torch.no_grad():
                for name, value in buffers.items():
                    t = live.get(name)
                    if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() == 1:
                        t.fill_(value)
            self._step, self._debt = max(self._step, step), 0
            self._revision += 1
            self.loads += 1
            if self._pending is not None:
                if self._staging is not None:
                    self._staging.wait_upload()
                self._pending, self._pending_count, self._spread = None, 0, 0
            if self.correction is not None:
                self.correction.reset()
            if self.outer is not None:
                self.outer.reset()

    def int_buffers(self) -> dict[str, int]:
        """The model's integer scalar buffers (such as ``num_batches_tracked``) by name."""
        with self.lock:
            return {name: int(t.item()) for name, t in self.model.state_dict().items()
                    if isinstance(t, torch.Tensor) and not t.is_floating_point()
                    and t.numel() == 1}


async def offload(replica: Replica, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a copy or arithmetic over the whole state) in a worker thread when
    :attr:`Replica.offloads`, else inline: a thread hop costs more than copying a small model,
    and inline work keeps simulated swarms on trio's virtual clock."""
    if replica.offloads:
        return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
    return fn(*args, **kwargs)


async def offload_for(numel: int, fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`offload` by size alone (:data:`OFFLOAD_NUMEL`), where no replica is at hand."""
    if numel < OFFLOAD_NUMEL:
        return fn(*args)
    return await trio.to_thread.run_sync(fn, *args)
