"""The training side of the daemon: the loop, and the steps it runs in a worker thread.

Theory of operation
-------------------
:class:`Training.run` is the whole loop, top to bottom: wait until the node is ready (a
joiner without a checkpoint downloads the swarm's state first; ``task.shard = "auto"``
chooses its shard once joined), then alternate a chunk of steps in a worker thread with, on
the trio side between chunks, whatever :class:`~daemon.cadence.Cadence` says is due: the
progress line (every ``task.progress_interval`` seconds, however fast the steps), a
checkpoint (state copied between chunks, written by :class:`daemon.checkpoint.Checkpointer`
in a background thread), an evaluation, and the stop at ``task.max_steps``.
:meth:`Training.finish` writes the final checkpoint once the node has left. "Is it due" is
pure (:mod:`daemon.cadence`) and tested without trio.

One flag stops everything (:class:`~daemon.cadence.Stop`): a signal, ``task.max_steps`` and a
lost process of the node set it on trio's side; the trainer's thread reads it after every
step, so the chunk in flight ends after its step; the loop and the waits for the node wake
on it.

:meth:`Trainer.chunk` is a run of optimizer steps that ends after ``seconds`` of wall time, at
the step limit, or as soon as the stop flag is set. After each step, still in the worker
thread, the step and its samples are counted on the replica (which starts an averaging
round every ``averaging.every`` of them) and the deltas queued by exchanges that committed
meanwhile are added to the model: a delta waits for at most one step. The thread never waits
on the network: exchanges read the model through the replica's snapshot (a copy under the
replica's lock) and hand back deltas, while this thread steps. A snapshot may straddle an optimizer step
(some tensors from step t, the rest from t+1); that is one step's worth of noise in one
exchange, cheaper than making every exchange wait for a step to end.

Between chunks, and only then, the loop takes checkpoints (:meth:`Trainer.state`) and
evaluations, so neither ever sees a half-applied step.

On a node of several processes (:mod:`daemon.processes`) this is process 0's trainer: each
step begins at a step boundary of the node's group (:class:`gossip.nodegroup.NodeGroup`),
where the deltas queued meanwhile are applied and reach every process together (not after
the step, nor at a chunk's end), and each process trains on every N-th batch (:class:`Batches`).

Losses stay on the device within a chunk and are read once at its end: reading a CUDA loss
after every step would wait for the GPU each time.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from pathlib import Path
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import torch
import trio

import gossip
from gossip import NodeGroup
from gossip.lowlevel import Counters, StageGroup, check_correction, check_outer

from . import checkpoint, sharding
from .cadence import Cadence, Stop, due
from .logs import RUN, LiveLine
from .task import Shard, Task, TaskError, to_device

if TYPE_CHECKING:
    from .config import Config
    from .metrics import Metrics
    from .processes import Speaker
    from .status import StepReports

__all__ = ["Batches", "Chunk", "Resumed", "Trainer", "Training", "first_batches", "resume"]

log = logging.getLogger(__name__)
run_log = logging.getLogger(RUN)


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
        if self._drawn == 0:  # a first pass with no batch (open_prepared draws one to catch it)
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
                 own_steps: int | None = 0, group: NodeGroup | StageGroup | None = None,
                 stop: Stop | None = None) -> None:
        self.task = task
        self.node = node
        self.device = device
        self.group = group
        self.stop = stop if stop is not None else Stop()  # set: the chunk ends after this step
        self.batches = Batches(task, shard, batches, 0, 1 if group is None else group.replicas)
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
        samples = task.batch_size * (1 if group is None else group.replicas)  # a node's step
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
        # A chunk of no steps (a node at task.max_steps) still takes what exchanges bring, at
        # once; a group applies at its boundaries, which space its broadcasts.
        if group is None and not steps:
            applied += self.node.apply_pending()
        elif isinstance(group, StageGroup) and not steps:  # what exchanges wait for, too
            applied += group.idle()
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
        if isinstance(self.group, StageGroup):  # the host copy, made whole and current
            self.group.settle()
        with torch.no_grad():
            result = self.task.evaluate()
        self.task.model.train()
        return {str(k): float(v) for k, v in result.items()}

    def state(self, meta: Mapping[str, Any]) -> dict[str, Any]:
        """A checkpoint's content, copied to the CPU (between chunks): the model with every
        committed delta applied, the optimizer, the counters and the RNG states."""
        staged = self.group if isinstance(self.group, StageGroup) else None
        if staged is not None:  # the stages' parts and optimizers, into the host copy
            staged.settle(optimizer=True)
        else:
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
        outer = self.node.replica.outer_state()
        if outer:
            state["outer"] = outer
        if staged is not None:  # the saved copy holds it; the stages' optimizers are live
            self.task.optimizer.state.clear()
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
    def restore(task: Task, state: Mapping[str, Any]) -> tuple[Counters, Any, Any]:
        """Load a checkpoint's model, optimizer and RNG state into ``task`` (before the node
        opens); returns its counters, drift correction and outer step's state (each None if
        it has none) for :func:`gossip.open_swarm`.

        Raises:
            KeyError, ValueError, RuntimeError: the checkpoint is not of this task's model.
        """
        task.model.load_state_dict(state["model"])
        task.optimizer.load_state_dict(state["optimizer"])
        checkpoint.restore_rng(state["rng"])
        c = state["counters"]
        correction = state.get("correction")
        if correction is not None:
            check_correction(task.model, correction)
        outer = state.get("outer")
        if outer is not None:
            check_outer(task.model, outer)
        counters = Counters(int(c["step"]), int(c["samples"]), float(c["weight"]))
        return counters, correction, outer


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumed (:func:`resume`)."""

    path: Path
    counters: Counters
    correction: Any  # its drift correction, for gossip.open_swarm (None: it has none)
    own_steps: int | None  # the steps its node took itself (:meth:`Trainer.own_steps_in`)
    outer: Any = None  # its outer step's state, for gossip.open_swarm (None: it has none)


