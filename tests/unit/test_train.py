"""Tests for daemon.train.Trainer with a small real Task and a stand-in for the node (a real
gossip Replica behind the three things the trainer uses): chunks count steps and samples and
apply queued deltas, stop early, and a checkpoint's state is a detached CPU copy that restores
the model, the optimizer and the random generators."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from daemon.task import Shard, Task, TaskError
from daemon.train import Chunk, Trainer
from gossip import tensors
from gossip.replica import Counters, Replica

BATCH = 4
CPU = torch.device("cpu")


class FakeNode:
    """What Trainer uses of a SwarmNode, over a real Replica (as SwarmNode does)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        self.replica = Replica(model, optimizer=optimizer)

    def apply_pending(self) -> int:
        return self.replica.apply_pending()

    def step(self, samples: int = 0) -> int:
        self.replica.advance(1, samples)
        return self.replica.apply_pending()

    @property
    def global_step(self) -> int:
        return self.replica.counters().step


def make_task(seed: int = 0, *, momentum: float = 0.9, losses: list[float] | None = None,
              evaluate: Any = None) -> Task:
    """A 2->1 linear regression with SGD; ``losses`` records each step's loss."""
    torch.manual_seed(seed)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)

    def batches(shard: Shard) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(1000 + shard.index)
        while True:
            x = torch.randn(BATCH, 2, generator=g)
            yield x, x @ torch.tensor([[2.0], [-1.0]]) + 0.5

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())
        return loss

    return Task(model, opt, batches, step, batch_size=BATCH, evaluate=evaluate)


def make_trainer(task: Task) -> tuple[Trainer, FakeNode]:
    node = FakeNode(task.model)
    return Trainer(task, node, CPU, Shard()), node  # type: ignore[arg-type]


def flat(model: nn.Module, replica: Replica) -> torch.Tensor:
    out = tensors.new_flat(replica.schema)
    tensors.snapshot(model, replica.schema, out)
    return out


# --- chunk ---------------------------------------------------------------------------------


def test_chunk_runs_limit_steps_and_counts_them() -> None:
    losses: list[float] = []
    task = make_task(losses=losses)
    trainer, node = make_trainer(task)
    before = [p.detach().clone() for p in task.model.parameters()]
    chunk = trainer.chunk(seconds=60.0, limit=5)
    assert isinstance(chunk, Chunk)
    assert (chunk.steps, chunk.samples, chunk.applied) == (5, 5 * BATCH, 0)
    assert len(losses) == 5
    assert chunk.loss == pytest.approx(sum(losses) / 5)
    assert chunk.seconds >= 0
    assert node.replica.counters() == Counters(5, 5 * BATCH, 1.0)
    assert node.global_step == 5
    assert any(not torch.equal(b, p) for b, p in zip(before, task.model.parameters()))
    # the next chunk continues the count
    trainer.chunk(seconds=60.0, limit=3)
    assert node.replica.counters() == Counters(8, 8 * BATCH, 1.0)
    assert len(losses) == 8


def test_chunk_learns() -> None:
    losses: list[float] = []
    trainer, _ = make_trainer(make_task(losses=losses))
    first = trainer.chunk(60.0, 20).loss
    for _ in range(5):
        last = trainer.chunk(60.0, 20).loss
    assert last < first / 4


def test_chunk_ends_after_seconds() -> None:
    trainer, node = make_trainer(make_task())
    chunk = trainer.chunk(seconds=0.0, limit=1000)  # the deadline is checked after each step
    assert chunk.steps == 1
    assert node.global_step == 1


def test_chunk_puts_the_model_in_training_mode() -> None:
    task = make_task()
    task.model.eval()
    trainer, _ = make_trainer(task)
    trainer.chunk(60.0, 1)
    assert task.model.training


def test_chunk_with_stop_set_before_takes_no_step() -> None:
    losses: list[float] = []
    task = make_task(losses=losses)
    trainer, node = make_trainer(task)
    before = flat(task.model, node.replica)
    trainer.stop.set()
    chunk = trainer.chunk(seconds=60.0, limit=10)
    assert (chunk.steps, chunk.samples, chunk.applied) == (0, 0, 0)
    assert math.isnan(chunk.loss)
    assert losses == []
    assert node.replica.counters() == Counters(0, 0, 1.0)
    assert torch.equal(flat(task.model, node.replica), before)


def test_chunk_stops_after_the_step_during_which_stop_is_set() -> None:
    task = make_task()
    trainer, node = make_trainer(task)
    inner = task.step
    calls = []

    def step(batch: Any) -> Any:
        calls.append(1)
        if len(calls) == 3:
            trainer.stop.set()  # as a signal would, seen by the trainer's thread after this step
        return inner(batch)

    task.step = step
    chunk = trainer.chunk(seconds=60.0, limit=100)
    assert chunk.steps == 3
    assert node.global_step == 3


