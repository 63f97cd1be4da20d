"""End to end: real ``gossipd`` processes on 127.0.0.1 train, average, crash and resume.

Every wait has a deadline and follows the daemons' JSON-lines logs (see :mod:`daemon.testing`).
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from daemon import checkpoint
from daemon.testing import START, Daemon, DaemonSwarm, wait_for

pytestmark = pytest.mark.slow


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def alive_in_status(observer: Daemon, peer: str) -> str | None:
    """The state ``observer``'s daemon reports for ``peer``, asked with ``gossipd status``."""
    for m in observer.status()["members"]:
        if m["peer"] == peer:
            return m["state"]
    return None


def test_three_daemons_train_average_and_report(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", shard=0, shards=3).start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        # b and c take their shards as `gossipd init --join` has them do: b the least covered
        # of a's swarm (1 or 2), then c the one left.
        b = swarm.add("b", bootstrap=[a], shard="auto", shards=3).start()
        wait_for(lambda: b.last("shard"), START, [a, b], "b to choose its shard")
        # c chooses from what a's table says: wait until a has heard b's choice.
        b_peer = b.last("start")["peer"]
        wait_for(lambda: any(m["peer"] == b_peer and m["shard"] is not None
                             for m in a.status()["members"]), START, [a, b],
                 "a to hear b's shard")
        c = swarm.add("c", bootstrap=[a], shard="auto", shards=3).start()
        nodes = [a, b, c]
        wait_for(lambda: all(d.committed() >= 3 for d in nodes), 90, nodes,
                 "3 committed exchanges at every daemon")
        wait_for(lambda: all(len(d.of("progress")) >= 10 for d in nodes), 60, nodes,
                 "10 progress lines each")

        # gossipd status lists the other two, alive, and the daemon's own figures.
        status = a.status()
        peers = {m["peer"]: m["state"] for m in status["members"]}
        assert peers == {b.last("start")["peer"]: "alive", c.last("start")["peer"]: "alive"}
        assert status["ready"] and status["exchanges"]["committed"] >= 3
        assert status["step"] > 0 and status["loss"] is not None
        # Its own steps apart from the swarm's step (a started from scratch: all its own),
        # and each peer's step as fresh as the exchanges that tell it (rounds every 0.5 s
        # here), not as stale as its announcements (at most one per 30 s).
        assert 0 < status["own_steps"] == status["own_steps_total"]
        assert status["evaluation"] is None and status["eval_every"] == 0
        for m in status["members"]:
            assert m["step"] > 0 and 0 <= m["step_age_s"] < 10, m

        # The late joiners downloaded the swarm's state rather than starting from scratch.
        assert b.last("download") is not None and c.last("download") is not None
        # Each daemon trains on a shard of its own.
        assert (status["shard"], status["shards"]) == (0, 3)
        assert {b.last("shard")["shard"], c.last("shard")["shard"]} == {1, 2}
        assert c.status()["shard"] == c.last("shard")["shard"]
        assert (c.directory / "shard").read_text() == f"{c.last('shard')['shard']}/3\n"

        # Loss falls at a, which started from scratch, and every node ends below chance. Not
        # "falls" at b and c: each downloaded a model trained on other classes and then meets
        # its own shard, and as averaging brings in the others' classes a joiner's loss on its
        # own shard may end above where it stood a few lines in (c: 0.94 then 1.05, in one run).
        losses = {d.name: [e["loss"] for e in d.of("progress")] for d in nodes}
        assert mean(losses["a"][-3:]) < mean(losses["a"][:3]), losses["a"]
        for name, seen in losses.items():
            assert mean(seen[-3:]) < math.log(10), (name, seen)  # 10 classes: chance is ln 10
        for d in nodes:
            d.signal(signal.SIGTERM)
        assert [d.wait_exit() for d in nodes] == [0, 0, 0]
        # Each evaluated its model as it stopped: averaging spread all ten classes, though
        # each node saw mostly three or four.
        for d in nodes:
            assert d.last("eval")["accuracy"] > 0.5, d.name


def test_kill9_then_restart_resumes_from_its_checkpoint_and_rejoins(tmp_path: Path) -> None:
    # A larger model so that an exchange takes a while, and rounds often: the kill is likely
    # to land in the middle of one (it lands wherever it lands, which is the point).
    settings = ["task.options.hidden=2048", "averaging.interval=0.3", "checkpoint.interval=1"]
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=settings).start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        b = swarm.add("b", bootstrap=[a], settings=settings).start()
        c = swarm.add("c", bootstrap=[a], settings=settings).start()
        nodes = [a, b, c]
        wait_for(lambda: all(d.committed() >= 3 for d in nodes), 90, nodes, "exchanges")
        wait_for(lambda: b.of("checkpoint"), 30, nodes, "b's first checkpoint")
        victim_peer = b.last("start")["peer"]
        b.kill9()
        seen = [len(d.events) for d in (a, c)]
        steps = [a.own_steps(), c.own_steps()]
        wait_for(lambda: alive_in_status(a, victim_peer) in ("suspect", "dead"), 60, [a, c],
                 "a to notice b's crash")

        saved = checkpoint.load_latest(b.directory / "checkpoints")
        assert saved is not None
        path, state = saved
        b.start()
        start = wait_for(lambda: b.last("start") if len(b.of("start")) == 2 else None, START,
                         [b], "b to restart")
        assert start["resumed"] == str(path) and start["step"] >= state["counters"]["step"]
        assert start["peer"] == victim_peer  # the same identity
        wait_for(lambda: alive_in_status(a, victim_peer) == "alive", 60, nodes,
                 "a to see b alive again")
        after = len(b.events)
        wait_for(lambda: b.committed(since=after) >= 2, 60, nodes, "b to average again")
        # The others kept training all along.
        assert a.own_steps() > steps[0] and c.own_steps() > steps[1]
        assert all(e["event"] != "stop" for d, n in zip((a, c), seen) for e in d.events[n:])


