"""Lifeguard's suspicion timeout: the bounds, and how confirmations shrink it.

The expected values below restate the formula of the gossip.suspicion docstring (the Lifeguard
paper's): long while a lone member suspects, shorter on a log curve with each independent
confirmation, down to the minimum once ``expected`` confirmations are in.
"""

import math

import pytest

from gossip.suspicion import Suspicion, suspicion_bounds

A, B, C, D, E = "a" * 26, "b" * 26, "c" * 26, "d" * 26, "e" * 26


@pytest.mark.parametrize(
    "alive, interval, mult, max_mult, minimum",
    [
        (1, 1.0, 4.0, 6.0, 4.0),  # log10(1) = 0: the scale never drops below 1
        (0, 1.0, 4.0, 6.0, 4.0),  # a nonsensical count is treated as 1, not a math error
        (9, 1.0, 4.0, 6.0, 4.0),  # log10(9) < 1
        (10, 1.0, 4.0, 6.0, 4.0),
        (100, 1.0, 4.0, 6.0, 8.0),
        (1000, 0.5, 4.0, 6.0, 6.0),
        (10_000, 5.0, 6.0, 6.0, 120.0),  # the WAN profile's multipliers
        (50, 1.0, 4.0, 1.0, 4.0 * math.log10(50)),
    ],
)
def test_bounds_formula(alive, interval, mult, max_mult, minimum):
    low, high = suspicion_bounds(alive, interval, mult, max_mult)
    assert low == pytest.approx(minimum)
    assert high == pytest.approx(max_mult * minimum)


def lifeguard(minimum, maximum, confirmations, expected):
    fraction = math.log(confirmations + 1) / math.log(expected + 1)
    return max(minimum, maximum - (maximum - minimum) * fraction)


def test_timeout_starts_at_the_maximum():
    s = Suspicion(100.0, A, 3, 4.0, 24.0)
    assert s.start == 100.0
    assert s.deadline == pytest.approx(124.0)
    assert s.confirmations == 0


def test_confirmations_move_the_deadline_down_the_log_curve_to_the_minimum():
    s = Suspicion(10.0, A, 3, 4.0, 24.0)
    deadlines = [s.deadline]
    for i, by in enumerate([B, C, D], start=1):
        assert s.confirm(by)
        assert s.confirmations == i
        assert s.deadline == pytest.approx(10.0 + lifeguard(4.0, 24.0, i, 3))
        deadlines.append(s.deadline)
    assert deadlines == sorted(deadlines, reverse=True)
    assert len(set(deadlines)) == 4  # every confirmation counted
    assert s.deadline == pytest.approx(14.0)  # the minimum at `expected` confirmations


def test_more_confirmations_than_expected_are_not_counted():
    s = Suspicion(0.0, A, 2, 4.0, 24.0)
    assert s.confirm(B) and s.confirm(C)
    assert s.deadline == pytest.approx(4.0)
    assert not s.confirm(D)  # no use passing it on: the timeout cannot get shorter
    assert s.confirmations == 2
    assert s.deadline == pytest.approx(4.0)


@pytest.mark.parametrize(
    "reports, counted",
    [
        ([A], 0),  # the first reporter confirms nothing
        ([B, B], 1),
        ([B, A, B], 1),
        ([B, C, B, C], 2),
    ],
)
def test_repeats_and_the_first_reporter_do_not_count(reports, counted):
    s = Suspicion(0.0, A, 4, 2.0, 12.0)
    results = [s.confirm(by) for by in reports]
    assert sum(results) == counted
    assert s.confirmations == counted
    assert s.deadline == pytest.approx(lifeguard(2.0, 12.0, counted, 4))


def test_our_own_silent_verification_counts_once_even_when_we_started_it():
    # Our probe started the suspicion (first = us); a verification ping that then goes a
    # period unanswered is new evidence, counted once.
    s = Suspicion(0.0, A, 2, 4.0, 24.0)
    assert s.confirm_silence(A)
    assert s.confirmations == 1
    assert s.deadline == pytest.approx(lifeguard(4.0, 24.0, 1, 2))
    assert not s.confirm_silence(A)  # once
    assert s.confirm(B)  # another member's confirmation still counts on top
    assert s.deadline == pytest.approx(4.0)
    # Started by someone else, our silence is an ordinary confirmation by us.
    t = Suspicion(0.0, B, 2, 4.0, 24.0)
    assert t.confirm_silence(A) and not t.confirm(A) and t.confirmations == 1


def test_no_expected_confirmations_means_the_minimum_at_once():
    # A swarm too small to supply confirmations must not wait the maximum.
    s = Suspicion(5.0, A, 0, 4.0, 24.0)
    assert s.deadline == pytest.approx(9.0)
    assert not s.confirm(B)
    assert s.deadline == pytest.approx(9.0)


def test_negative_expected_is_treated_as_zero():
    assert Suspicion(0.0, A, -3, 4.0, 24.0).deadline == pytest.approx(4.0)


@pytest.mark.parametrize("minimum, maximum", [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_invalid_bounds_are_refused(minimum, maximum):
    with pytest.raises(ValueError):
        Suspicion(0.0, A, 1, minimum, maximum)


def test_equal_bounds_give_a_fixed_timeout():
    s = Suspicion(1.0, A, 3, 5.0, 5.0)
    assert s.deadline == pytest.approx(6.0)
    s.confirm(B)
    s.confirm(E)
    assert s.deadline == pytest.approx(6.0)
