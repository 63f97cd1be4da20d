"""The training loop's pure parts, without trio: when each thing is due (:func:`due`,
:class:`Cadence`) and the one stop flag (:class:`Stop`); then the :class:`Checkpointer` and the
flag on trio's side."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from trio.testing import wait_all_tasks_blocked

from daemon import checkpoint
from daemon.checkpoint import Checkpointer
from daemon.config import from_dict
from daemon.cadence import Cadence, Stop, due


@pytest.mark.parametrize("now, last, interval, expected", [
    (9.99, 0.0, 10.0, False),
    (10.0, 0.0, 10.0, True),  # exactly at the interval: due
    (25.0, 12.0, 10.0, True),
    (12.0, 12.0, 0.0, True),  # 0: every time it is asked
    (1e12, 0.0, math.inf, False),  # inf: never
])
def test_due(now: float, last: float, interval: float, expected: bool) -> None:
    assert due(now, last, interval) is expected


def config(**task: Any) -> Any:
    return from_dict({"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "s"},
                      "task": {"entry": "m:f", **task}, "checkpoint": {"interval": 60}})


def test_cadence_of_the_config() -> None:
    c = Cadence.of(config(chunk=0.5, progress_interval=5, eval_interval=30, max_steps=100), True)
    assert c == Cadence(chunk=0.5, progress=5.0, checkpoint=60.0, evaluate=30.0, max_steps=100)


@pytest.mark.parametrize("eval_interval, can_evaluate", [(0, True), (0, False), (30, False)])
def test_no_evaluation_unless_asked_for_and_the_task_has_one(eval_interval: float,
                                                             can_evaluate: bool) -> None:
    assert Cadence.of(config(eval_interval=eval_interval), can_evaluate).evaluate == math.inf


def test_max_steps_bounds_each_chunk_and_ends_the_run() -> None:
    c = Cadence.of(config(max_steps=10), False)
    assert [c.steps_left(done) for done in (0, 3, 10)] == [10, 7, 0]
    assert [c.finished(done) for done in (0, 9, 10, 11)] == [False, False, True, True]


def test_max_steps_0_is_no_limit() -> None:
    c = Cadence.of(config(max_steps=0), False)
    assert c.steps_left(10**9) >= 1 << 62
    assert not c.finished(10**9)


def test_stop_is_one_flag_its_hooks_run_once() -> None:
    stop, calls = Stop(), []
    stop.on_set(lambda: calls.append("a"))
    assert not stop.is_set() and calls == []
    stop.set()
    stop.set()
    assert stop.is_set() and calls == ["a"]
    stop.on_set(lambda: calls.append("late"))  # already set: at once
    assert calls == ["a", "late"]


def test_stop_set_is_seen_by_another_thread() -> None:
    stop, seen = Stop(), threading.Event()

    def trainer() -> None:  # as Trainer.chunk reads it after each step
        while not stop.is_set():
            seen.wait(0.001)
        seen.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    stop.set()
    thread.join(5)
    assert seen.is_set()


async def test_stop_wakes_trio_waiters() -> None:
    stop = Stop()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop.wait)
        await wait_all_tasks_blocked()
        stop.set()
    assert stop.is_set()


async def test_stop_set_from_a_worker_thread_wakes_trio_and_runs_hooks_on_trio() -> None:
    stop, hooked_on = Stop(), []
    stop.on_set(lambda: hooked_on.append(threading.current_thread()))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop.wait)
        await wait_all_tasks_blocked()
        await trio.to_thread.run_sync(stop.set)  # as a task's own code might, mid-step
    assert stop.is_set() and hooked_on == [threading.current_thread()]


# ---- the Checkpointer ------------------------------------------------------------------------

class FakeMetrics:
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.checkpoint_failures = SimpleNamespace(n=0)
        self.checkpoint_failures.inc = lambda: setattr(  # type: ignore[attr-defined]
            self.checkpoint_failures, "n", self.checkpoint_failures.n + 1)

    def checkpointed(self, seconds: float) -> None:
        self.seconds.append(seconds)


def state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.ones(2)}, "counters": {"step": step}}


async def test_checkpointer_writes_logs_counts_and_remembers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    metrics, events = FakeMetrics(), []
    writer = Checkpointer(tmp_path / "ck", 2, metrics,
                          lambda name, **fields: events.append((name, fields)))
    with caplog.at_level(logging.INFO, logger="daemon.service"):
        for step in (1, 2, 3):
            await writer.write(state(step))
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "ck")] == [
        "checkpoint-000000000002.ckpt", "checkpoint-000000000003.ckpt"]  # keep=2
    assert checkpoint.load(tmp_path / "ck" / "checkpoint-000000000003.ckpt")["counters"] == {
        "step": 3}
    assert writer.last is not None and writer.last["step"] == 3
    assert writer.last["path"] == str(tmp_path / "ck" / "checkpoint-000000000003.ckpt")
    assert len(metrics.seconds) == 3 and [e[0] for e in events] == ["checkpoint"] * 3
    assert f"checkpoint path={writer.last['path']} step=3 seconds=" in caplog.text
    assert not writer.busy


async def test_a_periodic_checkpoint_that_fails_is_logged_counted_and_training_goes_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "ck").write_text("a file where the directory should be")
    metrics = FakeMetrics()
    writer = Checkpointer(tmp_path / "ck", 1, metrics, lambda name, **fields: None)
    with caplog.at_level(logging.ERROR, logger="daemon.service"):
        await writer.write_periodic(state(1))
    assert metrics.checkpoint_failures.n == 1 and writer.last is None
    assert f"checkpoint failed dir={tmp_path / 'ck'} error=" in caplog.text
    assert "training goes on" in caplog.text
    with pytest.raises(OSError):  # the final one: the caller's to report
        await writer.write(state(1))
