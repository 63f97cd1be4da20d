"""The step boundary of a pipelined node: one ordinary model for the swarm.

Theory of operation
-------------------
A node cut into pipeline stages (:mod:`gossip.pipeline`) is one member of the swarm, with one
model: the speaker (stage 0) keeps the whole model on the host, the *mirror*, and its replica
(the node's, :class:`~gossip.replica.Replica`) is made over the mirror, so exchanges,
downloads and checkpoints see an ordinary model and nodes of any layout average together.

The mirror lives in memory every stage maps: a file in ``/dev/shm`` that the speaker creates
and removes once each stage has mapped it. Each stage's slice of it holds that stage's
parameters, persistent buffers and, with the drift correction, its ``c`` and ``ĝ``; the
speaker's mirror model and correction are views of it. Nothing of the state crosses a
collective: at a step boundary the speaker broadcasts a header (eight integers, over gloo),
and as it says each stage

* *publishes*: copies its slice into the shared memory (its GPU's values to the host), then
  one all-reduce of the stages' gradient scales, which is also the barrier after which the
  mirror is whole; the speaker does so when an exchange is about to read the state (the
  replica's :attr:`~gossip.replica.Replica.refresh` hook asks, and waits for, the next
  boundary), before it applies committed deltas, and before a checkpoint or an evaluation;
* *takes*: after the speaker has added the committed deltas to the mirror (or a download
  replaced it, or at the start), a broadcast of the correction's timing, which is the
  barrier, then each stage copies its slice back into its own tensors.

So a committed exchange costs each stage one copy of its slice out and one back, at the
next boundary its spacing allows (as :class:`~gossip.nodegroup.NodeGroup`'s broadcasts are
spaced: :data:`~gossip.nodegroup.SYNC_SPACING`); steps with nothing to do cost the header
alone. A download replaces the mirror between boundaries: the next boundary takes it without
publishing over it.

The drift correction: each stage keeps one for its own parameters (on its device, hooked on
its optimizer), and the mirror's replica keeps the node's, its tensors views of the stages'
slices. Stages step together, so the steps since the last update and the measured flag are
stage 0's; the gradient scale is the norm of the stages' scales. Updates (an exchange's
commit, a download's reset) happen on the mirror and reach the stages when they take.

Failures: a stage that dies breaks the group's collectives; the others' next one raises
:class:`~gossip.errors.ProcessLost`, as for a node of several data-parallel processes.

Checkpoints: the optimizer's state is each stage's. :meth:`StageGroup.settle` with
``optimizer=True`` has each stage save its optimizer's state to a file beside the shared
memory, which the speaker reads (``torch.load(weights_only=True)``) into the whole model's
optimizer, in the whole optimizer's numbering: a checkpoint is the one a process training
the whole model writes, resumed into any layout (a download over it clears every stage's).
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .correction import Correction, corrected
from .errors import GossipError, ProcessLost
from .nodegroup import SYNC_SPACING, NodeGroupStatistics, _collective
from .tensors import StateSchema

if TYPE_CHECKING:
    from .pipeline import Pipeline
    from .replica import Replica

__all__ = ["StageGroup"]

# s a snapshot waits for the stages' next boundary, then reads the mirror as the last one left
# it: well under the 5 s a peer waits for our Accept (the responder snapshots before it).
REFRESH_WAIT = 2.0
ALIGN = 64  # bytes: each tensor's place in the shared memory

_STEP, _PUBLISH, _TAKE, _STOP, _OPTIMIZER, _START, _FRESH = 1, 2, 4, 8, 16, 32, 64


@dataclass(frozen=True)
class _Entry:
    """One tensor of a stage's slice: a parameter ("param"), a persistent buffer
    ("buffer"), or a correction's ``c`` or ``ĝ`` ("c", "g"), by the whole model's name."""

    kind: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _layout(model: nn.Sequential, bounds: list[tuple[int, int]],
            correction: bool) -> tuple[list[list[_Entry]], int]:
    """Every stage's entries, in the one order every process computes, and the bytes in
    all."""
    covered = set(corrected(model)) if correction else set()
    stages, offset = [], 0
    for start, stop in bounds:
        part = model[start:stop]
        params = dict(part.named_parameters())  # a tied weight once, by its first name
        seen = {id(p) for p in params.values()}
        items: list[tuple[str, str, torch.Tensor]] = [("param", n, p) for n, p in params.items()]
        for n, t in part.state_dict(keep_vars=True).items():
            if id(t) not in seen:  # a persistent buffer (a tied weight's other name is not)
                seen.add(id(t))
                items.append(("buffer", n, t))
        items += [(kind, n, params[n]) for n in params if n in covered for kind in ("c", "g")]
        entries = []
        for kind, name, t in items:
            dtype = torch.float32 if kind in ("c", "g") else t.dtype
            entry = _Entry(kind, name, dtype, tuple(t.shape), offset)
            entries.append(entry)
            offset += -(-entry.nbytes // ALIGN) * ALIGN
        stages.append(entries)
    return stages, offset


class StageGroup:
    """The step boundaries of a pipelined node (made by :class:`~gossip.pipeline.Pipeline`,
    as :attr:`~gossip.pipeline.Pipeline.boundaries`); the same calls as
    :class:`~gossip.nodegroup.NodeGroup`'s, so a trainer uses either.

    Args:
        pipeline: this process's stage.
        model: the whole model (every process's own copy, for the layout; the speaker's is
            the mirror, whose tensors become views of the shared memory).
        correction: whether the stages keep a drift correction.
    """

    replicas = 1  # copies of the model the node trains: its samples a step are one batch's

    def __init__(self, pipeline: Pipeline, model: nn.Module, *, correction: bool) -> None:
        self.pipeline = pipeline
        self.rank, self.size = pipeline.rank, pipeline.size
        self.backend = pipeline.backend
        self.control = pipeline.control
        self.global_step = 0
        self.started = self.stopped = False
        self.correction = correction
        self._replica: Replica | None = None
        self._loads = -1  # the mirror replica's downloads the stages have taken
        self._wanted = False  # an exchange waits for the next publish
        self._published = 0
        self._cond = threading.Condition()
        self._boundaries = self._syncs = self._bytes = 0
        self._sync_seconds = self._header_seconds = 0.0
        self._synced_at = self._sync_took = 0.0
        self.stages, total = _layout(model, pipeline.bounds, correction)  # type: ignore[arg-type]
        self._correction: Correction | None = None
        if correction:
            module = pipeline.module
            self._correction = Correction(module, StateSchema.from_module(module))
            stage_correction = self._correction
            self._hook = pipeline.optimizer.register_step_pre_hook(
                lambda opt, args, kwargs: stage_correction.before_step(opt))
        self._path, self._memory = self._map(total)
        self._own = list(zip(self.stages[self.rank], self._stage_tensors()))
        if self.speaker:
            self._bind_mirror(model)

    @property
    def speaker(self) -> bool:
        return self.rank == 0

    # ---- the shared memory ---------------------------------------------------------------

    def _map(self, total: int) -> tuple[str, torch.Tensor]:
        """Map ``total`` bytes every stage shares (the speaker creates the file; once every
        stage has mapped it, it is removed, so that nothing outlives the node)."""
        size = max(ALIGN, total)
        folder = _folder(size) if self.speaker else ""
        token = torch.tensor([os.getpid(), secrets.randbits(62)], dtype=torch.int64)
        with _collective("mapping the stages' memory"):
            dist.broadcast(token, src=self.pipeline._global(0), group=self.control)
        name = f"gossipd-stages-{int(token[0])}-{int(token[1])}"
        # The folder, by its index among the two the speaker chooses from.
        where = torch.tensor([_FOLDERS().index(folder) if self.speaker else 0])
        with _collective("mapping the stages' memory"):
            dist.broadcast(where, src=self.pipeline._global(0), group=self.control)
        path = os.path.join(_FOLDERS()[int(where[0])], name)
        try:
            if self.speaker:
                memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._barrier("mapping the stages' memory")
            if not self.speaker:
                if os.path.getsize(path) != size:
                    raise GossipError(f"the stages' shared memory {path} has "
                                      f"{os.path.getsize(path)} bytes where this stage's layout "
                                      f"needs {size}: the processes built different models")
                memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            self._barrier("mapping the stages' memory")
        finally:
            if self.speaker:
                Path(path).unlink(missing_ok=True)  # mapped, it lives until the stages end
        return path, memory

    def _view(self, entry: _Entry) -> torch.Tensor:
        raw = self._memory[entry.offset:entry.offset + entry.nbytes]
        return raw.view(entry.dtype).view(entry.shape)

    def _stage_tensors(self) -> list[torch.Tensor]:
        """This stage's own tensors, in its entries' order."""
        module = self.pipeline.module
        params = dict(module.named_parameters())
        state = module.state_dict(keep_vars=True)
        named = {} if self._correction is None else {
            n: (c, g) for n, c, g in self._correction.named()}
        out = []
        for entry in self.stages[self.rank]:
            if entry.kind == "param":
                out.append(params[entry.name].detach())
            elif entry.kind == "buffer":
                out.append(state[entry.name].detach())
            else:
                out.append(named[entry.name][0 if entry.kind == "c" else 1])
        return out

    def _bind_mirror(self, model: nn.Module) -> None:
        """The mirror's parameters and persistent buffers become views of the shared memory
        (their values copied in)."""
        with torch.no_grad():
            for entries in self.stages:
                for entry in entries:
                    if entry.kind == "param":
                        p = model.get_parameter(entry.name)
                        view = self._view(entry)
                        view.copy_(p)
                        p.data = view
                    elif entry.kind == "buffer":
                        owner, _, leaf = entry.name.rpartition(".")
                        module = model.get_submodule(owner)
                        view = self._view(entry)
                        view.copy_(module._buffers[leaf])
                        module._buffers[leaf] = view

    def _publish(self) -> None:
        own = self._correction
        if own is not None:  # as the mirror's estimate forgets one: ĝ no longer finite
            own.forget_unfinite()
        with torch.no_grad():
            for entry, tensor in self._own:
                self._view(entry).copy_(tensor)

    def _take(self) -> None:
        with torch.no_grad():
            for entry, tensor in self._own:
                tensor.copy_(self._view(entry))

    # ---- the boundary ----------------------------------------------------------------------

    def start(self, replica: Replica | None, resumed: int | None = None) -> None:
        """The first boundary: every stage takes the mirror's state (the speaker's replica
        holds the state to train from: resumed, downloaded or its own).

        Args:
            replica: the speaker's: the node's replica, made over the mirror (with a drift
                correction exactly when the stages keep one). Elsewhere ignored.
            resumed: the step of the checkpoint this process resumed (every stage's, alike).

        Raises:
            GossipError: a stage resumed another checkpoint, or its correction setting differs.
        """
        if self.speaker:
            if replica is None or (replica.correction is not None) != self.correction:
                self.finish()  # the stages wait in start() for a header: it says stop
                raise GossipError("the node's replica keeps a drift correction where its "
                                  "stages do not (or the reverse): give the pipeline the "
                                  "averaging settings' correction")
            self._replica = replica
            if replica.correction is not None:
                replica.correction.bind({e.name: (self._view(e), self._view(g))
                                         for entries in self.stages
                                         for e, g in zip(entries, entries[1:])
                                         if e.kind == "c" and g.kind == "g"})
            replica.refresh = self._refresh
            per, step, fresh = replica.per_exchange, replica.counters().step, replica.loads
        else:
            per, step, fresh = False, 0, 0
        slots = torch.tensor([_START | _TAKE | (_FRESH if fresh else 0),
                              0 if resumed is None else resumed + 1,
                              int(self.correction), int(per), step], dtype=torch.int64)
        with _collective("a step boundary"):
            dist.broadcast(slots, src=self.pipeline._global(0), group=self.control)
        if int(slots[0]) & _STOP:
            self.stopped = True
            return
        self.global_step = int(slots[4])
        theirs = None if int(slots[1]) == 0 else int(slots[1]) - 1
        if not self.speaker:
            if theirs != resumed:
                raise GossipError(
                    f"stage {self.rank} resumed checkpoint step {resumed}, the speaking "
                    f"process step {theirs}: each must read the same checkpoint directory")
            if bool(int(slots[2])) != self.correction:
                raise GossipError(f"stage {self.rank} keeps no drift correction where the "
                                  f"speaking process does (or the reverse)")
        if self._correction is not None:
            self._correction.per_exchange = bool(int(slots[3]))
        if int(slots[0]) & _FRESH:  # the weights the resumed optimizer states were for went
            self.pipeline.optimizer.state.clear()
        self.started = True
        self._sync(_TAKE, loaded=True)

    def boundary(self) -> int:
        """A step boundary, before each step: the speaker decides what the stages publish
        and take (see the module's docstring); a follower waits for the speaker's next step,
        doing what the boundaries between say. Sets :attr:`stopped` when the speaker has
        finished.

        Returns:
            How many exchanges' deltas the speaker applied (0 on a follower).

        Raises:
            ProcessLost: another stage died.
        """
        if self._replica is None and self.speaker:
            raise GossipError("StageGroup.start() must come before the first boundary")
        if self.stopped:
            return 0
        if not self.speaker:
            while True:
                flags = self._header(0)  # a lost speaker: ProcessLost, and this process ends
                if flags & _STOP:
                    self.stopped = True
                    return 0
                self._sync(flags, loaded=False)
                if flags & _STEP:
                    self._boundaries += 1
                    return 0
        replica = self._replica
        assert replica is not None
        self._boundaries += 1
        with replica.lock:  # held through a round that writes the mirror, and no longer
            loaded = replica.loads != self._loads
            apply = replica.pending > 0 and self._may_sync()
            flags = _STEP | (_TAKE if loaded or apply else 0)
            if not loaded and (apply or self._wanted):
                flags |= _PUBLISH
            if flags != _STEP:
                return self._round(flags, loaded)
        return self._round(flags, loaded)

    def settle(self, optimizer: bool = False) -> int:
        """The speaker, between steps: the mirror made whole and current (every committed
        delta applied, every stage taking it), and with ``optimizer`` every stage's optimizer
        state gathered into the whole model's optimizer (a checkpoint). Returns how many
        exchanges' deltas it applied."""
        replica = self._replica
        if not self.speaker or replica is None or self.stopped:
            return 0
        with replica.lock:
            loaded = replica.loads != self._loads
            flags = (0 if loaded else _PUBLISH) | (_TAKE if loaded or replica.pending else 0)
            applied = self._round(flags | (_OPTIMIZER if optimizer else 0), loaded)
        if optimizer:  # files, not the mirror: without the lock the network side takes
            try:
                self._gather_optimizers()
            except ProcessLost:
                self.lost()
                raise
        return applied

    def idle(self) -> int:
        """The speaker's trainer took no step (a node at its step limit): what an exchange
        waits for or committed is settled all the same."""
        replica = self._replica
        if replica is None or not (self._wanted or replica.pending
                                   or replica.loads != self._loads):
            return 0
        return self.settle()

    def finish(self) -> None:
        """The speaker's last boundary: the stages' next one says stop. Idempotent."""
        if self.speaker and not self.stopped:
            self.stopped = True
            if not self.started:  # the stages wait in start(), for its header
                slots = torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.int64)
                with _collective("a step boundary"):
                    dist.broadcast(slots, src=self.pipeline._global(0), group=self.control)
            else:
                self._header(_STOP)
        self._wake()

    def lost(self) -> None:
        """Another stage is gone (a step's send or receive failed): stop, and let no exchange
        wait for a boundary that will not come."""
        self.stopped = True
        self._wake()

    def share(self, value: int) -> int:
        """The speaker's ``value``, in every process (a collective)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        with _collective("sharing a value"):
            dist.broadcast(tensor, src=self.pipeline._global(0), group=self.control)
        return int(tensor[0])

    def close(self) -> None:
        """Stop the stage's correction and let go of the replica's hook. Idempotent."""
        if self._correction is not None and getattr(self, "_hook", None) is not None:
            self._hook.remove()
            self._hook = None
        if self._replica is not None:
            self._replica.refresh = None
        self._wake()

    def statistics(self) -> NodeGroupStatistics:
        return NodeGroupStatistics(self.rank, self.size, self._boundaries, self._syncs,
                                   self._bytes, self._sync_seconds, self._header_seconds, 0,
                                   0.0, 0)

    # ---- the speaker's rounds ----------------------------------------------------------------

    def _round(self, flags: int, loaded: bool) -> int:
        """The speaker's side of one boundary (under the replica's lock). A failed
        collective stops the group: no exchange waits for it, and no last header is sent."""
        try:
            self._header(flags)
            return self._sync(flags, loaded)
        except ProcessLost:
            self.lost()
            raise

    def _may_sync(self) -> bool:
        return time.perf_counter() - self._synced_at >= SYNC_SPACING * self._sync_took

    def _header(self, flags: int) -> int:
        started = time.perf_counter()
        replica = self._replica
        step = replica.counters().step if self.speaker and replica is not None else 0
        slots = torch.tensor([flags, step], dtype=torch.int64)
        with _collective("a step boundary"):
            dist.broadcast(slots, src=self.pipeline._global(0), group=self.control)
        self._header_seconds += time.perf_counter() - started
        self.global_step = int(slots[1])
        return int(slots[0])

    def _sync(self, flags: int, loaded: bool) -> int:
        """What a header's flags say, in every stage: publish, apply (the speaker), take,
        gather the optimizers."""
        if not flags & (_PUBLISH | _TAKE | _OPTIMIZER):
            return 0
        started = time.perf_counter()
        applied = 0
        own = sum(e.nbytes for e, _ in self._own)
        if flags & _PUBLISH:
            self._publish()
            self._bytes += own
            self._gather_scales()
        if flags & _TAKE:
            replica = self._replica
            if self.speaker and replica is not None and not loaded:
                applied = replica.apply_pending()
            self._share_timing()
            self._take()
            self._bytes += own
            if self.speaker and replica is not None:
                self._loads = replica.loads
        self._syncs += 1
        self._synced_at = time.perf_counter()
        self._sync_took = self._synced_at - started  # what spaces the takes: not a checkpoint's
        self._sync_seconds += self._sync_took
        if self.speaker and flags & (_PUBLISH | _TAKE):
            self._wake(published=True)
        elif flags & _OPTIMIZER:  # the speaker's, once it has let go of the lock (settle)
            self._gather_optimizers()
        return applied

    def _gather_scales(self) -> None:
        """The barrier after a publish, carrying the stages' gradient scales: the mirror's
        correction takes their norm, and stage 0's steps."""
        own = self._correction
        slots = torch.tensor([0.0 if own is None else own.counts[0] ** 2], dtype=torch.float64)
        with _collective("a publish"):
            dist.all_reduce(slots, group=self.control)
        replica = self._replica
        if self.speaker and own is not None and replica is not None \
                and replica.correction is not None:
            mirror = replica.correction
            mirror.counts = (math.sqrt(float(slots[0])), own.counts[1])
            mirror.timing = (own.timing[0], mirror.timing[1])

    def _share_timing(self) -> None:
        """The barrier before a take, carrying the mirror's correction timing and whether it
        has measured (0 after a download's reset)."""
        slots = torch.zeros(3, dtype=torch.float64)
        replica = self._replica
        if self.speaker and replica is not None and replica.correction is not None:
            since, spacing = replica.correction.timing
            slots[0], slots[1], slots[2] = since, spacing, replica.correction.counts[1]
        with _collective("a take"):
            dist.broadcast(slots, src=self.pipeline._global(0), group=self.control)
        own = self._correction
        if own is not None:
            own.timing = (int(slots[0]), float(slots[1]))
            if int(slots[2]) == 0:
                own.counts = (0.0, 0)

    def _gather_optimizers(self) -> None:
        """Every stage's optimizer state into the speaker's whole optimizer (through files
        beside the shared memory, read back as weights only)."""
        pipeline = self.pipeline
        paths = [Path(f"{self._path}-optimizer-{stage}") for stage in range(self.size)]
        try:
            if not self.speaker:
                torch.save(pipeline.optimizer.state_dict(), paths[self.rank])
            self._barrier("gathering the optimizers")
            if self.speaker:
                whole = pipeline.full_optimizer
                assert whole is not None and pipeline.mirror is not None
                for stage in range(self.size):
                    state = (pipeline.optimizer.state_dict() if stage == 0 else
                             torch.load(paths[stage], weights_only=True, map_location="cpu"))
                    _merge_optimizer(whole, pipeline.mirror, pipeline.bounds[stage], state)
            self._barrier("gathering the optimizers")
        finally:
            if self.speaker:  # read, or left by a stage that failed: removed either way
                for path in paths[1:]:
                    path.unlink(missing_ok=True)

    def _barrier(self, what: str) -> None:
        slots = torch.zeros(1, dtype=torch.int64)
        with _collective(what):
            dist.all_reduce(slots, group=self.control)

    # ---- the network side ------------------------------------------------------------------

    def _refresh(self) -> None:
        """The replica's hook before a snapshot: ask the stages to publish at their next
        boundary and wait for it (at most :data:`REFRESH_WAIT`: a trainer between steps, an
        evaluation say, leaves the mirror as the last boundary made it). Copies are spaced as
        takes are: within :data:`~gossip.nodegroup.SYNC_SPACING` times the last one's length
        of it, the mirror is read as that one left it (a few steps old), so that exchanges
        every step cost the stages at most about a tenth of their time."""
        if not self.started or self.stopped or not self._may_sync():
            return
        with self._cond:
            seen = self._published
            self._wanted = True
            self._cond.wait_for(lambda: self._published != seen or self.stopped,
                                timeout=REFRESH_WAIT)

    def _wake(self, published: bool = False) -> None:
        with self._cond:
            if published:
                self._published += 1
                self._wanted = False
            self._cond.notify_all()


