"""What a follower process of a node does: the same task, the speaker's state, steps.

See :mod:`daemon.processes` for the node of several processes as a whole. A follower builds
the task as the speaker does, by the same steps (:mod:`daemon.startup`: same config, same seed,
same device rule), resumes the same checkpoint, joins the group, and then loops — a step
boundary, one step, again — until the speaker's last boundary says stop. The group is
released on every way out, closed and then left (one :class:`contextlib.ExitStack`): a gloo
group still open at exit aborts the process. Its exit code is the daemon's: 0 once stopped, 1
when the node's group broke or the task failed, 2 for a start-up error (the speaker reports
the same one).
"""

from __future__ import annotations

import logging
import os
import signal
from contextlib import ExitStack
from typing import Any

import torch

import gossip
from gossip import NodeGroup
from gossip.lowlevel import Replica

from .config import Config
from .exits import EXIT_FAILED, EXIT_OK, EXIT_USAGE
from .processes import (COLLECTIVE_TIMEOUT, Placement, ProcessesError, agree_shard,
                        die_with_parent, init_group, leave_group, set_threads)
from .startup import (GlobalStep, Group, StartupError, build_task, resolve_device,
                      stage_pipeline, staged_task)
from .task import Shard, Task, TaskError, load_entry, to_device
from .train import Batches, resume

__all__ = ["follow"]

log = logging.getLogger(__name__)


def follow(config: Config, where: Placement) -> int:
    """Run process ``where.rank`` of the node until the speaker stops it; returns the exit
    code."""
    _patient_signals(where.rank)
    if where.launcher == "gossipd":
        die_with_parent()
    with ExitStack() as stack:
        stack.callback(leave_group)  # last, on every way out
        try:
            group, task, batches, device = _prepare(config, where, stack)
        except (StartupError, ProcessesError, TaskError, OSError, gossip.GossipError) as exc:
            log.error("process %d of the node cannot start: %s", where.rank, exc)
            return EXIT_USAGE
        code = _train(group, task, batches, device, where.rank)
    if code == EXIT_OK:
        log.info("process %d stopped steps=%d", where.rank, group.statistics().boundaries)
    return code


def _train(group: Group, task: Task, batches: Batches, device: torch.device,
           rank: int) -> int:
    """A step boundary, one step, again, until the speaker's last boundary says stop; returns
    the exit code."""
    task.model.train()  # as the speaker's trainer does (a model may come built in eval mode)
    try:
        while True:
            group.boundary()
            if group.stopped:
                return EXIT_OK
            task.step(to_device(batches.next(), device))
    except (gossip.ProcessLost, gossip.ReplicasDiverged) as exc:
        log.error("process %d stops: %s", rank, exc)
    except TaskError as exc:
        log.error("process %d failed: %s", rank, exc)
    except Exception:  # the task's own code: the speaker's trainer fails the same way
        log.exception("process %d failed", rank)
    return EXIT_FAILED


def _prepare(config: Config, where: Placement,
             stack: ExitStack) -> tuple[Group, Task, Batches, torch.device]:
    """Build the task, resume the checkpoint the speaker resumes, join the group (closed by
    ``stack``) and take the speaker's state.

    Raises:
        StartupError, ProcessesError, TaskError, OSError, GossipError: as the speaker's
            start-up would.
    """
    device = resolve_device(config.task.device, where)
    set_threads(config.task.threads, where, device)
    fn = load_entry(config.task.entry, config.data_dir())
    step = GlobalStep()
    task = build_task(config, fn, where, device, step)
    if not where.pipelined:  # a stage moves its own part alone
        task.model.to(device)
    found = resume(task, config)  # TaskError: as the speaker's start-up says it
    resumed = None if found is None else found.counters.step
    if found is not None:
        log.info("process %d resuming checkpoint=%s step=%d", where.rank, found.path, resumed)
    init_group(where, device)
    group: Group
    replica: Replica | None = None
    if where.pipelined:
        pipeline = stage_pipeline(config, task, device)
        stack.callback(pipeline.close)
        group, task = pipeline.boundaries, staged_task(task, pipeline)
    else:
        group = NodeGroup(task.model, task.optimizer, check_every=config.task.check_every,
                          timeout=COLLECTIVE_TIMEOUT)
        averaging = config.averaging.to_averaging()
        replica = Replica(task.model, by_samples=averaging.by_samples, leak=averaging.leak,
                          optimizer=task.optimizer if averaging.correction else None,
                          outer=averaging.outer_setting)
    stack.callback(group.close)
    step.follow_group(group)
    group.start(replica, resumed)  # type: ignore[arg-type]
    if group.stopped:  # the speaker stopped before it was ready
        return group, task, Batches(task, Shard()), device
    count = config.task.shards
    index = agree_shard(group, int(config.task.shard) if config.task.shard != "auto" else 0)
    if where.pipelined:
        start, stop = group.pipeline.bounds[where.rank]  # type: ignore[union-attr]
        log.info("process %d of %d is stage %d of the node's pipeline: modules %d..%d, "
                 "shard %d/%d, every batch", where.rank, where.size, where.rank, start,
                 stop - 1, index, count)
        return group, task, Batches(task, Shard(index, count), None, 0, 1), device
    log.info("process %d of %d follows the node's process 0: shard %d/%d, batches %d, %d, "
             "%d, ...", where.rank, where.size, index, count, where.rank,
             where.rank + where.size, where.rank + 2 * where.size)
    batches = Batches(task, Shard(index, count), None, where.rank, where.size)
    return group, task, batches, device


def _patient_signals(rank: int) -> None:
    """The first SIGINT or SIGTERM is noted (the speaker stops the node, and this process
    with it); the second ends this process at once."""
    count = [0]

    def handler(signum: int, frame: Any) -> None:
        count[0] += 1
        if count[0] == 1:
            log.info("process %d got %s: waiting for process 0 to stop the node (send it "
                     "again to exit at once)", rank, signal.Signals(signum).name)
            return
        logging.shutdown()
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
