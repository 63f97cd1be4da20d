"""Tests for gossip.correction: what the optimizer's pre-hook does to the gradients, the
estimate a node sends, how the correction's strength follows how often it is updated, and
its checkpoint form. Pure: a replica and an optimizer, no network."""

from __future__ import annotations

import math

import pytest
import torch

from gossip.correction import (CORRECTION_RATE, DEFAULT_LEAK, FADE_LEAK, FULL_SPACING,
                               GRADIENT_AVERAGE, REACH, SCALE_STEPS, STRAY_FLOOR, Stray,
                               check_state, corrected)
from gossip.identity import Identity, PeerId
from gossip.member import Member, State
from gossip.mixing import DeltaHistory, judge
from gossip.replica import Replica


class Pair(torch.nn.Module):
    """Two parameters (one frozen) and a float buffer, to see what gets a correction."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3))
        self.frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
        self.register_buffer("stat", torch.zeros(2))


def replica_with(model: torch.nn.Module) -> tuple[Replica, torch.optim.Optimizer]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return Replica(model, optimizer=optimizer), optimizer


def set_correction(replica: Replica, values: torch.Tensor) -> None:
    """c := values (a flat vector of the schema), through the replica's own queue."""
    n = replica.schema.numel
    delta = torch.cat([torch.zeros(n), values])
    replica.queue(delta, scale=1e-9, correction=1.0, weight=None, sent_weight=0.0)
    replica.leak = 0.0
    replica.apply_pending()


def step_with_grad(model: Pair, optimizer: torch.optim.Optimizer, grad: list[float]) -> torch.Tensor:
    """One optimizer step whose raw gradient for ``a`` is ``grad``; returns what the
    optimizer saw."""
    model.a.grad = torch.tensor(grad)
    seen = {}

    def look(opt: object, args: object, kwargs: object) -> None:
        seen["grad"] = model.a.grad.clone()

    handle = optimizer.register_step_pre_hook(look)
    optimizer.step()  # the replica's hook was registered first: ``seen`` is after it
    handle.remove()
    return seen["grad"]


def test_the_hook_adds_the_correction_and_averages_the_raw_gradient() -> None:
    model = Pair()
    replica, optimizer = replica_with(model)
    replica.leak = 0.0
    assert replica.correction is not None and not replica.estimating
    place = replica.schema.places()
    c = torch.zeros(replica.schema.numel)
    c[place["a"]] = torch.tensor([1.0, 2.0, 3.0])
    set_correction(replica, c)
    seen = step_with_grad(model, optimizer, [10.0, 0.0, -10.0])
    assert torch.allclose(seen, torch.tensor([11.0, 2.0, -7.0]))  # g + c
    assert replica.estimating
    out = torch.zeros(2 * replica.schema.numel)
    replica.snapshot(out)
    z = out[replica.schema.numel:]
    # z = ĝ + c, ĝ the raw gradient's running average (started from zero)
    assert torch.allclose(z[place["a"]], GRADIENT_AVERAGE * torch.tensor([10.0, 0.0, -10.0])
                          + torch.tensor([1.0, 2.0, 3.0]))
    assert torch.equal(z[place["frozen"]], torch.zeros(2))  # no gradient, no correction
    assert torch.equal(z[place["stat"]], torch.zeros(2))  # a buffer has none either
    assert set(replica.correction_state()) == {"a"}


def test_a_step_adds_less_of_the_correction_when_updates_of_it_are_rare() -> None:
    model = Pair()
    replica, optimizer = replica_with(model)
    c = torch.zeros(replica.schema.numel)
    c[replica.schema.places()["a"]] = 1.0
    set_correction(replica, c)  # an update: the count of steps since starts again
    for k in range(1, 3 * FULL_SPACING):
        seen = step_with_grad(model, optimizer, [0.0, 0.0, 0.0])
        want = min(1.0, FULL_SPACING / k)  # the steps since the update, once they are many
        assert seen[0].item() == pytest.approx(want, rel=1e-6), k


