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
whose own nursery runs the control socket, the metrics and the training loop. The training
loop waits until the node is ready (a joiner without a checkpoint downloads the swarm's
state first), then alternates: a chunk of steps in a worker thread, then — on the trio side —
counters, the progress line (every ``task.progress_interval`` seconds, however fast the steps)
and, when due, a checkpoint (state copied between chunks, written by a background thread).

Stopping (SIGTERM, SIGINT, or ``task.max_steps``): the current chunk ends after its step, the
node leaves (no new exchanges; one in flight is abandoned and applies nothing; the departure
is gossiped), the deltas already committed are applied, a final checkpoint is written, and
:func:`run` returns. A second signal ends the process at once (exit code 128 + signal).
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import math
import os
import random
import signal
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator

import torch
import trio

import gossip
import gossip.nodegroup
from gossip.address import format_address
from gossip.groups import one_error

from . import checkpoint, processes, sharding
from .config import Config
from .control import ControlError, bind_control, serve_control
from .keys import KeyFileError, encode_options, load_swarm
from .logs import LiveLine
from .metrics import Metrics, MetricsLog
from .rotation import rotation_status
from .status import PeerSteps
from .task import Context, Shard, Task, TaskError, entry_file, load_entry, pick_device
from .train import Chunk, Trainer

__all__ = ["StartupError", "Prepared", "prepare", "run"]

log = logging.getLogger(__name__)

VERSION = gossip.__version__
LOST_GRACE = 60.0  # s a node of several processes may take to stop once one has died


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
    choose_shard: bool = False  # task.shard "auto", no earlier choice holds: choose once joined
    placement: processes.Placement = processes.Placement()  # this process in its node
    group: gossip.nodegroup.NodeGroup | None = None  # a node of several processes: its group
    followers: list[Any] = field(default_factory=list)  # the processes we started (Popen)


class _Step:
    """The task's ``Context.global_step``: the node's step once it runs, the checkpoint's
    until then."""

    def __init__(self) -> None:
        self.start = 0
        self.node: gossip.SwarmNode | None = None
        self.group: gossip.nodegroup.NodeGroup | None = None

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
        except OSError as exc:
            raise _listen_error(config.node.listen, exc) from None
        except processes.ProcessesError as exc:
            raise StartupError(str(exc)) from None
        port = _start_followers(where, argv, followers)
        prepared = _prepare(config, control, where)
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


