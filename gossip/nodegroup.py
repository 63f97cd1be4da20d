"""A node of several processes: synchronous inside a machine, gossip between machines.

Theory of operation
-------------------
A machine with several GPUs trains one model replica with N processes (one per GPU, say),
which form a ``torch.distributed`` group and average their gradients at every step, as
``DistributedDataParallel`` does. To the swarm they are one node with one identity: rank 0,
the *speaker*, runs the swarm node (membership, exchanges, downloads; in the daemon also
checkpoints, status and metrics); the other ranks, the *followers*, only train.

The group's processes hold bit-identical parameters at every step boundary. Identical
gradients on identical parameters keep them so through an optimizer step (and keep the
optimizers' states identical, which are never sent), so what needs care is every change made
*outside* a step. Each one happens on the speaker and reaches the followers at a step
boundary (:meth:`NodeGroup.boundary`), all of them at the same one:

* gradients: averaged over the group at the end of each backward pass, before the training
  code can clip, unscale or step them (:class:`_GradientSync`) — or by a
  ``DistributedDataParallel`` wrapper the caller made, which then does it instead;
* an exchange's delta and a download: the speaker applies what is queued at the boundary, and
  when its state changed since the last broadcast (:attr:`~gossip.replica.Replica.revision`)
  the boundary broadcasts the whole of it — parameters, buffers, the drift correction —
  to the followers: at most one broadcast of the model per committed exchange, none on other
  steps. A broadcast stops every process, so the speaker spaces them to take at most about a
  tenth of the node's time (:data:`SYNC_SPACING`); exchanges that commit faster are merged in
  the queue meanwhile, as they are for a single process between two of its steps;
* the step the swarm schedules by: the speaker's, taken at the boundary, is what every process
  (the speaker too) reads in :attr:`NodeGroup.global_step` until the next one, so learning-rate
  schedules agree to the step whatever the exchanges do meanwhile.

A follower keeps a replica of its own (:class:`~gossip.replica.Replica`) only for the drift
correction: its optimizer hook adds ``c`` to the gradients as the speaker's does, and the
boundary's broadcast carries ``c`` and the timing its strength depends on.

Costs: each boundary broadcasts a header of a few integers over a gloo group (on the CPU, also
when the main backend is NCCL, so that no process waits for its GPU at every step), and the
state's broadcast, when there is one, over the main group. The gradient average is one
all-reduce per backward pass, not overlapped with the backward as DDP's buckets are (wrap the
model in DDP for that). :meth:`NodeGroup.statistics` counts both.

Stopping and failures: the speaker's :meth:`NodeGroup.finish` sends a last header that says
stop, and a follower's :meth:`~NodeGroup.boundary` then reports :attr:`~NodeGroup.stopped`.
A process that dies breaks the group's collectives: gloo notices the closed connection and the
others' next collective raises, so each process stops instead of waiting. Every process must
call :meth:`~NodeGroup.boundary` once per step, the same number of times: the collectives pair
up in order.

Time: the statistics time the collectives with ``time.perf_counter`` — blocking calls in a
training thread, never on trio's clock (which :mod:`gossip`'s network code keeps to).

Threads: a group is used from one thread at a time (any thread: the daemon's trainer runs in
trio's worker threads); the speaker's replica is shared with the network side under its lock.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .errors import GossipError, ProcessLost, ReplicasDiverged

if TYPE_CHECKING:
    from .replica import Replica

__all__ = ["NodeGroup", "NodeGroupStatistics", "ProcessLost", "ReplicasDiverged", "unwrap"]

log = logging.getLogger(__name__)

BUCKET = 1 << 24  # elements per collective (64 MiB of float32): bounds the extra memory
SYNC_SPACING = 9.0  # a broadcast waits 9x as long as the last one took: <= 10% of the time

# A header's flags: what follows it.
_STATE, _CHECK, _STOP = 1, 2, 4  # the speaker's state; a bit-identity check; nothing, ever
_FRESH = 8  # at the start: the speaker took a downloaded state; optimizers start afresh
_HELD = 16  # the drift correction is held (gossip.correction): no step adds it


@dataclass(frozen=True)
class _Header:
    """What the speaker broadcasts at every step boundary, as seven int64 slots: ``flags``,
    ``step``, ``since``, ``spacing`` (its float64 bits), ``parts``, ``resumed`` (+1; 0:
    none), and the ``elements`` of the state a broadcast carries (each process checks its
    own has as many). A follower sends zeros (:data:`EMPTY`) and reads the speaker's."""

    flags: int = 0
    step: int = 0
    since: int = 0
    spacing: float = 0.0
    parts: int = 0
    resumed: int | None = None
    elements: int = 0

    def encode(self) -> torch.Tensor:
        spacing = torch.tensor([self.spacing], dtype=torch.float64).view(torch.int64)[0]
        return torch.tensor([self.flags, self.step, self.since, int(spacing), self.parts,
                             0 if self.resumed is None else self.resumed + 1, self.elements],
                            dtype=torch.int64)

    @classmethod
    def decode(cls, slots: torch.Tensor) -> _Header:
        flags, step, since, spacing, parts, resumed, elements = (int(x) for x in slots)
        return cls(flags, step, since, float(slots[3:4].clone().view(torch.float64)[0]), parts,
                   None if resumed == 0 else resumed - 1, elements)


