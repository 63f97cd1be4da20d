"""A node of several processes: which one this is, starting the others, and what they do.

Theory of operation
-------------------
With ``task.processes = N`` (N > 1), ``gossipd run`` is process 0 of its node, the one that
speaks to the swarm: it starts N − 1 *followers* (``gossipd run`` again, with the same
arguments, told its rank by the environment variables torchrun sets) as soon as its control
socket and listen address are its own, so that they import and build the task while it does
(and it ends them if its own start-up fails); then the N processes form a ``torch.distributed``
group (NCCL on CUDA, gloo on the CPU) on 127.0.0.1. Under ``torchrun`` the same variables come
from torchrun instead, and each process it starts is ``gossipd run``: rank 0 speaks, the others
follow. :mod:`gossip.nodegroup` keeps the processes' models identical.

A follower reads the same config, builds the same task, resumes the same checkpoint (only
the speaker writes them; the optimizer's state is never sent between processes, so each loads
it from the file) and then only trains: a step boundary, one step on its batch, again, until
the speaker's last boundary says stop. It binds no address, has no identity, no control
socket and no metrics. Each process of a node trains on every N-th batch of the node's
shard (process ``r`` on batches ``r``, ``r + N``, ...): the node as a whole sees what a single
process would, N batches a step.

Failures: a process that dies breaks the group's collectives and the others' next one raises
(:class:`gossip.ProcessLost`). The speaker then stops the node as it would on a signal — the
swarm told, a final checkpoint of the last whole step written — and exits 1, so that a
supervisor's restart resumes it; a follower exits 1 at once. The speaker also watches the
followers it started, and says which one died and how. Followers started by ``gossipd run``
live in their own session, so a terminal's Ctrl-C reaches the speaker alone, which stops them
in order; a follower's first SIGINT or SIGTERM (torchrun forwards them to every process) is
noted and the follower waits for the speaker's stop; a second one ends it at once.

On the speaker's trio side, :class:`Speaker` brings the group to the node's starting state,
stops it at the last step boundary, and turns a lost process into the daemon's stop and its
exit code 1.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, Sequence

import torch
import torch.distributed as dist
import trio

import gossip
from gossip import NodeGroup
from gossip.lowlevel import Replica, StageGroup

from .logs import RUN

if TYPE_CHECKING:
    from .cadence import Stop

__all__ = ["Placement", "ProcessesError", "Speaker", "agree_shard", "describe_exit",
           "die_with_parent", "exit_now", "init_group", "leave_group", "placement",
           "set_threads", "spawn_followers", "stop_followers"]

log = logging.getLogger(__name__)
run_log = logging.getLogger(RUN)

SPAWNED = "GOSSIPD_NODE_PROCESS"  # the followers gossipd run starts: its pid (not torchrun's)
START_TIMEOUT = 600.0  # s for every process to reach the group at start-up (a big task's build)
# The step headers wait for the speaker for as long as it takes (a download on a thin link, a
# long evaluation); gloo notices a process that dies by its closed connections, not by a
# timeout. NCCL's collectives (gradients, state) start only once every process has passed the
# header, so theirs can be short: it is what ends a process stuck on a dead peer.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)
NCCL_TIMEOUT = datetime.timedelta(minutes=10)
LOST_GRACE = 60.0  # s a node of several processes may take to stop once one has died


class ProcessesError(Exception):
    """The node's processes cannot be set up as configured (the operator's to fix)."""


@dataclass(frozen=True)
class Placement:
    """This process's place in its node: rank ``rank`` of ``size``, on local GPU
    ``local_rank``; ``launcher`` is "gossipd" (task.processes), "torchrun", or "" (one)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launcher: str = ""
    pipelined: bool = False  # the processes are pipeline stages (task.pipeline), not replicas

    @property
    def speaker(self) -> bool:
        return self.rank == 0

    @property
    def several(self) -> bool:
        return self.size > 1


