"""The synchronous facade: averaging for ordinary (non-trio) training scripts.

Theory of operation
-------------------
:class:`Averager` runs :func:`gossip.node.open_swarm` in a trio event loop on a background
thread of its own. The training script keeps the main thread and calls :meth:`Averager.step`
after each optimizer step: it counts the step and adds whatever deltas the background side
has queued, under the replica's lock, and never waits for the network. Calls that need the
event loop (:meth:`Averager.statistics`, :meth:`Averager.average_now`) go through trio's
thread portal.

Starting waits until the node is ready: joined, and holding its initial state (downloaded
from the swarm, or its own for the first node), so the first step trains the swarm's weights.
Closing stops averaging, leaves the swarm gracefully and joins the thread. A failure of the
background side is raised by the next call from the script (and by :meth:`close`).

Several processes: a script started by ``torchrun`` (``torch.distributed`` initialized, more
than one process) makes an Averager in every process, with the same arguments, and the
processes are one node of the swarm (:mod:`gossip.nodegroup`). Rank 0, the *speaker*, runs the
node and its thread as above; the other ranks run no thread and open no socket. Each Averager
makes its :class:`~gossip.nodegroup.NodeGroup` before anything else hooks the optimizer, so
that the gradients are averaged over the processes before the drift correction is added to
them. The constructor returns in every process once the speaker's node is ready and every
process holds the speaker's state. From then on :meth:`Averager.step` is the group's step
boundary: the speaker counts the step over all the processes' samples and applies the queued
deltas (as often as the state's broadcast leaves time for), every process takes the speaker's
state when it changed, and every process reads the same :attr:`Averager.global_step` until the
next step. It waits for every process, so each must call :meth:`~Averager.step` after every
optimizer step, the same number of times, and :meth:`~Averager.close` once after the last: the
speaker's tells the others to stop, and theirs checks that it did.

Failures, several processes: a failure of the speaker's background side is told to the others
at the step that finds it (or, before the node is ready, in their constructor), and every
process raises :class:`~gossip.errors.GossipError` there. A process that leaves a ``with``
block by an exception makes no collective call on its way out, since the others may be anywhere
in their step: its exit fails their next collective (:class:`~gossip.errors.ProcessLost`), and
``torchrun`` stops them all. Processes that train different numbers of steps pair one's
gradient average with another's boundary, and both wait until the process group's timeout
(``init_process_group(timeout=...)``, 30 minutes by default) ends it with ``ProcessLost``;
only a speaker that calls :meth:`~Averager.step` more often without training is caught at
once, by the others' :meth:`~Averager.close`. For the same reason an evaluation in the speaker
alone calls the module inside a ``DistributedDataParallel`` wrapper
(:func:`gossip.nodegroup.unwrap`), not the wrapper, whose forward broadcasts its buffers.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

import torch
import torch.distributed as dist
import trio

from .averaging import AveragingStatistics, Result
from .config import NodeConfig
from .errors import GossipError
from .handshake import Swarm
from .node import SwarmNode, open_swarm
from .nodegroup import NodeGroup, unwrap
from .pipeline import Pipeline
from .replica import Replica
from .stages import StageGroup

__all__ = ["Averager"]

log = logging.getLogger(__name__)

# What open_swarm takes by keyword: the objects and callbacks; the settings are its config.
_OBJECTS = frozenset(name for name, p in inspect.signature(open_swarm).parameters.items()
                     if p.kind is inspect.Parameter.KEYWORD_ONLY)


class Averager:
    """Average ``model`` with a swarm from a synchronous training loop.

    ::

        config = gossip.NodeConfig(listen="0.0.0.0:7070", bootstrap=["10.0.0.2:7070"])
        with gossip.Averager(model, swarm, config, optimizer=opt) as avg:
            for batch in data:
                loss = train_step(model, batch)
                avg.step(samples=len(batch))   # applies pending deltas; never blocks
                lr = schedule(avg.global_step)

    Under ``torchrun`` every process makes one, with the same arguments, and the processes are
    one node (see the module's docstring); only rank 0 (:attr:`speaker`) has a :attr:`node`.

    Args:
        model: the live module (CPU or CUDA), or its ``DistributedDataParallel`` wrapper;
            or, under torchrun, this process's :class:`~gossip.pipeline.Pipeline` stage: the
            processes are then the stages of one node, whose model is the speaker's whole
            host copy (train with ``pipeline.step(batch)``, then :meth:`step`).
        swarm: the swarm's name and key.
        config: the node's settings (:class:`~gossip.config.NodeConfig`), as
            :func:`gossip.node.open_swarm` takes them.
        ready_timeout: seconds to wait for the node to be ready (None: as long as it takes;
            a joiner retries its bootstrap addresses meanwhile and logs each attempt). The
            other processes of a node wait for the speaker, as long as their process group's
            timeout allows.
        check_every: several processes: every this many steps, check that the processes hold
            bit-identical parameters (a broadcast of the model; 0: never). Ignored in a
            single process.
        **objects: the objects and callbacks :func:`gossip.node.open_swarm` takes by keyword
            (``optimizer``, ``counters``, ``identity``, ``on_exchange``...). Several
            processes without a ``DistributedDataParallel`` wrapper need the ``optimizer``:
            the processes' gradients are averaged before it steps.

    Raises:
        GossipError: the node failed to start, or was not ready within ``ready_timeout``
            (:class:`~gossip.errors.PeerTimeout`); or, several processes, they were not given
            the same settings (:meth:`gossip.nodegroup.NodeGroup.start`).
        TypeError: ``config`` is not a :class:`~gossip.config.NodeConfig`, or a keyword
            argument that :func:`gossip.node.open_swarm` does not take (settings such as
            ``listen`` go in ``config``).
    """

    def __init__(self, model: torch.nn.Module | Pipeline, swarm: Swarm,
                 config: NodeConfig = NodeConfig(), *, ready_timeout: float | None = None,
                 check_every: int = 0, **objects: Any) -> None:
        if not isinstance(config, NodeConfig):  # here, not from the background thread
            raise TypeError(f"config must be a gossip.NodeConfig, not "
                            f"{type(config).__name__}: put averaging settings in "
                            f"NodeConfig(averaging=...)")
        unknown = sorted(set(objects) - _OBJECTS)
        if unknown:
            raise TypeError(f"Averager() got unexpected keyword arguments {unknown}: settings "
                            f"go in config (a gossip.NodeConfig); the keywords are the "
                            f"objects open_swarm takes, {sorted(_OBJECTS)}")
        pipeline = model if isinstance(model, Pipeline) else None
        if pipeline is not None:  # the node's model is the speaker's whole host copy
            if "optimizer" in objects:
                raise TypeError("Averager(pipeline): the pipeline's optimizers are the node's; "
                                "give no optimizer=")
            model = pipeline.mirror if pipeline.speaker else pipeline.module
            objects = {**objects, "optimizer": pipeline.full_optimizer}
        assert isinstance(model, torch.nn.Module)
        self._model = unwrap(model)
        self._swarm = swarm
        self._config = config
        self._objects = objects
        self._node: SwarmNode | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._closed = False  # the group's stop handshake is done (several processes)
        self._replica: Replica | None = None  # a follower's own (several processes)
        self._thread: threading.Thread | None = None
        self._started = threading.Event()  # the node is ready, or the thread ended
        # Before open_swarm: the group's gradient hooks go on the optimizer ahead of the
        # correction's.
        self._group: NodeGroup | StageGroup | None = (
            pipeline.boundaries if pipeline is not None
            else _open_group(model, objects.get("optimizer"), check_every))
        self._own_lock = threading.RLock()  # a pipeline stage's, which nothing else takes
        counters = objects.get("counters")
        resumed = None if counters is None else counters.step
        if self._group is not None and not self._group.speaker:
            self._follow(resumed)
            return
        self._thread = threading.Thread(target=self._main, name="gossip-averager", daemon=True)
        self._thread.start()
        if not self._started.wait(ready_timeout):
            self._abandon()
            self._check()
            raise GossipError(f"the node was not ready within {ready_timeout} s")
        if self._error is not None:
            self._abandon()
            self._check()
        if self._group is None:
            return
        try:
            assert self._node is not None
            self._group.start(self._node.replica, resumed)
        except BaseException:
            self._closed = True
            self._release()
            raise

    # ---- the training script's side ---------------------------------------------------

    def step(self, samples: int = 0) -> int:
        """Count one optimizer step over ``samples`` samples and add the queued deltas to the
        model. Never blocks on the network. Several processes: ``samples`` is this process's
        (the node counts the group's size times it), and the step waits for every process to
        reach it.

        Returns:
            The number of exchanges whose deltas were applied (0 but in the speaker).

        Raises:
            GossipError: the background side failed (in the speaker; the others raise it at
                the same step), or the Averager is closed.
            ProcessLost: several processes, and another one died.
        """
        group = self._group
        if group is None:
            self._check()
            assert self._node is not None
            return self._node.step(samples)
        if self._closed:
            raise GossipError("step() after close()")
        if group.speaker:
            try:
                self._check()
            except GossipError:
                group.finish()  # the others are at this boundary too: tell them
                raise
            assert self._node is not None
            self._node.replica.advance(1, samples * group.replicas)
        applied = group.boundary()
        if group.stopped:
            raise GossipError("the speaking process (rank 0) stopped this node before this "
                              "process did: its averaging failed (see its log), or it called "
                              "step() fewer times")
        return applied

    @property
    def global_step(self) -> int:
        """The step the swarm agrees on, for learning-rate schedules: this node's optimizer
        steps, moved towards its peers' at each exchange (never back). Several processes:
        the speaker's as of the last :meth:`step`, the same in every process."""
        if self._group is not None:
            return self._group.global_step
        assert self._node is not None
        return self._node.global_step

    @property
    def lock(self) -> threading.RLock:
        """Held by the background side while it copies the model. Hold it around
        ``optimizer.step()`` if snapshots must never straddle an optimizer step (it is
        re-entrant: the drift correction's hook takes it inside the step). In a process
        other than the speaker, its own replica's lock, which nothing else takes."""
        if self._replica is not None:
            return self._replica.lock
        if isinstance(self._group, StageGroup) and not self._group.speaker:
            return self._own_lock
        return self.node.replica.lock

    @property
    def node(self) -> SwarmNode:
        """The node (for its roster and replica); use its async methods only via trio.

        Raises:
            GossipError: this process is not the speaker: only rank 0 runs the node.
        """
        if self._node is None:
            raise GossipError(self._not_speaking("node"))
        return self._node

    @property
    def group(self) -> NodeGroup | StageGroup | None:
        """The processes of this node (None: a single process)."""
        return self._group

    @property
    def speaker(self) -> bool:
        """Whether this process runs the node: rank 0, or a single process."""
        return self._group is None or self._group.speaker

    def statistics(self) -> AveragingStatistics:
        """The node's averaging statistics.

        Raises:
            GossipError: the background side failed, or this process is not the speaker.
        """
        self._check()
        return trio.from_thread.run_sync(self.node.statistics, trio_token=self._token)

    def average_now(self) -> Result:
        """Run one averaging round now and wait for it (this one does block).

        Raises:
            GossipError: the background side failed, or this process is not the speaker.
        """
        self._check()
        return trio.from_thread.run(self.node.average_now, trio_token=self._token)

    def close(self) -> None:
        """Stop averaging, leave the swarm and end the background thread. Idempotent.
        Several processes: every process calls it after its last :meth:`step`; the
        speaker's tells the others to stop, theirs waits for that.

        Raises:
            GossipError: the background side had failed; or this process is not the speaker
                and the speaker had not stopped (they called :meth:`step` different numbers
                of times).
        """
        group = self._group
        try:
            if group is not None and not self._closed:
                self._closed = True
                if group.speaker:
                    group.finish()
                else:
                    group.boundary()
                    if not group.stopped:
                        raise GossipError(
                            f"process {group.rank} closed its Averager while the speaking "
                            f"process (rank 0) went on training: the processes called "
                            f"step() different numbers of times")
        finally:
            self._release()
        self._check()

    def __enter__(self) -> "Averager":
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is not None and self._group is not None:
            # The other processes may be anywhere in their step, where a collective from us
            # would pair with one of theirs: leave without one (when this process exits,
            # theirs fail).
            self._closed = True
            self._release()
            return
        self.close()

    # ---- the background thread --------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            if isinstance(self._error, GossipError):
                raise self._error
            raise GossipError(f"the averaging thread failed: {self._error!r}") from self._error

    def _not_speaking(self, what: str) -> str:
        if self._group is None or self._group.speaker:
            return f"Averager.{what}: the node is not running"
        return (f"Averager.{what}: process {self._group.rank} of this node is not the "
                f"speaking process; only rank 0 runs the swarm node (check Averager.speaker)")

    def _abandon(self) -> None:
        """Give up before the node was ready: the speaker tells the others, which wait in
        their :meth:`~gossip.nodegroup.NodeGroup.start`."""
        self._closed = True
        try:
            if self._group is not None:
                self._group.finish()
        finally:
            self._release()

    def _release(self) -> None:
        """Stop the background side and take this process's hooks off the optimizer and the
        model; no collective."""
        thread = self._thread
        if thread is not None and thread.is_alive() and self._token is not None \
                and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        if thread is not None:
            thread.join()
        if self._replica is not None:
            self._replica.close()
        if self._group is not None:
            self._group.close()

    def _follow(self, resumed: int | None) -> None:
        """A follower's start: a replica made as :func:`~gossip.node.open_swarm` makes the
        speaker's (for the drift correction's hook), then the speaker's state."""
        assert self._group is not None
        config = self._config.averaging
        optimizer = self._objects.get("optimizer")
        if not isinstance(self._group, StageGroup):  # a stage keeps its own correction
            self._replica = Replica(self._model, by_samples=config.by_samples,
                                    leak=config.leak,
                                    optimizer=optimizer if config.correction else None,
                                    outer=config.outer_setting)
        try:
            self._group.start(self._replica, resumed)
        except BaseException:
            self._closed = True
            self._release()
            raise
        if self._group.stopped:
            self._closed = True
            self._release()
            raise GossipError("the speaking process (rank 0) gave up before its node was "
                              "ready: its log says why")

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # reported to the script by its next call
            log.error("averaging thread failed: %r", exc)
            self._error = exc
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_swarm(self._model, self._swarm, self._config,
                              **self._objects) as node:
            self._node = node
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._when_ready, node)
                await self._stop.wait()  # close() sets it, ready or not
                nursery.cancel_scope.cancel()

    async def _when_ready(self, node: SwarmNode) -> None:
        await node.wait_ready()
        self._started.set()


def _open_group(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                check_every: int) -> NodeGroup | None:
    """The processes' group when ``torch.distributed`` holds several, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    if optimizer is None and unwrap(model) is model:
        raise GossipError("a node of several processes averages their gradients before the "
                          "optimizer steps: give the Averager optimizer=..., or wrap the model "
                          "in DistributedDataParallel")
    return NodeGroup(model, optimizer, check_every=check_every)  # type: ignore[arg-type]
