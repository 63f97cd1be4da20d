"""The daemon without a swarm: the training loop's (daemon.train.Training) progress line is paced
by time on a mock clock, whatever the speed of the steps; ``open_prepared`` binds
``node.listen`` before it imports the task, says what each slow phase of start-up is waiting
for, and releases what it opened on the way out, a failed start's included."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from daemon.config import Config, from_dict
from daemon.keys import write_swarm_key
from daemon.checkpoint import Checkpointer
from daemon.processes import Speaker
from daemon.service import Prepared, _first_shard, open_prepared
from daemon.startup import GlobalStep, StartupError
from daemon.task import Shard
from daemon.cadence import Stop
from daemon.train import Chunk, Training

CHUNK = 0.1  # s of the mock clock each fake chunk takes


class FakeTrainer:
    """What the loop uses of a Trainer: a chunk is one step, and instant."""

    def __init__(self) -> None:
        self.shard = Shard()
        self.task = SimpleNamespace(evaluate=None)

    def chunk(self, seconds: float, limit: int) -> Chunk:
        return Chunk(steps=1, samples=32, loss=0.5, applied=0, seconds=CHUNK)


class FakeNode:
    """What the loop uses of a SwarmNode. ``lines`` records the clock at each progress line
    (the line reads the node's statistics)."""

    downloaded = None
    replica = None  # read only by a node of several processes

    def __init__(self) -> None:
        self.lines: list[float] = []
        self.roster = SimpleNamespace(statistics=lambda: SimpleNamespace(alive=0))

    async def wait_ready(self) -> None:
        pass

    def statistics(self) -> Any:
        self.lines.append(trio.current_time())
        return SimpleNamespace(step=len(self.lines), committed=0, pending=0,
                               own_steps=len(self.lines), held=0)

    def stop_averaging(self) -> None:
        pass


class FakeMetrics:
    """Counts chunks; each takes CHUNK seconds of the mock clock, jumped here, on trio's
    thread, as the loop counts the chunk."""

    def __init__(self, clock: MockClock) -> None:
        self.clock = clock

    def trained(self, steps: int, samples: int, loss: float) -> None:
        self.clock.jump(CHUNK)

    def samples_per_second(self) -> float:
        return 0.0


def loop_config(**task: Any) -> Config:
    return from_dict({"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "s"},
                      "task": {"entry": "m:f", **task}})


def training(clock: MockClock, config: Config, node: FakeNode, trainer: FakeTrainer,
             choose_shard: bool = False) -> Training:
    """The loop over fakes; its checkpoints are never due (every 300 s by default)."""
    stop, metrics = Stop(), FakeMetrics(clock)
    checkpoints = Checkpointer(config.path(config.checkpoint.dir), 1, metrics, no_event)
    return Training(config, node, trainer, stop, checkpoints,  # type: ignore[arg-type]
                    Speaker(None, [], stop), metrics, no_event,  # type: ignore[arg-type]
                    choose_shard=choose_shard)


def no_event(name: str, **fields: Any) -> None:
    """The metrics log's ``event``, with no log file (``metrics.log`` unset)."""


async def run_loop(clock: MockClock, config: Config) -> FakeNode:
    node = FakeNode()
    await training(clock, config, node, FakeTrainer()).run()
    return node


async def test_a_fast_loop_logs_at_most_one_progress_line_per_interval(
        mock_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    # 600 chunks of 0.1 s: a minute of fast steps, which a line per N steps would flood.
    with caplog.at_level(logging.INFO, logger="daemon.service"):
        node = await run_loop(mock_clock, loop_config(progress_interval=10, max_steps=600))
    lines = [r for r in caplog.records if r.getMessage().startswith("progress ")]
    assert len(lines) == len(node.lines) in (5, 6)  # at about 10, 20, ... 60 s
    assert node.lines[0] == pytest.approx(10, abs=CHUNK * 1.01)
    gaps = [b - a for a, b in zip(node.lines, node.lines[1:])]
    assert all(gap >= 10 for gap in gaps), gaps


async def test_progress_interval_0_logs_after_every_chunk(mock_clock: MockClock) -> None:
    node = await run_loop(mock_clock, loop_config(progress_interval=0, max_steps=25))
    assert len(node.lines) == 25


def test_the_default_is_a_line_every_10_seconds() -> None:
    assert loop_config().task.progress_interval == 10.0


# ---- task.shard = "auto" -----------------------------------------------------------------------

class ShardTrainer(FakeTrainer):
    """A FakeTrainer that records the shard it is switched to."""

    def __init__(self) -> None:
        super().__init__()
        self.shard = Shard(0, 4)
        self.task = SimpleNamespace(evaluate=None, batches=lambda shard: iter([shard.index] * 3))
        self.first: list[Any] = []

    def use_shard(self, shard: Shard, batches: Any) -> None:
        self.shard, self.first = shard, [next(batches)]


def shard_service(clock: MockClock, tmp_path: Path, announced: list[tuple[int, int]],
                  bootstrap: list[str]) -> tuple[Training, FakeNode, ShardTrainer]:
    config = from_dict({"node": {"listen": "127.0.0.1:0"},
                        "swarm": {"name": "s", "bootstrap": bootstrap},
                        "task": {"entry": "m:f", "shard": "auto", "shards": 4, "max_steps": 1}},
                       tmp_path)
    node, trainer = FakeNode(), ShardTrainer()
    members = [SimpleNamespace(shard=i, shards=n) for i, n in announced]

    async def joined() -> None:
        pass

    async def prove(members: list[Any], most: int) -> None:
        pass

    node.said = []  # type: ignore[attr-defined]
    node.peer_id = "a" * 26  # type: ignore[attr-defined]
    node.roster = SimpleNamespace(statistics=lambda: SimpleNamespace(alive=len(members)),
                                  alive=lambda **which: members, wait_joined=joined,
                                  prove=prove, proven_host=lambda m: str(id(m)),
                                  set_meta=lambda **meta: node.said.append(meta))  # type: ignore
    return training(clock, config, node, trainer, choose_shard=True), node, trainer


async def test_auto_takes_the_least_covered_shard_keeps_it_and_announces_it(
        mock_clock: MockClock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Shards 0 and 1 have two members, 2 has one, 3 none; a member cutting the data in 2,
    # and one announcing no shard, count for none of them.
    announced = [(0, 4), (1, 4), (2, 4), (0, 4), (1, 4), (1, 2), (0, 0)]
    service, node, trainer = shard_service(mock_clock, tmp_path, announced, ["10.0.0.1:7070"])
    with caplog.at_level(logging.INFO, logger="daemon.service"):
        await service.run()
    assert trainer.shard == Shard(3, 4) and trainer.first == [3]
    assert node.said == [{"shard": 3, "shards": 4}]  # type: ignore[attr-defined]
    assert (tmp_path / "shard").read_text() == "3/4\n"
    assert service.shard == Shard(3, 4)
    assert "data shard 3 of 4, chosen as the least covered: 5 of 7 members proved to us announce " \
           "a shard of 4; members per shard 2 2 1 0" in caplog.text
    assert _first_shard(service.config) == (Shard(3, 4), False)  # a restart keeps it


async def test_auto_chooses_once_joined_before_the_download_ends(
        mock_clock: MockClock, tmp_path: Path) -> None:
    # Announced while the state still downloads: joiners arriving meanwhile count this node.
    service, node, trainer = shard_service(mock_clock, tmp_path, [(0, 4)], ["10.0.0.1:7070"])
    downloaded = trio.Event()
    node.wait_ready = downloaded.wait  # type: ignore[method-assign]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(service.run)
        # Chosen (the file and the batches come from threads) while the download still runs.
        while trainer.shard.index == 0:
            await wait_all_tasks_blocked()
        assert node.said == [{"shard": trainer.shard.index, "shards": 4}]  # type: ignore
        downloaded.set()


async def test_auto_on_the_first_node_of_a_swarm_takes_shard_0(
        mock_clock: MockClock, tmp_path: Path) -> None:
    service, node, trainer = shard_service(mock_clock, tmp_path, [], [])
    await service.run()
    assert trainer.shard == Shard(0, 4) and trainer.first == []  # already drawing from it
    assert node.said == [{"shard": 0, "shards": 4}]  # type: ignore[attr-defined]
    assert (tmp_path / "shard").read_text() == "0/4\n"


@pytest.mark.parametrize("kept, task, expected", [
    (None, {"shard": "auto", "shards": 4}, (Shard(0, 4), True)),
    ("2/4\n", {"shard": "auto", "shards": 4}, (Shard(2, 4), False)),
    ("2/4\n", {"shard": "auto", "shards": 8}, (Shard(0, 8), True)),  # shards changed: again
    ("9/4\n", {"shard": "auto", "shards": 4}, (Shard(0, 4), True)),  # damaged: again
    ("2/4\n", {"shard": 1, "shards": 4}, (Shard(1, 4), False)),  # a fixed shard wins
])
def test_first_shard(tmp_path: Path, kept: str | None, task: dict[str, Any],
                     expected: tuple[Shard, bool]) -> None:
    if kept is not None:
        (tmp_path / "shard").write_text(kept)
    config = from_dict({"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "s"},
                        "task": {"entry": "m:f", **task}}, tmp_path)
    assert _first_shard(config) == expected


# ---- start-up: bind first, then say what each slow phase waits for ----------------------------

def node_config(directory: Path, listen: str, entry: str) -> Config:
    write_swarm_key(directory / "swarm.key", bytes(32))
    return from_dict({"node": {"listen": listen}, "swarm": {"name": "s"},
                      "task": {"entry": entry, "device": "cpu"}, "metrics": {"log": ""}},
                     directory)


TINY_TASK = """\
import torch
from daemon.task import Task

def task(ctx):
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Task(model, opt, lambda shard: iter([(torch.zeros(1, 2),)] * 3), lambda b: 0.0,
                batch_size=1)
"""


async def test_prepare_says_what_it_imports_and_builds(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "tiny.py").write_text(TINY_TASK)
    with caplog.at_level(logging.INFO, logger="daemon.service"):
        async with open_prepared(node_config(tmp_path, "127.0.0.1:0", "./tiny.py:task")):
            pass
    said = [r.getMessage() for r in caplog.records if r.name == "daemon.service"]
    assert said == [
        f"importing task entry=./tiny.py:task file={tmp_path / 'tiny.py'}",
        "building task entry=./tiny.py:task device=cpu shard=0/1: the task function, then its "
        "first batch",
    ]


async def test_prepare_keeps_node_listen_bound_for_the_node_and_releases_it(
        tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_TASK)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    async with open_prepared(node_config(tmp_path, f"127.0.0.1:{port}", "tiny.py:task")) as p:
        assert isinstance(p, Prepared) and p.found is None and p.followers == ()
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held from now until the node takes it
        assert (tmp_path / "control.sock").exists()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))  # given back on the way out
    assert not (tmp_path / "control.sock").exists()
    assert p.control.fileno() == -1


async def test_a_failed_start_releases_what_it_opened(tmp_path: Path) -> None:
    # The events log is open and the listen address reserved when the task fails to build.
    (tmp_path / "bad.py").write_text("def task(ctx):\n    raise ValueError('no')\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = from_dict({"node": {"listen": f"127.0.0.1:{port}"}, "swarm": {"name": "s"},
                        "task": {"entry": "bad.py:task", "device": "cpu"},
                        "metrics": {"log": "events.jsonl"}}, tmp_path)
    write_swarm_key(tmp_path / "swarm.key", bytes(32))
    with pytest.raises(StartupError, match=r"^bad.py:task failed: ValueError\('no'\)$"):
        async with open_prepared(config):
            pass  # pragma: no cover
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))
    assert not (tmp_path / "control.sock").exists()