def test_the_scale_is_the_largest_gradient_of_the_first_steps_and_a_reset_forgets() -> None:
    model = Pair()
    replica, optimizer = replica_with(model)
    norms = [3.0, 5.0, 4.0] + [0.5] * SCALE_STEPS + [100.0]  # the last comes too late
    for norm in norms:
        step_with_grad(model, optimizer, [norm, 0.0, 0.0])
    assert replica.gradient_scale == 5.0
    replica.load(torch.zeros(replica.schema.numel), step=0, buffers={})  # a download
    assert replica.gradient_scale == 0.0 and not replica.estimating
    assert all(float(v.abs().max()) == 0 for v in replica.correction_state().values())


def test_a_queued_correction_leaks_at_each_commit() -> None:
    model = Pair()
    replica, _ = replica_with(model)
    n = replica.schema.numel
    place = replica.schema.places()["a"]
    c = torch.zeros(n)
    c[place] = 1.0
    set_correction(replica, c)
    replica.leak = 0.25
    for _ in range(2):  # two commits, one apply: c x 0.75^2 + the second's 0.5
        delta = torch.zeros(2 * n)
        delta[n:][place] = 1.0
        replica.queue(delta, scale=1e-9, correction=0.5 if _ else 0.0, weight=None,
                      sent_weight=0.0)
    replica.apply_pending()
    assert torch.allclose(replica.correction_state()["a"], torch.full((3,), 0.75**2 + 0.5))


def test_an_exchange_never_leaves_the_correction_longer_than_reach_times_the_scale() -> None:
    # However the estimates' steps add up, c stays within REACH x the node's own gradient
    # scale, which no peer moves; shorter, it is left alone.
    model = Pair()
    replica, optimizer = replica_with(model)
    step_with_grad(model, optimizer, [2.0, 0.0, 0.0])  # scale 2
    n, place = replica.schema.numel, replica.schema.places()["a"]
    for length, kept in ((1.0, 1.0), (100.0, REACH * 2.0)):
        delta = torch.zeros(2 * n)
        delta[n:][place] = torch.tensor([length, 0.0, 0.0])
        replica.leak = 1.0  # forget the last c: this exchange's delta is all of it
        replica.queue(delta, scale=1e-9, correction=1.0, weight=None, sent_weight=0.0)
        replica.apply_pending()
        assert float(torch.linalg.vector_norm(replica.correction_state()["a"])) == (
            pytest.approx(kept))
    assert replica.correction.bounded == 1


def test_a_checkpointed_correction_must_be_this_models() -> None:
    shapes = corrected(Pair())
    assert shapes == {"a": torch.Size([3])}
    check_state(shapes, {"a": torch.ones(3)})
    for bad, why in [({}, "missing"), ({"a": torch.ones(3), "b": torch.ones(1)}, "unknown"),
                     ({"a": torch.ones(4)}, "shape"), ({"a": torch.tensor([1.0, math.inf, 0])},
                                                        "finite"),
                     ({"a": torch.ones(3, dtype=torch.int64)}, "finite"), ([], "table")]:
        with pytest.raises(ValueError, match=why):
            check_state(shapes, bad)


# --- the estimate's norm check --------------------------------------------------------------

def test_a_node_that_learned_its_own_data_still_takes_the_swarms_estimate() -> None:
    # Our estimate is near zero (our own loss is), the peer's is the swarm's gradient: a
    # check against our own norm alone would refuse every honest peer.
    n = 8
    own = torch.cat([torch.zeros(n), torch.full((n,), 1e-4)])
    theirs = torch.cat([torch.zeros(n), torch.full((n,), 0.5)])

    def verdict(received: torch.Tensor, scale: float):
        return judge(received.clone(), own, 2, 0.5, (DeltaHistory(), DeltaHistory()), clip=5.0,
                     max_norm_ratio=100.0, correction=0.25, gradient_scale=scale)

    assert "correction" in verdict(theirs, 0.0).refused
    assert verdict(theirs, 2.0).refused is None  # our gradients' scale as we started
    assert verdict(theirs, 2.0).correction.scale == 0.25
    huge = torch.cat([torch.zeros(n), torch.full((n,), 1e6)])
    assert "correction" in verdict(huge, 2.0).refused


