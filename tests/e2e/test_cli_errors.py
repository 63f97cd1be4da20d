"""End to end: every way ``gossipd run`` can be misconfigured ends in one line and exit code 2.

No traceback, nothing half-started: the message names the file or key to fix. The only lines
before it are the log's lines for the slow start-up phases it began (``importing task ...``),
which say how far it got.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest

from daemon.config import from_dict, render
from daemon.keys import write_swarm_key

pytestmark = pytest.mark.slow


def write_config(directory: Path, **sections: dict) -> Path:
    data = {"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "e2e"},
            "task": {"entry": "daemon.tasks.digits:task"}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    path = directory / "gossipd.toml"
    path.write_text(render(from_dict(data, directory, str(path))))
    return path


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "daemon", *args], capture_output=True,
                          text=True, timeout=120)


def with_key(tmp_path: Path) -> Path:
    write_swarm_key(tmp_path / "swarm.key", bytes(32))
    return write_config(tmp_path)


def busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


MINIMAL = """\
[node]
listen = "127.0.0.1:0"
[swarm]
name = "e2e"
[task]
entry = "daemon.tasks.digits:task"
"""

# A start-up phase's log line (DAEMON.md, "Starting and stopping").
PHASE = re.compile(r"\S+ INFO daemon\.service (importing|building) task entry=.*")

# Each case makes its files in a directory and returns the arguments after ``run``; the
# error line must contain the second element.
CASES: dict[str, tuple[Callable[[Path], list[str]], str]] = {
    "missing config file": (lambda d: ["-c", str(d / "nope.toml")], "does not exist"),
    "not TOML": (lambda d: (d / "c.toml").write_text("[node\n") and ["-c", str(d / "c.toml")],
                 "c.toml"),
    "unknown key": (lambda d: (d / "c.toml").write_text(MINIMAL + "[metrics]\nevry = 1\n")
                    and ["-c", str(d / "c.toml")], "metrics.evry"),
    "bad value": (lambda d: ["-c", str(with_key(d)), "--set", "task.device=gpu"], "task.device"),
    "missing swarm key": (lambda d: ["-c", str(write_config(d))], "swarm.key"),
    "malformed swarm key": (lambda d: (d / "swarm.key").write_text("xyz\n")
                            and ["-c", str(write_config(d))], "64 hex"),
    "task not importable": (lambda d: ["-c", str(with_key(d)), "--set",
                                       "task.entry=no_such_module:task"], "no_such_module"),
    "task file missing": (lambda d: ["-c", str(with_key(d)), "--set",
                                     "task.entry=./missing.py:task"], "missing.py"),
    "cuda asked, absent": (lambda d: ["-c", str(with_key(d)), "--set", "task.device=cuda:7"],
                           "cuda"),
    "task file does not compile": (lambda d: (d / "t.py").write_text("def task(:\n")
                                   and ["-c", str(with_key(d)), "--set",
                                        f"task.entry={d / 't.py'}:task"], "t.py"),
    "task yields no batch": (lambda d: ["-c", str(with_key(d)), "--set", "task.shards=2000",
                                        "--set", "task.shard=1999"], "shard 1999/2000"),
    "control path is a file": (lambda d: ["-c", str(with_key(d)), "--set",
                                          "node.control=swarm.key"], "not a socket"),
    "bad identity file": (lambda d: (d / "identity.key").write_text("garbage")
                          and ["-c", str(with_key(d))], "identity.key"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_setup_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    make, needle = CASES[case]
    out = run("run", *make(tmp_path))
    assert out.returncode == 2, out.stderr
    *phases, line = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr, out.stderr
    assert all(PHASE.fullmatch(phase) for phase in phases), out.stderr
    assert line.startswith("gossipd run: ") and needle in line, line


def test_a_listen_port_in_use_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Reported before the task is imported: this one would fail loudly if it were, and the
    # log would say "importing task". The interpreter, the config and torch (which the config
    # module imports through gossip) are all that come first.
    (tmp_path / "loud.py").write_text("raise SystemExit('the task was imported')\n")
    holder, port = busy_port()
    with holder:
        started = time.monotonic()
        out = run("run", "-c", str(with_key(tmp_path)), "--set", f"node.listen=127.0.0.1:{port}",
                  "--set", "task.entry=loud.py:task")
        seconds = time.monotonic() - started
    assert out.returncode == 2, out.stderr
    assert out.stderr == f"gossipd run: node.listen 127.0.0.1:{port}: address already in use\n"
    assert seconds < 30, seconds  # about 3 s on 2 cores, most of it importing torch
