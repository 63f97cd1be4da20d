"""Real ``gossipd run`` processes for fault-injection tests: start, kill -9, stop, restart,
and watch them through their own logs.

Theory of operation
-------------------
A :class:`Daemon` is a directory (config, identity, a copy of the swarm key, checkpoints,
``daemon.log`` and the JSON-lines ``metrics.jsonl``) and, while it runs, a process. The
daemon writes one JSON event per line (``start``, ``progress``, ``exchange``,
``checkpoint``, ``eval``, ``stop``, ``metrics``); :meth:`Daemon.poll` follows that file and
keeps every event, across restarts, so a test asks "how many exchanges has b committed since
its restart" and waits for the answer with :func:`wait_for`: a deadline on every wait, never
a fixed sleep. A dead process ends a wait at once, with the tail of its log.

Synchronous on purpose: these are processes, and a test that also needs trio (a hostile
peer, say) runs it with ``trio.run`` between waits. A :class:`DaemonSwarm` shares one swarm
key among its daemons and stops them all on exit (SIGTERM, then SIGKILL).

Nodes that share a machine can each take their own loopback address (``127.0.0.x``: Linux
routes all of ``127/8`` to the loopback device) with ``dial_from`` set to it, so that a fault
proxy in front of each one (:mod:`gossip.testing.proxy`) tells them apart by source address
and can partition them. :func:`free_port` finds a port free for both TCP and UDP there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from daemon.checkpoint import checkpoints
from daemon.config import from_dict, render
from daemon.keys import write_swarm_key
from daemon.metrics import MetricsLogReader
from daemon.processes import free_port

__all__ = ["Daemon", "DaemonSwarm", "wait_for", "free_port", "FAST", "POLL", "START"]

POLL = 0.05  # s between looks at a log while waiting for a condition
START = 60.0  # s for a daemon to import torch and open its node, on a quiet machine
TASK = "daemon.tasks.digits:task"
FAST = (  # quick rounds and progress; one torch thread each, so several share two cores
    "averaging.interval=0.5",
    "averaging.download_wait=2",
    "task.progress_interval=0.5",
    "task.threads=1",
    "task.chunk=0.1",
    "metrics.interval=0.5",
    "task.options.lr=0.002",
)


class Daemon:
    """One daemon: its directory, its config and, while it runs, its process.

    Args:
        directory: created; must not exist.
        name: for messages.
        key: the swarm key (32 bytes).
        bootstrap: addresses to join through (empty: this daemon starts the swarm).
        listen, advertise, dial_from: as ``node.*`` in the config.
        task: ``task.entry``.
        settings: ``--set`` overrides applied at every start, after ``base``.
        base: the overrides every start begins with (:data:`FAST`: quick rounds, one torch
            thread; ``()`` for the config's own defaults).
    """

    def __init__(self, directory: Path, name: str, key: bytes, *, swarm: str = "test",
                 bootstrap: Sequence[str] = (), listen: str = "127.0.0.1:0",
                 advertise: str = "", dial_from: str = "", task: str = TASK,
                 shard: int | str = 0, shards: int = 1, settings: Sequence[str] = (),
                 base: Sequence[str] = FAST) -> None:
        self.directory = Path(directory)
        self.name = name
        self.settings = [*base, *settings]
        self.process: subprocess.Popen[bytes] | None = None
        self.events: list[dict[str, Any]] = []
        self.directory.mkdir(parents=True)
        self._reader = MetricsLogReader(self.directory / "metrics.jsonl")
        self._log: Any = None
        write_swarm_key(self.directory / "swarm.key", key)
        data = {"node": {"listen": listen, "advertise": advertise, "dial_from": dial_from},
                "swarm": {"name": swarm, "bootstrap": list(bootstrap)},
                "task": {"entry": task, "shard": shard, "shards": shards}}
        self.config_path = self.directory / "gossipd.toml"
        self.config = from_dict(data, self.directory, str(self.config_path))
        self.config_path.write_text(render(self.config))

    def __repr__(self) -> str:
        return f"<Daemon {self.name} pid={self.pid}>"

    # ---- process ----------------------------------------------------------------------

    def start(self, *settings: str) -> "Daemon":
        """Start ``gossipd run`` (with ``settings`` on top of the daemon's own)."""
        if self.running:
            raise RuntimeError(f"{self.name} is already running (pid {self.pid})")
        self._log = open(self.directory / "daemon.log", "ab")
        sets = [a for s in [*self.settings, *settings] for a in ("--set", s)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daemon", "run", "-c", str(self.config_path), *sets],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    restart = start  # after kill9() or stop(): same directory, identity and checkpoints

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def signal(self, signum: int) -> None:
        assert self.process is not None, f"{self.name} was never started"
        self.process.send_signal(signum)

    def kill9(self) -> None:
        """SIGKILL: no goodbye, no final checkpoint. Returns once the process is gone."""
        assert self.process is not None, f"{self.name} was never started"
        if self.running:
            os.kill(self.process.pid, signal.SIGKILL)
        self.wait_exit()

    def pause(self) -> None:
        """SIGSTOP: the whole process freezes (a long GC, a swapped-out host)."""
        self.signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.signal(signal.SIGCONT)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit; returns its exit code."""
        assert self.process is not None, f"{self.name} was never started"
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is not None and self._log is not None:
                self._log.close()
                self._log = None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (a graceful leave and a final checkpoint), then SIGKILL after ``timeout``.
        Returns the exit code (None if it was not running)."""
        if not self.running:
            return None
        self.signal(signal.SIGCONT)  # a paused daemon cannot handle SIGTERM
        self.signal(signal.SIGTERM)
        try:
            return self.wait_exit(timeout)
        except subprocess.TimeoutExpired:
            self.kill9()
            return None

    # ---- observing --------------------------------------------------------------------

    def poll(self) -> list[dict[str, Any]]:
        """Read the events written since the last look; returns them (all are kept)."""
        new = self._reader.read()
        self.events.extend(new)
        return new

    def of(self, event: str, since: int = 0) -> list[dict[str, Any]]:
        """Events named ``event``, from index ``since`` of the whole log (``len(events)``
        before an action gives the events after it)."""
        self.poll()
        return [e for e in self.events[since:] if e["event"] == event]

    def last(self, event: str) -> dict[str, Any] | None:
        found = self.of(event)
        return found[-1] if found else None

    @property
    def address(self) -> str:
        """The address peers dial (the advertised one), from the latest start."""
        start = self.last("start")
        assert start is not None, f"{self.name} has not started yet"
        return start["address"]

    def committed(self, since: int = 0) -> int:
        return sum(e["result"] == "committed" for e in self.of("exchange", since))

    def step(self) -> int:
        """The swarm's step in the latest run's latest progress event (0 before its first):
        the step the schedule follows, which a node ahead of the swarm holds while it trains
        on."""
        return self.progress()[1]

    def own_steps(self) -> int:
        """The latest run's own optimizer steps in its latest progress event (0 before its
        first): what says it trains."""
        return self.progress()[2]

    def progress(self) -> tuple[int, int, int]:
        """``(runs, step, own steps)`` read together from one look at the log: the runs
        started so far, and the latest run's :meth:`step` and :meth:`own_steps`."""
        self.poll()
        runs = sum(e["event"] == "start" for e in self.events)
        for e in reversed(self.events):
            if e["event"] == "start":
                break
            if e["event"] == "progress":
                return runs, e["step"], e["own"]
        return runs, 0, 0

    def text(self) -> str:
        """The daemon's own log (stdout and stderr), all runs."""
        path = self.directory / "daemon.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def status(self) -> dict[str, Any]:
        """``gossipd status --json`` of the running daemon."""
        out = subprocess.run([sys.executable, "-m", "daemon", "status", "-c",
                              str(self.config_path), "--json"], capture_output=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"gossipd status failed for {self.name}: {out.stderr.decode()}")
        return json.loads(out.stdout)

    def memory(self) -> dict[str, int]:
        """Resident memory of the running process, bytes: ``rss`` now and ``peak`` (VmHWM,
        the high-water mark since it started). Linux only."""
        fields = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields["rss" if key == "VmRSS" else "peak"] = int(value.split()[0]) * 1024
        return fields

    def children(self) -> list[int]:
        """The pids of the running process's children (the other processes of a node of
        several, :mod:`daemon.processes`), lowest first. Linux only."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            if int(stat.rpartition(")")[2].split()[1]) == self.pid:  # field 4: the parent
                found.append(int(entry))
        return sorted(found)

    def open_files(self) -> int:
        """File descriptors the running process holds. Linux only."""
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def checkpoints(self) -> list[Path]:
        """Checkpoint files by name, oldest first (names only: load one to verify it)."""
        return checkpoints(self.config.path(self.config.checkpoint.dir))


def wait_for(condition: Callable[[], Any], timeout: float, daemons: Sequence[Daemon] = (),
             what: str = "condition") -> Any:
    """Return ``condition()`` once it is truthy; raise AssertionError after ``timeout`` s,
    or at once if one of ``daemons`` has exited, with the tail of its log."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        for d in daemons:
            if d.process is not None and d.process.poll() is not None:
                raise AssertionError(f"{d.name} exited ({d.process.returncode}) while waiting "
                                     f"for {what}:\n{d.text()[-3000:]}")
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {d.name}\n{d.text()[-2000:]}" for d in daemons)
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{logs}")
        time.sleep(POLL)


class DaemonSwarm:
    """Daemons sharing one swarm key under ``root``; a context manager that stops them all.

    Args:
        root: the parent of every daemon's directory.
        name: the swarm's name.
    """

    def __init__(self, root: Path, name: str = "test") -> None:
        self.root = Path(root)
        self.name = name
        self.key = os.urandom(32)
        self.daemons: list[Daemon] = []

    def add(self, name: str, *, bootstrap: Sequence[Daemon | str] = (), **options: Any) -> Daemon:
        """A new daemon (not started) in ``root/name``; ``bootstrap`` takes daemons (their
        current address) or addresses. ``options`` go to :class:`Daemon`."""
        addresses = [b.address if isinstance(b, Daemon) else b for b in bootstrap]
        daemon = Daemon(self.root / name, name, self.key, swarm=self.name, bootstrap=addresses,
                        **options)
        self.daemons.append(daemon)
        return daemon

    def running(self) -> list[Daemon]:
        return [d for d in self.daemons if d.running]

    def __enter__(self) -> "DaemonSwarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for d in self.daemons:
            d.stop()
