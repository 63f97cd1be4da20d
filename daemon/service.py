"""``gossipd run``: one daemon, from its config to a clean exit.

Theory of operation
-------------------
:func:`prepare` does everything that can fail because of the operator — claim the control
socket, bind ``node.listen``, read the keys, load the task, pick the device, find the newest
valid checkpoint — before anything touches the network, and raises :class:`StartupError` with a
one-line message. The cheap checks come first, so that a mistake such as an address in use is
reported at once rather than after the task's imports; each slow phase logs a line as it
begins (importing the task, building it, loading a checkpoint), saying what start-up waits for.

:func:`run` then owns one nursery (signals) around the node (:func:`gossip.open_swarm`),
whose own nursery runs the control socket, the metrics and the training loop
(:class:`daemon.train.Training`, which holds the whole cadence: progress lines, checkpoints,
evaluations, ``task.max_steps``). This module is wiring and lifecycle only: the node of
several processes is :class:`daemon.processes.Speaker`'s, the checkpoint writes
:class:`daemon.checkpoint.Checkpointer`'s.

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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
import trio

import gossip
from gossip import format_address, one_error
from gossip.devices import DeviceError

from . import checkpoint, processes, sharding
from .config import Config
from .control import ControlError, bind_control, serve_control
from .keys import KeyFileError, encode_options, load_swarm
from .logs import LiveLine
from .metrics import Metrics, MetricsLog
from .rotation import rotation_status
from .status import PeerSteps
from .task import Context, Shard, Task, TaskError, entry_file, load_entry
from .cadence import Stop
from .train import Trainer, Training, first_batches, resume

__all__ = ["StartupError", "Prepared", "prepare", "run"]

log = logging.getLogger(__name__)

VERSION = gossip.__version__


class StartupError(Exception):
    """The daemon cannot start as configured (the operator's to fix; exit code 2)."""


@dataclass
class Prepared:
    """What :func:`prepare` found and opened, ready for :func:`run` (which closes it)."""

    config: Config
    identity: gossip.Identity
    swarm: gossip.Swarm
    device: torch.device
    task: Task
    batches: Iterator[Any]  # this node's batches, the first one already drawn (it exists)
    counters: gossip.Counters | None  # from the checkpoint resumed, if any
    correction: Any  # the drift correction saved with it (None: none)
    resumed: Path | None
    control: socket.socket  # the control socket, bound and listening
    metrics: Metrics
    log_file: MetricsLog | None
    step: _Step  # what the task's Context.global_step reads
    metrics_server: Any = None  # prometheus_client's HTTP server, if configured
    network: gossip.TcpNetwork | None = None  # node.listen already bound (reserved) on it
    own_steps: int | None = 0  # our own steps the checkpoint resumed counts (None: unknown)
    shard: Shard = Shard()  # the shard ``batches`` draws from
    outer: Any = None  # the outer step's state saved with the checkpoint (None: none)
    choose_shard: bool = False  # task.shard "auto", no earlier choice holds: choose once joined
    placement: processes.Placement = processes.Placement()  # this process in its node
    group: gossip.NodeGroup | None = None  # a node of several processes: its group
    followers: list[Any] = field(default_factory=list)  # the processes we started (Popen)


class _Step:
    """The task's ``Context.global_step``: the node's step once it runs, the checkpoint's
    until then."""

    def __init__(self) -> None:
        self.start = 0
        self.node: gossip.SwarmNode | None = None
        self.group: gossip.NodeGroup | None = None

    def __call__(self) -> int:
        if self.group is not None and self.group.started:  # every process reads the same
            return self.group.global_step
        return self.start if self.node is None else self.node.global_step


def prepare(config: Config, argv: tuple[str, ...] | None = None) -> Prepared:
    """Check, load and open everything :func:`run` needs that the operator could get wrong,
    in the order they would fix it, before anything touches the network.

    Args:
        argv: the ``gossipd run`` arguments, for the other processes of a node of several
            (``task.processes``). It starts them once the control socket and the listen
            address are its own, so that they build the task while it does
            (:mod:`daemon.processes`), and ends them if its own start-up fails.

    Raises:
        StartupError: with a one-line message.
    """
    data_dir = config.data_dir()
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        control = bind_control(config.path(config.node.control))  # first: no thread yet
    except (OSError, ControlError) as exc:
        raise StartupError(str(exc)) from None
    # Bound now and kept for the node, before the slow phases below: an address in use is
    # reported within moments of launch, and nobody can take it while the task loads.
    network = gossip.TcpNetwork(config.node.dial_from or None)
    followers: list[Any] = []
    try:
        try:
            network.reserve(config.node.listen)
            where = processes.placement(config.task.processes)
            # Before any follower starts: a device this machine lacks fails here, at once.
            device = processes.node_device(config.task.device, where)
        except OSError as exc:
            raise _listen_error(config.node.listen, exc) from None
        except (processes.ProcessesError, DeviceError) as exc:
            raise StartupError(str(exc)) from None
        port = _start_followers(where, argv, followers)
        prepared = _prepare(config, control, where, device)
        prepared.followers = followers
        if where.several:
            _form_group(prepared, port)
    except BaseException:  # Ctrl-C too: no follower left waiting for the group
        processes.stop_followers(followers, grace=0.0)
        network.release()
        control.close()
        config.path(config.node.control).unlink(missing_ok=True)
        raise
    prepared.network = network
    return prepared


def _listen_error(listen: str, exc: OSError) -> StartupError:
    """The one-line error for ``node.listen`` that cannot be bound."""
    if exc.errno == errno.EADDRINUSE:
        return StartupError(f"node.listen {listen}: address already in use")
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"node.listen {listen}: not an address of this machine")
    return StartupError(f"node.listen {listen}: {exc.strerror or exc}")


