"""Pipeline stages inside a node: a model too big for one GPU, cut into K stages.

Theory of operation
-------------------
A model that is an ``nn.Sequential`` can be cut into K consecutive runs of its modules, the
*stages*; a node of K processes holds one each (stage k on GPU k, or on the CPU). A step
splits its batch into micro-batches that flow forward through the stages and back, so the
stages work at once: stage k runs micro-batch i forward while stage k + 1 runs micro-batch
i − 1. Each stage then steps its own optimizer on its own parameters: the node's step is the
step one process would take on the whole batch, the micro-batches' gradients summed with
each one's share of the batch (:func:`sequential_step` is that step in one process).

The schedule is one-forward-one-backward (1F1B): stage k runs K − k − 1 forwards first,
then alternates a forward and a backward, then finishes the backwards. It keeps at most
K − k micro-batches' activations in stage k where GPipe's order (every forward, then every
backward) keeps all of them, at the same idle time (the *bubble*, (K − 1) / (M + K − 1) of
a step with M micro-batches); ``schedule="gpipe"`` measured no faster (bench/pipeline.py).
Activations go forward and their gradients back with point-to-point sends over the node's
group (gloo on the CPU, NCCL between GPUs). A small header over a gloo group (on the CPU, so
that no stage waits on its GPU to read one) goes with each step's first activation and with
the first of a shape not seen before: its dtype and shape, the step's micro-batch count and a
checksum of its batch's shape, which every stage draws alike, so a neighbour knows the shapes
of the others without a word, and stages that drew different batches stop with an error
rather than a hang. Headers on every activation had cost a tenth of the throughput of two
CPU stages. Sends do not block (``isend``), so two neighbours that send to
each other at once cannot wait on each other; under NCCL, which runs a pair's sends in one
stream in order, the gradients travel on a communicator of their own for the same reason.

Why a schedule of our own rather than ``torch.distributed.pipelining``: measured on the same
cut (bench/pipeline.py, two CPU stages), torch's 1F1B ran at 1.10 and 1.33 times one
single-threaded process in two runs where ours ran at 1.11 and 1.15 (with a header on every
activation, ours had trailed by up to a fifth), and both match one process's losses; but it
exists
only from torch 2.4 (we support 2.1), its interface has changed between releases, and ours
weighs each micro-batch's loss by its share of the batch (so a step is exactly one process's
whatever the sizes), reports a dead stage as :class:`~gossip.errors.ProcessLost` like every
other collective of a node, and checks that the stages drew the same batches. It is a
hundred lines.

The swarm sees one ordinary model: the speaker (stage 0, rank 0) keeps the whole model on the
host (its *mirror*) in memory that every stage maps, and :class:`~gossip.stages.StageGroup`
has each stage write its slice there at the step boundaries where an exchange, a checkpoint
or a committed delta needs it. See :mod:`gossip.stages`.

What a model must be: an ``nn.Sequential`` whose stages each take one tensor and return one
tensor (the first stage takes the batch's input, the last stage's output goes to the loss
with the batch's target), with no parameter shared between two stages (a language model's
tied embedding and output layer must live in one stage, or be untied).
"""

from __future__ import annotations

import copy
import datetime
import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .errors import GossipError, ProcessLost
from .nodegroup import _collective

__all__ = ["Pipeline", "Stages", "sequential_step", "split_optimizer", "split_order",
           "stage_bounds"]

