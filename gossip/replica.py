"""The local replica: a live model shared by the trainer and the network side.

Theory of operation
-------------------
The trainer owns the live parameters and writes them on every optimizer step; the network side
only ever *reads* them (a snapshot, under :attr:`Replica.lock`) and *queues* deltas. The
trainer adds what is queued at its next step boundary (:meth:`Replica.apply_pending`, under
the same lock). So the network never waits for the trainer for longer than a copy, and the
trainer never waits for the network at all.

A queued delta is a difference and the fraction of it to take (``scale``); the add that
applies it multiplies, so the network side never makes a pass over the model just to scale.

Memory: the flat buffers (one float32 copy of the model each) are the snapshot being sent, the
state being received, and the pending delta. The received buffer *becomes* the pending delta
when nothing is pending, and applied deltas go back to a spare slot for the next exchange, so
a node holds at most three buffers however many exchanges it makes. On a CUDA model the
buffers are page-locked, so device copies are fast.

Counters: ``step`` is the node's training step, raised to a peer's on an exchange or a download
(so learning-rate schedules line up across the swarm) as far as the caller allows (see
:func:`gossip.standing.step_ceiling`); ``samples`` counts samples this node trained on;
``weight`` is the push-sum weight (see :mod:`gossip.mixing`). Counting saturates at the
protocol's range (:data:`~gossip.messages.MAX_COUNT`), so every counter stays one a peer
would accept.

Threads: any thread may call any method; each takes :attr:`lock` for as long as it touches the
model or the buffers. A trainer that wants snapshots that never straddle an optimizer step
holds :attr:`lock` around ``optimizer.step()`` too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import trio

from . import tensors
from .messages import MAX_COUNT, MAX_WEIGHT
from .tensors import StateSchema

__all__ = ["Replica", "Counters", "offload", "OFFLOAD_NUMEL"]

OFFLOAD_NUMEL = 1 << 18  # models this large (1 MiB of float32) copy and mix in a thread


@dataclass(frozen=True)
class Counters:
    """A replica's counters, read together."""

    step: int
    samples: int
    weight: float