def test_chunk_applies_pending_deltas() -> None:
    task = make_task()
    trainer, node = make_trainer(task)
    replica = node.replica
    trainer.stop.set()  # no steps: the only change to the model is the delta
    before = flat(task.model, replica)
    delta = torch.arange(replica.schema.numel, dtype=torch.float32)
    replica.queue(delta.clone(), scale=0.5, step_move=40, weight=None, sent_weight=1.0)
    assert replica.pending == 1
    chunk = trainer.chunk(seconds=60.0, limit=10)
    assert chunk.applied == 1
    assert replica.pending == 0
    assert torch.allclose(flat(task.model, replica), before + 0.5 * delta)
    assert node.global_step == 40  # the step the replica was given (bounded by its caller)


def test_a_delta_queued_during_a_step_is_applied_at_the_end_of_that_step() -> None:
    task = make_task()
    trainer, node = make_trainer(task)
    replica = node.replica
    inner = task.step
    pending = []

    def step(batch: Any) -> Any:
        pending.append(replica.pending)  # what the step starts with
        loss = inner(batch)
        if len(pending) == 1:  # an exchange commits during the chunk's first step
            replica.queue(torch.ones(replica.schema.numel), step_move=2, weight=None,
                          sent_weight=1.0)
        return loss

    task.step = step
    chunk = trainer.chunk(seconds=60.0, limit=3)
    assert (chunk.steps, chunk.applied) == (3, 1)
    assert pending == [0, 0, 0]  # added at the step boundary, never waiting for the chunk
    assert node.global_step == 2 + 3  # moved by 2, and three steps counted


def test_evaluate() -> None:
    task = make_task(evaluate=lambda: {"accuracy": torch.tensor(0.75), "n": 3})
    trainer, _ = make_trainer(task)
    task.model.train()
    assert trainer.evaluate() == {"accuracy": 0.75, "n": 3.0}
    assert task.model.training  # back in training mode after it
    assert make_trainer(make_task())[0].evaluate() == {}


def test_evaluate_runs_without_grad() -> None:
    seen = []
    task = make_task(evaluate=lambda: seen.append(torch.is_grad_enabled()) or {})
    make_trainer(task)[0].evaluate()
    assert seen == [False]


# --- non-finite losses ---------------------------------------------------------------------