SCHEDULES = ("1f1b", "gpipe")
HEADER = 10  # int64 slots of an activation's header: dtype, ndim, the step's key, 6 sizes
SHAPES = 4096  # activation shapes a stage remembers (by batch shape and micro-batch)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Stages:
    """A task's declaration that its model (an ``nn.Sequential``) may be cut into stages.

    Attributes:
        loss: ``loss(output, target)``: the mean loss of a micro-batch (a 0-dim tensor),
            from the last stage's output and the batch's target.
        split: the indices of the model's modules where stages 1, 2, ... begin (K − 1 of
            them, increasing); None: cut where each stage holds about as many parameters.
        micro_batches: how many parts a batch is split into (fewer when a batch is smaller).
        schedule: ``"1f1b"`` (default) or ``"gpipe"``: see the module's docstring.
        clip_norm: clip the whole model's gradient to this norm before each step (the
            stages' norms summed over the node); None: no clipping.
        before_step: ``before_step(optimizer)`` is called in every stage before its
            optimizer steps (a learning-rate schedule: set each group's ``lr`` from the
            task's ``global_step()``); it sees that stage's optimizer only.
    """

    loss: Callable[[torch.Tensor, Any], torch.Tensor]
    split: tuple[int, ...] | None = None
    micro_batches: int = 4
    schedule: str = "1f1b"
    clip_norm: float | None = None
    before_step: Callable[[torch.optim.Optimizer], None] | None = None

    def __post_init__(self) -> None:
        if not callable(self.loss):
            raise ValueError("Stages.loss must be a callable loss(output, target)")
        if type(self.micro_batches) is not int or not 1 <= self.micro_batches <= 4096:
            raise ValueError(f"Stages.micro_batches must be an integer in 1..4096, not "
                             f"{self.micro_batches!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Stages.schedule must be one of {SCHEDULES}, not "
                             f"{self.schedule!r}")
        if self.clip_norm is not None and not (isinstance(self.clip_norm, (int, float))
                                               and 0 < self.clip_norm < math.inf):
            raise ValueError(f"Stages.clip_norm must be a positive number or None, not "
                             f"{self.clip_norm!r}")
        if self.split is not None:
            object.__setattr__(self, "split", tuple(self.split))
            if not all(type(i) is int for i in self.split):
                raise ValueError(f"Stages.split must be module indices, not {self.split!r}")
        if self.before_step is not None and not callable(self.before_step):
            raise ValueError("Stages.before_step must be a callable or None")


