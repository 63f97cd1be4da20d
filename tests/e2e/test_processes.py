"""Nodes of several processes, as real daemons (gloo on the CPU, as CI runs them).

One test, since each start of a node of two processes imports torch twice: a swarm of two
nodes of two processes and one of one trains the digits task, every node of two checking at
every step boundary that its processes hold bit-identical parameters; one of them joins late,
so it downloads; a follower is killed with SIGKILL, its node stops with a message naming it,
and a restart resumes from the checkpoint.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from daemon.testing import START, Daemon, DaemonSwarm, wait_for

pytestmark = pytest.mark.slow
TWO = ("task.processes=2", "task.check_every=1", "checkpoint.interval=2")


def node_status(daemon: Daemon) -> dict:
    """The ``processes`` entry of a node's status."""
    return daemon.status()["processes"]


def synced(daemon: Daemon, syncs: int, exchanges: int, since: int = 0) -> bool:
    """Whether ``daemon`` has committed ``exchanges`` exchanges (events from ``since``) and
    broadcast its state to its follower ``syncs`` times, checks passing at every boundary."""
    if daemon.committed(since) < exchanges:
        return False
    group = node_status(daemon)
    return group["syncs"] >= syncs and group["checks"] > 0


def test_nodes_of_two_processes_train_stay_identical_and_restart(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=TWO, shard=0, shards=2).start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        b = swarm.add("b", bootstrap=[a], shard=1, shards=2).start()
        wait_for(lambda: a.committed() >= 3 and b.committed() >= 3, START, [a, b],
                 "a and b to exchange")
        # c joins a swarm that has trained: it downloads, and its follower takes the state.
        c = swarm.add("c", bootstrap=[a], settings=TWO, shard=1, shards=2).start()
        wait_for(lambda: c.last("download"), START, [a, b, c], "c to download")
        wait_for(lambda: synced(a, 3, 5) and synced(c, 3, 5), START, [a, b, c],
                 "exchanges applied on both nodes of two processes")
        for node in (a, c):
            group = node_status(node)
            assert group["count"] == 2 and group["backend"] == "gloo"
            # check_every=1: every boundary broadcast the parameters and compared them.
            assert group["checks"] >= group["syncs"]
            assert "ReplicasDiverged" not in node.text() and "ERROR" not in node.text()
        wait_for(lambda: c.checkpoints(), START, [a, b, c], "a checkpoint of c")

        # SIGKILL to c's follower: c stops with a message naming it, and checkpoints.
        followers = c.children()
        assert len(followers) == 1, followers
        before = len(c.checkpoints())
        os.kill(followers[0], signal.SIGKILL)
        assert c.wait_exit(60) == 1
        assert "process 1 of this node was killed by SIGKILL" in c.text()
        assert "the node stopped:" in c.text()
        assert len(c.checkpoints()) > before or c.checkpoints()[-1].exists()
        last = c.last("checkpoint")
        assert last is not None

        # A restart resumes from that checkpoint, both processes, and averages again.
        since = len(c.events)
        c.restart()
        wait_for(lambda: synced(c, 2, 3, since), START, [a, b, c], "c to resume and average")
        text = c.text()
        assert f"resuming checkpoint={last['path']}" in text
        assert f"[process 1] daemon.follower process 1 resuming checkpoint={last['path']}" in text

        # SIGTERM: every node stops cleanly, the followers with their speakers (all at once:
        # each waits a moment for its goodbye to spread).
        pids = a.children() + c.children()
        for node in (c, b, a):
            node.signal(signal.SIGTERM)
        for node in (c, b, a):
            assert node.wait_exit(30) == 0, node.text()[-2000:]
        for pid in pids:
            assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"follower {pid} left"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True
