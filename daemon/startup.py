"""What every process of a node does the same way at start-up, speaker and followers alike.

Theory of operation
-------------------
The speaker (:mod:`daemon.service`) and each follower of a node of several processes
(:mod:`daemon.follower`) build the same task from the same config, so the steps they share
live here, beneath both:

* :func:`resolve_device` turns ``task.device`` into this process's device by the one rule of
  :func:`gossip.devices.resolve`, for its place in the node (:class:`processes.Placement`).
  ``gossipd check-config`` calls it too, so that a device it accepts is one ``run`` starts with.
* :func:`build_task` calls the task function with its :class:`~daemon.task.Context` and checks
  what comes back.
* :class:`GlobalStep` is the context's ``global_step``: the task is built before the node opens
  and before a node of several forms its group, so the hook is told where to read as each
  comes to exist: the checkpoint's step, then the node's, then the group's once started.

Everything the operator could get wrong is a :class:`StartupError`: one line, exit code 2.
The lines logged here are the daemon's start-up lines and log as ``daemon.service``
(:data:`daemon.logs.RUN`), the name operators filter on.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Union

import torch

from gossip import GossipError, NodeGroup, Pipeline
from gossip.devices import DeviceError, resolve
from gossip.lowlevel import StageGroup

from .logs import RUN
from .processes import Placement
from .task import Context, Task, TaskError

if TYPE_CHECKING:
    import gossip

    from .config import Config

__all__ = ["GlobalStep", "Group", "StartupError", "build_task", "resolve_device",
           "stage_pipeline", "staged_task"]

log = logging.getLogger(RUN)

# The step boundaries of a node of several processes: replicas, or pipeline stages.
Group = Union[NodeGroup, StageGroup]


class StartupError(Exception):
    """The daemon cannot start as configured (the operator's to fix; exit code 2)."""


def resolve_device(name: str, where: Placement) -> torch.device:
    """The device of process ``where`` of its node, by the one resolver
    (:func:`gossip.devices.resolve`): ``auto``/``cuda`` take local GPU ``where.local_rank``,
    ``cuda:N`` suits only a node of one process.

    Raises:
        StartupError: the name does not fit this machine or the node's processes.
    """
    try:
        return resolve(name, local_rank=where.local_rank, processes=where.size,
                       what="task.device")
    except DeviceError as exc:
        raise StartupError(str(exc)) from None


class GlobalStep:
    """The task's ``Context.global_step``: the step of the checkpoint resumed (0: none) until
    the node opens, the node's after, and on a node of several processes the group's once it
    has started, which every process of the node reads alike."""

    def __init__(self) -> None:
        self._start = 0
        self._node: gossip.SwarmNode | None = None
        self._group: gossip.NodeGroup | None = None

    def start_at(self, step: int) -> None:
        """The checkpoint resumed is at ``step``."""
        self._start = step

    def follow_node(self, node: gossip.SwarmNode) -> None:
        """Read the node's step from now on (the node is open)."""
        self._node = node

    def follow_group(self, group: Group) -> None:
        """Read the group's step once it has started (a node of several processes)."""
        self._group = group

    def __call__(self) -> int:
        group = self._group
        if group is not None and group.started:
            return group.global_step
        return self._start if self._node is None else self._node.global_step


def build_task(config: Config, fn: Callable[[Context], Any], where: Placement,
               device: torch.device, step: GlobalStep) -> Task:
    """The task ``fn`` returns for this process: its :class:`~daemon.task.Context` holds the
    config's seed and options, ``device``, the cache directory, the ``step`` hook and the
    process's place in its node.

    Raises:
        StartupError: it failed, or returned something else than a :class:`Task`.
    """
    # Pipeline stages each see every batch of the node: to the task, one process.
    rank, size = (0, 1) if where.pipelined else (where.rank, where.size)
    context = Context(config.task.seed, device, dict(config.task.options),
                      config.data_dir() / "cache", step, rank, size)
    try:
        task = fn(context)
    except TaskError as exc:
        raise StartupError(str(exc)) from None
    except Exception as exc:  # the task's own code: one line names it, the log has the rest
        log.debug("the task function failed", exc_info=True)
        raise StartupError(f"{config.task.entry} failed: {exc!r}") from None
    if not isinstance(task, Task):
        raise StartupError(f"{config.task.entry} returned {type(task).__name__}, not a Task")
    return task


def stage_pipeline(config: Config, task: Task, device: torch.device) -> Pipeline:
    """This process's stage of a pipelined node (``task.pipeline``), once the group has
    formed: the task's model cut as it declares (its model and optimizer still whole, on
    the CPU, with any checkpoint resumed).

    Raises:
        StartupError: the task declares no stages, or its model cannot be cut so.
    """
    from .processes import COLLECTIVE_TIMEOUT
    if task.pipeline is None:
        raise StartupError(f"task.pipeline is {config.task.pipeline} but {config.task.entry} "
                           f"declares no stages: its Task needs pipeline=gossip.Stages(...) "
                           f"and an nn.Sequential model (docs/TASKS.md)")
    try:
        return Pipeline(task.model, task.optimizer, task.pipeline, device=device,
                        correction=config.averaging.correction, timeout=COLLECTIVE_TIMEOUT)
    except GossipError as exc:
        raise StartupError(f"task.pipeline {config.task.pipeline}: {exc}") from None


def staged_task(task: Task, pipeline: Pipeline) -> Task:
    """The task as this stage trains it: the pipeline's step; the speaker keeps the whole
    model on the host (the mirror) and its optimizer, for the node's replica, checkpoints and
    evaluations; another stage only its own part."""
    if pipeline.speaker:
        assert pipeline.mirror is not None and pipeline.full_optimizer is not None
        return Task(pipeline.mirror, pipeline.full_optimizer, task.batches, pipeline.step,
                    task.batch_size, task.evaluate, task.pipeline)
    return Task(pipeline.module, pipeline.optimizer, task.batches, pipeline.step,
                task.batch_size, None, task.pipeline)