def stage_bounds(model: nn.Module, count: int,
                 split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The ``[start, stop)`` module indices of each of ``count`` stages of ``model``.

    Raises:
        GossipError: the model is not an ``nn.Sequential``, has fewer modules than stages,
            or ``split`` does not name ``count − 1`` increasing indices inside it.
    """
    if not isinstance(model, nn.Sequential):
        raise GossipError(f"a model cut into stages must be an nn.Sequential (its modules "
                          f"in order), not {type(model).__name__}")
    n = len(model)
    if count < 1 or n < count:
        raise GossipError(f"{count} stages need at least {count} modules; the model has {n}")
    if split is not None:
        points = list(split)
        edges = [0, *points, n]
        if len(points) != count - 1 or any(a >= b for a, b in zip(edges, edges[1:])):
            raise GossipError(f"Stages.split {tuple(points)} must be {count - 1} increasing "
                              f"module indices in 1..{n - 1} for {count} stages")
    else:
        points = _balanced(model, count)
    edges = [0, *points, n]
    return list(zip(edges[:-1], edges[1:]))


def _balanced(model: nn.Sequential, count: int) -> list[int]:
    """Cut points that give each stage about 1/count of the parameters (and one module at
    least)."""
    sizes = [sum(p.numel() for p in m.parameters()) for m in model]
    total = max(1, sum(sizes))
    points: list[int] = []
    running = 0
    for index, size in enumerate(sizes[:-1]):
        running += size
        k = len(points) + 1
        if k >= count:
            break
        left = len(sizes) - index - 1  # modules after this one
        if running >= total * k / count or left == count - k:
            points.append(index + 1)
    return points


def split_order(optimizer: torch.optim.Optimizer,
                part: nn.Module) -> tuple[list[int], list[int]]:
    """Where the parameters of ``part`` sit in ``optimizer``: each one's index among all of
    its parameters (in the optimizer's order), and the index of each group holding one."""
    keep = {id(p) for p in part.parameters()}
    order, origin, index = [], [], 0
    for gi, group in enumerate(optimizer.param_groups):
        held = False
        for p in group["params"]:
            if id(p) in keep:
                order.append(index)
                held = True
            index += 1
        if held:
            origin.append(gi)
    return order, origin


def split_optimizer(optimizer: torch.optim.Optimizer,
                    keep: dict[int, torch.nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer of the same class for a stage: ``optimizer``'s groups (their settings)
    with only the parameters in ``keep`` (``id`` of the original → the stage's copy), in
    :func:`split_order`'s order, and their state moved over.

    Raises:
        GossipError: the optimizer's class cannot be made again from its groups.
    """
    groups = []
    for group in optimizer.param_groups:
        params = [keep[id(p)] for p in group["params"] if id(p) in keep]
        if params:
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": params})
    try:
        made = type(optimizer)(groups, **_constructor_defaults(optimizer))
    except Exception as exc:
        raise GossipError(f"cannot make a {type(optimizer).__name__} for one stage from the "
                          f"task's optimizer's groups ({exc!r})") from None
    kept = [p for group in optimizer.param_groups for p in group["params"] if id(p) in keep]
    if any(p in optimizer.state for p in kept):  # through torch's own rules for devices
        state = made.state_dict()
        state["state"] = {i: dict(optimizer.state[p]) for i, p in enumerate(kept)
                          if p in optimizer.state}
        made.load_state_dict(state)
    return made


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The defaults of ``optimizer`` that its constructor takes by name."""
    import inspect
    try:
        names = set(inspect.signature(type(optimizer).__init__).parameters)
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in optimizer.defaults.items() if k in names}


def micro_batches(batch: Any, count: int) -> list[tuple[Any, Any, float]]:
    """``(input, target, share)`` of each micro-batch of ``batch`` (an ``(input, target)``
    pair of tensors split along their first dimension), ``share`` its part of the batch.

    Raises:
        GossipError: the batch is not such a pair.
    """
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2
            and isinstance(batch[0], torch.Tensor) and batch[0].dim() > 0):
        raise GossipError("a pipelined task's batches must be (input, target) pairs whose "
                          "input is a tensor with a batch dimension")
    x, y = batch
    n = x.shape[0]
    parts = max(1, min(count, n))
    xs = torch.tensor_split(x, parts)
    ys = (torch.tensor_split(y, parts) if isinstance(y, torch.Tensor) and y.dim() > 0
          else [y] * parts)
    return [(a, b, a.shape[0] / n) for a, b in zip(xs, ys)]


def sequential_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                    stages: Stages) -> Callable[[Any], torch.Tensor]:
    """The step a pipelined node takes, in one process: the same micro-batches, their
    gradients summed with each one's share of the batch, the same clipping and
    ``before_step``. What a task declaring :class:`Stages` trains with in a node of one
    process."""

    def step(batch: Any) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        total: torch.Tensor | float = 0.0  # summed as a pipeline's last stage sums it
        for x, y, share in micro_batches(batch, stages.micro_batches):
            loss = stages.loss(model(x), y)
            (loss * share).backward()
            total = total + loss.detach() * share
        if stages.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), stages.clip_norm)
        if stages.before_step is not None:
            stages.before_step(optimizer)
        optimizer.step()
        return torch.tensor(float(total))

    return step


