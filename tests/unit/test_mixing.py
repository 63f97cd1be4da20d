"""Tests for gossip.mixing: the averaging identity, the coefficients, clipping and quarantine.

Pure: no trio, no I/O. Flat states come from gossip.tensors, as the averager makes them.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip import tensors
from gossip.mixing import (
    ADVANCE_CHUNKS, MAX_QUARANTINED, Delta, DeltaHistory, Difference, Quarantine, coefficient,
    judge,
    make_delta, merged_weight,
)
from gossip.standing import Standing
from gossip.tensors import StateSchema

CHUNK = tensors.REDUCE_CHUNK  # make_delta reduces in chunks of this many elements

NO_CLIP = {"clip": 0.0, "max_norm_ratio": 100.0}
ANY_NORM = math.inf  # our norm with a history entry, where the norm check is not under test


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def flat_of(model: torch.nn.Module) -> torch.Tensor:
    return tensors.snapshot(model, StateSchema.from_module(model))


def sgd_run(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
            lr: float) -> torch.Tensor:
    """Train ``model`` with plain SGD; returns the sum of its updates ``lr * grad`` (flat),
    accumulated from the gradients, not from the states."""
    schema = StateSchema.from_module(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    total = torch.zeros(schema.numel)
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        total += lr * tensors.snapshot(grads, schema)
        optimizer.step()
    return total


def batches(seed: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(k)]


def exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- the identity the design rests on -------------------------------------------------


def test_worked_example_from_the_design() -> None:
    # Start (0, 0); deltas (1, 1) and (1, -1) with w <- w - delta.
    start = torch.zeros(2)
    d_a, d_b = torch.tensor([1.0, 1.0]), torch.tensor([1.0, -1.0])
    averaged_states = ((start - d_a) + (start - d_b)) / 2
    averaged_deltas = start - (d_a + d_b) / 2
    exact(averaged_states, torch.tensor([-1.0, 0.0]))
    exact(averaged_deltas, torch.tensor([-1.0, 0.0]))


@pytest.mark.parametrize("k", [1, 5])
def test_averaging_states_after_sgd_equals_applying_the_mean_delta(k: int) -> None:
    # Two replicas from a common start each take k SGD steps on their own batches. The
    # average of their states is the start moved by the mean of their accumulated updates.
    start = flat_of(mlp())
    a, b = mlp(), mlp()
    delta_a = sgd_run(a, batches(1, k), lr=0.1)
    delta_b = sgd_run(b, batches(2, k), lr=0.1)
    assert float(tensors.norm(delta_a - delta_b)) > 1e-3  # they really went different ways
    averaged = (flat_of(a) + flat_of(b)) / 2
    torch.testing.assert_close(averaged, start - (delta_a + delta_b) / 2, rtol=1e-5, atol=1e-6)


def test_half_deltas_through_make_delta_land_both_on_the_midpoint() -> None:
    a, b = mlp(), mlp()
    sgd_run(a, batches(3, 3), lr=0.2)
    sgd_run(b, batches(4, 3), lr=0.2)
    s_a, s_b = flat_of(a), flat_of(b)
    c = coefficient(0.5, False, 0.0, 0.0)
    received_a = s_b.clone()
    verdict_a = make_delta(received_a, s_a, c, DeltaHistory(), **NO_CLIP)
    received_b = s_a.clone()
    verdict_b = make_delta(received_b, s_b, c, DeltaHistory(), **NO_CLIP)
    assert verdict_a.refused is None and verdict_b.refused is None
    assert verdict_a.scale == verdict_b.scale == 0.5
    schema = StateSchema.from_module(a)
    tensors.add_(a, schema, received_a, verdict_a.scale)
    tensors.add_(b, schema, received_b, verdict_b.scale)
    midpoint = (s_a + s_b) / 2
    torch.testing.assert_close(flat_of(a), midpoint, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(flat_of(b), midpoint, rtol=1e-6, atol=1e-7)


def test_deltas_applied_after_local_steps_keep_the_steps_and_the_mean() -> None:
    # The exchange uses snapshots; each side takes another SGD step before the delta lands.
    # Each keeps its own step, and the pair's mean is exactly the mean of the live states.
    a, b = mlp(), mlp()
    sgd_run(a, batches(5, 2), lr=0.1)
    sgd_run(b, batches(6, 2), lr=0.1)
    s_a, s_b = flat_of(a), flat_of(b)
    delta_a, delta_b = s_b.clone(), s_a.clone()
    assert make_delta(delta_a, s_a, 0.5, DeltaHistory(), **NO_CLIP).scale == 0.5
    assert make_delta(delta_b, s_b, 0.5, DeltaHistory(), **NO_CLIP).scale == 0.5
    step_a = sgd_run(a, batches(7, 1), lr=0.1)
    step_b = sgd_run(b, batches(8, 1), lr=0.1)
    live_mean = (flat_of(a) + flat_of(b)) / 2
    schema = StateSchema.from_module(a)
    tensors.add_(a, schema, delta_a, 0.5)
    tensors.add_(b, schema, delta_b, 0.5)
    midpoint = (s_a + s_b) / 2
    torch.testing.assert_close(flat_of(a), midpoint - step_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flat_of(b), midpoint - step_b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close((flat_of(a) + flat_of(b)) / 2, live_mean, rtol=1e-5, atol=1e-6)


# --- coefficient and merged_weight ----------------------------------------------------


@pytest.mark.parametrize("weight", [0.5, 0.25, 1.0])
def test_fixed_mode_ignores_the_push_sum_weights(weight: float) -> None:
    assert coefficient(weight, False, 0.0, 0.0) == weight
    assert coefficient(weight, False, 7.0, 1.0) == weight


def test_push_sum_coefficient_is_the_peers_share() -> None:
    assert coefficient(0.5, True, 1.0, 3.0) == 0.75
    assert coefficient(0.5, True, 3.0, 1.0) == 0.25
    assert coefficient(0.9, True, 2.0, 2.0) == 0.5  # the fixed weight plays no part
    assert merged_weight(1.0, 3.0) == 2.0


weights = st.floats(min_value=1e-3, max_value=1e6)
values = st.floats(min_value=-1e3, max_value=1e3)


@settings(max_examples=200, deadline=None)
@given(weights, weights, values, values)
def test_push_sum_exchange_lands_on_the_weighted_mean_and_preserves_the_sums(
    w_a: float, w_b: float, x_a: float, x_b: float
) -> None:
    new_a = x_a + coefficient(0.5, True, w_a, w_b) * (x_b - x_a)
    new_b = x_b + coefficient(0.5, True, w_b, w_a) * (x_a - x_b)
    mean = (w_a * x_a + w_b * x_b) / (w_a + w_b)
    scale = max(1.0, abs(x_a), abs(x_b))
    assert math.isclose(new_a, mean, rel_tol=1e-9, abs_tol=1e-9 * scale)
    assert math.isclose(new_b, mean, rel_tol=1e-9, abs_tol=1e-9 * scale)
    merged = merged_weight(w_a, w_b)
    assert merged_weight(w_b, w_a) == merged
    assert math.isclose(2 * merged, w_a + w_b, rel_tol=1e-12)  # sum of weights
    total = w_a * x_a + w_b * x_b  # sum of weight x value
    assert math.isclose(merged * new_a + merged * new_b, total, rel_tol=1e-9,
                        abs_tol=1e-9 * scale * (w_a + w_b))


# --- DeltaHistory ---------------------------------------------------------------------


def test_history_median_odd_and_even() -> None:
    h = DeltaHistory(window=8, min_history=1)
    assert h.median() is None
    for d in (5.0, 1.0, 3.0):
        h.add(d, ANY_NORM)
    assert h.median() == 3.0
    h.add(10.0, ANY_NORM)
    assert h.median() == 4.0  # (3 + 5) / 2
    assert len(h) == 4


def test_history_forgets_beyond_its_window() -> None:
    h = DeltaHistory(window=3, min_history=1)
    for d in (100.0, 200.0, 300.0, 1.0, 2.0):
        h.add(d, ANY_NORM)
    assert len(h) == 3
    assert h.median() == 2.0  # of 300, 1, 2: the first two are gone
    h.add(2.0, ANY_NORM)
    h.add(2.0, ANY_NORM)
    assert h.median() == 2.0  # only 2s are left; 300 was evicted, not a duplicate 2


def test_history_bound_waits_for_min_history_and_clip_zero_disables() -> None:
    h = DeltaHistory(window=4, min_history=3)
    h.add(2.0, ANY_NORM)
    h.add(4.0, ANY_NORM)
    assert h.bound(5.0) is None
    h.add(6.0, ANY_NORM)
    assert h.bound(5.0) == 20.0
    assert h.bound(0.0) is None
    assert h.bound(-1.0) is None


def test_a_zero_median_bounds_nothing() -> None:
    # A node that has only met identical states (right after a download, or a swarm at
    # rest) knows no scale for a step; clipping to 0 would freeze it.
    h = DeltaHistory(window=4, min_history=2)
    h.add(0.0, ANY_NORM)
    h.add(0.0, ANY_NORM)
    assert h.bound(5.0) is None
    verdict, delta = make(torch.tensor([3.0, 4.0]), torch.zeros(2), h, c=0.5, clip=5.0)
    assert verdict == Delta(5.0, None, False, 0.5)
    exact(delta, torch.tensor([1.5, 2.0]))


@pytest.mark.parametrize("window, min_history", [(0, 1), (4, 0), (4, 5), (-1, -1)])
def test_history_refuses_bad_sizes(window: int, min_history: int) -> None:
    with pytest.raises(ValueError):
        DeltaHistory(window, min_history)


distances = st.one_of(st.integers(0, 5).map(float),  # duplicates matter for the eviction
                      st.floats(min_value=0.0, max_value=1e6))


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.lists(distances, max_size=60))
def test_history_median_matches_statistics_median(window: int, seq: list[float]) -> None:
    h = DeltaHistory(window=window, min_history=1)
    for i, d in enumerate(seq):
        h.add(d, ANY_NORM)
        recent = seq[max(0, i + 1 - window) : i + 1]
        assert len(h) == len(recent)
        assert h.median() == statistics.median(recent)
        median = statistics.median(recent)
        assert h.bound(2.0) == (2.0 * median if median else None)


# --- make_delta -----------------------------------------------------------------------


def make(received: torch.Tensor, own: torch.Tensor, history: DeltaHistory | None = None, *,
         c: float = 0.5, clip: float = 0.0, ratio: float = 100.0) -> tuple[Delta, torch.Tensor]:
    """make_delta, checking that ``own`` is untouched and a refusal leaves ``history`` alone;
    returns the verdict and the step it stands for (``scale`` times the difference)."""
    history = history if history is not None else DeltaHistory(window=8, min_history=1)
    own_before, before = own.clone(), (len(history), history.median())
    verdict = make_delta(received, own, c, history, clip=clip, max_norm_ratio=ratio)
    exact(own, own_before)
    if verdict.refused is not None:
        assert (len(history), history.median()) == before
        assert verdict.scale == 0.0
        return verdict, received
    assert len(history) == min(before[0] + 1, 8)
    assert 0 < verdict.scale <= c
    return verdict, received * verdict.scale


def test_make_delta_success_queues_the_scaled_difference() -> None:
    own = torch.tensor([1.0, 2.0, 3.0])
    verdict, delta = make(torch.tensor([3.0, 2.0, -1.0]), own, c=0.5)
    assert verdict == Delta(math.sqrt(20.0), None, False, 0.5)
    exact(delta, torch.tensor([1.0, 0.0, -2.0]))


BIG = CHUNK + 1000


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", [0, 12345, CHUNK - 1, CHUNK, BIG - 1],
                         ids=["first", "middle", "end-of-chunk", "second-chunk", "last"])
def test_make_delta_refuses_non_finite_values_anywhere(bad: float, where: int) -> None:
    own = torch.ones(BIG)
    received = torch.full((BIG,), 2.0)
    received[where] = bad
    history = DeltaHistory(window=8, min_history=1)
    history.add(1.0, ANY_NORM)
    verdict, _ = make(received, own, history)
    assert verdict.refused is not None and "finite" in verdict.refused
    assert math.isnan(verdict.distance)


def test_make_delta_takes_huge_finite_values_whose_sum_overflows() -> None:
    # Finite values whose float32 sum overflows are still finite: only the distance check
    # may refuse them (here it does not: the ratio allows it).
    own = torch.full((4,), 1e38)
    verdict, delta = make(torch.full((4,), 3e38), own, ratio=1e6, c=1.0)
    assert verdict.refused is None
    assert math.isclose(verdict.distance, 4e38, rel_tol=1e-6)
    torch.testing.assert_close(delta, torch.full((4,), 2e38))


def test_make_delta_refuses_a_difference_that_overflows() -> None:
    own = torch.tensor([-3e38, 0.0])
    verdict, _ = make(torch.tensor([3e38, 0.0]), own, ratio=1e30)
    assert verdict.refused is not None and "overflow" in verdict.refused
    assert math.isinf(verdict.distance)


def test_make_delta_refuses_a_state_too_far_from_ours() -> None:
    own = torch.tensor([3.0, 4.0])  # norm 5
    verdict, _ = make(torch.tensor([3.0, 4.0 + 501.0]), own, ratio=100.0)
    assert verdict.refused is not None and "100x" in verdict.refused
    assert verdict.distance == 501.0
    # At most the ratio, not less than it: exactly 100 x our norm passes.
    verdict, _ = make(torch.tensor([3.0, 504.0]), own, ratio=100.0)
    assert verdict.refused is None and verdict.distance == 500.0


def test_make_delta_with_own_norm_zero_does_not_refuse() -> None:
    verdict, delta = make(torch.tensor([1e6, -1e6]), torch.zeros(2), ratio=1.0, c=0.5)
    assert verdict.refused is None
    exact(delta, torch.tensor([5e5, -5e5]))


@pytest.mark.parametrize("c", [0.5, 0.25, 1.0])
def test_clipping_scales_the_step_to_exactly_the_bound(c: float) -> None:
    history = DeltaHistory(window=8, min_history=1)
    history.add(2.0, ANY_NORM)
    bound = history.bound(3.0)
    assert bound == 6.0
    own = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    direction = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    received = own + direction * (60.0 / float(direction.norm()))  # 10 x the bound away
    verdict, delta = make(received, own, history, c=c, clip=3.0)
    assert verdict.refused is None and verdict.clipped
    assert math.isclose(verdict.distance, 60.0, rel_tol=1e-5)
    assert math.isclose(tensors.norm(delta), c * bound, rel_tol=1e-5)
    # Same direction as the raw difference.
    cosine = float(torch.dot(delta, direction) / (delta.norm() * direction.norm()))
    assert cosine > 1 - 1e-5
    # The clipped distance, what we accepted, entered the history: not the raw 60.
    assert len(history) == 2
    assert history.median() == 4.0  # of 2 and 6


def test_clipping_leaves_a_step_within_the_bound_alone() -> None:
    history = DeltaHistory(window=8, min_history=2)
    history.add(4.0, ANY_NORM)
    history.add(4.0, ANY_NORM)
    verdict, delta = make(torch.tensor([3.0, 4.0]), torch.zeros(2), history, c=0.5, clip=2.0)
    assert verdict == Delta(5.0, None, False, 0.5)
    exact(delta, torch.tensor([1.5, 2.0]))


def test_no_clipping_before_min_history_or_with_clip_zero() -> None:
    history = DeltaHistory(window=8, min_history=2)
    history.add(1.0, ANY_NORM)
    verdict, delta = make(torch.tensor([30.0, 40.0]), torch.zeros(2), history, c=1.0, clip=1.0)
    assert verdict == Delta(50.0, None, False, 1.0)  # one entry known, two needed
    exact(delta, torch.tensor([30.0, 40.0]))
    verdict, delta = make(torch.tensor([300.0, 400.0]), torch.zeros(2), history, c=1.0, clip=0.0)
    assert verdict == Delta(500.0, None, False, 1.0)  # clip=0: off, however far
    exact(delta, torch.tensor([300.0, 400.0]))


def test_poison_in_a_minority_of_the_history_cannot_raise_the_bound() -> None:
    # The history only hears of exchanges we initiated, to peers picked at random: an
    # attacker holding a third of the member table fills a third of it, with states as far
    # away as it likes. The median, and the bound, stay the honest ones.
    history = DeltaHistory(window=32, min_history=8)
    for i in range(300):
        far = i % 3 == 0
        distance = 1e6 if far else 1.0 + (i % 5) / 10
        bound = history.bound(5.0)
        history.add(min(distance, bound) if bound else distance, ANY_NORM)
    assert history.bound(5.0) is not None and history.bound(5.0) <= 5 * 1.4


def test_a_history_all_poison_grows_by_at_most_clip_per_half_window() -> None:
    # Even a window of nothing but poison raises the bound by a factor ``clip`` per half
    # window, not to the attacker's distance at once: the entries are what we accepted.
    history = DeltaHistory(window=32, min_history=8)
    for _ in range(32):
        history.add(1.0, ANY_NORM)
    own = torch.zeros(4)
    for _ in range(16):
        verdict = make_delta(torch.full((4,), 5e5), own.clone(), 0.5, history, clip=5.0,
                             max_norm_ratio=math.inf)
        assert verdict.clipped
    assert history.median() == 3.0  # (1 + 5) / 2: sixteen clipped entries of 5 beside 1s
    assert history.bound(5.0) == 15.0


def test_the_norm_reference_is_the_median_of_our_recent_norms_when_smaller() -> None:
    # An attacker that got our norm pushed up (by accepted steps) must not earn a larger
    # refusal radius with it: the reference is our norm over the history, at its median.
    history = DeltaHistory(window=8, min_history=8)
    for _ in range(8):
        history.add(1.0, 5.0)  # our norm was 5 at each of the last 8 exchanges
    assert history.norm_reference(5000.0) == 5.0
    assert history.norm_reference(2.0) == 2.0  # our norm now, when that is the smaller
    own = torch.tensor([3000.0, 4000.0])  # norm 5000 now
    received = own + torch.tensor([0.0, 501.0])  # 501 away: over 100 x 5, under 100 x 5000
    verdict = make_delta(received, own, 0.5, history, clip=0.0, max_norm_ratio=100.0)
    assert verdict.refused is not None and "our norm 5" in verdict.refused


def test_a_newcomers_state_is_checked_committed_and_moves_us_by_nothing() -> None:
    history = DeltaHistory(window=8, min_history=1)
    history.add(1.0, ANY_NORM)
    own = torch.tensor([3.0, 4.0])
    verdict = make_delta(torch.tensor([30.0, 40.0]), own, 0.5, history, clip=5.0,
                         max_norm_ratio=100.0, standing=Standing.NEWCOMER)
    assert verdict == Delta(math.sqrt(27.0**2 + 36.0**2), None, False, 0.0)
    assert len(history) == 1  # a newcomer's distance is not ours to learn the scale from
    bad = make_delta(torch.tensor([math.nan, 0.0]), own, 0.5, history, clip=5.0,
                     max_norm_ratio=100.0, standing=Standing.NEWCOMER)
    assert bad.refused is not None  # still a strike: the checks run for everyone


def test_a_member_is_clipped_like_a_chosen_peer_but_does_not_feed_the_history() -> None:
    history = DeltaHistory(window=8, min_history=1)
    history.add(2.0, ANY_NORM)
    received = torch.tensor([60.0, 0.0])
    verdict = make_delta(received, torch.zeros(2), 0.5, history, clip=3.0,
                         max_norm_ratio=100.0, standing=Standing.MEMBER)
    assert verdict.clipped and math.isclose(verdict.scale, 0.5 * 6.0 / 60.0)
    assert len(history) == 1


def test_make_delta_over_several_chunks() -> None:
    # Distances and norms are reduced chunk by chunk: the result must not depend on that.
    g = torch.Generator().manual_seed(2)
    own = torch.randn(2 * CHUNK + 3, generator=g)
    received = torch.randn(2 * CHUNK + 3, generator=g)
    expected = float(torch.linalg.vector_norm((received - own).double()))
    delta_expected = (received - own) * 0.5
    verdict, delta = make(received, own, c=0.5)
    assert verdict.refused is None
    assert math.isclose(verdict.distance, expected, rel_tol=1e-5)
    torch.testing.assert_close(delta, delta_expected)


# --- Quarantine -----------------------------------------------------------------------


def test_strikes_in_a_row_bar_a_peer() -> None:
    q = Quarantine(strikes=3, duration=60.0)
    assert not q.strike("p", 0.0)
    assert not q.strike("p", 1.0)
    assert not q.barred("p", 1.0)
    assert q.strike("p", 2.0)
    assert q.barred("p", 2.0)
    assert q.count(2.0) == 1


def test_a_valid_exchange_clears_the_strikes() -> None:
    q = Quarantine(strikes=2, duration=60.0)
    assert not q.strike("p", 0.0)
    q.clear("p")
    assert not q.strike("p", 1.0)  # counting starts again
    assert not q.barred("p", 1.0)
    assert q.strike("p", 2.0)


def test_strikes_are_counted_per_peer() -> None:
    q = Quarantine(strikes=2, duration=60.0)
    assert not q.strike("p", 0.0)
    assert not q.strike("q", 0.0)
    assert q.strike("p", 0.0)
    assert q.barred("p", 0.0) and not q.barred("q", 0.0)


def test_bar_is_immediate_and_expires_at_until() -> None:
    q = Quarantine(strikes=3, duration=10.0)
    q.bar("p", 5.0)
    assert q.barred("p", 5.0)
    assert q.barred("p", 14.999)
    assert q.count(14.999) == 1
    assert q.count(15.0) == 0
    assert not q.barred("p", 15.0)  # now >= until: free again
    assert not q.barred("p", 14.0)  # and forgotten


def test_bar_again_extends_and_strikes_after_expiry_start_over() -> None:
    q = Quarantine(strikes=2, duration=10.0)
    q.bar("p", 0.0)
    q.bar("p", 8.0)
    assert q.barred("p", 12.0)
    assert not q.barred("p", 18.0)
    assert not q.strike("p", 18.0)  # the bar reset its strikes
    assert q.strike("p", 19.0)


def test_count_counts_only_current_quarantines() -> None:
    q = Quarantine(strikes=1, duration=10.0)
    q.bar("a", 0.0)
    q.bar("b", 5.0)
    assert q.strike("c", 7.0)
    assert q.count(9.0) == 3
    assert q.count(12.0) == 2
    assert q.count(16.0) == 1
    assert q.count(17.0) == 0


def test_zero_duration_bars_nobody() -> None:
    q = Quarantine(strikes=1, duration=0.0)
    assert q.strike("p", 3.0)
    assert not q.barred("p", 3.0)
    assert q.count(3.0) == 0


@pytest.mark.parametrize("strikes, duration", [(0, 1.0), (-1, 1.0), (1, -1.0)])
def test_quarantine_refuses_bad_settings(strikes: int, duration: float) -> None:
    with pytest.raises(ValueError):
        Quarantine(strikes, duration)


def test_quarantine_table_is_bounded_oldest_first() -> None:
    q = Quarantine(strikes=1, duration=100.0)
    for i in range(MAX_QUARANTINED + 10):
        q.bar(f"p{i}", 0.0)
    assert q.count(1.0) == MAX_QUARANTINED
    assert not q.barred("p0", 1.0) and not q.barred("p9", 1.0)  # the oldest went first
    assert q.barred("p10", 1.0) and q.barred(f"p{MAX_QUARANTINED + 9}", 1.0)


def test_strike_table_is_bounded_oldest_first() -> None:
    q = Quarantine(strikes=2, duration=100.0)
    for i in range(MAX_QUARANTINED + 1):
        assert not q.strike(f"p{i}", 0.0)
    assert not q.strike("p0", 1.0)  # its first strike was forgotten to make room
    assert q.strike("p2", 1.0)  # a later one was remembered
    assert q.count(1.0) == 1


# --- the pass as the payload arrives ------------------------------------------------------


def _pair(numel: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)


@pytest.mark.parametrize("records", [[1], [7, 300_000, 300_001, 600_000], [0, 0, 600_000]])
def test_a_difference_fed_record_by_record_gives_make_deltas_verdict(records: list[int]) -> None:
    received, own = _pair(600_000)  # more than two REDUCE_CHUNKs
    alone = make_delta(received.clone(), own, 0.5, DeltaHistory(), **NO_CLIP)
    into = received.clone()
    difference = Difference(into, own, own.numel())
    for decoded in records:  # how far the decoder had got after each record
        difference.advance(decoded)
    fused = make_delta(into, own, 0.5, DeltaHistory(), **NO_CLIP, difference=difference)
    assert fused.refused is None and fused.scale == alone.scale
    assert fused.distance == pytest.approx(alone.distance, rel=1e-6)
    assert fused.own_norm == pytest.approx(alone.own_norm, rel=1e-6)
    torch.testing.assert_close(into, received - own, rtol=0, atol=0)


def test_a_difference_waits_for_our_snapshot_to_be_whole() -> None:
    chunk = tensors.REDUCE_CHUNK
    received, own = _pair(4 * chunk)
    whole = False
    difference = Difference(received, own, 4 * chunk, lambda: whole)
    before = received.clone()
    difference.advance(3 * chunk)  # our copy is still running: nothing is touched
    torch.testing.assert_close(received, before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="before our snapshot is whole"):
        difference.sums()
    whole = True
    difference.advance(3 * chunk)  # the backlog: ADVANCE_CHUNKS chunks now, the rest later
    done = ADVANCE_CHUNKS * chunk
    torch.testing.assert_close(received[:done], before[:done] - own[:done], rtol=0, atol=0)
    torch.testing.assert_close(received[done:], before[done:], rtol=0, atol=0)
    distance_sq, own_sq, finite = difference.sums()  # the rest, now
    assert finite and distance_sq == pytest.approx(float(((before - own) ** 2).sum()), rel=1e-5)
    torch.testing.assert_close(received, before - own, rtol=0, atol=0)


def test_tiny_records_cost_nothing_until_a_whole_chunk_has_come() -> None:
    # A peer that sends one element a record gets no pass per record out of us.
    chunk = tensors.REDUCE_CHUNK
    received, own = _pair(2 * chunk)
    before = received.clone()
    difference = Difference(received, own, 2 * chunk)
    for decoded in range(1, 1000):
        difference.advance(decoded)
    torch.testing.assert_close(received, before, rtol=0, atol=0)
    difference.advance(chunk + 5)  # one whole chunk now; the 5 wait
    torch.testing.assert_close(received[:chunk], before[:chunk] - own[:chunk], rtol=0, atol=0)
    torch.testing.assert_close(received[chunk:], before[chunk:], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_difference_stops_at_a_non_finite_record_and_the_state_is_refused(bad: float) -> None:
    received, own = _pair(600_000)
    received[400_000] = bad
    difference = Difference(received, own, own.numel())
    difference.advance(300_000)
    difference.advance(600_000)
    verdict = make_delta(received, own, 0.5, DeltaHistory(), **NO_CLIP, difference=difference)
    assert verdict.refused == "non-finite values"


def test_a_difference_covers_its_state_part_only_and_only_its_buffers() -> None:
    received, own = _pair(2000)
    payload, ours = received.clone(), own.clone()
    difference = Difference(payload, ours, 1000)  # the state of a two-part payload
    difference.advance(2000)
    torch.testing.assert_close(payload[1000:], received[1000:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="not over these buffers"):
        make_delta(payload[:1000].clone(), ours[:1000], 0.5, DeltaHistory(), **NO_CLIP,
                   difference=difference)
    verdict = judge(payload, ours, 2, 0.5, (DeltaHistory(), DeltaHistory()), **NO_CLIP,
                    difference=difference)
    assert verdict.refused is None
    torch.testing.assert_close(payload, received - own, rtol=0, atol=0)  # both parts


def test_an_estimate_has_its_own_tighter_clip_and_the_state_keeps_the_usual_one() -> None:
    """With the outer step the averager passes ``estimate_clip`` (gossip.correction's
    ESTIMATE_CLIP): an estimate far from ours moves the correction by that bound, while the
    state is clipped as before."""
    n = 100
    states, estimates = DeltaHistory(window=8, min_history=1), DeltaHistory(window=8, min_history=1)
    states.add(1.0, ANY_NORM)
    estimates.add(1.0, ANY_NORM)
    own = torch.zeros(2 * n)
    received = torch.zeros(2 * n)
    received[0] = 4.0  # the state 4 x its median away
    received[n] = 4.0  # the estimate too
    verdict = judge(received, own, 2, 0.5, (states, estimates), clip=5.0, max_norm_ratio=1e6,
                    correction=0.5, gradient_scale=1.0, estimate_clip=1.2)
    assert verdict.refused is None
    assert not verdict.state.clipped and verdict.state.scale == 0.5
    assert verdict.correction is not None and verdict.correction.clipped
    assert math.isclose(verdict.correction.scale * 4.0, 0.5 * 1.2, rel_tol=1e-6)


def test_the_bound_takes_the_median_only_up_to_the_reach() -> None:
    history = DeltaHistory(window=8, min_history=2)
    for distance in (10.0, 10.0, 10.0):
        history.add(distance, 1.0)
    assert history.bound(2.0) == 20.0
    assert history.bound(2.0, reach=3.0) == 6.0  # a median past the reach counts as the reach
    assert history.bound(2.0, reach=50.0) == 20.0
