"""Tests for gossip.replica: counters, queued deltas, buffer reuse, load, threads."""

from __future__ import annotations

import math
import random
import threading
import weakref

import pytest
import torch

from gossip import tensors
from gossip.replica import MAX_SPREAD, OFFLOAD_NUMEL, Counters, Replica, offload
from gossip.standing import LEAD_RATE, MOVE_SLACK


def linear(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 4).to(dtype)


def with_batchnorm(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 3))  # training mode: moves the running stats, counts one batch
    return model


def state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def filled(replica: Replica, values: torch.Tensor) -> torch.Tensor:
    """A buffer from the replica holding ``values`` (as the network side makes a delta)."""
    flat = replica.buffer()
    flat.copy_(values)
    return flat


def queue(replica: Replica, delta: torch.Tensor, step_move: int = 0, scale: float = 1.0) -> None:
    replica.queue(delta, scale=scale, step_move=step_move, weight=None, sent_weight=0.0)


def random_flat(replica: Replica, seed: int, scale: float = 0.1) -> torch.Tensor:
    return torch.randn(replica.schema.numel, generator=torch.Generator().manual_seed(seed)) * scale


# --- counters -------------------------------------------------------------------------


def test_advance_counts_steps_and_samples() -> None:
    replica = Replica(linear())
    assert replica.counters() == Counters(0, 0, 1.0)
    replica.advance()
    replica.advance(3, samples=64)
    assert replica.counters() == Counters(4, 64, 1.0)  # fixed mode: the weight stays 1


def test_push_sum_weight_grows_by_samples() -> None:
    replica = Replica(linear(), by_samples=True)
    replica.advance(1, samples=32)
    replica.advance(2, samples=8)
    assert replica.counters() == Counters(3, 40, 41.0)


@pytest.mark.parametrize("steps, samples", [(-1, 0), (0, -1)])
def test_advance_refuses_negative_counts(steps: int, samples: int) -> None:
    replica = Replica(linear())
    with pytest.raises(ValueError):
        replica.advance(steps, samples)
    assert replica.counters() == Counters(0, 0, 1.0)


def test_a_step_moves_up_at_once_and_a_move_down_is_paid_from_the_next_steps() -> None:
    replica = Replica(linear())
    replica.advance(5)
    queue(replica, filled(replica, torch.zeros(replica.schema.numel)), step_move=4)
    assert replica.counters().step == 9
    queue(replica, filled(replica, torch.zeros(replica.schema.numel)), step_move=-3)
    assert replica.counters().step == 9  # the step never goes back ...
    replica.advance(2)
    assert replica.counters().step == 9  # ... the next steps pay the debt instead
    replica.advance(2)
    assert replica.counters().step == 10
    assert replica.local_steps == 9  # the node's own steps count all the same
    queue(replica, filled(replica, torch.zeros(replica.schema.numel)), step_move=-2)
    queue(replica, filled(replica, torch.zeros(replica.schema.numel)), step_move=5)
    assert replica.counters().step == 13  # a move up pays the debt first


def test_moves_up_add_at_most_the_lead_the_nodes_own_steps_earn() -> None:
    # MOVE_SLACK at first, then LEAD_RATE per optimizer step, however far the moves ask.
    replica = Replica(linear())
    zeros = torch.zeros(replica.schema.numel)
    queue(replica, filled(replica, zeros), step_move=MOVE_SLACK + 7)
    assert replica.counters().step == MOVE_SLACK
    queue(replica, filled(replica, zeros), step_move=5)
    assert replica.counters().step == MOVE_SLACK  # nothing left
    replica.advance(2)  # counts 2, earns 2 x LEAD_RATE
    queue(replica, filled(replica, zeros), step_move=MOVE_SLACK)
    assert replica.counters().step == MOVE_SLACK + 2 + 2 * LEAD_RATE
    queue(replica, filled(replica, zeros), step_move=-4)  # a debt: paying it back is no lead
    queue(replica, filled(replica, zeros), step_move=4)
    assert replica.counters().heading == MOVE_SLACK + 2 + 2 * LEAD_RATE
    replica.advance(10 * MOVE_SLACK)  # what is saved stops at MOVE_SLACK
    queue(replica, filled(replica, zeros), step_move=3 * MOVE_SLACK)
    assert replica.counters().step == 12 * MOVE_SLACK + 2 + 2 * LEAD_RATE