def placement(processes: int, env: Any = None, pipeline: int = 1) -> Placement:
    """Where this process stands: from torchrun's variables (``WORLD_SIZE``, ``RANK``,
    ``LOCAL_RANK``) when they name more than one process, else from ``task.processes`` (or
    ``task.pipeline``: one process per stage).

    Raises:
        ProcessesError: the variables are malformed, or disagree with ``task.processes``
            or ``task.pipeline``.
    """
    env = os.environ if env is None else env
    staged = pipeline > 1
    if staged:
        processes = pipeline
    if env.get("WORLD_SIZE", "1") in ("", "1"):
        return Placement(0, processes, 0, "gossipd" if processes > 1 else "", staged)
    try:
        size, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local = int(env.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise ProcessesError("WORLD_SIZE is set but RANK or LOCAL_RANK is missing or not an "
                             "integer: start a node of several processes with "
                             "task.processes, or under torchrun") from None
    if not (0 <= rank < size and 0 <= local < size):
        raise ProcessesError(f"RANK {rank} / LOCAL_RANK {local} out of range for WORLD_SIZE "
                             f"{size}")
    if env.get("LOCAL_WORLD_SIZE", str(size)) != str(size) or local != rank:
        raise ProcessesError(f"torchrun spans {size} processes over several machines: a node "
                             f"is one machine, so run one torchrun per machine "
                             f"(--nnodes 1), each its own node")
    if staged and pipeline != size:
        raise ProcessesError(f"task.pipeline is {pipeline} but torchrun started {size}: "
                             f"start one process per stage")
    if processes not in (1, size):
        raise ProcessesError(f"task.processes is {processes} but torchrun started {size}: "
                             f"leave task.processes at 1 under torchrun, or set it equal")
    return Placement(rank, size, local, "gossipd" if env.get(SPAWNED) else "torchrun", staged)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nobody uses for TCP or UDP right now: the group's rendezvous
    needs TCP, a daemon both. Another process may still take it before it is bound: tests on
    a shared machine should use an address of their own (``127.0.0.x``).

    Raises:
        OSError: no such port was found in 100 tries.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as tcp:
            tcp.bind((host, 0))
            port = tcp.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
                try:
                    udp.bind((host, port))
                except OSError:
                    continue
                return int(port)
    raise OSError(f"no port free for both TCP and UDP on {host}")


def spawn_followers(argv: Sequence[str], size: int, port: int) -> list[subprocess.Popen]:
    """Start processes 1..size-1 of this node: ``python -m daemon`` with ``argv`` (the
    speaker's own ``run`` arguments) and torchrun's variables, each in a session of its own.

    Raises:
        ProcessesError: a process cannot be started.
    """
    followers = []
    for rank in range(1, size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "WORLD_SIZE": str(size), "RANK": str(rank), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(size), SPAWNED: str(os.getpid())}
        try:
            followers.append(subprocess.Popen([sys.executable, "-m", "daemon", *argv], env=env,
                                              start_new_session=True, stdin=subprocess.DEVNULL))
        except OSError as exc:
            stop_followers(followers, grace=0.0)
            raise ProcessesError(f"cannot start process {rank} of this node: {exc}") from None
    return followers


def init_group(where: Placement, device: torch.device, port: int | None = None,
               followers: Sequence[subprocess.Popen] = ()) -> None:
    """Join the node's ``torch.distributed`` group (NCCL on CUDA, gloo on the CPU), on
    torchrun's rendezvous or on ``port``. The speaker waits at most :data:`START_TIMEOUT` for
    the others, and gives up as soon as a follower it started exits.

    Raises:
        ProcessesError: a follower exited first, or the group did not form in time.
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    method = "env://" if port is None else f"tcp://127.0.0.1:{port}"
    done = threading.Event()
    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(
                backend, init_method=method, rank=where.rank, world_size=where.size,
                timeout=COLLECTIVE_TIMEOUT if backend == "gloo" else NCCL_TIMEOUT)
        except BaseException as exc:  # reported by the waiting thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=join, name="gossipd-group", daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT
    log.info("forming the node's group processes=%d backend=%s rank=%d", where.size, backend,
             where.rank)
    while not done.wait(0.2):
        for rank, proc in enumerate(followers, start=1):
            code = proc.poll()
            if code is not None:
                raise ProcessesError(f"process {rank} of this node {describe_exit(code)} while "
                                     f"starting (its own lines above say why)")
        if time.monotonic() > deadline:
            raise ProcessesError(f"the node's {where.size} processes did not all start within "
                                 f"{START_TIMEOUT:.0f} s")
    if failure:
        raise ProcessesError(f"cannot form the node's group: {failure[0]}") from None


def agree_shard(group: NodeGroup | StageGroup, index: int) -> int:
    """The speaker's shard index, in every process of the node (after the group's start: the
    speaker may choose it once joined).

    Raises:
        gossip.ProcessLost: another process of the node died.
    """
    return group.share(index)


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the process that started it dies (Linux),
    so that a follower never outlives a speaker killed while an NCCL collective waits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the collectives' own errors must do
        return
    # The parent died before the call (a check against its pid: it may itself be pid 1, in
    # a container, where a reparented process's parent is also 1).
    if str(os.getppid()) != os.environ.get(SPAWNED):
        os._exit(1)


def leave_group() -> None:
    """Leave the node's group before exiting: a gloo group still open at interpreter exit
    aborts the process ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError as exc:  # a broken group; the process exits anyway
            log.debug("leaving the node's group failed: %s", exc)