class Replica:
    """A model, its schema and counters, and the deltas queued for it.

    Args:
        model: the live module, on any device.
        by_samples: push-sum mode: the weight grows by the samples trained on.
    """

    def __init__(self, model: torch.nn.Module, *, by_samples: bool = False) -> None:
        self.model = model
        self.schema = StateSchema.from_module(model)
        self.lock = threading.Lock()
        self.by_samples = by_samples
        self._step = 0
        self._samples = 0
        self._weight = 1.0
        self._pending: torch.Tensor | None = None
        self._pending_scale = 0.0  # the delta to apply is _pending_scale x _pending
        self._pending_count = 0
        self._spare: list[torch.Tensor] = []
        self._pin = any(t.is_cuda for t in model.state_dict().values()
                        if isinstance(t, torch.Tensor))

    # ---- trainer side -----------------------------------------------------------------

    def advance(self, steps: int = 1, samples: int = 0) -> None:
        """Count ``steps`` optimizer steps over ``samples`` training samples."""
        if steps < 0 or samples < 0:
            raise ValueError("steps and samples must be non-negative")
        with self.lock:
            self._step = min(self._step + steps, MAX_COUNT)
            self._samples = min(self._samples + samples, MAX_COUNT)
            if self.by_samples:
                self._weight = min(self._weight + samples, MAX_WEIGHT)

    def restore(self, counters: Counters) -> None:
        """Take the counters saved with a checkpoint (before the node starts averaging).

        Raises:
            ValueError: a counter out of the protocol's range (a damaged or foreign file).
        """
        if not (0 <= counters.step <= MAX_COUNT and 0 <= counters.samples <= MAX_COUNT
                and 0 < counters.weight <= MAX_WEIGHT):
            raise ValueError(f"bad counters {counters}: each must be in the protocol's range, "
                             f"0 to {MAX_COUNT} (a weight above 0)")
        with self.lock:
            self._step, self._samples = counters.step, counters.samples
            self._weight = counters.weight if self.by_samples else 1.0

    def apply_pending(self) -> int:
        """Add every queued delta to the live parameters; returns how many were queued."""
        with self.lock:
            if self._pending is None:
                return 0
            tensors.add_(self.model, self.schema, self._pending, self._pending_scale)
            count, self._pending_count = self._pending_count, 0
            self._spare.append(self._pending)
            self._pending = None
            return count

    @property
    def pending(self) -> int:
        """Deltas queued and not yet applied."""
        return self._pending_count

    def counters(self) -> Counters:
        with self.lock:
            return Counters(self._step, self._samples, self._weight)

    # ---- network side -----------------------------------------------------------------

    def buffer(self) -> torch.Tensor:
        """A flat buffer to snapshot or receive into (a spare one if there is one)."""
        with self.lock:
            if self._spare:
                return self._spare.pop()
        return tensors.new_flat(self.schema, pin_memory=self._pin)

    def release(self, flat: torch.Tensor) -> None:
        """Give back a buffer from :meth:`buffer` that is no longer needed. Spares and the
        pending delta together are at most the three buffers the module promises."""
        with self.lock:
            if len(self._spare) + (self._pending is not None) < 3:
                self._spare.append(flat)

    def snapshot(self, out: torch.Tensor) -> Counters:
        """Copy the state into ``out``: the live state plus the deltas committed and not yet
        applied, so that an exchange starts from the state the node has (and the push-sum
        weight, merged at commit, goes with it); returns the counters at that instant."""
        with self.lock:
            tensors.snapshot(self.model, self.schema, out)
            if self._pending is not None:
                out.add_(self._pending, alpha=self._pending_scale)
            return Counters(self._step, self._samples, self._weight)

    def queue(self, delta: torch.Tensor, *, scale: float = 1.0, peer_step: int,
              weight: float | None, sent_weight: float) -> None:
        """Queue a committed delta, ``scale × delta`` (``delta`` is handed over: do not use it
        afterwards).

        Args:
            scale: the fraction of ``delta`` to apply; positive.
            peer_step: the step the peer gives us, already bounded by the caller; ours
                becomes the max of the two.
            weight: the merged push-sum weight, or None in fixed mode.
            sent_weight: the weight we offered (samples trained since then are kept).
        """
        if not scale > 0:
            raise ValueError(f"scale must be positive, not {scale!r}")
        with self.lock:
            self._step = max(self._step, peer_step)
            if weight is not None:
                self._weight = min(self._weight + weight - sent_weight, MAX_WEIGHT)
            if self._pending is None:
                self._pending, self._pending_scale = delta, scale
            else:  # pending = s1·p + s2·d = s1·(p + (s2/s1)·d): one pass, s1 stays
                self._pending.add_(delta, alpha=scale / self._pending_scale)
                if len(self._spare) < 2:
                    self._spare.append(delta)
            self._pending_count += 1

    def load(self, flat: torch.Tensor, *, step: int, buffers: dict[str, int]) -> None:
        """Replace the live state by a downloaded one (parameters, float buffers, integer
        scalar buffers such as ``num_batches_tracked``) and take ``step`` (the sender's, as
        far as the caller allows) if it is ahead. Our sample count and push-sum weight stay ours: a copy of a peer's state is
        one more replica, and a small weight disturbs the swarm's weighted mean least.
        Anything pending is dropped: it was relative to the state being replaced."""
        with self.lock:
            tensors.load_(self.model, self.schema, flat)
            live = self.model.state_dict()
            with torch.no_grad():
                for name, value in buffers.items():
                    t = live.get(name)
                    if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.numel() == 1:
                        t.fill_(value)
            self._step = max(self._step, step)
            if self._pending is not None:
                self._pending, self._pending_count = None, 0

    def int_buffers(self) -> dict[str, int]:
        """The model's integer scalar buffers (such as ``num_batches_tracked``) by name."""
        with self.lock:
            return {name: int(t.item()) for name, t in self.model.state_dict().items()
                    if isinstance(t, torch.Tensor) and not t.is_floating_point()
                    and t.numel() == 1}


async def offload(replica: Replica, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn`` (a copy or arithmetic over the whole state) in a worker thread for a model
    of :data:`OFFLOAD_NUMEL` elements or more, inline for a smaller one: a thread hop costs
    more than copying a small model, and inline work keeps simulated swarms on trio's
    virtual clock."""
    if replica.schema.numel < OFFLOAD_NUMEL:
        return fn(*args, **kwargs)
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))