def test_queue_takes_the_merged_weight_and_keeps_samples_trained_since_the_offer() -> None:
    replica = Replica(linear(), by_samples=True)
    replica.advance(1, samples=4)  # weight 5: offered
    sent = replica.counters().weight
    replica.advance(1, samples=3)  # trained on while the exchange ran: weight 8
    replica.queue(filled(replica, torch.zeros(replica.schema.numel)),
                  weight=6.0, sent_weight=sent)
    assert replica.counters() == Counters(2, 7, 9.0)  # 6 merged + 3 since the offer


# --- queued deltas --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=str)
def test_apply_pending_adds_the_delta_in_the_params_dtype(dtype: torch.dtype) -> None:
    model = linear(dtype)
    replica = Replica(model)
    before = state(model)
    delta = random_flat(replica, 1)
    queue(replica, filled(replica, delta))
    assert replica.pending == 1
    torch.testing.assert_close(state(model), before, rtol=0, atol=0)  # nothing until applied
    assert replica.apply_pending() == 1
    assert replica.pending == 0
    views = tensors.unflatten(delta, replica.schema)
    for name, value in state(model).items():
        assert value.dtype == dtype
        if dtype == torch.float64:
            expected = before[name] + views[name].double()
        else:  # added in float32, rounded once into the parameter's dtype
            expected = (before[name].float() + views[name]).to(dtype)
        torch.testing.assert_close(value, expected, rtol=0, atol=0)


def test_batchnorm_running_stats_get_deltas_and_the_batch_count_does_not() -> None:
    model = with_batchnorm()
    replica = Replica(model)
    before = state(model)
    assert int(before["1.num_batches_tracked"]) == 1
    assert {"1.running_mean", "1.running_var"} <= {s.name for s in replica.schema.entries}
    delta = random_flat(replica, 2)
    queue(replica, filled(replica, delta))
    assert replica.apply_pending() == 1
    views = tensors.unflatten(delta, replica.schema)
    after = state(model)
    for name in views:
        torch.testing.assert_close(after[name], before[name] + views[name], rtol=0, atol=0)
    assert torch.equal(after["1.num_batches_tracked"], before["1.num_batches_tracked"])
    assert after["1.num_batches_tracked"].dtype == torch.int64


def test_two_queued_deltas_accumulate_and_apply_once() -> None:
    model = linear()
    replica = Replica(model)
    start = tensors.snapshot(model, replica.schema)
    d1, d2 = random_flat(replica, 3), random_flat(replica, 4)
    queue(replica, filled(replica, d1))
    queue(replica, filled(replica, d2))
    assert replica.pending == 2
    assert replica.apply_pending() == 2
    assert replica.pending == 0
    torch.testing.assert_close(tensors.snapshot(model, replica.schema), start + d1 + d2)
    assert replica.apply_pending() == 0  # nothing left: applied once
    torch.testing.assert_close(tensors.snapshot(model, replica.schema), start + d1 + d2)


@pytest.mark.parametrize("s1, s2", [(0.5, 0.5), (0.5, 0.125), (1e-3, 0.75)])
def test_queued_deltas_are_applied_at_their_scales(s1: float, s2: float) -> None:
    # Each delta is queued as a difference and the fraction to take; the snapshot (what the
    # next exchange starts from) and the applied state both see scale x difference.
    model = linear()
    replica = Replica(model)
    start = tensors.snapshot(model, replica.schema)
    d1, d2 = random_flat(replica, 5), random_flat(replica, 6)
    queue(replica, filled(replica, d1), scale=s1)
    expected = start + s1 * d1
    torch.testing.assert_close(tensors.snapshot(model, replica.schema), start)  # not yet
    out = replica.buffer()
    replica.snapshot(out)
    torch.testing.assert_close(out, expected)
    queue(replica, filled(replica, d2), scale=s2)
    expected = expected + s2 * d2
    replica.snapshot(out)
    torch.testing.assert_close(out, expected)
    assert replica.apply_pending() == 2
    torch.testing.assert_close(tensors.snapshot(model, replica.schema), expected)