def exit_now(code: int) -> NoReturn:
    """End a process of a node of several with ``code``, its logs flushed, skipping the
    interpreter's finalization: gloo's worker threads can still hold work objects then, and
    freeing them without the GIL aborts the process ("terminate called without an active
    exception", SIGABRT) after a clean stop."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def describe_exit(code: int) -> str:
    """How a process ended, in words: "exited with code 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_followers(followers: Sequence[subprocess.Popen], grace: float = 30.0) -> None:
    """Wait up to ``grace`` seconds for the followers to exit (they do once the speaker's last
    boundary said stop), then end those left: SIGTERM twice (a follower's second signal ends
    it), then SIGKILL."""
    deadline = time.monotonic() + grace
    for proc in followers:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in followers:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)  # two signals at once may be delivered as one
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def set_threads(threads: int, where: Placement, device: torch.device) -> None:
    """``task.threads`` for torch; 0 leaves torch's default (a thread per core), except on
    the CPU processes of a node of several, which share the cores rather than each take all."""
    if threads:
        torch.set_num_threads(threads)
    elif where.several and device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // where.size))


class Speaker:
    """Process 0's side of its node's ``group`` (None: a node of one process, for which
    every method does nothing), on trio's thread: start and finish the group, watch the
    ``followers`` it started, and turn a lost process into ``stop`` and a failure.

    :attr:`failed` is the error the daemon exits 1 with once stopped (None: none).
    """

    def __init__(self, group: NodeGroup | StageGroup | None,
                 followers: Sequence[subprocess.Popen],
                 stop: Stop) -> None:
        self.group = group
        self.followers = list(followers)
        self.stop = stop
        self.failed: gossip.GossipError | None = None  # the node's processes broke apart

    async def start(self, replica: Replica, resumed: int | None, shard: int) -> None:
        """Every process takes the state the node starts from (the step of the checkpoint it
        ``resumed``, if any), and its ``shard``."""
        group = self.group
        if group is None:
            return
        try:
            await trio.to_thread.run_sync(group.start, replica, resumed)
            await trio.to_thread.run_sync(agree_shard, group, shard)
        except gossip.ProcessLost as exc:
            self.lost(exc)
            return
        if isinstance(group, StageGroup):
            start, stop = group.pipeline.bounds[0]
            run_log.info("node of %d pipeline stages backend=%s: this process speaks for it "
                         "and is stage 0, modules %d..%d, every batch", group.size,
                         group.backend, start, stop - 1)
            return
        run_log.info("node of %d processes backend=%s: this process speaks for it and trains "
                     "on batches 0, %d, %d, ... of its shard", group.size, group.backend,
                     group.size, 2 * group.size)

    async def finish(self) -> None:
        """The last step boundary: the other processes stop (none if one died)."""
        group = self.group
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
            run_log.error("%s: stopping the node (a restart resumes it from its checkpoint)",
                          exc)
        self.stop.set()

    def name_the_lost(self) -> None:
        """Which follower we started has died, and how, when a collective said only that one
        had (the node may stop before :meth:`watch` looks)."""
        ended = [(rank, proc.poll()) for rank, proc in enumerate(self.followers, start=1)]
        dead = [(rank, code) for rank, code in ended if code is not None and code < 0] or [
            (rank, code) for rank, code in ended if code]
        # Only in place of a collective's "another process is gone" (which has a cause).
        if dead and self.failed is not None and self.failed.__cause__ is not None:
            rank, code = dead[0]
            self.failed = gossip.ProcessLost(f"process {rank} of this node {describe_exit(code)}")
            run_log.error("%s", self.failed)

    async def watch(self) -> None:
        """Say which process of the node died and how, and stop the node. If training is
        still stuck :data:`LOST_GRACE` seconds later (an NCCL collective waits for a dead
        peer, where gloo notices the closed connection), exit 1 at once: the last periodic
        checkpoint stands. Runs until cancelled (when training returns)."""
        group, followers = self.group, list(enumerate(self.followers, start=1))
        assert group is not None
        while followers or self.failed is not None:
            if self.failed is not None:
                await trio.sleep(LOST_GRACE)  # cancelled when training returns
                run_log.error("training is still stuck %.0f s after %s: exiting without a "
                              "final checkpoint", LOST_GRACE, self.failed)
                logging.shutdown()
                for proc in self.followers:
                    proc.kill()
                os._exit(1)
            for rank, proc in list(followers):
                code = proc.poll()
                if code is None:
                    continue
                followers.remove((rank, proc))
                if code != 0 or not group.stopped:
                    # Said even when a collective said so first: this names who and how.
                    exc = gossip.ProcessLost(f"process {rank} of this node {describe_exit(code)}")
                    run_log.error("%s", exc)
                    if self.failed is None or self.failed.__cause__ is not None:
                        self.failed = exc  # in place of a collective's "one is gone"
                    self.stop.set()
            await trio.sleep(0.2)

    def status(self) -> dict[str, Any] | None:
        """The node's processes, for ``gossipd status`` (None: a node of one)."""
        group = self.group
        if group is None:
            return None
        stats = group.statistics()
        return {"count": group.size, "backend": group.backend,
                "layout": "pipeline" if isinstance(group, StageGroup) else "data",
                "syncs": stats.syncs,
                "sync_seconds": round(stats.sync_seconds, 3),
                "header_seconds": round(stats.header_seconds, 3),
                "gradient_seconds": round(stats.reduce_seconds, 3), "checks": stats.checks}