@dataclass(frozen=True)
class NodeGroupStatistics:
    """What the group's collectives cost, since it opened (seconds of wall time)."""

    rank: int
    size: int
    boundaries: int  # step boundaries passed
    syncs: int  # state broadcasts: the first, then one per boundary that applied exchanges
    sync_bytes: int  # bytes each broadcast carried, summed
    sync_seconds: float  # time in the state broadcasts
    header_seconds: float  # time in the boundaries' headers (the per-step cost)
    reductions: int  # gradient averages (one per backward pass)
    reduce_seconds: float
    checks: int  # bit-identity checks passed


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside a ``DistributedDataParallel`` wrapper (or the model itself)."""
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


class NodeGroup:
    """The processes of one node, as a ``torch.distributed`` group (the default one unless
    ``group`` is given); every process of the group makes one, in the same order.

    Args:
        model: the live module, or its ``DistributedDataParallel`` wrapper: then the wrapper
            averages the gradients, and the group does not.
        optimizer: the model's optimizer. The group averages gradients before this
            optimizer sees them (see the module's docstring); None only with a DDP wrapper.
        group: the process group (None: the default group, ``dist.init_process_group``'s).
        check_every: every this many boundaries, check that the processes hold
            bit-identical parameters (a broadcast of the model); 0: never.
        timeout: how long a follower waits at a boundary for the speaker (which may be
            downloading a state, or evaluating) when the group's backend is not gloo and the
            headers need a gloo group of their own; None: torch's default (30 minutes). On
            gloo the group's own timeout applies.

    Raises:
        GossipError: ``torch.distributed`` is not initialized, or the model has sparse
            gradients or a parameter on no device the backend can reach.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, *,
                 group: Any = None, check_every: int = 0,
                 timeout: datetime.timedelta | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise GossipError("a node of several processes needs torch.distributed "
                              "initialized (dist.init_process_group) before its group is made")
        if type(check_every) is not int or check_every < 0:
            raise ValueError(f"check_every must be a non-negative integer, not {check_every!r}")
        self.module = unwrap(model)
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        # Headers go over gloo on the CPU whatever the main backend: reading an NCCL header
        # would wait for the GPU at every step.
        self.control = group if self.backend == "gloo" else dist.new_group(
            ranks=None if group is None else dist.get_process_group_ranks(group),
            backend="gloo", timeout=timeout)
        self.check_every = check_every
        self.global_step = 0
        self.started = False  # start() has passed: global_step is the speaker's
        self.stopped = False
        self._replica: Replica | None = None
        self._sent = -1  # the replica's revision last broadcast (-1: never)
        self._boundaries = self._syncs = self._sync_bytes = self._checks = 0
        self._sync_seconds = self._header_seconds = 0.0
        self._synced_at = self._sync_took = 0.0  # the end of the last broadcast, its length
        self._sync = None
        self._optimizer = optimizer
        if unwrap(model) is model:
            if optimizer is None:
                raise GossipError("a node of several processes averages a plain model's "
                                  "gradients before its optimizer's step: give the optimizer "
                                  "(or wrap the model in DistributedDataParallel)")
            self._sync = _GradientSync(self.module, optimizer, self._all_reduce, self.size)

    @property
    def speaker(self) -> bool:
        """Whether this process speaks for the node (rank 0)."""
        return self.rank == 0

    @property
    def replicas(self) -> int:
        """Copies of the model the node trains at once: its samples a step are this many
        batches."""
        return self.size

    # ---- the step boundary ---------------------------------------------------------------

    def start(self, replica: Replica, resumed: int | None = None) -> None:
        """The first boundary: every follower takes the speaker's whole state. Call it once
        the speaker's replica holds the state to train from (resumed, downloaded or its own),
        before the first step. If the speaker downloaded it, every process clears its
        optimizer's state, as the speaker did (a resumed checkpoint's was for the weights the
        download replaced: :mod:`gossip.node`, "Resuming"); with a DDP wrapper and no
        optimizer given, that is the caller's to do.

        Args:
            replica: the speaker's: the node's replica; a follower's: its own, made with the
                optimizer exactly when the speaker's keeps a drift correction.
            resumed: the step of the checkpoint this process resumed, if any: the speaker's
                and each follower's must agree (each read the same file; the optimizer's state
                is never broadcast).

        Raises:
            GossipError: this process resumed another checkpoint, or keeps a correction when
                the speaker does not (or the reverse).
        """
        self._replica = replica
        header = self._header(_STATE | (_FRESH if replica.loads else 0), resumed)
        if header.flags & _STOP:  # the speaker finished before it started (a signal)
            self.stopped = True
            return
        self.started = True
        if header.flags & _FRESH and self._optimizer is not None:
            self._optimizer.state.clear()
        if not self.speaker:
            if header.resumed != resumed:
                raise GossipError(
                    f"process {self.rank} resumed checkpoint step {resumed}, the speaking "
                    f"process step {header.resumed}: each must read the same checkpoint "
                    f"directory")
            if header.parts != replica.parts:
                raise GossipError(f"process {self.rank} keeps no drift correction where the "
                                  f"speaking process does (or the reverse): give every "
                                  f"process the same optimizer and averaging settings")
        self._broadcast_state(header)

    def boundary(self) -> int:
        """A step boundary (before each step): the speaker applies the deltas its exchanges
        queued; every process then takes the speaker's state if it changed, and its step.
        Sets :attr:`stopped` on a follower when the speaker has finished.

        Returns:
            How many exchanges' deltas the speaker applied (0 on a follower).

        Raises:
            ReplicasDiverged: a check found the processes' parameters differ.
            ProcessLost: a collective failed (another process of the node died; or, the
                processes having called it different numbers of times, timed out).
        """
        replica = self._replica
        if replica is None:
            raise GossipError("NodeGroup.start() must come before the first boundary")
        if self.stopped:
            return 0
        applied = replica.apply_pending() if self.speaker and self._may_sync() else 0
        flags = 0
        if self.speaker:
            due = self.check_every and (self._boundaries + 1) % self.check_every == 0
            flags = (_STATE if replica.revision != self._sent else 0) | (_CHECK if due else 0)
        header = self._header(flags, None)
        flags = header.flags
        if flags & _STOP:
            self.stopped = True
            return 0
        self._boundaries += 1
        if flags & _STATE:
            self._broadcast_state(header)
        if flags & _CHECK:
            self._check()
        return applied

    def finish(self) -> None:
        """The speaker's last boundary: the followers' next :meth:`boundary` (or their
        :meth:`start`, if the speaker never started) says stop. On a follower, nothing (it
        waits for the speaker's). Idempotent."""
        if self.speaker and not self.stopped:
            self.stopped = True
            self._header(_STOP, None)

    def share(self, value: int) -> int:
        """The speaker's ``value``, in every process (one more collective: every process
        calls it at the same point).

        Raises:
            ProcessLost: another process of the node died.
        """
        tensor = torch.tensor([value], dtype=torch.int64)
        with _collective("sharing a value"):
            dist.broadcast(tensor, src=self._src(), group=self.control)
        return int(tensor[0])

    def close(self) -> None:
        """Stop averaging gradients (the training is over) and destroy the gloo group the
        headers used, if this group made one. Idempotent; the group given stays the caller's."""
        if self._sync is not None:
            self._sync.close()  # idempotent; its counts stay for statistics()
        if self.control is not self.group:
            dist.destroy_process_group(self.control)
            self.control = self.group

    def __enter__(self) -> NodeGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> NodeGroupStatistics:
        sync = self._sync
        return NodeGroupStatistics(
            self.rank, self.size, self._boundaries, self._syncs, self._sync_bytes,
            self._sync_seconds, self._header_seconds, 0 if sync is None else sync.count,
            0.0 if sync is None else sync.seconds, self._checks)

    # ---- the collectives -----------------------------------------------------------------

    def _may_sync(self) -> bool:
        """Whether the speaker may apply what is queued now, and so broadcast its state: once
        the time since the last broadcast is at least :data:`SYNC_SPACING` times what that
        one took. Deltas that wait are merged in the queue (nothing is lost, and exchanges
        snapshot them); a broadcast, which stops every process, takes at most about a tenth
        of the node's time however large the model and however often exchanges commit."""
        return time.perf_counter() - self._synced_at >= SYNC_SPACING * self._sync_took

    def _header(self, flags: int, resumed: int | None) -> _Header:
        """The speaker's header (see :class:`_Header`), broadcast; a follower's ``flags``
        are ignored."""
        started = time.perf_counter()
        header = _Header()
        replica = self._replica
        if self.speaker and replica is not None:
            correction = replica.correction
            if correction is not None:  # latched here, so every process steps alike
                correction.held = correction.hold
                flags |= _HELD if correction.held else 0
            since, spacing = replica.correction_timing()
            elements = sum(t.numel() for t in self._state_tensors()) if flags & _STATE else 0
            header = _Header(flags, replica.counters().step, since, spacing, replica.parts,
                             resumed, elements)
        elif self.speaker:
            header = _Header(flags)
        slots = header.encode()
        with _collective("a step boundary"):
            dist.broadcast(slots, src=self._src(), group=self.control)
        self._header_seconds += time.perf_counter() - started
        header = _Header.decode(slots)
        self.global_step = header.step
        if not self.speaker and replica is not None and replica.correction is not None:
            replica.correction.held = bool(header.flags & _HELD)
        return header

    def _broadcast_state(self, header: _Header) -> None:
        """The speaker's parameters, persistent buffers and correction, into every
        follower's. No lock: once the node is ready the speaker's trainer (this thread) is the
        only writer of its model and correction, and the network side only reads them."""
        replica = self._replica
        assert replica is not None
        started = time.perf_counter()
        tensors = self._state_tensors()
        elements = sum(t.numel() for t in tensors)
        if elements != header.elements:  # before any bulk collective, in every process
            raise GossipError(
                f"process {self.rank}'s model state has {elements} elements where the "
                f"speaking process's has {header.elements}: a buffer whose size depends on the "
                f"input (a cache?) must not be persistent, or the processes build different "
                f"models")
        self._syncs += 1
        self._sync_bytes += sum(t.numel() * t.element_size() for t in tensors)
        self._broadcast(tensors)
        if not self.speaker:
            replica.set_correction_timing(header.since, header.spacing)
        self._sent = replica.revision
        self._synced_at = time.perf_counter()
        self._sync_took = self._synced_at - started
        self._sync_seconds += self._sync_took

    def _check(self) -> None:
        """Every follower compares its parameters with the speaker's, exactly."""
        params = [p.detach() for p in self.module.parameters()]
        theirs = [p.clone() for p in params]
        self._broadcast(theirs)
        same = all(torch.equal(a, b) for a, b in zip(params, theirs))
        verdict = torch.tensor([1 if same else 0], dtype=torch.int64)
        with _collective("a check"):
            dist.all_reduce(verdict, op=dist.ReduceOp.MIN, group=self.control)
        if not int(verdict[0]):
            raise ReplicasDiverged(
                f"the processes of this node hold different parameters at step "
                f"{self.global_step}" + ("" if same else f" (process {self.rank} differs)"))
        self._checks += 1

    def _state_tensors(self) -> list[torch.Tensor]:
        """Everything a follower takes: parameters, persistent buffers (those in the state
        dict: not a cache a module resizes as it goes), the correction ``c``."""
        module, replica = self.module, self._replica
        assert replica is not None
        seen: set[int] = set()
        out = []
        state = module.state_dict(keep_vars=True).values()
        for t in itertools.chain(module.parameters(), state, replica.correction_tensors()):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t.detach())
        return out

    def _src(self) -> int:
        return 0 if self.group is None else dist.get_global_rank(self.group, 0)

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from the speaker into the followers' (in place), a bucket
        of one dtype and device at a time."""
        with torch.no_grad():
            for bucket in _buckets(tensors):
                flat = self._to_backend(_flatten_dense_tensors(bucket))
                with _collective("a state broadcast"):
                    dist.broadcast(flat, src=self._src(), group=self.group)
                if not self.speaker:
                    flat = flat.to(bucket[0].device)
                    for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                        t.copy_(value)

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        """The sum over the group of ``flat`` (on its device)."""
        moved = self._to_backend(flat)
        with _collective("a gradient average"):
            dist.all_reduce(moved, group=self.group)
        return moved.to(flat.device)

    def _to_backend(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` where the backend can take it: gloo reads the CPU, NCCL the GPU."""
        if self.backend == "gloo" and flat.is_cuda:
            return flat.cpu()
        if self.backend == "nccl" and not flat.is_cuda:
            raise GossipError("the NCCL backend needs the model on a CUDA device")
        return flat


@contextmanager
def _collective(what: str) -> Iterator[None]:
    """A collective's failure as :class:`ProcessLost` (torch raises a bare RuntimeError when
    gloo finds a closed connection)."""
    try:
        yield
    except RuntimeError as exc:
        if isinstance(exc, ProcessLost):
            raise
        raise ProcessLost(f"{what} failed: another process of this node is gone "
                          f"({_reason(exc)})") from exc


def _reason(exc: RuntimeError) -> str:
    """The gist of a collective's error: gloo's ``[file.cc:537] Read error [addr]: Connection
    reset by peer. This is typically caused by...`` as ``Read error [addr]: Connection reset
    by peer``."""
    text = str(exc).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0].rstrip(".")