@pytest.mark.parametrize("scale", [0.0, -0.5, math.nan])
def test_queue_refuses_a_scale_that_is_not_positive(scale: float) -> None:
    replica = Replica(linear())
    with pytest.raises(ValueError, match="scale"):
        queue(replica, replica.buffer(), scale=scale)
    assert replica.pending == 0


def test_apply_pending_with_nothing_queued_changes_nothing() -> None:
    model = linear()
    replica = Replica(model)
    before = state(model)
    assert replica.apply_pending() == 0
    torch.testing.assert_close(state(model), before, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exchanges_keep_at_most_three_flat_buffers_alive(seed: int) -> None:
    # The averager's pattern, as initiator or responder: a snapshot buffer and a receive
    # buffer per exchange; the receive buffer is queued (committed) or released (refused);
    # the snapshot buffer is released. The trainer applies between steps, at random times.
    rng = random.Random(seed)
    model = linear(torch.float64)
    replica = Replica(model)
    handed_out: list[weakref.ref] = []  # weak: a buffer the replica dropped may be freed

    def take() -> torch.Tensor:
        flat = replica.buffer()
        if not any(ref() is flat for ref in handed_out):
            handed_out.append(weakref.ref(flat))
        return flat

    def alive() -> int:
        return sum(ref() is not None for ref in handed_out)

    expected = tensors.snapshot(model, replica.schema).double()
    queued = torch.zeros(replica.schema.numel, dtype=torch.float64)
    for _ in range(300):
        action = rng.random()
        if action < 0.4:  # a committed exchange
            own = take()
            replica.snapshot(own)
            theirs = take()
            assert alive() <= 3
            value = float(rng.randint(-4, 4))
            theirs.fill_(value)
            queue(replica, theirs)
            queued += value
            replica.release(own)
        elif action < 0.55:  # a refused one
            own, theirs = take(), take()
            assert alive() <= 3
            replica.snapshot(own)
            replica.release(theirs)
            replica.release(own)
        else:
            replica.apply_pending()
            expected += queued
            queued.zero_()
        own = theirs = None  # the exchange is over: only the replica holds buffers
        assert alive() <= 3
    replica.apply_pending()
    expected += queued
    torch.testing.assert_close(tensors.snapshot(model, replica.schema).double(), expected)
    # Reused, not made afresh for each exchange.
    assert len(handed_out) == 3  # reused, never made afresh once three exist


def test_release_keeps_at_most_three_buffers_with_the_pending_one() -> None:
    replica = Replica(linear())
    extra = [replica.buffer() for _ in range(5)]
    for flat in extra:
        replica.release(flat)
    again = [replica.buffer() for _ in range(4)]
    assert sum(any(a is e for e in extra) for a in again) == 3
    queue(replica, again[0])
    for flat in again[1:]:
        replica.release(flat)
    again = [replica.buffer() for _ in range(3)]
    assert sum(any(a is e for e in extra) for a in again) == 2  # and the pending delta


def test_snapshot_copies_the_live_state_and_returns_the_counters() -> None:
    model = with_batchnorm()
    replica = Replica(model)
    replica.advance(2, samples=10)
    flat = replica.buffer()
    assert replica.snapshot(flat) == Counters(2, 10, 1.0)
    torch.testing.assert_close(flat, tensors.snapshot(model, replica.schema), rtol=0, atol=0)


def test_snapshot_includes_the_deltas_committed_and_not_yet_applied() -> None:
    # An exchange starts from the state the node has, applied or not: a node that has
    # committed an exchange and not stepped yet must not offer its pre-exchange state.
    model = linear()
    replica = Replica(model)
    live = tensors.snapshot(model, replica.schema)
    delta = random_flat(replica, 7)
    queue(replica, filled(replica, delta))
    flat = replica.buffer()
    replica.snapshot(flat)
    torch.testing.assert_close(flat, live + delta, rtol=0, atol=0)
    torch.testing.assert_close(tensors.snapshot(model, replica.schema), live, rtol=0, atol=0)


# --- load -----------------------------------------------------------------------------


def test_load_replaces_the_state_and_integer_buffers_and_drops_pending() -> None:
    model, source = with_batchnorm(0), with_batchnorm(1)
    for _ in range(4):
        source(torch.randn(8, 3))
    replica = Replica(model, by_samples=True)
    replica.advance(5, samples=7)
    queue(replica, filled(replica, random_flat(replica, 5)))
    assert replica.pending == 1
    flat = tensors.snapshot(source, replica.schema)
    buffers = Replica(source).int_buffers()
    assert buffers == {"1.num_batches_tracked": 5}
    replica.load(flat, step=3, buffers=buffers)
    assert replica.pending == 0
    assert replica.apply_pending() == 0  # the dropped delta is never applied
    for name, value in state(model).items():
        assert torch.equal(value, source.state_dict()[name]), name
    assert replica.counters() == Counters(5, 7, 8.0)  # step: max(5, 3); samples, weight ours
    assert replica.int_buffers() == {"1.num_batches_tracked": 5}
    replica.load(flat, step=11, buffers={})
    assert replica.counters().step == 11


def test_load_ignores_buffers_that_are_not_integer_scalars() -> None:
    model = with_batchnorm()
    replica = Replica(model)
    before = state(model)
    flat = tensors.snapshot(model, replica.schema)
    replica.load(flat, step=0, buffers={"1.running_mean": 9, "no.such.buffer": 9})
    for name, value in state(model).items():
        assert torch.equal(value, before[name]), name


def test_load_casts_into_the_live_dtypes() -> None:
    model = linear(torch.bfloat16)
    replica = Replica(model)
    flat = random_flat(replica, 6, scale=1.0)
    replica.load(flat, step=0, buffers={})
    views = tensors.unflatten(flat, replica.schema)
    for name, value in state(model).items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, views[name].to(torch.bfloat16))


