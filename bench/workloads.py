"""The tasks of the low-communication benchmark, how their data is split over the nodes, the
budgets, the held-out evaluation, and the link each spacing is measured on.

Import it from a script run as ``python bench/<script>.py`` (``bench/`` is then the first
entry of ``sys.path``), as :mod:`common` is imported.

Every method of ``bench/lowcomm.py`` builds its nodes (or replicas) here, so that each trains
the same model from the same initial weights, with the same inner optimizer and the same
batches, and is evaluated on the same held-out data.

- ``lm_iid``: a byte-level decoder-only transformer (``daemon.tasks.charlm``) of
  :data:`LM_OPTIONS` (1,000,704 parameters: width 192, two blocks of four heads, 64 bytes of
  context, four windows a step, AdamW at the task's lr 3e-3), trained on the Python standard
  library with its documentation (``corpus = "stdlib"``: 12 MB on Python 3.11, its tests
  left out). Every node trains on all of the training text (``Shard(0, 1)``), each in its
  own order (one task seed per node), from node 0's initial weights.
- ``lm_skewed``: the same LM, node i on ``Shard(i, 8)`` cut by top-level package
  (``shard_by = "package"``): one node holds ``encodings``' codec tables, another the
  documentation's English, another ``asyncio``, ... (1.46 MB each).
- ``digits``: the digits MLP (``daemon.tasks.digits``: SGD lr 0.05, momentum 0.9, batch 32),
  node i on ``Shard(i, 8)``: the training split sorted by label and cut in 8 blocks, so each
  node sees one or two classes.

Every method's inner optimizer runs at the task's learning rate throughout (``schedule =
"constant"``), or (``"cosine"``) at a cosine of it over the run's budget down to
:data:`DECAY_FLOOR` of it, each node counting its own steps.

The held-out text is every 20th file of the corpus (36 files, 455 KB), never trained on;
:data:`LM_OPTIONS` scores 256 windows of 64 bytes of it (16,384 predictions), the same for
every run. The digits: the 359 test images.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from daemon.task import Context, Shard, Task
from daemon.tasks import charlm, digits

__all__ = ["GPU_LM_OPTIONS", "LM_OPTIONS", "N", "ROUNDS", "SCHEDULES", "STEP_TIME", "Workload",
           "WORKLOADS", "allreduce_bytes", "build", "budget", "evaluate", "figures", "link_rate",
           "mean_model", "numel", "points"]

N = 8  # nodes (replicas, shards)
ROUNDS = 20  # the fewest syncs any method gets at any H: a budget is at least ROUNDS x H
STEP_TIME = 0.05  # virtual s per training step, every method
# The inner learning rate over a run's budget, the same for every method: constant (the
# task's), or a cosine to DECAY_FLOOR of it at the budget (the published runs' recipe: a run
# ends at a small learning rate, so its nodes' last local steps move them little).
SCHEDULES = ("constant", "cosine")
DECAY_FLOOR = 0.1
CURVE_POINTS = 8  # held-out evaluations per run, the last at the budget
LM_OPTIONS: Mapping[str, Any] = {"corpus": "stdlib", "d_model": 192, "layers": 2, "heads": 4,
                                 "context": 64, "batch_size": 4, "eval_windows": 256}
# --gpu: the same LM at 25.4M parameters (width 512, eight blocks of eight heads, 256 bytes
# of context, 16 windows a step, AdamW at 1e-3), scored on 256 windows of 256 bytes.
GPU_LM_OPTIONS: Mapping[str, Any] = {"corpus": "stdlib", "d_model": 512, "layers": 8,
                                     "heads": 8, "context": 256, "batch_size": 16,
                                     "eval_windows": 256, "lr": 1e-3}


@dataclass(frozen=True)
class Workload:
    """A task and how its data is split over the nodes."""

    name: str
    label: str
    factory: Callable[[Context], Task]
    options: Mapping[str, Any]
    iid: bool  # every node on all the data, each in its own order; else Shard(i, N)
    schedule: str = "constant"  # the inner optimizer's learning rate over the budget: SCHEDULES

    @property
    def classifier(self) -> bool:
        return self.factory is digits.task


def lm_workloads(options: Mapping[str, Any]) -> list[Workload]:
    """The IID and the skewed LM of ``options``."""
    return [Workload("lm_iid", "byte LM, IID (all the text on every node)", charlm.task,
                     options, True),
            Workload("lm_skewed", "byte LM, skewed (node i: the packages of shard i)",
                     charlm.task, {**options, "shard_by": "package"}, False)]


WORKLOADS = [*lm_workloads(LM_OPTIONS),
             Workload("digits", "digits MLP, label-sorted shards", digits.task, {}, False)]


def build(work: Workload, seed: int, device: torch.device, steps: int,
          count: int = N) -> tuple[list[Task], list[Iterator[Any]]]:
    """``count`` tasks with the same initial weights, on ``device``, and each one's batches;
    each to train ``steps`` steps (the length of ``work.schedule``).

    IID: a task's seed picks its batch order, so one seed per node, then node 0's initial
    weights everywhere. Skewed: one seed, node i on shard i.
    """
    if work.iid:
        tasks = [work.factory(Context(seed * 1000 + i, device, work.options))
                 for i in range(count)]
        for t in tasks[1:]:
            t.model.load_state_dict(tasks[0].model.state_dict())
        shards = [Shard(0, 1)] * count
    else:
        tasks = [work.factory(Context(seed, device, work.options)) for _ in range(count)]
        shards = [Shard(i, count) for i in range(count)]
    for t in tasks:
        t.model.to(device)
        if work.schedule == "cosine":
            _cosine(t, steps)
        elif work.schedule != "constant":
            raise ValueError(f"schedule: one of {', '.join(SCHEDULES)}, not {work.schedule!r}")
    return tasks, [_on(device, t.batches(s)) for t, s in zip(tasks, shards)]


def _cosine(task: Task, steps: int) -> None:
    """From its next step on, ``task`` steps at its optimizer's learning rates times a cosine
    from 1 at its first step to ``DECAY_FLOOR`` at its ``steps``-th (and after), counted in
    its own steps."""
    base = [group["lr"] for group in task.optimizer.param_groups]
    inner = task.step
    assert inner is not None
    taken = 0

    def step(batch: Any) -> Any:
        nonlocal taken
        done = min(taken, steps - 1) / max(steps - 1, 1)
        factor = DECAY_FLOOR + (1 - DECAY_FLOOR) * (1 + math.cos(math.pi * done)) / 2
        for group, lr in zip(task.optimizer.param_groups, base):
            group["lr"] = lr * factor
        taken += 1
        return inner(batch)

    task.step = step


def _on(device: torch.device, batches: Iterator[Any]) -> Iterator[Any]:
    """Each batch (a tuple of tensors) moved to ``device``."""
    for batch in batches:
        yield tuple(x.to(device, non_blocking=True) for x in batch)


def numel(task: Task) -> int:
    """The parameters the swarm averages."""
    return sum(p.numel() for p in task.model.parameters())


def budget(h: int, least: int) -> int:
    """Steps per node at spacing ``h``: at least ``least`` and at least ``ROUNDS`` syncs,
    a multiple of ``h`` (so that DiLoCo ends on a sync)."""
    return math.ceil(max(least, ROUNDS * h) / h) * h


def points(steps: int) -> list[int]:
    """The steps (per node) after which every node is evaluated: ``CURVE_POINTS`` evenly
    spaced, the last at ``steps``."""
    return sorted({round(steps * (k + 1) / CURVE_POINTS) for k in range(CURVE_POINTS)})


def evaluate(tasks: list[Task]) -> dict[str, list[float]]:
    """Every node's held-out figures: ``loss`` and, for a classifier, ``accuracy`` in %."""
    results = [t.evaluate() for t in tasks]  # type: ignore[misc]  # both tasks have one
    out = {"loss": [r["loss"] for r in results]}
    if "accuracy" in results[0]:
        out["accuracy"] = [100 * r["accuracy"] for r in results]
    return out