def _prepare(config: Config, control: socket.socket, where: processes.Placement,
             device: torch.device) -> Prepared:
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
    processes.set_threads(config.task.threads, where, device)
    shard, choose = _first_shard(config)
    step = _Step()
    log.info("building task entry=%s device=%s shard=%d/%d%s: the task function, then its "
             "first batch", config.task.entry, device, shard.index, shard.count,
             " (auto: chosen once joined)" if choose else "")
    task = build_task(config, fn, Context(config.task.seed, device, dict(config.task.options),
                                          data_dir / "cache", step, where.rank, where.size))
    try:
        batches = first_batches(task, shard, config.task.entry)
    except TaskError as exc:
        raise StartupError(str(exc)) from None
    task.model.to(device)
    try:
        found = resume(task, config)
    except TaskError as exc:
        raise StartupError(str(exc)) from None
    counters, correction, resumed, own_steps = ((found.counters, found.correction, found.path,
                                                 found.own_steps) if found is not None
                                                else (None, None, None, 0))
    metrics = Metrics()
    try:
        log_file = MetricsLog(config.path(config.metrics.log)) if config.metrics.log else None
    except OSError as exc:
        raise StartupError(f"metrics.log {config.path(config.metrics.log)}: {exc.strerror}") from None
    prepared = Prepared(config, identity, swarm, device, task, batches, counters, correction,
                        resumed, control, metrics, log_file, step)
    step.start = counters.step if counters is not None else 0
    prepared.own_steps = own_steps
    prepared.outer = found.outer if found is not None else None
    prepared.shard, prepared.choose_shard = shard, choose
    prepared.placement = where
    if config.metrics.prometheus:  # last: it starts a thread
        prepared.metrics_server = _serve_metrics(metrics, config.metrics.prometheus)
    return prepared


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


def _start_followers(where: processes.Placement, argv: tuple[str, ...] | None,
                     followers: list[Any]) -> int | None:
    """Start processes 1..N-1 of a node of several that ``gossipd run`` starts itself (not
    torchrun), into ``followers``; returns the group's rendezvous port (None: torchrun's)."""
    if where.launcher != "gossipd":
        return None
    if argv is None:
        raise StartupError("task.processes > 1 needs the run's arguments to start the other "
                           "processes")
    port = processes.free_port()
    log.info("starting the node's other processes count=%d", where.size - 1)
    try:
        followers.extend(processes.spawn_followers(argv, where.size, port))
    except processes.ProcessesError as exc:
        raise StartupError(str(exc)) from None
    return port