def test_sigterm_checkpoints_and_leaves(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a").start()
        wait_for(lambda: a.last("start"), START, [a], "a to start")
        b = swarm.add("b", bootstrap=[a]).start()
        wait_for(lambda: b.committed() >= 1, 60, [a, b], "an exchange")
        b_peer = b.last("start")["peer"]
        b.signal(signal.SIGTERM)
        assert b.wait_exit() == 0
        stop = b.last("stop")
        assert stop is not None
        path, state = checkpoint.load_latest(b.directory / "checkpoints")
        assert state["counters"]["step"] == stop["step"]
        assert "stopping signal=SIGTERM" in b.text()
        # The stop event sums up the run: what was trained here, and the exchanges by result.
        assert stop["steps"] > 0 and stop["samples"] >= stop["steps"]
        assert stop["loss"] > 0 and stop["uptime_s"] > 0
        assert stop["exchanges"]["committed"] >= b.committed() >= 1
        assert set(stop["exchanges"]) == {"committed", "failed", "busy", "rejected", "invalid",
                                          "no_peer"}
        assert f"stopped step={stop['step']} steps={stop['steps']} " in b.text()
        # The other side learns it left (a graceful departure, not a crash).
        wait_for(lambda: alive_in_status(a, b_peer) == "left", 30, [a], "a to see b leave")


def test_eval_interval_evaluates_while_training(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=["task.eval_interval=0.5"]).start()
        wait_for(lambda: len(a.of("eval")) >= 3, START, [a], "3 evaluations while training")
        running = a.of("eval")
        assert a.last("stop") is None
        assert all(0 <= e["accuracy"] <= 1 and e["loss"] > 0 for e in running)
        assert [e["step"] for e in running] == sorted(e["step"] for e in running)
        # gossipd status shows the latest, with the swarm's step it was taken at and its age.
        evaluation = a.status()["evaluation"]
        assert set(evaluation["metrics"]) == {"accuracy", "loss"}
        assert evaluation["step"] >= running[-1]["step"] and 0 <= evaluation["age_s"] < 30
        # Spaced by eval_interval (at chunk boundaries), not once per chunk.
        gaps = [later["time"] - earlier["time"] for earlier, later in zip(running, running[1:])]
        assert min(gaps) >= 0.45, gaps
        a.signal(signal.SIGTERM)
        assert a.wait_exit() == 0
        assert a.of("eval")[-1]["step"] == a.last("stop")["step"]  # and one as it stopped
        final = {k: v for k, v in a.of("eval")[-1].items() if k not in ("time", "event", "step")}
        assert a.last("stop")["eval"] == final  # which the stop event repeats


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=["checkpoint.interval=0.2", "checkpoint.keep=5"])
        a.start("task.max_steps=3000")
        assert a.wait_exit(120) == 0  # max_steps: a clean stop, like a signal
        files = checkpoint.checkpoints(a.directory / "checkpoints")
        assert len(files) >= 2
        newest, previous = files[-1], files[-2]
        newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])

        a.start("task.max_steps=10")
        start = wait_for(lambda: a.last("start") if len(a.of("start")) == 2 else None, START,
                         [a], "the restart")
        assert start["resumed"] == str(previous)
        assert a.wait_exit(60) == 0
        log = a.text()
        assert f"checkpoint unusable path={newest}" in log
        assert f"resuming checkpoint={previous}" in log
