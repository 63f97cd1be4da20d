"""Real ``gossipd run`` processes on 127.0.0.1 for end-to-end tests.

Each :class:`Daemon` has its own directory, config, identity and a copy of the swarm key,
and listens on port 0; tests learn its address from the ``start`` event of its JSON-lines
metrics log and follow that log to wait for conditions (a deadline on every wait, never a
fixed sleep). Their CPU is kept to one torch thread each, so three fit on two cores.
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

from daemon.config import from_dict, render
from daemon.keys import write_swarm_key
from daemon.metrics import MetricsLogReader

__all__ = ["Daemon", "Swarm", "POLL"]

POLL = 0.05  # s between looks at a log while waiting for a condition
START = 60.0  # s for a daemon to import torch and open its node
TASK = "daemon.tasks.digits:task"
FAST = [  # settings for quick tests: frequent rounds, quick failure detection
    "averaging.interval=0.5",
    "averaging.download_wait=2",
    "task.progress_every=20",
    "task.threads=1",
    "task.chunk=0.1",
    "metrics.every=0.5",
    "task.options.lr=0.002",
]


class Daemon:
    """One daemon process and its files."""

    def __init__(self, directory: Path, name: str, key: bytes, *, swarm: str = "e2e",
                 bootstrap: Sequence[str] = (), shard: int = 0, shards: int = 1,
                 settings: Sequence[str] = ()) -> None:
        self.directory = directory
        self.name = name
        self.settings = [*FAST, *settings]
        self.process: subprocess.Popen[bytes] | None = None
        self.events: list[dict[str, Any]] = []
        directory.mkdir(parents=True)
        self._reader = MetricsLogReader(directory / "metrics.jsonl")
        write_swarm_key(directory / "swarm.key", key)
        data = {"node": {"listen": "127.0.0.1:0"},
                "swarm": {"name": swarm, "bootstrap": list(bootstrap)},
                "task": {"entry": TASK, "shard": shard, "shards": shards}}
        self.config = directory / "gossipd.toml"
        self.config.write_text(render(from_dict(data, directory, str(self.config))))

    # ---- process ----------------------------------------------------------------------

    def start(self, *settings: str) -> "Daemon":
        self.log = open(self.directory / "daemon.log", "ab")
        sets = [a for s in [*self.settings, *settings] for a in ("--set", s)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daemon", "run", "-c", str(self.config), *sets],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        assert self.process is not None
        self.process.send_signal(signum)

    def kill9(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def wait_exit(self, timeout: float = 30.0) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        finally:
            self.log.close()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit (test clean-up)."""
        if self.running:
            self.signal(signal.SIGTERM)
            try:
                self.wait_exit(30.0)
            except subprocess.TimeoutExpired:
                self.kill9()

    # ---- observing --------------------------------------------------------------------

    def poll(self) -> list[dict[str, Any]]:
        new = self._reader.read()
        self.events.extend(new)
        return new

    def of(self, event: str, since: int = 0) -> list[dict[str, Any]]:
        """Events named ``event`` (from index ``since`` of the whole log)."""
        self.poll()
        return [e for e in self.events[since:] if e["event"] == event]

    def last(self, event: str) -> dict[str, Any] | None:
        found = self.of(event)
        return found[-1] if found else None

    @property
    def address(self) -> str:
        start = self.last("start")
        assert start is not None, f"{self.name} has not started"
        return start["address"]

    def committed(self, since: int = 0) -> int:
        return sum(e["result"] == "committed" for e in self.of("exchange", since))

    def step(self) -> int:
        progress = self.last("progress")
        return progress["step"] if progress else 0

    def text(self) -> str:
        return (self.directory / "daemon.log").read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        out = subprocess.run([sys.executable, "-m", "daemon", "status", "-c", str(self.config),
                              "--json"], capture_output=True, timeout=60)
        assert out.returncode == 0, out.stderr.decode()
        return json.loads(out.stdout)


def wait_for(condition: Callable[[], Any], timeout: float, daemons: Sequence[Daemon] = (),
             what: str = "condition") -> Any:
    """Return ``condition()`` once it is truthy; fail after ``timeout`` s, or at once if one
    of ``daemons`` exits, with the tail of its log."""
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


class Swarm:
    """Daemons sharing one swarm key, in ``root``; stops them all on exit."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = os.urandom(32)
        self.daemons: list[Daemon] = []

    def add(self, name: str, *, bootstrap: Sequence[Daemon] = (), **options: Any) -> Daemon:
        d = Daemon(self.root / name, name, self.key,
                   bootstrap=[b.address for b in bootstrap], **options)
        self.daemons.append(d)
        return d

    def __enter__(self) -> "Swarm":
        return self

    def __exit__(self, *exc: object) -> None:
        for d in self.daemons:
            d.stop()
