"""``gossipd run``: one daemon, from its config to a clean exit.

Theory of operation
-------------------
:func:`open_prepared` owns start-up. It does everything that can fail because of the
operator — claim the control socket, bind ``node.listen``, read the keys, load the task, pick
the device, find the newest valid checkpoint — before anything touches the network, and raises
:class:`daemon.startup.StartupError` with a one-line message. The cheap checks come first, so
that a mistake such as an address in use is reported at once rather than after the task's
imports; each slow phase logs a line as it begins (importing the task, building it, loading a
checkpoint), saying what start-up waits for. Every resource it opens — the control socket,
the listen reservation, the other processes of a node of several, their group, the metrics
log and endpoint — is pushed on one :class:`contextlib.AsyncExitStack` as it is acquired, so
that a failure at any point, and the end of the run, release what is open in reverse order;
what it yields, :class:`Prepared`, is built once and frozen. The steps a follower process
shares (device, task, global step) are :mod:`daemon.startup`'s.

:func:`run` then watches signals around :func:`open_prepared`'s body (and its release: a
second signal still ends the process while the other processes are waited for), which opens
the node (:func:`gossip.open_swarm`) whose own nursery runs the control socket, the metrics
and the training loop (:class:`daemon.train.Training`, which holds the whole cadence: progress
lines, checkpoints, evaluations, ``task.max_steps``). This module is wiring, lifecycle and the
log lines of exchanges and identity clashes: the node of several processes is
:class:`daemon.processes.Speaker`'s, the checkpoint writes
:class:`daemon.checkpoint.Checkpointer`'s, the ``gossipd status`` reply :mod:`daemon.status`'s.

Stopping (SIGTERM, SIGINT, ``task.max_steps``, or a lost process of the node) sets the one
stop flag (:class:`daemon.cadence.Stop`): the current chunk ends after its step, the node
leaves (no new exchanges; one in flight is abandoned and applies nothing; the departure is
gossiped), the deltas already committed are applied, a final checkpoint is written, and
:func:`run` returns. A second signal ends the process at once (exit code 128 + signal).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import trio

import gossip
import gossip.lowlevel
from gossip.lowlevel import format_address, one_error

from . import checkpoint, processes, sharding
from .cadence import Stop
from .config import Config
from .control import ControlError, bind_control, serve_control
from .keys import KeyFileError, encode_options, load_swarm
from .logs import LiveLine
from .metrics import Metrics, MetricsLog
from .startup import (GlobalStep, Group, StartupError, build_task, resolve_device,
                      stage_pipeline, staged_task)
from .status import StepReports, status_reply
from .task import Shard, Task, TaskError, entry_file, load_entry
from .train import Resumed, Trainer, Training, first_batches, resume

__all__ = ["Prepared", "open_prepared", "run"]

log = logging.getLogger(__name__)

VERSION = gossip.__version__


@dataclass(frozen=True)
class Prepared:
    """What :func:`open_prepared` found and opened, for the run (and released by it)."""

    config: Config
    identity: gossip.Identity
    swarm: gossip.Swarm
    placement: processes.Placement  # this process in its node
    device: torch.device
    task: Task
    shard: Shard  # the shard ``batches`` draws from
    choose_shard: bool  # task.shard "auto", no earlier choice holds: choose once joined
    batches: Iterator[Any]  # this node's batches, the first one already drawn (it exists)
    found: Resumed | None  # the checkpoint resumed (None: none)
    step: GlobalStep  # what the task's Context.global_step reads
    control: socket.socket  # the control socket, bound and listening
    network: gossip.lowlevel.TcpNetwork  # node.listen already bound (reserved) on it
    metrics: Metrics
    log_file: MetricsLog | None
    followers: tuple[subprocess.Popen, ...]  # the processes we started
    group: Group | None  # a node of several processes: its group


@asynccontextmanager
async def open_prepared(config: Config,
                        argv: tuple[str, ...] | None = None) -> AsyncIterator[Prepared]:
    """Check, load and open everything the run needs that the operator could get wrong, in
    the order they would fix it, before anything touches the network; release it all on the
    way out, in reverse order, whatever ends the run or start-up.

    Args:
        argv: the ``gossipd run`` arguments, for the other processes of a node of several
            (``task.processes``). It starts them once the control socket and the listen
            address are its own, so that they build the task while it does
            (:mod:`daemon.processes`), and ends them if its own start-up fails.

    Raises:
        StartupError: with a one-line message.
    """
    async with AsyncExitStack() as stack:
        yield _acquire(stack, config, argv)


def _acquire(stack: AsyncExitStack, config: Config, argv: tuple[str, ...] | None) -> Prepared:
    """Open each resource in turn, pushing its release on ``stack`` as soon as it is open."""
    control = _claim_control(stack, config)
    # Bound now and kept for the node, before the slow phases below: an address in use is
    # reported within moments of launch, and nobody can take it while the task loads.
    network = gossip.lowlevel.TcpNetwork(config.node.dial_from or None)
    stack.callback(network.release)  # what the node did not take, if it never opened
    try:
        network.reserve(config.node.listen)
    except OSError as exc:
        raise _listen_error(config.node.listen, exc) from None
    try:
        where = processes.placement(config.task.processes, pipeline=config.task.pipeline)
    except processes.ProcessesError as exc:
        raise StartupError(str(exc)) from None
    # Before any follower starts: a device this machine lacks fails here, at once.
    device = resolve_device(config.task.device, where)
    followers, port = _start_followers(stack, where, argv)
    identity, swarm, fn = _load_keys_and_entry(config)
    processes.set_threads(config.task.threads, where, device)
    shard, choose = _first_shard(config)
    step = GlobalStep()
    log.info("building task entry=%s device=%s shard=%d/%d%s: the task function, then its "
             "first batch", config.task.entry, device, shard.index, shard.count,
             " (auto: chosen once joined)" if choose else "")
    task = build_task(config, fn, where, device, step)
    try:
        batches = first_batches(task, shard, config.task.entry)
        if not where.pipelined:  # a pipelined node moves each stage's part alone
            task.model.to(device)
        found = resume(task, config)
    except TaskError as exc:
        raise StartupError(str(exc)) from None
    if found is not None:
        step.start_at(found.counters.step)
    metrics, log_file = Metrics(), _open_log(stack, config)
    if config.metrics.prometheus:  # last but the group: it starts a thread
        _serve_metrics(stack, metrics, config.metrics.prometheus)
    group, task = _form_group(stack, config, where, device, task, port, followers)
    if group is not None:
        step.follow_group(group)
    return Prepared(config, identity, swarm, where, device, task, shard, choose, batches,
                    found, step, control, network, metrics, log_file, followers, group)


def _claim_control(stack: AsyncExitStack, config: Config) -> socket.socket:
    """The data directory made and the control socket bound, first: no thread yet."""
    path = config.path(config.node.control)
    try:
        config.data_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
        control = bind_control(path)
    except (OSError, ControlError) as exc:
        raise StartupError(str(exc)) from None
    stack.callback(path.unlink, missing_ok=True)
    stack.callback(control.close)
    return control


def _listen_error(listen: str, exc: OSError) -> StartupError:
    """The one-line error for ``node.listen`` that cannot be bound."""
    if exc.errno == errno.EADDRINUSE:
        return StartupError(f"node.listen {listen}: address already in use")
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"node.listen {listen}: not an address of this machine")
    return StartupError(f"node.listen {listen}: {exc.strerror or exc}")


def _start_followers(stack: AsyncExitStack, where: processes.Placement,
                     argv: tuple[str, ...] | None) -> tuple[tuple[subprocess.Popen, ...],
                                                             int | None]:
    """Start processes 1..N-1 of a node of several that ``gossipd run`` starts itself (not
    torchrun); returns them and the group's rendezvous port (None: torchrun's). Released by
    ending them at once: until the group forms they wait for it (once it has, its release
    waits for them first)."""
    if where.launcher != "gossipd":
        return (), None
    if argv is None:
        raise StartupError("task.processes > 1 needs the run's arguments to start the other "
                           "processes")
    port = processes.free_port()
    log.info("starting the node's other processes count=%d", where.size - 1)
    try:
        followers = tuple(processes.spawn_followers(argv, where.size, port))
    except processes.ProcessesError as exc:
        raise StartupError(str(exc)) from None
    stack.callback(processes.stop_followers, followers, grace=0.0)
    return followers, port


def _load_keys_and_entry(config: Config) -> tuple[gossip.Identity, gossip.Swarm, Any]:
    """This node's identity, the swarm's keys and the task function."""
    data_dir = config.data_dir()
    try:
        identity = gossip.Identity.load_or_generate(config.path(config.node.identity))
        previous = config.swarm.previous_key_file
        swarm = load_swarm(config.swarm.name, config.path(config.swarm.key_file),
                           config.path(previous) if previous else None, config.swarm.cipher)
        if previous:
            log.info("rotating the swarm key: accepting the previous key too previous_key_file=%s",
                     config.path(previous))
        file = entry_file(config.task.entry, data_dir)
        log.info("importing task entry=%s%s", config.task.entry, f" file={file}" if file else "")
        fn = load_entry(config.task.entry, data_dir)
    except (OSError, KeyFileError, TaskError, gossip.IdentityError,
            processes.ProcessesError) as exc:
        raise StartupError(str(exc)) from None
    return identity, swarm, fn


def _first_shard(config: Config) -> tuple[Shard, bool]:
    """The shard start-up draws its first batch from, and whether the node must still choose
    its shard once joined (:mod:`daemon.sharding`): a fixed ``task.shard``; with ``"auto"``
    the choice an earlier run kept, if it holds for ``task.shards``, or else shard 0 until the
    node has chosen."""
    shards = config.task.shards
    if config.task.shard != "auto":
        return Shard(int(config.task.shard), shards), False
    path = config.path(sharding.CHOICE_FILE)
    try:
        kept = sharding.read_choice(path, shards)
    except OSError as exc:
        raise StartupError(f"task.shard auto: cannot read {path}: {exc.strerror}") from None
    return Shard(kept or 0, shards), kept is None


def _open_log(stack: AsyncExitStack, config: Config) -> MetricsLog | None:
    """The events log (``metrics.log``; None: none), closed last of the run's writers."""
    if not config.metrics.log:
        return None
    try:
        log_file = MetricsLog(config.path(config.metrics.log))
    except OSError as exc:
        raise StartupError(f"metrics.log {config.path(config.metrics.log)}: {exc.strerror}") from None
    stack.callback(log_file.close)
    return log_file