def test_a_gradient_that_is_not_finite_is_forgotten_not_sent() -> None:
    model = Pair()
    replica, optimizer = replica_with(model)
    step_with_grad(model, optimizer, [1.0, 2.0, 3.0])
    step_with_grad(model, optimizer, [math.nan, 0.0, 0.0])  # a step that blew up
    out = torch.zeros(2 * replica.schema.numel)
    replica.snapshot(out)
    estimate = out[replica.schema.numel:]  # (the state itself took the NaN step: our test's)
    assert bool(estimate.isfinite().all())  # z is c alone (zero here), never a NaN
    assert not replica.estimating  # until the next step measures again
    step_with_grad(model, optimizer, [1.0, 1.0, 1.0])
    replica.snapshot(out)
    assert replica.estimating and bool(estimate.isfinite().all())


def test_a_fused_optimizers_scaled_gradients_are_unscaled_for_the_average() -> None:
    # Under a GradScaler a fused optimizer steps on scaled gradients and unscales inside:
    # the hook sees optimizer.grad_scale, averages the unscaled gradient and scales c.
    model = Pair()
    optimizer = torch.optim.SGD([model.a], lr=0.1, fused=True)
    replica = Replica(model, optimizer=optimizer)
    replica.leak = 0.0
    c = torch.zeros(replica.schema.numel)
    c[replica.schema.places()["a"]] = 1.0
    set_correction(replica, c)
    optimizer.grad_scale = torch.tensor(1024.0)  # as torch.amp.GradScaler.step sets it
    seen = step_with_grad(model, optimizer, [1024.0, 0.0, 0.0])
    del optimizer.grad_scale
    assert torch.allclose(seen, torch.tensor([2048.0, 1024.0, 1024.0]))  # g + 1024 c
    assert replica.gradient_scale == pytest.approx(1.0)  # the unscaled norm
    out = torch.zeros(2 * replica.schema.numel)
    replica.snapshot(out)
    a = out[replica.schema.numel:][replica.schema.places()["a"]]
    assert torch.allclose(a, torch.tensor([GRADIENT_AVERAGE, 0.0, 0.0]) + 1.0)


def test_the_step_may_run_under_the_replicas_lock_as_the_docs_suggest() -> None:
    # A trainer that wants no snapshot to straddle a step holds the lock around it; the
    # correction's hook takes the same lock inside the step (a hang here, before it was
    # re-entrant).
    model = Pair()
    replica, optimizer = replica_with(model)
    model.a.grad = torch.ones(3)
    with replica.lock:
        optimizer.step()
    assert replica.estimating


def test_per_exchange_every_step_adds_all_and_the_estimate_spans_the_gap() -> None:
    """With the outer step the correction is measured per exchange: 100 steps between two
    updates, and every step still adds all of ``c``; ``ĝ`` then weighs each of the last
    hundred steps about alike (a mean gradient over the gap, not over the last five steps),
    and an exchange takes the whole difference of the estimates."""
    model = Pair()
    optimizer = torch.optim.SGD([model.a], lr=0.1)
    replica = Replica(model, optimizer=optimizer, outer=(0.7, 0.5))
    assert replica.correction is not None and replica.correction.per_exchange
    assert replica.correction_rate() == CORRECTION_RATE  # spacing not known yet
    c = torch.zeros(replica.schema.numel)
    c[replica.schema.places()["a"]] = 1.0
    for _ in range(100):
        step_with_grad(model, optimizer, [0.0, 0.0, 0.0])
    set_correction(replica, c)  # an update after 100 steps: the spacing is 100
    assert replica.correction_rate() == 1.0
    for k in range(100):
        raw = 1.0 if k < 50 else 0.0
        seen = step_with_grad(model, optimizer, [raw, 0.0, 0.0])
        assert seen[0].item() == pytest.approx(raw + 1.0, rel=1e-6)  # all of c, every step
    z = torch.zeros(replica.schema.numel)
    replica.correction.estimate_into(z, decay=0.0)
    # The first half of the gap had gradient 1: an average of weight 1/100 per step still reads
    # 0.99^50 x (1 - 0.99^50) ≈ 0.24 of it, where the per-step one (weight 0.2) reads 1e-5.
    assert z[replica.schema.places()["a"]][0].item() == pytest.approx(0.24, abs=0.01)