def figures(result: dict[str, list[float]]) -> dict[str, float]:
    """The mean and the worst over nodes of :func:`evaluate`'s figures."""
    out = {"loss": sum(result["loss"]) / len(result["loss"]), "worst_loss": max(result["loss"])}
    if "accuracy" in result:
        out["accuracy"] = sum(result["accuracy"]) / len(result["accuracy"])
        out["worst_accuracy"] = min(result["accuracy"])
    return out


def mean_model(work: Workload, tasks: list[Task], probe: Task) -> dict[str, float]:
    """The held-out figures of the nodes' parameters averaged, loaded into ``probe`` (a task
    of the same model that no node trains): a model no node holds, which tells the nodes'
    drift from one another apart from what the swarm learned as a whole."""
    with torch.no_grad():
        for mean, *ps in zip(probe.model.parameters(), *(t.model.parameters() for t in tasks)):
            mean.copy_(torch.stack(ps).mean(0))
    return {f"mean_model_{key}": values[0] for key, values in evaluate([probe]).items()}


def spread(tasks: list[Task]) -> float:
    """How far apart the nodes are: the mean over nodes of ``||x_i - mean||``, over the mean's
    norm."""
    with torch.no_grad():
        xs = torch.stack([parameters_to_vector(t.model.parameters()) for t in tasks])
        mean = xs.mean(0)
        return float((xs - mean).norm(dim=1).mean() / mean.norm())


def link_rate(payload: int, h: int) -> float:
    """Bytes/s each way of the link that spaces rounds ``h`` steps apart: the one on which
    ``averaging.every = "auto"`` picks ``h`` (an exchange of ``payload`` bytes each way takes
    ``h / 2`` steps: :mod:`gossip.spacing`)."""
    return payload / (h * STEP_TIME / 2)


def allreduce_bytes(parameters: int, nodes: int = N) -> float:
    """Bytes each node sends in one ring all-reduce of ``parameters`` float32 values."""
    return 2 * (nodes - 1) / nodes * 4 * parameters