# --- threads --------------------------------------------------------------------------


def test_a_trainer_thread_applying_while_another_queues() -> None:
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    replica = Replica(model)
    n = 300
    applied: list[int] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def trainer() -> None:
        try:
            while not stop.is_set():
                applied.append(replica.apply_pending())
                replica.advance(1)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    def network() -> None:
        try:
            for _ in range(n):
                own = replica.buffer()
                replica.snapshot(own)  # reads the live model while the trainer writes it
                theirs = replica.buffer()
                theirs.fill_(1.0)
                queue(replica, theirs)
                replica.release(own)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=trainer), threading.Thread(target=network)]
    for t in threads:
        t.start()
    threads[1].join(timeout=60)
    stop.set()
    threads[0].join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    applied.append(replica.apply_pending())
    assert sum(applied) == n
    for p in model.parameters():
        assert torch.equal(p.detach(), torch.full_like(p, float(n)))


# --- offload --------------------------------------------------------------------------


async def test_offload_runs_inline_for_a_small_model() -> None:
    replica = Replica(linear())
    assert await offload(replica, threading.get_ident) == threading.get_ident()
    assert await offload(replica, lambda a, b=0: a + b, 2, b=3) == 5


async def test_offload_uses_a_thread_for_a_large_model() -> None:
    replica = Replica(torch.nn.Linear(OFFLOAD_NUMEL, 1, bias=False))
    assert replica.schema.numel >= OFFLOAD_NUMEL
    assert await offload(replica, threading.get_ident) != threading.get_ident()


# --- a delta spread over the steps between exchanges ------------------------------------


def stepped(replica: Replica, steps: int) -> None:
    """``steps`` optimizer steps that change nothing: only the counters move."""
    for _ in range(steps):
        replica.advance()


def spaced(replica: Replica, every: int, count: int = 6) -> None:
    """Queue (and apply) ``count`` zero deltas ``every`` steps apart, then take ``every``
    steps: the replica has learnt the spacing of its exchanges, and the next is due."""
    for _ in range(count):
        queue(replica, filled(replica, torch.zeros(replica.parts * replica.schema.numel)))
        replica.apply_pending()
        stepped(replica, every)