def resume(task: Task, config: Config) -> Resumed | None:
    """Load the newest checkpoint of ``checkpoint.dir`` into ``task`` (model, optimizer, RNG
    states), before the node opens: every process of a node resumes the same file. None when
    there is none.

    Raises:
        TaskError: the directory cannot be read, or its checkpoint does not fit the task.
    """
    directory = config.path(config.checkpoint.dir)
    try:
        found = checkpoint.load_latest(directory)
    except OSError as exc:
        raise TaskError(f"checkpoint.dir {directory}: {exc.strerror}") from None
    if found is None:
        return None
    path, state = found
    try:
        counters, correction, outer = Trainer.restore(task, state)
        return Resumed(path, counters, correction, Trainer.own_steps_in(state), outer)
    except (KeyError, ValueError, RuntimeError, TypeError) as exc:
        raise TaskError(f"checkpoint {path} does not fit task {config.task.entry}: "
                        f"{str(exc).splitlines()[0]}") from None


class Training:
    """The training loop of a running node (:meth:`run`), its final checkpoint
    (:meth:`finish`), and what it reports: log lines, events, metrics, and the ``shard`` and
    ``evaluation`` that ``gossipd status`` shows.

    Args:
        choose_shard: ``task.shard = "auto"`` and no earlier choice holds: choose once joined.
        resumed_step: the step of the checkpoint this run resumed (None: none), which the
            other processes of a node of several start from.
        started: ``time.monotonic()`` when the daemon started (the ``uptime_s`` it reports).
    """

    def __init__(self, config: Config, node: gossip.SwarmNode, trainer: Trainer, stop: Stop,
                 checkpoints: checkpoint.Checkpointer, speaker: Speaker, metrics: Metrics,
                 event: Callable[..., None], *, live: LiveLine | None = None,
                 peer_steps: StepReports | None = None, choose_shard: bool = False,
                 resumed_step: int | None = None, started: float = 0.0) -> None:
        self.config, self.node, self.trainer, self.stop = config, node, trainer, stop
        self.checkpoints, self.speaker, self.metrics, self.event = (checkpoints, speaker,
                                                                     metrics, event)
        self.live, self.peer_steps, self.started = live, peer_steps, started
        self.choose, self.resumed_step = choose_shard, resumed_step
        self.shard: Shard | None = None if choose_shard else trainer.shard  # auto: once chosen
        self.evaluation: dict[str, Any] | None = None  # the latest, for gossipd status
        self.staged = isinstance(getattr(trainer, "group", None), StageGroup)  # pipelined
        self._final: dict[str, Any] | None = None  # its last state, while its stages live

    async def run(self) -> None:
        """Train until the stop flag is set (a signal, ``task.max_steps``, a lost process)."""
        c, node, trainer, stop = self.config, self.node, self.trainer, self.stop
        if self.choose:
            # As soon as the join's push-pull has brought the swarm's table, not after the
            # download: from then on, other joiners see this node's choice.
            await _race(node.roster.wait_joined, stop.wait)
            if not stop.is_set():
                await self.choose_shard()
        await _race(node.wait_ready, stop.wait)
        if stop.is_set():
            await self.speaker.finish()
            return
        await self.speaker.start(node.replica, self.resumed_step, trainer.shard.index)
        if node.downloaded is not None:
            self.downloaded()
        if c.task.eval_interval and trainer.task.evaluate is None:
            run_log.warning("task.eval_interval is set but the task has no evaluate(): nothing "
                            "to run")
        cadence = Cadence.of(c, trainer.task.evaluate is not None)
        steps = 0  # this run's
        last_progress = last_checkpoint = last_eval = trio.current_time()
        async with trio.open_nursery() as writers:
            while not stop.is_set():
                try:
                    chunk = await trio.to_thread.run_sync(trainer.chunk, cadence.chunk,
                                                          cadence.steps_left(steps))
                except (gossip.ProcessLost, gossip.ReplicasDiverged) as exc:
                    self.speaker.lost(exc)
                    break
                steps += chunk.steps
                self.metrics.trained(chunk.steps, chunk.samples, chunk.loss)
                self.show(chunk)
                if due(trio.current_time(), last_progress, cadence.progress):
                    last_progress = trio.current_time()  # at most one line per interval
                    self.progress(chunk)
                if cadence.finished(steps):
                    run_log.info("stopping reason=max_steps steps=%d", steps)
                    stop.set()
                elif (due(trio.current_time(), last_checkpoint, cadence.checkpoint)
                      and not self.checkpoints.busy):
                    last_checkpoint = trio.current_time()
                    state = await self.capture()
                    if state is not None:
                        writers.start_soon(self.checkpoints.write_periodic, state)
                if due(trio.current_time(), last_eval, cadence.evaluate) and not stop.is_set():
                    last_eval = trio.current_time()
                    await self.evaluate()
        if self.staged and self.speaker.failed is None:  # while every stage holds its part
            self._final = await self.capture()
        await self.speaker.finish()

    async def finish(self) -> None:
        """Once the node has left: the final checkpoint first (a supervisor's grace period may
        run out), then the task's evaluation, then the ``stopped`` line."""
        if not self.node.ready:
            # Stopped while fetching the swarm's state: the model is still our own
            # initialization, and a checkpoint of it would make the next start skip the
            # download.
            run_log.info("stopped before the node was ready: no checkpoint written")
            self.stopped()
            return
        state = self._final if self.staged else await self.capture()
        if state is None:
            run_log.warning("no final checkpoint: the node's pipeline stages did not all "
                            "reach its last step, and each holds its own part (a restart "
                            "resumes the last checkpoint written)")
        else:
            await self.checkpoints.write(state)
        await self.evaluate()
        self.stopped()

    # ---- between chunks ---------------------------------------------------------------

    async def choose_shard(self) -> None:
        """``task.shard = "auto"``: choose the shard the fewest members announce, keep
        the choice, announce it, and train on it (:mod:`daemon.sharding`). Only members that
        proved their identity to this node count (a handshake with a sample of the others
        first): records invented in gossip would steer every joiner off the shards they
        claim."""
        c, node, trainer = self.config, self.node, self.trainer
        shards = c.task.shards
        announced = await sharding.announced(node.roster)
        counts = sharding.coverage(shards, announced)
        if not c.swarm.bootstrap:
            index, why = 0, "as the first node of the swarm (no bootstrap address)"
        else:
            index = sharding.choose_shard(shards, announced, random.Random(str(node.peer_id)))
            why = (f"as the least covered: {sum(counts)} of {len(announced)} members proved "
                   f"to us announce a shard of {shards}; {sharding.describe(counts)}")
        shard = Shard(index, shards)
        path = c.path(sharding.CHOICE_FILE)
        try:
            await trio.to_thread.run_sync(sharding.write_choice, path, index, shards)
        except OSError as exc:  # training goes on; the next run chooses again
            run_log.warning("cannot keep the shard choice in %s: %s; the next start chooses "
                            "again", path, exc.strerror)
        run_log.info("data shard %d of %d, chosen %s", index, shards, why)
        self.event("shard", shard=index, shards=shards, members=len(announced),
                   covering=counts[index])
        node.roster.set_meta(shard=index, shards=shards)
        self.shard = shard
        if shard != trainer.shard:
            batches = await trio.to_thread.run_sync(first_batches, trainer.task, shard,
                                                    c.task.entry)
            trainer.use_shard(shard, batches)

    def downloaded(self) -> None:
        """The node started from the swarm's state: say whose, and warn of another task."""
        node, entry = self.node, self.config.task.entry
        assert node.downloaded is not None
        theirs = node.downloaded.task.get("entry")
        if theirs != entry:
            run_log.warning("task mismatch ours=%s theirs=%s: the swarm may train another "
                            "model", entry, theirs)
        self.event("download", peer=node.downloaded.peer, step=node.downloaded.step)
        if self.peer_steps is not None:
            self.peer_steps.heard(node.downloaded.peer, node.downloaded.step,
                                  trio.current_time())

    def progress(self, chunk: Chunk) -> None:
        # step is the swarm's (the schedule's), which a node ahead of the swarm holds while it
        # trains on (gossip.replica: a debt, held); own counts this process's optimizer steps,
        # so a line shows training going on whatever the step does.
        stats, peers = self.node.statistics(), self.node.roster.statistics().alive
        rate = self.metrics.samples_per_second()
        run_log.info("progress step=%d own=%d held=%d loss=%.4f samples_per_s=%.0f peers=%d "
                     "exchanges=%d pending=%d", stats.step, stats.own_steps, stats.held,
                     chunk.loss, rate, peers, stats.committed, stats.pending)
        self.event("progress", step=stats.step, own=stats.own_steps, held=stats.held,
                   loss=_finite(chunk.loss), samples_per_s=round(rate, 1), peers=peers,
                   exchanges=stats.committed)

    def show(self, chunk: Chunk) -> None:
        """The live status line on a terminal."""
        if self.live is None:
            return
        stats = self.node.statistics()
        self.live.show(f"step {stats.step}  loss {chunk.loss:.4f}  "
                       f"{self.metrics.samples_per_second():.0f} samples/s  "
                       f"peers {self.node.roster.statistics().alive}  "
                       f"exchanges {stats.committed}")

    async def capture(self) -> dict[str, Any] | None:
        """A checkpoint's state (in the trainer's thread, between chunks); None when a
        pipelined node's stages cannot give their parts (one is gone: the node stops)."""
        node = self.node
        meta = {"entry": self.config.task.entry, "peer": str(node.peer_id),
                "schema": node.replica.schema.fingerprint.hex(), "time": time.time()}
        try:
            return await trio.to_thread.run_sync(self.trainer.state, meta)
        except gossip.ProcessLost as exc:
            self.speaker.lost(exc)
            return None

    async def evaluate(self) -> None:
        """The task's evaluation (in the trainer's thread, between chunks): logged, an
        ``eval`` event, and the ``gossip_eval`` gauges."""
        try:
            evaluation = await trio.to_thread.run_sync(self.trainer.evaluate)
        except gossip.ProcessLost as exc:  # a pipelined node's stage is gone
            self.speaker.lost(exc)
            return
        if evaluation:
            run_log.info("evaluation %s", " ".join(f"{k}={v:.4f}" for k, v in evaluation.items()))
        self.metrics.evaluated(evaluation)
        if evaluation:
            self.evaluation = {"metrics": evaluation, "step": self.node.global_step,
                               "time": time.monotonic()}
        self.event("eval", step=self.node.global_step, **evaluation)

    def stopped(self) -> None:
        """The ``stopped`` line and ``stop`` event: this run's totals (:meth:`Metrics.totals`)."""
        t = self.metrics.totals(self.node)
        uptime = round(time.monotonic() - self.started, 1)
        loss = "-" if t["loss"] is None else f"{t['loss']:.4f}"
        evaluation = "".join(f" eval_{k}={v:.4f}" for k, v in (t["eval"] or {}).items())
        x = t["exchanges"]  # exchanges= is the committed ones, as in the progress line
        run_log.info("stopped step=%d steps=%d samples=%d loss=%s exchanges=%d failed=%d "
                     "busy=%d rejected=%d invalid=%d no_peer=%d uptime_s=%.1f%s", t["step"],
                     t["steps"], t["samples"], loss, x["committed"], x["failed"], x["busy"],
                     x["rejected"], x["invalid"], x["no_peer"], uptime, evaluation)
        self.event("stop", **t, uptime_s=uptime)


def first_batches(task: Task, shard: Shard, entry: str) -> Iterator[Any]:
    """``task.batches(shard)`` with its first batch drawn (so that it exists), as start-up
    draws one (in a worker thread: a task may load its data there).

    Raises:
        TaskError: it yields nothing or fails.
    """
    try:
        first = iter(task.batches(shard))
        return itertools.chain([next(first)], first)
    except StopIteration:
        raise TaskError(f"{entry}: batches({shard}) yields nothing") from None
    except Exception as exc:  # the task's own code: one line names it, the log has the rest
        run_log.debug("the task's batches() failed", exc_info=True)
        raise TaskError(f"{entry}: batches({shard}) failed: {exc!r}") from None


async def _race(*fns: Any) -> None:
    """Wait until the first of the async functions ``fns`` returns, then cancel the rest."""
    async with trio.open_nursery() as nursery:
        async def one(fn: Any) -> None:
            await fn()
            nursery.cancel_scope.cancel()
        for fn in fns:
            nursery.start_soon(one, fn)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