class Pipeline:
    """This process's stage of a model cut into as many stages as the group has processes
    (every process makes one, with the same arguments, after ``dist.init_process_group``).

    Args:
        model: the whole model, built alike in every process (on the CPU: only this
            process's stage moves to ``device``). The speaker (rank 0) keeps it as the node's
            host copy (:attr:`mirror`); the others may drop it once this returns.
        optimizer: its optimizer (over all its parameters, with any state a checkpoint
            gave it): each stage takes an optimizer of the same class over its own
            parameters, with their state.
        stages: the task's declaration.
        device: where this stage trains.
        correction: whether the node keeps a drift correction (as its averaging settings
            say): each stage keeps one for its parameters.
        group: the process group (None: the default one).
        timeout: as :class:`~gossip.nodegroup.NodeGroup`'s.

    Raises:
        GossipError: the model cannot be cut so, or a parameter belongs to two stages.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, stages: Stages, *,
                 device: torch.device | str = "cpu", correction: bool = True,
                 group: Any = None, timeout: datetime.timedelta | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise GossipError("a node of pipeline stages needs torch.distributed initialized "
                              "(dist.init_process_group) first")
        self.stages = stages
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.device = torch.device(device)
        self.bounds = stage_bounds(model, self.size, stages.split)
        _check_untied(model, self.bounds)
        start, stop = self.bounds[self.rank]
        part = model[start:stop]  # keeps the whole model's names ("3.weight")
        self.module: nn.Module = copy.deepcopy(part).to(self.device)
        keep = {id(a): b for a, b in zip(part.parameters(), self.module.parameters())}
        self.optimizer = split_optimizer(optimizer, keep)
        self.mirror: nn.Module | None = model if self.rank == 0 else None
        self.full_optimizer = optimizer if self.rank == 0 else None
        if self.rank == 0:
            optimizer.state.clear()  # each stage's optimizer holds its own part
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.control = group if self.backend == "gloo" else dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout)
        # NCCL runs a pair's sends both ways in one stream, in order: a 1F1B stage's send of
        # an activation would wait behind its receive of a gradient, and the neighbour's the
        # other way round. The gradients get a communicator (and so a stream) of their own.
        self.gradients = group if self.backend == "gloo" else dist.new_group(
            ranks=ranks, backend=self.backend, timeout=timeout)
        from .stages import StageGroup  # the boundary protocol; it reads this object
        # Activations' shapes by micro-batch: a header goes only with each step's first one and
        # with the first of a shape (as both neighbours know from the batch every stage draws).
        self._sent: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]] = {}
        self._received: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]] = {}
        self.boundaries = StageGroup(self, model, correction=correction)
        self.steps = 0

    @property
    def speaker(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def close(self) -> None:
        """Release the shared memory and the groups this made. Idempotent."""
        self.boundaries.close()
        for made in {id(g): g for g in (self.control, self.gradients)
                     if g is not self.group}.values():
            dist.destroy_process_group(made)
        self.control = self.gradients = self.group

    # ---- a step ----------------------------------------------------------------------------

    def step(self, batch: Any) -> torch.Tensor:
        """One training step of the node on ``batch``, in every stage at once; returns the
        batch's mean loss (from the last stage, in every process).

        Raises:
            ProcessLost: another stage died.
            GossipError: the batch is not an ``(input, target)`` pair, or a stage's output
                is not one tensor.
        """
        try:
            return self._step(batch)
        except ProcessLost:
            self.boundaries.lost()
            raise

    def _step(self, batch: Any) -> torch.Tensor:
        stages = self.stages
        parts = micro_batches(batch, stages.micro_batches)
        # What every stage knows of the step without a word: its batch's shape and parts.
        step = (len(parts), zlib.crc32(repr(tuple(batch[0].shape)).encode()))
        self.module.train()
        self.optimizer.zero_grad(set_to_none=True)
        sends: list[Any] = []
        held: list[tuple[torch.Tensor | None, torch.Tensor] | None] = []  # (input, output)
        total: torch.Tensor | float = 0.0  # on the device: no sync per micro-batch
        forward = backward = 0
        for op in self._order(len(parts)):
            sends = self._collect(sends)  # a send done lets go of its tensor
            if op == "F":
                x, y, share = parts[forward]
                forward += 1
                inp = (x.to(self.device) if self.rank == 0
                       else self._receive(self.rank - 1, key=(*step, forward - 1)))
                if self.rank > 0 and inp.is_floating_point():
                    inp.requires_grad_(True)
                out = self.module(inp)
                if not isinstance(out, torch.Tensor):
                    raise GossipError(f"stage {self.rank} returned {type(out).__name__}: each "
                                      f"stage of a pipelined model must return one tensor")
                if self.last:
                    target = y.to(self.device) if isinstance(y, torch.Tensor) else y
                    loss = stages.loss(out, target)
                    total = total + loss.detach() * share
                    out = loss * share
                else:
                    sends.append(self._send(out.detach(), self.rank + 1,
                                            key=(*step, forward - 1)))
                held.append((inp if self.rank > 0 else None, out))
            else:
                pair, held[backward] = held[backward], None  # freed as the backwards go
                assert pair is not None
                inp, out = pair
                backward += 1
                if self.last:
                    out.backward()
                else:
                    grad = self._receive(self.rank + 1, like=out)
                    if out.requires_grad:  # a frozen stage still passes the gradient on
                        torch.autograd.backward(out, grad)
                if inp is not None:
                    g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                    sends.append(self._send(g, self.rank - 1))
        for handle in sends:
            with _collective("a stage's send"):
                handle.wait()
        self._clip()
        if stages.before_step is not None:
            stages.before_step(self.optimizer)
        self.optimizer.step()
        self.steps += 1
        loss = torch.tensor([float(total)], dtype=torch.float64)
        with _collective("the step's loss"):
            dist.broadcast(loss, src=self._global(self.size - 1), group=self.control)
        return loss[0].float()

    @staticmethod
    def _collect(sends: list[Any]) -> list[Any]:
        """The sends still under way; those done are waited for (an error surfaces), and
        their tensors let go of, so that 1F1B holds few activations."""
        pending = []
        for handle in sends:
            if handle.is_completed():
                with _collective("a stage's send"):
                    handle.wait()
            else:
                pending.append(handle)
        return pending

    def _order(self, parts: int) -> list[str]:
        """This stage's forwards (F) and backwards (B), in order."""
        if self.stages.schedule == "gpipe":
            return ["F"] * parts + ["B"] * parts
        warm = min(self.size - self.rank - 1, parts)
        return ["F"] * warm + ["F", "B"] * (parts - warm) + ["B"] * warm

    def _clip(self) -> None:
        """Scale every stage's gradients so that the node's whole norm is at most
        ``clip_norm`` (torch's ``clip_grad_norm_`` over the stages)."""
        if self.stages.clip_norm is None:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = sum(float(n) ** 2 for n in torch._foreach_norm(grads)) if grads else 0.0
        square = torch.tensor([local], dtype=torch.float64)
        with _collective("the gradient's norm"):
            dist.all_reduce(square, group=self.control)
        norm = math.sqrt(float(square[0]))
        coefficient = self.stages.clip_norm / (norm + 1e-6)
        if coefficient < 1.0 and grads:
            torch._foreach_mul_(grads, coefficient)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def _send(self, tensor: torch.Tensor, to: int,
              key: tuple[int, int, int] | None = None) -> Any:
        """Start sending ``tensor`` to stage ``to``: a gradient (no header: its receiver
        knows the shape) or the activation of micro-batch ``key`` (the step's micro-batch
        count, its batch's shape's checksum, the index), after a header of its dtype and
        shape for each step's first one and for a micro-batch of a shape not seen before;
        returns the handle of the data's send.

        Raises:
            GossipError: the tensor cannot be an activation, or its shape changed for a
                micro-batch of a shape seen before (a stage's output shape must follow from
                its input's).
        """
        if key is not None:
            if tensor.dtype not in _DTYPES or tensor.dim() > HEADER - 4:
                raise GossipError(f"stage {self.rank} returned a {tensor.dtype} tensor of "
                                  f"{tensor.dim()} dimensions: what a stage passes on must be a "
                                  f"floating-point tensor of at most {HEADER - 4} dimensions")
            form = (_DTYPES.index(tensor.dtype), tuple(tensor.shape))
            known = self._sent.get(key)
            if known is not None and known != form:
                raise GossipError(f"stage {self.rank}'s output changed shape from {known[1]} to "
                                  f"{form[1]} for a micro-batch of the same shape: a stage's "
                                  f"output shape must follow from its input's")
            if known is None or key[2] == 0:
                _remember(self._sent, key, form)
                slots = torch.zeros(HEADER, dtype=torch.int64)
                slots[0], slots[1], slots[2], slots[3] = form[0], tensor.dim(), key[0], key[1]
                slots[4:4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
                with _collective("a stage's send"):
                    dist.isend(slots, self._global(to), group=self.control).wait()
        data = self._on_backend(tensor.contiguous())
        with _collective("a stage's send"):
            return dist.isend(data, self._global(to),
                              group=self.group if key is not None else self.gradients)

    def _receive(self, src: int, like: torch.Tensor | None = None,
                 key: tuple[int, int, int] | None = None) -> torch.Tensor:
        """The next tensor from stage ``src``, on this stage's device: one of ``like``'s shape
        and dtype (a gradient), or the activation of micro-batch ``key`` (as :meth:`_send`),
        as its header says or as the last one of that micro-batch's shape was.

        Raises:
            GossipError: the header is malformed, or stage ``src`` cut another batch (the
                stages drew different batches).
        """
        if like is None:
            assert key is not None
            form = self._received.get(key)
            if form is None or key[2] == 0:
                slots = torch.zeros(HEADER, dtype=torch.int64)
                with _collective("a stage's receive"):
                    dist.recv(slots, self._global(src), group=self.control)
                code, ndim = int(slots[0]), int(slots[1])
                if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= HEADER - 4:
                    raise GossipError(f"stage {self.rank} got a malformed activation header")
                if (int(slots[2]), int(slots[3])) != key[:2]:
                    differ = (f"stage {src} cut its batch into {int(slots[2])} micro-batches "
                              f"and stage {self.rank} into {key[0]}" if int(slots[2]) != key[0]
                              else f"stages {src} and {self.rank} drew batches of other "
                                   f"shapes")
                    raise GossipError(f"{differ}: every stage must draw the same batches "
                                      f"(seed their order from ctx.seed)")
                form = (code, tuple(int(v) for v in slots[4:4 + ndim]))
                _remember(self._received, key, form)
            shape, dtype = list(form[1]), _DTYPES[form[0]]
        else:
            shape, dtype = list(like.shape), like.dtype
        where = "cpu" if self.backend == "gloo" else self.device
        data = torch.empty(shape, dtype=dtype, device=where)
        with _collective("a stage's receive"):
            dist.recv(data, self._global(src), group=self.group if like is None
                      else self.gradients)
        return data.to(self.device)

    def _on_backend(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.backend == "gloo" and tensor.is_cuda:
            return tensor.cpu()
        return tensor


def _remember(shapes: dict[tuple[int, int, int], tuple[int, tuple[int, ...]]],
              key: tuple[int, int, int], form: tuple[int, tuple[int, ...]]) -> None:
    """The shape of micro-batch ``key``'s activation. A sender and its receiver remember the
    same keys in the same order, so both forget at the same point."""
    if key not in shapes and len(shapes) >= SHAPES:
        shapes.clear()
    shapes[key] = form


def _check_untied(model: nn.Sequential, bounds: list[tuple[int, int]]) -> None:
    """No parameter may sit in two stages (each stage steps its own copy).

    Raises:
        GossipError: naming the parameter and the stages.
    """
    owner: dict[int, int] = {}
    for stage, (start, stop) in enumerate(bounds):
        for name, p in model[start:stop].named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(p), stage)
            if first != stage:
                raise GossipError(f"parameter {name} is in stages {first} and {stage}: a "
                                  f"parameter shared between stages (tied weights) must sit in "
                                  f"one stage; move the cut (Stages.split) or untie it")
