"""The training side of the daemon: steps in a worker thread, in chunks.

Theory of operation
-------------------
The service's trio loop calls :meth:`Trainer.chunk` through ``trio.to_thread.run_sync``.
One chunk is a run of optimizer steps that ends after ``seconds`` of wall time, at the step
limit, or as soon as :attr:`Trainer.stop` is set (a signal). After each step, still in the
worker thread, the step and its samples are counted on the replica (which starts an averaging
round every ``averaging.every`` of them) and the deltas queued by exchanges that committed
meanwhile are added to the model: a delta waits for at most one step. The thread never waits
on the network: exchanges read the model through the replica's snapshot (a copy under the
replica's lock) and hand back deltas, while this thread steps. A snapshot may straddle an optimizer step
(some tensors from step t, the rest from t+1); that is one step's worth of noise in one
exchange, cheaper than making every exchange wait for a step to end.

Between chunks, and only then, the service takes checkpoints (:meth:`Trainer.state`) and
evaluations, so neither ever sees a half-applied step.

On a node of several processes (:mod:`daemon.processes`) this is process 0's trainer: each
step begins at a step boundary of the node's group (:class:`gossip.nodegroup.NodeGroup`),
where the deltas queued meanwhile are applied and reach every process together (not after
the step, nor at a chunk's end), and each process trains on every N-th batch (:class:`Batches`).

Losses stay on the device within a chunk and are read once at its end: reading a CUDA loss
after every step would wait for the GPU each time.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
import threading
from typing import Any, Iterator, Mapping

import torch

import gossip
from gossip.correction import check_state, corrected
from gossip.nodegroup import NodeGroup
from gossip.replica import Counters

from . import checkpoint
from .task import Shard, Task, TaskError, to_device

__all__ = ["Batches", "Chunk", "Trainer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Chunk:
    """What one chunk did."""

    steps: int
    samples: int
    loss: float  # mean over the chunk's steps (nan if none)
    applied: int  # exchanges whose deltas were added after it
    seconds: float


def _to_cpu(value: Any) -> Any:
    """A deep copy of ``value`` with every tensor copied to the CPU (for a checkpoint)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class Batches:
    """The batches of one shard, pass after pass of a finite ``task.batches(shard)``; on a
    node of ``size`` processes, process ``rank`` takes every ``size``-th batch of that stream
    (batches ``rank``, ``rank + size``, ...: the node's processes split what one process
    would train on, each drawing the whole stream)."""

    def __init__(self, task: Task, shard: Shard, batches: Iterator[Any] | None = None,
                 rank: int = 0, size: int = 1) -> None:
        self.task = task
        self._shard = shard
        self._batches = batches if batches is not None else iter(task.batches(shard))
        self._drawn = 0  # batches drawn from the current pass of task.batches(shard)
        self.epochs = 0  # passes of a finite task.batches(shard) that have ended
        self._rank, self._size = rank, size

    @property
    def shard(self) -> Shard:
        return self._shard

    def use(self, shard: Shard, batches: Iterator[Any]) -> None:
        """Draw from ``shard``'s ``batches`` (its iterator) from now on."""
        self._shard, self._batches, self._drawn = shard, batches, 0

    def next(self) -> Any:
        """This process's next batch."""
        for _ in range(self._rank):
            self._draw()
        batch = self._draw()
        for _ in range(self._size - self._rank - 1):
            self._draw()
        return batch

    def _draw(self) -> Any:
        try:
            batch = next(self._batches)
        except StopIteration:
            batch = self._next_epoch()
        self._drawn += 1
        return batch

    def _next_epoch(self) -> Any:
        """The first batch of a new pass of a finite ``batches(shard)`` (one epoch of a
        DataLoader, the usual habit): said once, then counted quietly in :attr:`epochs`.

        Raises:
            TaskError: the new pass yields nothing (``batches`` handed back the iterator that
                just ended, say); training would spin without a step.
        """
        shard = f"{self._shard.index}/{self._shard.count}"
        if self._drawn == 0:  # a first pass with no batch (prepare() draws one to catch it)
            raise TaskError(f"task.batches(shard {shard}) yields no batch")
        ended, self._drawn = self._drawn, 0
        self._batches = iter(self.task.batches(self._shard))
        try:
            batch = next(self._batches)
        except StopIteration:
            raise TaskError(
                f"task.batches(shard {shard}) yielded no batch "
                f"when called again after a pass of {ended}: it must return a new iterator "
                f"each time it is called (not one that has already ended)") from None
        if self.epochs == 0 and self._rank == 0:
            log.info("task.batches ended after %d batches; starting it again each time it "
                     "ends (one epoch = %d batches) shard=%s", ended, ended, shard)
        self.epochs += 1
        return batch


