"""End to end: a join line takes a new user from nothing to a training node, as if on another
machine.

The swarm's task is a package (``tinyswarm.task:task``, a linear regression) that both nodes
have installed, here by ``PYTHONPATH`` into a directory of their own, and the ``gossipd``
command is the installed console script, which puts neither the current directory nor the
repository on the Python path. The first node is made with ``gossipd init --swarm`` in one
home directory, with swarm settings that are not the defaults; the line it prints goes to
``gossipd init --join -`` run from another home directory and another current directory,
with a relative ``--dir``, as a volunteer pastes it. The joiner's config must hold the swarm's
settings and nothing of the first node's files, and the two daemons must average.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.config import load
from daemon.keys import JoinLine
from daemon.metrics import MetricsLogReader
from daemon.testing import FAST, START, free_port, wait_for

pytestmark = pytest.mark.slow

TASK = '''\
import torch

from daemon.task import Task


def task(ctx):
    torch.manual_seed(ctx.seed)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.arange(8, dtype=torch.float32) / 8

    def batches(shard):
        g = torch.Generator().manual_seed(shard.index + 1)
        while True:
            x = torch.randn(16, 8, generator=g)
            yield x, x @ w

    def step(batch):
        x, y = batch
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        opt.step()
        return loss

    return Task(model, opt, batches, step, batch_size=16)
'''
# Quick rounds and progress, as the other end-to-end tests run (the options are digits').
RUN = [item for s in FAST if not s.startswith("task.options.") for item in ("--set", s)]


def gossipd() -> list[str]:
    """The installed command, as a user runs it."""
    script = Path(sys.executable).with_name("gossipd")
    return [str(script)] if script.exists() else [sys.executable, "-m", "daemon"]


class User:
    """Someone with a home directory of their own and the task package installed."""

    def __init__(self, home: Path, site: Path) -> None:
        self.home = home
        self.cwd = home / "work"
        self.cwd.mkdir(parents=True)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("GOSSIPD_CONFIG", "PYTHONPATH")}
        self.env.update(HOME=str(home), PYTHONPATH=str(site))
        self.process: subprocess.Popen[bytes] | None = None
        self.events: list[dict[str, Any]] = []

    def gossipd(self, *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*gossipd(), *args], input=stdin, capture_output=True,
                              text=True, cwd=self.cwd, env=self.env, timeout=60)
        assert done.returncode == 0, done.stderr
        return done

    def start(self, config: Path) -> None:
        self.config = config
        self.log = config.parent / "daemon.log"
        self.reader = MetricsLogReader(config.parent / "metrics.jsonl")
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([*gossipd(), "run", "-c", str(config), *RUN],
                                            stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.cwd,
                                            env=self.env)

    def committed(self) -> int:
        self.events += self.reader.read()
        return sum(e["event"] == "exchange" and e["result"] == "committed" for e in self.events)

    def kill(self) -> bool:
        """SIGKILL (a graceful stop is other tests' subject, and a WAN node takes 5 s to
        leave); returns whether it was still running."""
        if self.process is None:
            return False
        running = self.process.poll() is None
        self.process.kill()
        self.process.wait()
        return running

    # What wait_for reads of a daemon: whether it exited, and its log.
    @property
    def name(self) -> str:
        return self.home.name

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def test_a_join_line_makes_a_working_node_on_another_machine(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "tinyswarm").mkdir(parents=True)
    (site / "tinyswarm" / "__init__.py").write_text("")
    (site / "tinyswarm" / "task.py").write_text(TASK)
    alice, bob = User(tmp_path / "alice", site), User(tmp_path / "bob", site)
    a_port, b_port = free_port(), free_port()

    out = alice.gossipd("init", "--swarm", "lab", "--dir", str(alice.home / "node"),
                        "--listen", f"127.0.0.1:{a_port}", "--task", "tinyswarm.task:task",
                        "--set", "swarm.profile=wan", "--set", "averaging.codec=bf16").stdout
    (text,) = re.findall(r"gossipd init --join '([^']*)'", out)
    line = JoinLine.parse(text)
    assert line.bootstrap == (f"127.0.0.1:{a_port}",) and line.task == "tinyswarm.task:task"
    assert (line.profile, line.codec) == ("wan", "bf16")
    assert str(alice.home) not in text and str(tmp_path) not in text

    joined = bob.gossipd("init", "--join", "-", "--dir", "gossipd", "--listen",
                         f"127.0.0.1:{b_port}", stdin=text + "\n")
    assert "not installed" not in joined.stderr
    assert 'swarm.profile = "wan", averaging.codec = "bf16"' in joined.stdout
    config_path = bob.cwd / "gossipd" / "gossipd.toml"
    config = load(config_path)
    assert (config.swarm.profile, config.averaging.codec) == ("wan", "bf16")
    assert config.swarm.bootstrap == (f"127.0.0.1:{a_port}",)
    assert config.task.entry == "tinyswarm.task:task" and config.task.shard == "auto"
    assert config.node.advertise == f"127.0.0.1:{b_port}"
    assert config.data_dir() == config_path.parent
    assert str(alice.home) not in config_path.read_text()

    try:
        alice.start(alice.home / "node" / "gossipd.toml")
        bob.start(config_path)
        wait_for(lambda: alice.committed() >= 1 and bob.committed() >= 1, START + 30,
                 [alice, bob], "an exchange committed at both nodes")
        assert any(e["event"] == "download" for e in bob.events)  # it took the swarm's state
    finally:
        running = [alice.kill(), bob.kill()]
    assert running == [True, True], (alice.text()[-2000:], bob.text()[-2000:])