# --- departures: the adaptive leak (Stray) -------------------------------------------------

def members(n: int) -> list[PeerId]:
    return [Identity.generate().peer_id for _ in range(n)]


def fades(stray: Stray, base: float = DEFAULT_LEAK) -> int:
    """How many exchanges leak by more than ``base`` before it is back."""
    count = 0
    while stray.leak(base) > base:
        count += 1
        assert count < 100
    return count


def taking_part(n: int) -> tuple[Stray, list[PeerId]]:
    """A Stray that has seen ``n`` members alive and ready, and the first of them die."""
    stray, peers = Stray(), members(n)
    for peer in peers:
        stray.seen(peer, State.ALIVE, ready=True)
    stray.seen(peers[0], State.DEAD, ready=True)
    return stray, peers


def test_a_departure_fades_its_share_over_a_few_exchanges_then_the_leak_is_back() -> None:
    stray, peers = taking_part(3)
    assert stray.share == pytest.approx(1 / 3)  # two others and this node are left
    # (1 − 0.3)^k · 1/3 ≤ 0.05 from k = 6 on
    expected = math.ceil(math.log(STRAY_FLOOR * 3) / math.log(1 - FADE_LEAK))
    assert fades(stray) == expected == 6
    assert stray.leak(DEFAULT_LEAK) == DEFAULT_LEAK
    stray.seen(peers[1], State.LEFT, ready=True)  # a departure announced: the same
    assert stray.share > STRAY_FLOOR and stray.leak(DEFAULT_LEAK) == FADE_LEAK


def test_only_members_that_took_part_count_and_a_return_counts_too() -> None:
    stray = Stray()
    watcher, joiner = members(2)
    stray.seen(watcher, State.ALIVE, ready=False)  # never took part: it holds no correction
    stray.seen(watcher, State.DEAD, ready=False)
    stray.seen(joiner, State.ALIVE, ready=True)
    stray.seen(joiner, State.SUSPECT, ready=True)  # suspected is not gone
    assert stray.share == 0
    stray.seen(joiner, State.DEAD, ready=True)
    assert stray.share == 1.0  # this node alone is left: all of the sum is stray
    fades(stray)
    left = stray.share
    stray.seen(joiner, State.ALIVE, ready=True)  # back, with its checkpoint's correction
    assert stray.share == pytest.approx(left + 1 / 2)
    stray.seen(joiner, State.ALIVE, ready=True)  # a record that says nothing new
    assert stray.share == pytest.approx(left + 1 / 2)


def test_in_a_large_swarm_a_departure_is_below_the_floor_and_plain_leak_applies() -> None:
    stray, _ = taking_part(21)
    assert stray.share == pytest.approx(1 / 21) and fades(stray) == 0


def test_without_the_outer_step_nothing_strays() -> None:
    peer = members(1)[0]
    for outer, on in (((1.0, 0.0), False), ((0.7, 0.5), True)):
        model = torch.nn.Linear(2, 2)
        replica = Replica(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          outer=outer)
        replica.member_changed(Member(peer, "h:1", 0, State.ALIVE, 1, 0, True, 0.0))
        replica.member_changed(Member(peer, "h:1", 0, State.DEAD, 1, 0, True, 0.0))
        assert (replica.stray.share > 0) is on
        replica.close()