def _serve_metrics(stack: AsyncExitStack, metrics: Metrics, address: str) -> None:
    """The Prometheus endpoint, shut down on the way out."""
    try:
        server = metrics.serve(address)
    except OSError as exc:
        raise StartupError(f"metrics.prometheus {address}: {exc.strerror}") from None
    host, port = server.server_address[:2]
    log.info("metrics endpoint address=http://%s/metrics", format_address(host, port))

    async def shut_down() -> None:
        with trio.CancelScope(shield=True):  # shutdown() waits out a 0.5 s poll
            await trio.to_thread.run_sync(server.shutdown)
        server.server_close()

    stack.push_async_callback(shut_down)


def _form_group(stack: AsyncExitStack, config: Config, where: processes.Placement,
                device: torch.device, task: Task, port: int | None,
                followers: Sequence[subprocess.Popen]) -> tuple[Group | None, Task]:
    """A node of several processes: form its group, last: every check the operator could
    fail has passed here, and each process has built the task it will train. None for a node
    of one process. A pipelined node's task comes back as its speaker trains it: the whole
    model on the host (the mirror), its optimizer, the pipeline's step."""
    if not where.several:
        return None, task
    try:
        processes.init_group(where, device, port, followers)
    except processes.ProcessesError as exc:
        raise StartupError(str(exc)) from None

    async def leave() -> None:  # last: once formed, on every way out
        processes.leave_group()
        if followers:  # stopped by the last boundary; the rest are ended
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(processes.stop_followers, followers)

    stack.push_async_callback(leave)
    group: Group
    if where.pipelined:
        try:
            pipeline = stage_pipeline(config, task, device)
        except gossip.ProcessLost as exc:  # a stage that failed its own start-up
            raise StartupError(f"the node's stages could not start together: {exc}") from None
        stack.callback(pipeline.close)
        group, task = pipeline.boundaries, staged_task(task, pipeline)
    else:
        group = gossip.NodeGroup(task.model, task.optimizer, check_every=config.task.check_every,
                                 timeout=processes.COLLECTIVE_TIMEOUT)
    # First on the way out: a follower still waiting at a boundary sees its group close.
    stack.callback(group.close)
    return group, task