class Trainer:
    """Trains ``task`` on this node's shard, counting on ``node``'s replica; on a node of
    several processes, ``group`` (:class:`gossip.nodegroup.NodeGroup`) brings every process to
    the same state at each step boundary, and this process is its speaker."""

    def __init__(self, task: Task, node: gossip.SwarmNode, device: torch.device,
                 shard: Shard, batches: Iterator[Any] | None = None,
                 own_steps: int | None = 0, group: NodeGroup | None = None) -> None:
        self.task = task
        self.node = node
        self.device = device
        self.group = group
        self.stop = threading.Event()  # set from any thread: the chunk ends after this step
        self.batches = Batches(task, shard, batches, 0, 1 if group is None else group.size)
        self._warned_nan = False
        self.own_steps_before = own_steps  # of the runs before (own_steps_in); None: unknown

    @property
    def shard(self) -> Shard:
        """The shard it trains on."""
        return self.batches.shard

    @property
    def epochs(self) -> int:
        return self.batches.epochs

    def use_shard(self, shard: Shard, batches: Iterator[Any]) -> None:
        """Train on ``shard`` from now on, drawing from ``batches`` (its iterator, first batch
        checked); between chunks only. Once, for a shard chosen after start-up."""
        self.batches.use(shard, batches)

    def chunk(self, seconds: float, limit: int) -> Chunk:
        """Run up to ``limit`` steps for about ``seconds`` (in a worker thread).

        Raises:
            gossip.ProcessLost: another process of this node died (several processes only).
        """
        task, group, started = self.task, self.group, time.monotonic()
        deadline = started + seconds
        if self.device.type == "cuda":  # worker threads start on device 0
            torch.cuda.set_device(self.device)
        task.model.train()
        samples = task.batch_size * (1 if group is None else group.size)  # the node's, a step
        total: torch.Tensor | float = 0.0
        steps = applied = 0
        while steps < limit and not self.stop.is_set():
            if group is not None:  # applies what is queued, and every process takes it
                applied += group.boundary()
            batch = to_device(self.batches.next(), self.device)
            loss = task.step(batch)
            total = total + (loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
            steps += 1
            if group is None:
                applied += self.node.step(samples)
            else:
                self.node.replica.advance(1, samples)
            if time.monotonic() >= deadline:
                break
        if group is None:  # a chunk of no steps still takes them; a group applies them at its
            applied += self.node.apply_pending()  # boundaries, which space its broadcasts
        mean = float(total) / steps if steps else math.nan
        if steps and not math.isfinite(mean) and not self._warned_nan:
            self._warned_nan = True
            log.warning("loss is not finite step=%d: peers will refuse this model's state "
                        "until it is fixed (lower the learning rate?)",
                        self.node.global_step)
        return Chunk(steps, steps * samples, mean, applied, time.monotonic() - started)

    def evaluate(self) -> dict[str, float]:
        """The task's evaluation, if it has one (in a worker thread, between chunks)."""
        if self.task.evaluate is None:
            return {}
        with torch.no_grad():
            result = self.task.evaluate()
        self.task.model.train()
        return {str(k): float(v) for k, v in result.items()}

    def state(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's content, copied to the CPU (between chunks): the model with every
        committed delta applied, the optimizer, the counters and the RNG states."""
        self.node.apply_pending()
        counters = self.node.replica.counters()
        state = {
            "model": _to_cpu(self.task.model.state_dict()),
            "optimizer": _to_cpu(self.task.optimizer.state_dict()),
            "counters": {"step": counters.step, "samples": counters.samples,
                         "weight": counters.weight, "own_steps": self.own_steps},
            "rng": checkpoint.capture_rng(),
            "meta": dict(meta),
        }
        correction = self.node.replica.correction_state()
        if correction is not None:
            state["correction"] = correction
        return state

    @property
    def own_steps(self) -> int | None:
        """The optimizer steps this node has taken itself: this run's and those the checkpoint
        it resumed counts (the swarm's ``step`` also moves at exchanges and downloads); None
        when that checkpoint was written before they were counted."""
        before = self.own_steps_before
        return None if before is None else before + self.node.replica.local_steps

    @staticmethod
    def own_steps_in(state: Mapping[str, Any]) -> int | None:
        """The own steps a checkpoint's state counts (None: written before they were)."""
        own = state["counters"].get("own_steps")
        return None if own is None else int(own)

    @staticmethod
    def restore(task: Task, state: Mapping[str, Any]) -> tuple[Counters, Any]:
        """Load a checkpoint's model, optimizer and RNG state into ``task`` (before the node
        opens); returns its counters and drift correction (None if it has none) for
        :func:`gossip.open_swarm`.

        Raises:
            KeyError, ValueError, RuntimeError: the checkpoint is not of this task's model.
        """
        task.model.load_state_dict(state["model"])
        task.optimizer.load_state_dict(state["optimizer"])
        checkpoint.restore_rng(state["rng"])
        c = state["counters"]
        correction = state.get("correction")
        if correction is not None:
            check_state(corrected(task.model), correction)
        return Counters(int(c["step"]), int(c["samples"]), float(c["weight"])), correction