def _FOLDERS() -> list[str]:
    """Where the stages' memory may live: shared memory, else the temporary directory."""
    return ["/dev/shm", tempfile.gettempdir()]


def _folder(size: int) -> str:
    """The first of :func:`_FOLDERS` this process can write with room for ``size`` bytes and
    a checkpoint's optimizer states beside them (about twice as much again, for Adam).

    Raises:
        GossipError: none has room (a container's /dev/shm is 64 MiB by default).
    """
    need = 3 * size
    for folder in _FOLDERS():
        try:
            if os.access(folder, os.W_OK):
                stat = os.statvfs(folder)
                if stat.f_bavail * stat.f_frsize >= need:
                    return folder
        except OSError:
            continue
    raise GossipError(f"no room for the stages' shared copy of the model ({need / 2**20:.0f} "
                      f"MiB with the optimizers' states) in {' or '.join(_FOLDERS())}: give "
                      f"the container more shared memory (docker --shm-size)")


def _merge_optimizer(whole: torch.optim.Optimizer, mirror: nn.Module,
                     bounds: tuple[int, int], state: dict[str, Any]) -> None:
    """Put one stage's optimizer ``state`` (its ``state_dict()``) into ``whole``, the
    optimizer of the whole model, under the mirror's parameters."""
    from .pipeline import split_order
    start, stop = bounds
    order, origin = split_order(whole, mirror[start:stop])  # type: ignore[index]
    if len(origin) != len(state["param_groups"]):
        raise GossipError("a stage's optimizer state does not fit the whole model's optimizer")
    flat = [p for g in whole.param_groups for p in g["params"]]
    for local, values in state["state"].items():
        whole.state[flat[order[int(local)]]] = {
            k: (v.to("cpu") if isinstance(v, torch.Tensor) else v) for k, v in values.items()}
    for group, came_from in zip(state["param_groups"], origin):
        target = whole.param_groups[came_from]
        for key, value in group.items():
            if key != "params":
                target[key] = value
