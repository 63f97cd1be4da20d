"""``gossipd run``: one daemon, from its config to a clean exit.

Theory of operation
-------------------
:func:`prepare` does everything that can fail because of the operator — read the keys, claim
the control socket, load the task, pick the device, find the newest valid checkpoint — before
anything touches the network, and raises :class:`StartupError` with a one-line message.

:func:`run` then owns one nursery (signals) around the node (:func:`gossip.open_swarm`),
whose own nursery runs the control socket, the metrics and the training loop. The training
loop waits until the node is ready (a joiner without a checkpoint downloads the swarm's
state first), then alternates: a chunk of steps in a worker thread, then — on the trio side —
counters, the progress line and, when due, a checkpoint (state copied between chunks, written
by a background thread).

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
import signal
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
import trio

import gossip
from gossip.address import format_address
from gossip.groups import one_error

from . import checkpoint
from .config import Config
from .control import ControlError, bind_control, serve_control
from .keys import KeyFileError, read_swarm_key
from .logs import LiveLine
from .metrics import Metrics, MetricsLog
from .task import Context, Shard, Task, TaskError, load_entry, pick_device
from .train import Chunk, Trainer

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


class _Step:
    """The task's ``Context.global_step``: the node's step once it runs, the checkpoint's
    until then."""

    def __init__(self) -> None:
        self.start = 0
        self.node: gossip.SwarmNode | None = None

    def __call__(self) -> int:
        return self.start if self.node is None else self.node.global_step


def prepare(config: Config) -> Prepared:
    """Check, load and open everything :func:`run` needs that the operator could get wrong,
    in the order they would fix it, before anything touches the network.

    Raises:
        StartupError: with a one-line message.
    """
    data_dir = config.data_dir()
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        control = bind_control(config.path(config.node.control))  # first: no thread yet
    except (OSError, ControlError) as exc:
        raise StartupError(str(exc)) from None
    try:
        return _prepare(config, control)
    except BaseException:
        control.close()
        config.path(config.node.control).unlink(missing_ok=True)
        raise


def _prepare(config: Config, control: socket.socket) -> Prepared:
    data_dir = config.data_dir()
    try:
        identity = gossip.Identity.load_or_generate(config.path(config.node.identity))
        swarm = gossip.Swarm(config.swarm.name, read_swarm_key(config.path(config.swarm.key_file)))
        device = pick_device(config.task.device)
        fn = load_entry(config.task.entry)
    except (OSError, KeyFileError, TaskError, gossip.IdentityError) as exc:
        raise StartupError(str(exc)) from None
    if config.task.threads:
        torch.set_num_threads(config.task.threads)
    shard = Shard(config.task.shard, config.task.shards)
    step = _Step()
    task = _build_task(config, fn, Context(config.task.seed, device, dict(config.task.options),
                                           data_dir / "cache", step))
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
    try:
        found = checkpoint.load_latest(config.path(config.checkpoint.dir))
    except OSError as exc:
        raise StartupError(f"checkpoint.dir {config.path(config.checkpoint.dir)}: "
                           f"{exc.strerror}") from None
    if found is not None:
        resumed, state = found
        try:
            counters, correction = Trainer.restore(task, state)
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
    if config.metrics.prometheus:  # last: it starts a thread
        prepared.metrics_server = _serve_metrics(metrics, config.metrics.prometheus)
    return prepared


def _build_task(config: Config, fn: Any, context: Context) -> Task:
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
        finally:
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
        task_meta = {"entry": c.task.entry, "seed": c.task.seed}
        start = "own" if p.resumed is not None else c.averaging.start
        try:
            async with gossip.open_swarm(
                p.task.model, p.swarm, listen=c.node.listen, advertise=c.node.advertise or None,
                bootstrap=c.swarm.bootstrap, identity=p.identity,
                config=replace(c.averaging.to_averaging(), start=start),
                membership=c.membership(), timeouts=c.averaging.to_timeouts(), task=task_meta,
                counters=p.counters, optimizer=p.task.optimizer, correction=p.correction,
                allow=c.swarm.allow or None, on_exchange=self.on_exchange,
                limits=c.swarm.limits(), network=gossip.TcpNetwork(c.node.dial_from or None),
            ) as node:
                self.node = p.step.node = node
                self.trainer = Trainer(p.task, node, p.device, Shard(c.task.shard, c.task.shards),
                                       p.batches)
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
                    task_status.started(node.address)
                    await self.train()
                    nursery.cancel_scope.cancel()
                log.info("leaving the swarm peer=%s", node.peer_id.short)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise StartupError(f"node.listen {c.node.listen}: address already in use") from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise StartupError(f"node.listen {c.node.listen}: not an address of this "
                                   "machine") from None
            raise

    # ---- training ---------------------------------------------------------------------

    async def train(self) -> None:
        c, node, trainer = self.config, self.node, self.trainer
        assert node is not None and trainer is not None
        await _race(node.wait_ready, self.stop.wait)
        if self.stop.is_set():
            return
        if node.downloaded is not None:
            theirs = node.downloaded.task.get("entry")
            if theirs != c.task.entry:
                log.warning("task mismatch ours=%s theirs=%s: the swarm may train another model",
                            c.task.entry, theirs)
            self.event("download", peer=node.downloaded.peer, step=node.downloaded.step)
        every, max_steps = c.task.progress_every, c.task.max_steps
        steps_here = 0
        next_progress = every
        next_checkpoint = trio.current_time() + c.checkpoint.interval
        next_eval = math.inf
        if c.task.eval_every and trainer.task.evaluate is None:
            log.warning("task.eval_every is set but the task has no evaluate(): nothing to run")
        elif c.task.eval_every:
            next_eval = trio.current_time() + c.task.eval_every
        async with trio.open_nursery() as writers:
            while not self.stop.is_set():
                limit = max_steps - steps_here if max_steps else 1 << 62
                chunk = await trio.to_thread.run_sync(trainer.chunk, c.task.chunk, limit)
                steps_here += chunk.steps
                self.metrics.trained(chunk.steps, chunk.samples, chunk.loss)
                self.show(chunk)
                if steps_here >= next_progress:
                    next_progress = (steps_here // every + 1) * every
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
            self.event("stop", step=self.node.global_step)
            return
        await self.write_checkpoint(await self.capture())
        await self.evaluate()
        log.info("stopped step=%d", self.node.global_step)
        self.event("stop", step=self.node.global_step)

    async def evaluate(self) -> None:
        """The task's evaluation (in the trainer's thread, between chunks): logged, an
        ``eval`` event, and the ``gossip_eval`` gauges."""
        assert self.trainer is not None and self.node is not None
        evaluation = await trio.to_thread.run_sync(self.trainer.evaluate)
        if evaluation:
            log.info("evaluation %s", " ".join(f"{k}={v:.4f}" for k, v in evaluation.items()))
        for metric, value in evaluation.items():
            self.metrics.evaluation.labels(metric).set(value)
        self.event("eval", step=self.node.global_step, **evaluation)

    # ---- observability ----------------------------------------------------------------

    def event(self, name: str, **fields: Any) -> None:
        if self.log_file is not None:
            self.log_file.write(name, **fields)

    def on_exchange(self, exchange: gossip.Exchange) -> None:
        self.metrics.exchange(exchange)
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
        while True:
            snapshot = self.metrics.sample(self.node)
            self.event("metrics", **snapshot)
            await trio.sleep(self.config.metrics.every)

    def status(self) -> dict[str, Any]:
        node, c = self.node, self.config
        assert node is not None
        me = node.peer_id
        peers = [{"peer": m.peer, "address": m.address, "state": m.state.name.lower(),
                  "step": m.step, "ready": m.ready}
                 for m in node.roster.members() if m.peer != me]
        return {
            "peer": me, "address": node.address, "swarm": self.p.swarm.name,
            "task": c.task.entry, "schema": node.replica.schema.fingerprint_hex,
            "device": str(self.p.device), "version": VERSION,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "data_dir": str(c.data_dir()),
            **self.metrics.sample(node),
            "joined": node.roster.joined,
            "members": peers,
            "downloaded_from": node.downloaded.peer if node.downloaded else None,
            "last_checkpoint": self.last_checkpoint,
        }


async def _race(*fns: Any) -> None:
    """Wait until the first of the async functions ``fns`` returns, then cancel the rest."""
    async with trio.open_nursery() as nursery:
        async def one(fn: Any) -> None:
            await fn()
            nursery.cancel_scope.cancel()
        for fn in fns:
            nursery.start_soon(one, fn)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