def _form_group(p: Prepared, port: int | None) -> None:
    """Form the node's group, last: every check the operator could fail has passed here,
    and each process has built the task it will train."""
    try:
        processes.init_group(p.placement, p.device, port, p.followers)
    except processes.ProcessesError as exc:
        raise StartupError(str(exc)) from None
    p.group = gossip.NodeGroup(p.task.model, p.task.optimizer,
                                         check_every=p.config.task.check_every,
                                         timeout=processes.COLLECTIVE_TIMEOUT)
    p.step.group = p.group


def build_task(config: Config, fn: Any, context: Context) -> Task:
    """The task ``fn`` returns for ``context``.

    Raises:
        StartupError: it failed, or returned something else than a :class:`Task`.
    """
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


def _serve_metrics(metrics: Metrics, address: str) -> Any:
    try:
        server = metrics.serve(address)
    except OSError as exc:
        raise StartupError(f"metrics.prometheus {address}: {exc.strerror}") from None
    host, port = server.server_address[:2]
    log.info("metrics endpoint address=http://%s/metrics", format_address(host, port))
    return server


async def run(prepared: Prepared, *, live: LiveLine | None = None,
              task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Run the daemon until a signal or ``task.max_steps``; returns after a clean stop.

    Raises:
        StartupError: the listen or metrics address cannot be bound.
        gossip.GossipError: the node failed.
    """
    service = _Service(prepared, live)
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.watch_signals)
            await service.serve(task_status)
            nursery.cancel_scope.cancel()


class _Service:
    """Wiring and lifecycle: open the node, run the training loop (:class:`Training`) beside
    the control socket and the metrics, take signals, and close everything on the way out."""

    def __init__(self, prepared: Prepared, live: LiveLine | None) -> None:
        c = prepared.config
        self.p = prepared
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
        self.peer_steps = PeerSteps()  # what exchanges and the download said (gossipd status)

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
        p, control = self.p, self.config.path(self.config.node.control)
        try:
            await self.serve_node(task_status)
            if self.training is not None:
                await self.training.finish()
            if self.speaker.failed is not None:
                self.speaker.name_the_lost()
                raise self.speaker.failed
        finally:
            if p.group is not None:  # first: a follower still waiting at a boundary (this
                p.group.close()       # process failed otherwise) sees its group close
                processes.leave_group()
            if p.followers:  # stopped by the last boundary; the rest are ended
                await trio.to_thread.run_sync(processes.stop_followers, p.followers)
            if p.network is not None:
                p.network.release()  # what the node did not take, if it never opened
            p.control.close()
            control.unlink(missing_ok=True)
            if p.metrics_server is not None:
                with trio.CancelScope(shield=True):  # shutdown() waits out a 0.5 s poll
                    await trio.to_thread.run_sync(p.metrics_server.shutdown)
                p.metrics_server.server_close()
            if self.log_file is not None:
                self.log_file.close()

    async def serve_node(self, task_status: Any) -> None:
        c, p = self.config, self.p
        task_meta: dict[str, Any] = {"entry": c.task.entry, "seed": c.task.seed}
        try:  # published with the state, and named when a joiner's model differs
            encode_options(c.task.options)
            task_meta["options"] = dict(c.task.options)
        except KeyFileError:
            log.debug("task.options are not published: a join line could not carry them")
        start = "own" if p.resumed is not None else c.averaging.start
        try:
            async with gossip.open_swarm(
                p.task.model, p.swarm, c.node_config(start=start), identity=p.identity,
                task=task_meta, counters=p.counters, optimizer=p.task.optimizer,
                correction=p.correction, outer=p.outer, on_exchange=self.on_exchange,
                network=p.network or gossip.TcpNetwork(c.node.dial_from or None),
            ) as node:
                self.node = p.step.node = node
                trainer = Trainer(p.task, node, p.device, p.shard, p.batches, p.own_steps,
                                  p.group, self.stop)
                resumed = p.counters.step if p.resumed is not None and p.counters else None
                self.training = Training(
                    c, node, trainer, self.stop, self.checkpoints, self.speaker, self.metrics,
                    self.event, live=self.live, peer_steps=self.peer_steps,
                    choose_shard=p.choose_shard, resumed_step=resumed, started=self.started)
                if not p.choose_shard:  # fixed, or kept from an earlier run: known now
                    node.roster.set_meta(shard=p.shard.index, shards=p.shard.count)
                # Start or accept no more exchanges once stopped (at once: a signal while the
                # node was opening).
                self.stop.on_set(node.stop_averaging)
                schema = node.replica.schema.fingerprint_hex
                log.info("start version=%s peer=%s address=%s swarm=%s task=%s device=%s "
                         "schema=%s checkpoint=%s step=%d", VERSION, node.peer_id, node.address,
                         p.swarm.name, c.task.entry, p.device, schema, p.resumed or "none",
                         node.global_step)
                self.event("start", peer=node.peer_id, address=node.address, schema=schema,
                           resumed=str(p.resumed) if p.resumed else None, step=node.global_step)
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
        except OSError as exc:  # node.listen not reserved by prepare (a caller of its own)
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise _listen_error(c.node.listen, exc) from None
            raise

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
            await trio.sleep(self.config.metrics.every)

    def report_clash(self, address: str) -> None:
        """Tell the operator, once, how to resolve an identity clash on this machine."""
        key = self.config.path(self.config.node.identity)
        log.error("identity clash: the node at %s has this node's identity key (%s), as a "
                  "copied data directory does; neither node can average. Never copy "
                  "identity.key: on the copy, stop the daemon, delete its identity.key (a new "
                  "one is made at start) and start it again", address, key)
        self.event("identity_clash", address=address, identity=str(key))

    def join_trouble(self, node: gossip.SwarmNode) -> dict[str, Any] | None:
        """Why this node cannot join, for ``gossipd status``: None once it has joined."""
        trouble = node.roster.trouble
        if trouble is None or node.roster.joined:
            return None
        return {"seconds": round(trio.current_time() - trouble.since, 1),
                "attempts": trouble.attempts, "reasons": dict(trouble.reasons)}

    def status(self) -> dict[str, Any]:
        node, c = self.node, self.config
        assert node is not None
        me, now = node.peer_id, trio.current_time()
        training = self.training
        assert training is not None
        own = node.replica.local_steps  # read once: the trainer's thread goes on counting
        before = training.trainer.own_steps_before
        members = [m for m in node.roster.members() if m.peer != me]
        self.peer_steps.keep(m.peer for m in members)
        peers = [{"peer": m.peer, "address": m.address, "state": m.state.name.lower(),
                  **self.peer_steps.of(m, now), "ready": m.ready,
                  "shard": m.shard if m.shards else None, "reachable": m.reachable}
                 for m in members]
        evaluation = None
        if training.evaluation is not None:
            e = training.evaluation
            evaluation = {"metrics": e["metrics"], "step": e["step"],
                          "age_s": round(time.monotonic() - e["time"], 1)}
        return {
            "peer": me, "address": node.address, "swarm": self.p.swarm.name,
            "task": c.task.entry, "schema": node.replica.schema.fingerprint_hex,
            "device": str(self.p.device), "version": VERSION,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "data_dir": str(c.data_dir()),
            **self.metrics.sample(node),
            "every": c.averaging.every,  # as configured: "auto" means spacing is measured
            "own_steps": own,
            "own_steps_total": None if before is None else before + own,
            "evaluation": evaluation,
            "eval_every": c.task.eval_every,
            "joined": node.roster.joined,
            "join_trouble": self.join_trouble(node),
            "clash": node.roster.clash,
            "rotation": rotation_status(self.p.swarm, (
                m.address for m in members
                if m.state in (gossip.State.ALIVE, gossip.State.SUSPECT))),
            "reachability": asdict(node.roster.reachability),
            "processes": self.speaker.status(),
            "members": peers,
            "downloaded_from": node.downloaded.peer if node.downloaded else None,
            # None: task.shard "auto", not chosen yet
            "shard": None if training.shard is None else training.shard.index,
            "shards": c.task.shards,
            "last_checkpoint": self.checkpoints.last,
        }