def test_non_finite_loss_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    task = make_task()
    task.step = lambda batch: torch.tensor(float("nan"))
    trainer, node = make_trainer(task)
    with caplog.at_level(logging.WARNING, logger="daemon.train"):
        first = trainer.chunk(60.0, 2)
        trainer.chunk(60.0, 2)
    assert math.isnan(first.loss)
    warnings = [r for r in caplog.records if r.name == "daemon.train"
                and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "loss is not finite" in warnings[0].getMessage()
    assert "step=2" in warnings[0].getMessage()
    assert node.global_step == 4  # the steps are still counted


def test_infinite_float_loss_warns(caplog: pytest.LogCaptureFixture) -> None:
    task = make_task()
    task.step = lambda batch: math.inf  # a task may return a float
    trainer, _ = make_trainer(task)
    with caplog.at_level(logging.WARNING, logger="daemon.train"):
        assert trainer.chunk(60.0, 1).loss == math.inf
    assert any("not finite" in r.getMessage() for r in caplog.records)


def test_finite_loss_and_empty_chunk_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    trainer, _ = make_trainer(make_task())
    with caplog.at_level(logging.WARNING, logger="daemon.train"):
        trainer.chunk(60.0, 2)
        trainer.stop.set()
        trainer.chunk(60.0, 2)  # no steps: nan loss, but nothing to warn about
    assert not [r for r in caplog.records if r.name == "daemon.train"]


# --- state and restore ---------------------------------------------------------------------


def test_state_is_a_detached_cpu_copy() -> None:
    task = make_task()
    trainer, node = make_trainer(task)
    trainer.chunk(60.0, 3)  # momentum buffers now exist
    state = trainer.state({"entry": "m:f", "peer": "p"})
    model_copy = {k: v.clone() for k, v in state["model"].items()}
    momentum = state["optimizer"]["state"][0]["momentum_buffer"]
    momentum_copy = momentum.clone()

    for k, v in task.model.state_dict().items():
        assert torch.equal(state["model"][k], v)
        assert state["model"][k].device.type == "cpu"
        assert state["model"][k].data_ptr() != v.data_ptr()
        assert not state["model"][k].requires_grad

    # training on changes the live model and optimizer, never the saved state
    with torch.no_grad():
        for p in task.model.parameters():
            p.add_(1.0)
    trainer.chunk(60.0, 3)
    for k, v in state["model"].items():
        assert torch.equal(v, model_copy[k])
    assert torch.equal(momentum, momentum_copy)
    assert momentum.data_ptr() != task.optimizer.state_dict()["state"][0][
        "momentum_buffer"].data_ptr()


def test_state_counters_rng_and_meta() -> None:
    trainer, node = make_trainer(make_task())
    trainer.chunk(60.0, 4)
    meta = {"entry": "m:f"}
    state = trainer.state(meta)
    assert set(state) == {"model", "optimizer", "counters", "rng", "meta"}
    assert state["counters"] == {"step": 4, "samples": 4 * BATCH, "weight": 1.0,
                                 "own_steps": 4}
    assert set(state["rng"]) >= {"python", "torch"}
    assert state["meta"] == {"entry": "m:f"}
    meta["entry"] = "changed"
    assert state["meta"] == {"entry": "m:f"}  # a copy


def test_own_steps_count_what_this_node_trained_across_restarts() -> None:
    """The swarm's step moves at exchanges; the own steps count only what this node trained,
    this run's on top of those the checkpoint it resumed counts."""
    task = make_task()
    trainer, node = make_trainer(task)
    trainer.chunk(60.0, 3)
    node.replica.queue(torch.zeros(node.replica.schema.numel), step_move=50, weight=None,
                       sent_weight=1.0)  # an exchange moved the swarm's step
    first = trainer.state({})
    assert first["counters"]["step"] == 53 and first["counters"]["own_steps"] == 3

    resumed = make_task(seed=1)
    Trainer.restore(resumed, first)
    again = Trainer(resumed, FakeNode(resumed.model), CPU, Shard(),  # type: ignore[arg-type]
                    own_steps=Trainer.own_steps_in(first))
    again.chunk(60.0, 2)
    assert again.own_steps == 5
    assert again.state({})["counters"]["own_steps"] == 5


def test_own_steps_of_a_checkpoint_that_did_not_count_them_are_unknown() -> None:
    trainer, _ = make_trainer(make_task())
    older = trainer.state({})
    del older["counters"]["own_steps"]  # as a checkpoint of an earlier version
    assert Trainer.own_steps_in(older) is None
    task = make_task(seed=1)
    resumed = Trainer(task, FakeNode(task.model), CPU, Shard(),  # type: ignore[arg-type]
                      own_steps=Trainer.own_steps_in(older))
    resumed.chunk(60.0, 2)
    assert resumed.own_steps is None  # not 2: that would pass for the whole history
    assert resumed.state({})["counters"]["own_steps"] is None


def test_state_includes_pending_deltas() -> None:
    task = make_task()
    trainer, node = make_trainer(task)
    before = flat(task.model, node.replica)
    delta = torch.full((node.replica.schema.numel,), 2.0)
    node.replica.queue(delta, step_move=7, weight=None, sent_weight=1.0)
    state = trainer.state({})
    assert node.replica.pending == 0
    saved = torch.cat([state["model"][name].flatten() for name in ("weight", "bias")])
    assert torch.allclose(saved, before + 2.0)
    assert state["counters"]["step"] == 7


def test_the_drift_correction_goes_into_the_checkpoint_and_comes_back() -> None:
    task = make_task(seed=0)
    node = FakeNode(task.model, task.optimizer)
    trainer = Trainer(task, node, CPU, Shard())  # type: ignore[arg-type]
    correction = node.replica.correction
    assert correction is not None
    delta = torch.cat([torch.arange(node.replica.schema.numel, dtype=torch.float32)] * 2)
    node.replica.queue(delta, scale=0.5, correction=0.25, weight=None, sent_weight=0.0)
    state = trainer.state({})  # applies it: c = 0.25 x the second part
    want = {"weight": torch.tensor([[0.0, 0.25]]), "bias": torch.tensor([0.5])}
    assert state["correction"].keys() == want.keys()
    assert all(torch.equal(state["correction"][k], v) for k, v in want.items())
    node.replica.close()

    other = make_task(seed=1)
    counters, saved, _ = Trainer.restore(other, state)
    back = Replica(other.model, optimizer=other.optimizer)
    back.restore(counters, saved)
    assert back.correction_state() is not None
    for name, value in back.correction_state().items():
        assert torch.equal(value, state["correction"][name])
    state["correction"]["bias"] = torch.tensor([float("nan")])
    with pytest.raises(ValueError, match="finite"):
        Trainer.restore(make_task(seed=1), state)
    state["correction"]["bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape"):
        Trainer.restore(make_task(seed=1), state)


def test_restore_loads_model_optimizer_and_rng() -> None:
    task = make_task(seed=0)
    trainer, _ = make_trainer(task)
    trainer.chunk(60.0, 5)
    state = trainer.state({})
    want_torch, want_python = torch.rand(3), random.random()

    other = make_task(seed=1)  # other weights, no optimizer state yet
    assert not torch.equal(other.model.weight, task.model.weight)
    torch.rand(10)
    random.random()
    counters, correction, outer = Trainer.restore(other, state)
    assert counters == Counters(5, 5 * BATCH, 1.0)
    assert correction is None and outer is None  # the node kept neither
    for k, v in task.model.state_dict().items():
        assert torch.equal(other.model.state_dict()[k], v)
    assert torch.equal(other.optimizer.state_dict()["state"][0]["momentum_buffer"],
                       task.optimizer.state_dict()["state"][0]["momentum_buffer"])
    # the random generators continue from where the checkpoint was taken
    assert torch.equal(torch.rand(3), want_torch)
    assert random.random() == want_python

    # and training on from there goes exactly as it would have
    a_losses: list[float] = []
    b_losses: list[float] = []
    task.step, other.step = _recording(task, a_losses), _recording(other, b_losses)
    make_trainer(task)[0].chunk(60.0, 3)
    make_trainer(other)[0].chunk(60.0, 3)
    assert a_losses == b_losses


def _recording(task: Task, out: list[float]) -> Any:
    inner = task.step

    def step(batch: Any) -> Any:
        loss = inner(batch)
        out.append(float(loss.detach()))
        return loss

    return step


def test_restore_survives_torch_save_round_trip(tmp_path: Any) -> None:
    trainer, _ = make_trainer(make_task())
    trainer.chunk(60.0, 2)
    path = tmp_path / "state.pt"
    torch.save(trainer.state({"entry": "m:f"}), path)
    state = torch.load(path, weights_only=True)
    assert Trainer.restore(make_task(seed=3), state) == (Counters(2, 2 * BATCH, 1.0), None, None)


def test_restore_refuses_another_model() -> None:
    trainer, _ = make_trainer(make_task())
    state = trainer.state({})
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    wrong = Task(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda s: iter(()),
                 lambda b: 0.0, batch_size=1)
    with pytest.raises((KeyError, ValueError, RuntimeError)):
        Trainer.restore(wrong, state)


# ---- a finite batches(shard): one epoch of a DataLoader ---------------------------------------

def epoch_task(per_call: list[int]) -> tuple[Task, list[int]]:
    """The regression task with a finite ``batches``: its n-th call yields ``per_call[n]``
    batches (the last count repeats). Returns the task and the calls' counts so far."""
    task, calls = make_task(), []
    endless = task.batches

    def batches(shard: Shard) -> Iterator[Any]:
        n = per_call[min(len(calls), len(per_call) - 1)]
        calls.append(n)
        source = endless(shard)
        return iter([next(source) for _ in range(n)])

    task.batches = batches
    return task, calls


def test_a_finite_batches_is_started_again_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    task, calls = epoch_task([3])
    trainer, node = make_trainer(task)
    with caplog.at_level(logging.INFO, logger="daemon.train"):
        chunk = trainer.chunk(600.0, 30)
        chunk2 = trainer.chunk(600.0, 30)
    assert chunk.steps == chunk2.steps == 30 and node.global_step == 60
    assert len(calls) == 20 and trainer.epochs == 19  # the 20th pass has ended, not restarted
    lines = [r for r in caplog.records if r.name == "daemon.train"]
    assert [r.levelno for r in lines] == [logging.INFO]
    assert lines[0].getMessage() == ("task.batches ended after 3 batches; starting it again each "
                                     "time it ends (one epoch = 3 batches) shard=0/1")


def test_a_later_pass_that_yields_nothing_is_an_error(caplog: pytest.LogCaptureFixture) -> None:
    # batches() handing back an iterator that has already ended (a generator object kept in
    # a closure, say) would make training spin without a step: say so, and only that.
    task, _ = epoch_task([3, 0])
    trainer, node = make_trainer(task)
    with caplog.at_level(logging.INFO, logger="daemon.train"), \
            pytest.raises(TaskError, match=r"^task.batches\(shard 0/1\) yielded no batch when "
                                           r"called again after a pass of 3: it must return a "
                                           r"new iterator"):
        trainer.chunk(600.0, 10)
    assert node.global_step == 3
    assert not [r for r in caplog.records if r.name == "daemon.train"]


def test_a_batches_that_yields_nothing_at_all_is_an_error() -> None:
    task, _ = epoch_task([0])
    trainer, node = make_trainer(task)
    with pytest.raises(TaskError, match=r"^task.batches\(shard 0/1\) yields no batch$"):
        trainer.chunk(600.0, 10)
    assert node.global_step == 0