async def test_a_listen_address_in_use_is_reported_before_the_task_is_imported(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The task file would fail loudly if it were imported: it is never reached.
    (tmp_path / "loud.py").write_text("raise SystemExit('imported')\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        listen = f"127.0.0.1:{holder.getsockname()[1]}"
        config = node_config(tmp_path, listen, "loud.py:task")
        with caplog.at_level(logging.INFO), pytest.raises(StartupError) as caught:
            async with open_prepared(config):
                pass  # pragma: no cover
    assert str(caught.value) == f"node.listen {listen}: address already in use"
    assert not caplog.records
    assert not (tmp_path / "control.sock").exists()  # claimed, then given back


async def test_a_listen_host_that_is_not_ours_is_one_line(tmp_path: Path) -> None:
    config = node_config(tmp_path, "192.0.2.1:7070", "m:f")  # TEST-NET-1: nobody's address
    with pytest.raises(StartupError, match=r"^node.listen 192.0.2.1:7070: not an address of "
                                           r"this machine$"):
        async with open_prepared(config):
            pass  # pragma: no cover


def test_the_global_step_reads_the_checkpoint_then_the_node_then_the_started_group() -> None:
    step = GlobalStep()
    assert step() == 0
    step.start_at(40)
    assert step() == 40
    group = SimpleNamespace(started=False, global_step=7)
    step.follow_group(group)  # type: ignore[arg-type]
    assert step() == 40  # not started yet: the group's step is not the node's
    step.follow_node(SimpleNamespace(global_step=41))  # type: ignore[arg-type]
    assert step() == 41
    group.started = True
    assert step() == 7  # every process of the node reads the same