@pytest.mark.parametrize("every", [1, 2, 8, 18])
def test_a_delta_is_spread_evenly_over_half_the_steps_between_exchanges(every: int) -> None:
    replica = Replica(linear())
    spaced(replica, every)
    spread = max(1, every // 2)
    start = tensors.snapshot(replica.model, replica.schema)
    delta = random_flat(replica, seed=every)
    queue(replica, filled(replica, delta), scale=0.5)
    began = []
    for k in range(1, spread + 1):
        # Whenever an exchange looks, it sees the whole delta (the state the node heads to).
        seen = replica.buffer()
        replica.snapshot(seen)
        torch.testing.assert_close(seen, start + 0.5 * delta)
        began.append(replica.apply_step())
        torch.testing.assert_close(tensors.snapshot(replica.model, replica.schema),
                                   start + 0.5 * delta * k / spread)
    assert began == [1] + [0] * (spread - 1)  # an exchange counts once, when it begins
    assert replica.apply_step() == 0 and replica.pending == 0 and not replica.spreading
    torch.testing.assert_close(tensors.snapshot(replica.model, replica.schema),
                               start + 0.5 * delta)


def test_a_delta_that_arrives_mid_spread_takes_the_rest_along() -> None:
    replica = Replica(linear())
    spaced(replica, 16)
    start = tensors.snapshot(replica.model, replica.schema)
    first, second = random_flat(replica, 1), random_flat(replica, 2)
    queue(replica, filled(replica, first), scale=0.5)
    for _ in range(3):
        replica.apply_step()
    stepped(replica, 16)
    queue(replica, filled(replica, second), scale=0.25)
    for _ in range(8):
        replica.apply_step()
    torch.testing.assert_close(tensors.snapshot(replica.model, replica.schema),
                               start + 0.5 * first + 0.25 * second)


def test_apply_pending_adds_the_rest_at_once() -> None:
    replica = Replica(linear())
    spaced(replica, 10)
    start = tensors.snapshot(replica.model, replica.schema)
    delta = random_flat(replica, 3)
    queue(replica, filled(replica, delta))
    assert replica.apply_step() == 1
    assert replica.apply_pending() == 0  # the exchange was counted when it began
    torch.testing.assert_close(tensors.snapshot(replica.model, replica.schema), start + delta)
    assert replica.apply_step() == 0


def test_the_spread_is_bounded_and_at_least_one_step() -> None:
    replica = Replica(linear())
    spaced(replica, 1000, count=3)
    queue(replica, filled(replica, random_flat(replica, 4)))
    steps = 0
    while replica.pending or steps == 0 or replica.spreading:
        replica.apply_step()
        steps += 1
    assert steps == MAX_SPREAD
    fresh = Replica(linear())  # never exchanged: a delta applies at the next step
    queue(fresh, filled(fresh, random_flat(fresh, 5)))
    assert fresh.apply_step() == 1 and not fresh.spreading


def test_the_correction_takes_its_part_at_once_while_the_state_is_spread() -> None:
    model = linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    replica = Replica(model, optimizer=opt)
    assert replica.correction is not None
    spaced(replica, 4)
    n = replica.schema.numel
    delta = torch.cat([random_flat(replica, 6), torch.ones(n)])
    flat = replica.buffer()
    flat.copy_(delta)
    before = {k: v.clone() for k, v in replica.correction.state_dict().items()}
    replica.queue(flat, scale=0.5, correction=0.25, weight=None, sent_weight=0.0)
    replica.apply_step()
    after = replica.correction.state_dict()
    decay = 1.0 - replica.leak
    for name in after:
        torch.testing.assert_close(after[name], before[name] * decay + 0.25)
    replica.apply_pending()
    assert replica.correction.state_dict().keys() == after.keys()
    for name, value in replica.correction.state_dict().items():
        torch.testing.assert_close(value, after[name])  # once, not again with the state


def test_a_download_mid_spread_drops_the_rest() -> None:
    replica = Replica(linear())
    spaced(replica, 6)
    queue(replica, filled(replica, random_flat(replica, 7)))
    replica.apply_step()
    source = tensors.snapshot(linear(seed=9), replica.schema)
    replica.load(source, step=0, buffers={})
    replica.apply_step()
    torch.testing.assert_close(tensors.snapshot(replica.model, replica.schema), source)