def _buckets(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype and device, each group cut at :data:`BUCKET` elements."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for t in tensors:
        runs = groups.setdefault((t.dtype, t.device), [[]])
        if runs[-1] and sum(x.numel() for x in runs[-1]) + t.numel() > BUCKET:
            runs.append([])
        runs[-1].append(t)
    return [run for runs in groups.values() for run in runs if run]


class _GradientSync:
    """Averages a module's gradients over the group at the end of each backward pass.

    Every parameter gets a hook that runs once its gradient has been accumulated; the first
    of them in a backward pass queues a callback for the end of that pass (as DDP finalizes
    its reduction), and the callback averages every parameter's gradient, in place. So the
    training code sees the group's gradient before it clips, unscales or steps, whichever
    parameters its loss reaches in each process. An optimizer step pre-hook averages them
    there instead if no backward pass did (gradients written by hand).

    A parameter with no gradient in one process and one in another (a branch not taken) takes
    zeros where it had none; one with none anywhere keeps none.
    """

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 all_reduce: Any, size: int) -> None:
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._all_reduce = all_reduce
        self._size = size
        self._queued = False
        self._fresh = False  # averaged since the last optimizer step
        self._warned = False
        self.count = 0
        self.seconds = 0.0
        self._handles = [p.register_post_accumulate_grad_hook(self._after_accumulate)
                         for p in self._params]
        self._handles.append(optimizer.register_step_pre_hook(self._before_step))

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _after_accumulate(self, param: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._queued = False
        self.reduce()

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._fresh:
            if not self._warned:
                self._warned = True
                log.warning("gradients averaged at the optimizer's step, not at the end of a "
                            "backward pass: they were not computed by backward(). Clipping "
                            "or a mixed-precision scaler before the step then sees each "
                            "process's own gradient, and a scaler that skips a step in one "
                            "process only stops the node")
            self.reduce()
        self._fresh = False

    def reduce(self) -> None:
        """Average every parameter's gradient over the group, in place."""
        started = time.perf_counter()
        params = self._params
        had = [p.grad is not None for p in params]
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise GossipError("a node of several processes cannot average sparse "
                                  "gradients (an nn.Embedding with sparse=True, say): use "
                                  "dense ones")
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flags = torch.tensor(had, dtype=torch.float32, device=params[0].device)
        with torch.no_grad():
            for bucket in _buckets([*grads, flags]):
                flat = self._all_reduce(_flatten_dense_tensors(bucket))
                for t, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    t.copy_(value)
            for p, g, holders in zip(params, grads, flags.tolist()):
                if holders == 0:
                    p.grad = None
                    continue
                g.div_(self._size)
                if p.grad is None:
                    p.grad = g
        self._fresh = True
        self.count += 1
        self.seconds += time.perf_counter() - started