async def run(config: Config, argv: tuple[str, ...] | None = None, *,
              live: LiveLine | None = None,
              task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Start, then run the daemon until a signal or ``task.max_steps``; returns after a clean
    stop, everything released.

    Args:
        argv: as :func:`open_prepared` takes it.

    Raises:
        StartupError: the daemon cannot start as configured (:func:`open_prepared`), or the
            listen address cannot be bound.
        gossip.GossipError: the node failed.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            async with open_prepared(config, argv) as prepared:
                if prepared.found is not None:  # said under the CLI's name, as it always was
                    logging.getLogger("daemon").info("resuming checkpoint=%s step=%d",
                                                     prepared.found.path,
                                                     prepared.found.counters.step)
                service = _Service(prepared, live)
                nursery.start_soon(service.watch_signals)  # until everything is released
                await service.serve(task_status)
            nursery.cancel_scope.cancel()


class _Service:
    """Wiring and lifecycle: open the node, run the training loop (:class:`Training`) beside
    the control socket and the metrics, and take signals; :func:`open_prepared` closes what
    start-up opened."""

    def __init__(self, prepared: Prepared, live: LiveLine | None) -> None:
        c = prepared.config
        self.prepared = prepared
        self.config = c
        self.stop = Stop()  # the one stop flag: signals, max_steps, a lost process, the trainer
        self.live = live
        self.metrics = prepared.metrics
        self.log_file = prepared.log_file
        self.node: gossip.SwarmNode | None = None
        self.training: Training | None = None  # once the node is open
        self.started = time.monotonic()
        self.checkpoints = checkpoint.Checkpointer(c.path(c.checkpoint.dir), c.checkpoint.keep,
                                                   self.metrics, self.event)
        self.speaker = processes.Speaker(prepared.group, prepared.followers, self.stop)
        self.first_exchange = True
        self.signals = 0
        self.peer_steps = StepReports()  # what exchanges and the download said (gossipd status)

    async def watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                self.signals += 1
                if self.signals == 1:
                    log.info("stopping signal=%s: finishing the step, leaving the swarm, "
                             "writing a checkpoint (send it again to exit at once)", name)
                    self.stop.set()
                else:
                    log.warning("second signal=%s: exiting now without a checkpoint", name)
                    logging.shutdown()
                    os._exit(128 + signum)

    async def serve(self, task_status: Any) -> None:
        await self.serve_node(task_status)
        if self.training is not None:
            await self.training.finish()
        if self.speaker.failed is not None:
            self.speaker.name_the_lost()
            raise self.speaker.failed

    async def serve_node(self, task_status: Any) -> None:
        c, p = self.config, self.prepared
        found = p.found
        task_meta: dict[str, Any] = {"entry": c.task.entry, "seed": c.task.seed}
        try:  # published with the state, and named when a joiner's model differs
            encode_options(c.task.options)
            task_meta["options"] = dict(c.task.options)
        except KeyFileError:
            log.debug("task.options are not published: a join line could not carry them")
        try:
            async with gossip.open_swarm(
                p.task.model, p.swarm, c.node_config(), identity=p.identity,
                task=task_meta, counters=found.counters if found else None,
                optimizer=p.task.optimizer, correction=found.correction if found else None,
                outer=found.outer if found else None, on_exchange=self.on_exchange,
                network=p.network,
            ) as node:
                self.node = node
                p.step.follow_node(node)
                trainer = Trainer(p.task, node, p.device, p.shard, p.batches,
                                  found.own_steps if found else 0, p.group, self.stop)
                self.training = Training(
                    c, node, trainer, self.stop, self.checkpoints, self.speaker, self.metrics,
                    self.event, live=self.live, peer_steps=self.peer_steps,
                    choose_shard=p.choose_shard,
                    resumed_step=found.counters.step if found else None, started=self.started)
                if not p.choose_shard:  # fixed, or kept from an earlier run: known now
                    node.roster.set_meta(shard=p.shard.index, shards=p.shard.count)
                # Start or accept no more exchanges once stopped (at once: a signal while the
                # node was opening).
                self.stop.on_set(node.stop_averaging)
                schema = node.replica.schema.fingerprint_hex
                resumed = found.path if found else None
                log.info("start version=%s peer=%s address=%s swarm=%s task=%s device=%s "
                         "schema=%s checkpoint=%s step=%d", VERSION, node.peer_id, node.address,
                         p.swarm.name, c.task.entry, p.device, schema, resumed or "none",
                         node.global_step)
                self.event("start", peer=node.peer_id, address=node.address, schema=schema,
                           resumed=str(resumed) if resumed else None, step=node.global_step)
                async with trio.open_nursery() as nursery:
                    await nursery.start(functools.partial(
                        serve_control, c.path(c.node.control), {"status": self.status},
                        sock=p.control))
                    nursery.start_soon(self.metrics_loop)
                    if p.followers:
                        nursery.start_soon(self.speaker.watch)
                    task_status.started(node.address)
                    await self.training.run()
                    nursery.cancel_scope.cancel()
                log.info("leaving the swarm peer=%s", node.peer_id.short)
        except OSError as exc:  # the reservation lost (not expected: a last line of defence)
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise _listen_error(c.node.listen, exc) from None
            raise

    def status(self) -> dict[str, Any]:
        """The ``gossipd status`` reply (:func:`daemon.status.status_reply`)."""
        return status_reply(self, trio.current_time())

    # ---- observability ----------------------------------------------------------------

    def event(self, name: str, **fields: Any) -> None:
        if self.log_file is not None:
            self.log_file.write(name, **fields)

    def on_exchange(self, exchange: gossip.Exchange) -> None:
        self.metrics.exchange(exchange)
        if exchange.step is not None:
            self.peer_steps.heard(exchange.peer, exchange.step, trio.current_time())
        r = exchange.result
        level = (logging.INFO if r is gossip.Result.COMMITTED
                 else logging.DEBUG if r is gossip.Result.BUSY else logging.WARNING)
        distance = "-" if exchange.distance is None else f"{exchange.distance:.4g}"
        log.log(level, "exchange peer=%s result=%s initiated=%d seconds=%.3f distance=%s",
                exchange.peer.short, r.value, exchange.initiated, exchange.duration, distance)
        self.event("exchange", peer=exchange.peer, result=r.value, initiated=exchange.initiated,
                   seconds=round(exchange.duration, 4), distance=exchange.distance)
        if self.first_exchange and r is gossip.Result.COMMITTED:
            self.first_exchange = False
            self.event("first_exchange", uptime=round(time.monotonic() - self.started, 3))

    async def metrics_loop(self) -> None:
        assert self.node is not None
        clash = None
        while True:
            snapshot = self.metrics.sample(self.node)
            self.event("metrics", **snapshot)
            if self.node.roster.clash != clash:  # a new clash, or one resolved
                clash = self.node.roster.clash
                if clash is not None:
                    self.report_clash(clash)
            # Only members' steps are kept: exchanges with newcomers must not grow it.
            self.peer_steps.keep(m.peer for m in self.node.roster.members())
            await trio.sleep(self.config.metrics.interval)

    def report_clash(self, address: str) -> None:
        """Tell the operator, once, how to resolve an identity clash on this machine."""
        key = self.config.path(self.config.node.identity)
        log.error("identity clash: the node at %s has this node's identity key (%s), as a "
                  "copied data directory does; neither node can average. Never copy "
                  "identity.key: on the copy, stop the daemon, delete its identity.key (a new "
                  "one is made at start) and start it again", address, key)
        self.event("identity_clash", address=address, identity=str(key))