def _prepare(config: Config, control: socket.socket, where: processes.Placement) -> Prepared:
    data_dir = config.data_dir()
    try:
        identity = gossip.Identity.load_or_generate(config.path(config.node.identity))
        previous = config.swarm.previous_key_file
        swarm = load_swarm(config.swarm.name, config.path(config.swarm.key_file),
                           config.path(previous) if previous else None, config.swarm.cipher)
        if previous:
            log.info("rotating the swarm key: accepting the previous key too previous_key_file=%s",
                     config.path(previous))
        device = (processes.node_device(config.task.device, where) if where.several
                  else pick_device(config.task.device))
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
        first = iter(task.batches(shard))
        batches = itertools.chain([next(first)], first)
    except StopIteration:
        raise StartupError(f"{config.task.entry}: batches({shard}) yields nothing") from None
    except Exception as exc:  # the task's own code: one line names it, the log has the rest
        log.debug("the task's batches() failed", exc_info=True)
        raise StartupError(f"{config.task.entry}: batches({shard}) failed: {exc!r}") from None
    task.model.to(device)
    counters, correction, resumed = None, None, None
    own_steps: int | None = 0
    try:
        found = checkpoint.load_latest(config.path(config.checkpoint.dir))
    except OSError as exc:
        raise StartupError(f"checkpoint.dir {config.path(config.checkpoint.dir)}: "
                           f"{exc.strerror}") from None
    if found is not None:
        resumed, state = found
        try:
            counters, correction = Trainer.restore(task, state)
            own_steps = Trainer.own_steps_in(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise StartupError(f"checkpoint {resumed} does not fit task {config.task.entry}: "
                               f"{str(exc).splitlines()[0]}") from None
    metrics = Metrics()
    try:
        log_file = MetricsLog(config.path(config.metrics.log)) if config.metrics.log else None
    except OSError as exc:
        raise StartupError(f"metrics.log {config.path(config.metrics.log)}: {exc.strerror}") from None
    prepared = Prepared(config, identity, swarm, device, task, batches, counters, correction,
                        resumed, control, metrics, log_file, step)
    step.start = counters.step if counters is not None else 0
    prepared.own_steps = own_steps
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
    p.group = gossip.nodegroup.NodeGroup(p.task.model, p.task.optimizer,
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
    stop = trio.Event()
    service = _Service(prepared, stop, live)
    with one_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(service.watch_signals)
            await service.serve(task_status)
            nursery.cancel_scope.cancel()


class _Service:
    def __init__(self, prepared: Prepared, stop: trio.Event, live: LiveLine | None) -> None:
        self.p = prepared
        self.config = prepared.config
        self.stop = stop
        self.live = live
        self.metrics = prepared.metrics
        self.log_file = prepared.log_file
        self.trainer: Trainer | None = None
        self.node: gossip.SwarmNode | None = None
        self.started = time.monotonic()
        self.last_checkpoint: dict[str, Any] | None = None
        self.writing = trio.Lock()  # one checkpoint write at a time
        self.first_exchange = True
        self.signals = 0
        self.peer_steps = PeerSteps()  # what exchanges and the download said (gossipd status)
        self.evaluation: dict[str, Any] | None = None  # the latest, for gossipd status
        self.shard: Shard | None = None  # the shard we train on, once known (auto: chosen)
        self.failed: gossip.GossipError | None = None  # the node's processes broke apart

    # ---- the pieces -------------------------------------------------------------------

    async def watch_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                self.signals += 1
                if self.signals == 1:
                    log.info("stopping signal=%s: finishing the step, leaving the swarm, "
                             "writing a checkpoint (send it again to exit at once)", name)
                    self.request_stop()
                else:
                    log.warning("second signal=%s: exiting now without a checkpoint", name)
                    logging.shutdown()
                    os._exit(128 + signum)

    def request_stop(self) -> None:
        """Stop training after the current step, and start or accept no more exchanges."""
        self.stop.set()
        if self.trainer is not None:
            self.trainer.stop.set()
        if self.node is not None:
            self.node.stop_averaging()

    async def serve(self, task_status: Any) -> None:
        p, control = self.p, self.config.path(self.config.node.control)
        try:
            await self.serve_node(task_status)
            await self.final_checkpoint()
            if self.failed is not None:
                self.name_the_lost()
                raise self.failed
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
                p.task.model, p.swarm, listen=c.node.listen, advertise=c.node.advertise or None,
                bootstrap=c.swarm.bootstrap, identity=p.identity,
                config=replace(c.averaging.to_averaging(), start=start),
                membership=c.membership(), timeouts=c.averaging.to_timeouts(), task=task_meta,
                counters=p.counters, optimizer=p.task.optimizer, correction=p.correction,
                allow=c.swarm.allow or None, on_exchange=self.on_exchange,
                limits=c.swarm.limits(), reachable=c.node.reachable_setting(),
                network=p.network or gossip.TcpNetwork(c.node.dial_from or None),
            ) as node:
                self.node = p.step.node = node
                self.trainer = Trainer(p.task, node, p.device, p.shard, p.batches, p.own_steps,
                                       p.group)
                if not p.choose_shard:  # fixed, or kept from an earlier run: known now
                    self.shard = p.shard
                    node.roster.set_meta(shard=p.shard.index, shards=p.shard.count)
                if self.stop.is_set():  # a signal while the node was opening
                    self.request_stop()
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
                        nursery.start_soon(self.watch_followers)
                    task_status.started(node.address)
                    await self.train()
                    nursery.cancel_scope.cancel()
                log.info("leaving the swarm peer=%s", node.peer_id.short)
        except OSError as exc:  # node.listen not reserved by prepare (a caller of its own)
            if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL):
                raise _listen_error(c.node.listen, exc) from None
            raise

    # ---- training ---------------------------------------------------------------------

    async def train(self) -> None:
        c, node, trainer = self.config, self.node, self.trainer
        assert node is not None and trainer is not None
        if self.p.choose_shard:
            # As soon as the join's push-pull has brought the swarm's table, not after the
            # download: from then on, other joiners see this node's choice.
            await _race(node.roster.wait_joined, self.stop.wait)
            if not self.stop.is_set():
                await self.choose_shard()
        await _race(node.wait_ready, self.stop.wait)
        if self.stop.is_set():
            await self.finish_group()
            return
        if self.p.group is not None:
            await self.start_group()
        if node.downloaded is not None:
            theirs = node.downloaded.task.get("entry")
            if theirs != c.task.entry:
                log.warning("task mismatch ours=%s theirs=%s: the swarm may train another model",
                            c.task.entry, theirs)
            self.event("download", peer=node.downloaded.peer, step=node.downloaded.step)
            self.peer_steps.heard(node.downloaded.peer, node.downloaded.step, trio.current_time())
        max_steps = c.task.max_steps
        steps_here = 0
        next_progress = trio.current_time() + c.task.progress_interval  # by time: a fast model
        next_checkpoint = trio.current_time() + c.checkpoint.interval
        next_eval = math.inf
        if c.task.eval_every and trainer.task.evaluate is None:
            log.warning("task.eval_every is set but the task has no evaluate(): nothing to run")
        elif c.task.eval_every:
            next_eval = trio.current_time() + c.task.eval_every
        async with trio.open_nursery() as writers:
            while not self.stop.is_set():
                limit = max_steps - steps_here if max_steps else 1 << 62
                try:
                    chunk = await trio.to_thread.run_sync(trainer.chunk, c.task.chunk, limit)
                except (gossip.ProcessLost, gossip.ReplicasDiverged) as exc:
                    self.lost(exc)
                    break
                steps_here += chunk.steps
                self.metrics.trained(chunk.steps, chunk.samples, chunk.loss)
                self.show(chunk)
                if trio.current_time() >= next_progress:  # at most one line per interval
                    next_progress = trio.current_time() + c.task.progress_interval
                    self.progress(chunk)
                if max_steps and steps_here >= max_steps:
                    log.info("stopping reason=max_steps steps=%d", steps_here)
                    self.request_stop()
                elif trio.current_time() >= next_checkpoint and not self.writing.locked():
                    next_checkpoint = trio.current_time() + c.checkpoint.interval
                    state = await self.capture()
                    writers.start_soon(self.periodic_checkpoint, state)
                if trio.current_time() >= next_eval and not self.stop.is_set():
                    next_eval = trio.current_time() + c.task.eval_every
                    await self.evaluate()
        await self.finish_group()

    # ---- a node of several processes --------------------------------------------------

    async def start_group(self) -> None:
        """Every process takes the state the node starts from, and its shard."""
        group, node, trainer, p = self.p.group, self.node, self.trainer, self.p
        assert group is not None and node is not None and trainer is not None
        resumed = p.counters.step if p.resumed is not None and p.counters else None
        try:
            await trio.to_thread.run_sync(group.start, node.replica, resumed)
            await trio.to_thread.run_sync(processes.agree_shard, group, trainer.shard.index)
        except gossip.ProcessLost as exc:
            self.lost(exc)
            return
        log.info("node of %d processes backend=%s: this process speaks for it and trains on "
                 "batches 0, %d, %d, ... of its shard", group.size, group.backend, group.size,
                 2 * group.size)

    async def finish_group(self) -> None:
        """The last step boundary: the other processes stop (none if one died)."""
        group = self.p.group
        if group is None or self.failed is not None:
            return
        try:
            await trio.to_thread.run_sync(group.finish)
        except gossip.ProcessLost as exc:
            self.lost(exc)

    def lost(self, exc: gossip.GossipError) -> None:
        """Another process of the node died (or they diverged): stop as on a signal, then
        exit 1."""
        if self.failed is None:
            self.failed = exc
            log.error("%s: stopping the node (a restart resumes it from its checkpoint)", exc)
        self.request_stop()

    def name_the_lost(self) -> None:
        """Which follower we started has died, and how, when a collective said only that one
        had (the node may stop before :meth:`watch_followers` looks)."""
        ended = [(rank, proc.poll()) for rank, proc in enumerate(self.p.followers, start=1)]
        dead = [(rank, code) for rank, code in ended if code is not None and code < 0] or [
            (rank, code) for rank, code in ended if code]
        # Only in place of a collective's "another process is gone" (which has a cause).
        if dead and self.failed is not None and self.failed.__cause__ is not None:
            rank, code = dead[0]
            self.failed = gossip.ProcessLost(
                f"process {rank} of this node {processes.describe_exit(code)}")
            log.error("%s", self.failed)

    async def watch_followers(self) -> None:
        """Say which process of the node died and how, and stop the node. If training is
        still stuck :data:`LOST_GRACE` seconds later (an NCCL collective waits for a dead
        peer, where gloo notices the closed connection), exit 1 at once: the last periodic
        checkpoint stands."""
        group, followers = self.p.group, list(enumerate(self.p.followers, start=1))
        assert group is not None
        while followers or self.failed is not None:
            if self.failed is not None:
                await trio.sleep(LOST_GRACE)  # cancelled when training returns
                log.error("training is still stuck %.0f s after %s: exiting without a final "
                          "checkpoint", LOST_GRACE, self.failed)
                logging.shutdown()
                for proc in self.p.followers:
                    proc.kill()
                os._exit(1)
            for rank, proc in list(followers):
                code = proc.poll()
                if code is None:
                    continue
                followers.remove((rank, proc))
                if code != 0 or not group.stopped:
                    # Said even when a collective said so first: this names who and how.
                    exc = gossip.ProcessLost(
                        f"process {rank} of this node {processes.describe_exit(code)}")
                    log.error("%s", exc)
                    if self.failed is None or self.failed.__cause__ is not None:
                        self.failed = exc  # in place of a collective's "one is gone"
                    self.request_stop()
            await trio.sleep(0.2)

    async def choose_shard(self) -> None:
        """``task.shard = "auto"``: choose the shard the fewest alive members announce, keep
        the choice, announce it, and train on it (:mod:`daemon.sharding`)."""
        c, node, trainer = self.config, self.node, self.trainer
        assert node is not None and trainer is not None
        shards = c.task.shards
        announced = [(m.shard, m.shards) for m in node.roster.alive()]
        counts = sharding.coverage(shards, announced)
        if not c.swarm.bootstrap:
            index, why = 0, "as the first node of the swarm (no bootstrap address)"
        else:
            index = sharding.choose_shard(shards, announced, random.Random(str(node.peer_id)))
            why = (f"as the least covered: {sum(counts)} of {len(announced)} alive members "
                   f"announce a shard of {shards}; {sharding.describe(counts)}")
        shard = Shard(index, shards)
        path = c.path(sharding.CHOICE_FILE)
        try:
            await trio.to_thread.run_sync(sharding.write_choice, path, index, shards)
        except OSError as exc:  # training goes on; the next run chooses again
            log.warning("cannot keep the shard choice in %s: %s; the next start chooses again",
                        path, exc.strerror)
        log.info("data shard %d of %d, chosen %s", index, shards, why)
        self.event("shard", shard=index, shards=shards, members=len(announced),
                   covering=counts[index])
        node.roster.set_meta(shard=index, shards=shards)
        self.shard = shard
        if shard != trainer.shard:
            batches = await trio.to_thread.run_sync(_first_batches, trainer.task, shard,
                                                    c.task.entry)
            trainer.use_shard(shard, batches)

    def progress(self, chunk: Chunk) -> None:
        node = self.node
        assert node is not None
        stats, peers = node.statistics(), node.roster.statistics().alive
        rate = self.metrics.samples_per_second()
        log.info("progress step=%d loss=%.4f samples_per_s=%.0f peers=%d exchanges=%d pending=%d",
                 stats.step, chunk.loss, rate, peers, stats.committed, stats.pending)
        self.event("progress", step=stats.step, loss=_finite(chunk.loss),
                   samples_per_s=round(rate, 1), peers=peers, exchanges=stats.committed)

    def show(self, chunk: Chunk) -> None:
        if self.live is None or self.node is None:
            return
        stats = self.node.statistics()
        self.live.show(f"step {stats.step}  loss {chunk.loss:.4f}  "
                       f"{self.metrics.samples_per_second():.0f} samples/s  "
                       f"peers {self.node.roster.statistics().alive}  "
                       f"exchanges {stats.committed}")

    # ---- checkpoints ------------------------------------------------------------------

    async def capture(self) -> dict[str, Any]:
        assert self.trainer is not None and self.node is not None
        meta = {"entry": self.config.task.entry, "peer": str(self.node.peer_id),
                "schema": self.node.replica.schema.fingerprint.hex(), "time": time.time()}
        return await trio.to_thread.run_sync(self.trainer.state, meta)

    async def periodic_checkpoint(self, state: dict[str, Any]) -> None:
        """A checkpoint while training: a failure (disk full) is logged and training goes on;
        the previous checkpoint is still there."""
        try:
            await self.write_checkpoint(state)
        except OSError as exc:
            self.metrics.checkpoint_failures.inc()
            log.error("checkpoint failed dir=%s error=%s; training goes on",
                      self.config.path(self.config.checkpoint.dir), exc)

    async def write_checkpoint(self, state: dict[str, Any]) -> None:
        c = self.config
        async with self.writing:
            started = time.monotonic()
            step = state["counters"]["step"]
            path = await trio.to_thread.run_sync(
                lambda: checkpoint.save(c.path(c.checkpoint.dir), state, step=step,
                                        keep=c.checkpoint.keep))
            seconds = time.monotonic() - started
            self.metrics.checkpointed(seconds)
            self.last_checkpoint = {"path": str(path), "step": step, "time": time.time()}
            log.info("checkpoint path=%s step=%d seconds=%.2f", path, step, seconds)
            self.event("checkpoint", path=str(path), step=step, seconds=round(seconds, 3))

    async def final_checkpoint(self) -> None:
        """The checkpoint first (a supervisor's grace period may run out), then the task's
        evaluation, both once the node has left."""
        if self.trainer is None or self.node is None:
            return
        if not self.node.ready:
            # Stopped while fetching the swarm's state: the model is still our own
            # initialization, and a checkpoint of it would make the next start skip the
            # download.
            log.info("stopped before the node was ready: no checkpoint written")
            self.stopped()
            return
        await self.write_checkpoint(await self.capture())
        await self.evaluate()
        self.stopped()

    def stopped(self) -> None:
        """The ``stop`` line and event: this run's totals (:meth:`Metrics.totals`)."""
        assert self.node is not None
        t = self.metrics.totals(self.node)
        uptime = round(time.monotonic() - self.started, 1)
        loss = "-" if t["loss"] is None else f"{t['loss']:.4f}"
        evaluation = "".join(f" eval_{k}={v:.4f}" for k, v in (t["eval"] or {}).items())
        x = t["exchanges"]  # exchanges= is the committed ones, as in the progress line
        log.info("stopped step=%d steps=%d samples=%d loss=%s exchanges=%d failed=%d busy=%d "
                 "rejected=%d invalid=%d no_peer=%d uptime_s=%.1f%s", t["step"], t["steps"],
                 t["samples"], loss, x["committed"], x["failed"], x["busy"], x["rejected"],
                 x["invalid"], x["no_peer"], uptime, evaluation)
        self.event("stop", **t, uptime_s=uptime)

    async def evaluate(self) -> None:
        """The task's evaluation (in the trainer's thread, between chunks): logged, an
        ``eval`` event, and the ``gossip_eval`` gauges."""
        assert self.trainer is not None and self.node is not None
        evaluation = await trio.to_thread.run_sync(self.trainer.evaluate)
        if evaluation:
            log.info("evaluation %s", " ".join(f"{k}={v:.4f}" for k, v in evaluation.items()))
        self.metrics.evaluated(evaluation)
        if evaluation:
            self.evaluation = {"metrics": evaluation, "step": self.node.global_step,
                               "time": time.monotonic()}
        self.event("eval", step=self.node.global_step, **evaluation)

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
        own = node.replica.local_steps  # read once: the trainer's thread goes on counting
        before = self.trainer.own_steps_before if self.trainer is not None else None
        members = [m for m in node.roster.members() if m.peer != me]
        self.peer_steps.keep(m.peer for m in members)
        peers = [{"peer": m.peer, "address": m.address, "state": m.state.name.lower(),
                  **self.peer_steps.of(m, now), "ready": m.ready,
                  "shard": m.shard if m.shards else None, "reachable": m.reachable}
                 for m in members]
        evaluation = None
        if self.evaluation is not None:
            e = self.evaluation
            evaluation = {"metrics": e["metrics"], "step": e["step"],
                          "age_s": round(time.monotonic() - e["time"], 1)}
        return {
            "peer": me, "address": node.address, "swarm": self.p.swarm.name,
            "task": c.task.entry, "schema": node.replica.schema.fingerprint_hex,
            "device": str(self.p.device), "version": VERSION,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "data_dir": str(c.data_dir()),
            **self.metrics.sample(node),
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
            "processes": None if self.p.group is None else _group_status(self.p.group),
            "members": peers,
            "downloaded_from": node.downloaded.peer if node.downloaded else None,
            "shard": None if self.shard is None else self.shard.index,  # None: auto, not yet
            "shards": c.task.shards,
            "last_checkpoint": self.last_checkpoint,
        }


def _first_batches(task: Task, shard: Shard, entry: str) -> Iterator[Any]:
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
        log.debug("the task's batches() failed", exc_info=True)
        raise TaskError(f"{entry}: batches({shard}) failed: {exc!r}") from None


async def _race(*fns: Any) -> None:
    """Wait until the first of the async functions ``fns`` returns, then cancel the rest."""
    async with trio.open_nursery() as nursery:
        async def one(fn: Any) -> None:
            await fn()
            nursery.cancel_scope.cancel()
        for fn in fns:
            nursery.start_soon(one, fn)


def _group_status(group: gossip.nodegroup.NodeGroup) -> dict[str, Any]:
    """A node of several processes, for ``gossipd status``."""
    stats = group.statistics()
    return {"count": group.size, "backend": group.backend, "syncs": stats.syncs,
            "sync_seconds": round(stats.sync_seconds, 3),
            "header_seconds": round(stats.header_seconds, 3),
            "gradient_seconds": round(stats.reduce_seconds, 3), "checks": stats.checks}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
