"""The spacing of ``averaging.every = "auto"`` (:class:`gossip.spacing.Spacing`): pure, fed
step counts, durations and ``now`` by hand. No trio."""

from __future__ import annotations

import math

import pytest

from gossip.spacing import EXCHANGES, MAX_SPACING, STEP_POINTS, Spacing


def measured(step: float, exchanges: list[float], rounds: int = 4) -> Spacing:
    """A spacing that saw ``rounds`` round starts 10 steps apart at ``step`` s a step, and
    the committed exchanges ``exchanges``."""
    spacing = Spacing()
    for i in range(rounds):
        spacing.stepped(10 * i, 10 * i * step)
    for seconds in exchanges:
        spacing.exchanged(seconds)
    return spacing


def test_before_anything_is_measured_the_spacing_is_1() -> None:
    spacing = Spacing()
    assert spacing.steps() == 1 and spacing.exchange is None and spacing.step is None
    spacing.stepped(0, 0.0)
    spacing.exchanged(30.0)
    assert spacing.steps() == 1  # one observation is no step time yet
    spacing.stepped(0, 5.0)
    assert spacing.steps() == 1 and spacing.step is None  # no step in between
    assert measured(0.1, []).steps() == 1  # steps, no exchange yet


@pytest.mark.parametrize("step, exchange, expected", [
    (0.1, 64.0, 1280),  # 100M fp32 over 100 Mbit/s: 64 s an exchange, 0.1 s a step
    (1.0, 17.0, 34),  # 1B int8 over 1 Gbit/s
    (0.1, 0.37, 8),  # 7.4 steps: up to the next whole step
    (0.1, 0.25, 5),  # exactly 5: float dust in the times does not make it 6
])
def test_the_spacing_is_two_exchanges_in_steps(step: float, exchange: float,
                                               expected: int) -> None:
    spacing = measured(step, [exchange])
    assert spacing.step == pytest.approx(step) and spacing.exchange == exchange
    assert spacing.steps() == expected


def test_a_fast_link_gives_a_round_every_step() -> None:
    assert measured(0.25, [0.05, 0.04, 0.06]).steps() == 1
    assert measured(0.1, [0.0]).steps() == 1  # an instant exchange


def test_the_spacing_is_clamped_to_max_spacing() -> None:
    assert measured(1.0, [6400.0]).steps() == MAX_SPACING  # 1B fp32 over 10 Mbit/s: 12,800
    assert measured(1e-9, [1.0]).steps() == MAX_SPACING
    frozen = Spacing()  # steps counted while the clock stood still
    frozen.stepped(0, 3.0)
    frozen.stepped(50, 3.0)
    frozen.exchanged(2.0)
    assert frozen.step == 0.0 and frozen.steps() == MAX_SPACING


def test_one_outlier_exchange_moves_nothing() -> None:
    usual = measured(0.1, [2.0, 2.1, 1.9, 2.0])
    assert usual.steps() == 40
    usual.exchanged(900.0)  # one exchange waited on a stalled peer
    assert usual.steps() == 40
    usual.exchanged(0.001)  # and one was unusually quick
    assert usual.steps() == 40


def test_the_figures_are_recent() -> None:
    spacing = measured(0.1, [2.0] * EXCHANGES)
    for _ in range(EXCHANGES // 2 + 1):  # a majority of the window: the link slowed down
        spacing.exchanged(10.0)
    assert spacing.steps() == 200
    # The step time is the mean over the last STEP_POINTS round starts: after that many at
    # 0.2 s a step, the 0.1 s ones are forgotten.
    steps, now = 30, 3.0
    for _ in range(STEP_POINTS):
        steps, now = steps + 10, now + 2.0
        spacing.stepped(steps, now)
    assert spacing.step == pytest.approx(0.2) and spacing.steps() == 100


def test_a_counter_or_clock_that_goes_back_starts_the_step_time_over() -> None:
    spacing = measured(0.1, [2.0])
    spacing.stepped(5, 100.0)  # the counter went back
    assert spacing.step is None and spacing.steps() == 1
    spacing.stepped(15, 101.0)
    assert spacing.step == pytest.approx(0.1)
    spacing.stepped(25, 50.0)  # the clock went back
    assert spacing.step is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_duration_that_is_no_duration_is_ignored(bad: float) -> None:
    spacing = measured(0.1, [2.0])
    spacing.exchanged(bad)
    assert spacing.exchange == 2.0 and spacing.steps() == 40


def test_exchanges_of_other_sizes_count_in_proportion_to_their_bytes() -> None:
    """A spacing asked for payloads of some size counts each exchange whose size it knows at
    its seconds times that size over its own (the wide plan's small payloads measure the
    link for the close plan's large ones, and back), one of unknown size as it was."""
    spacing = measured(0.1, [])
    for _ in range(5):
        spacing.exchanged(1.0, 1_000)  # 1 s for 1 kB each way
    assert spacing.steps() == 20 and spacing.steps(1_000) == 20
    assert spacing.steps(8_000) == 160 and spacing.steps(125) == 3  # ceil(2.5)
    for _ in range(4):
        spacing.exchanged(1.0, 8_000)  # the same link carrying 8 kB in a second: faster now
    # Scaled to 8 kB: 8 s five times and 1 s four times, the median 8 s.
    assert spacing.steps(8_000) == 160
    spacing.exchanged(4.0)  # a size not known: counted as measured
    spacing.exchanged(4.0, 0)  # a size that is no size: likewise
    # The last nine, scaled to 8 kB: 8 s three times, 1 s four times, 4 s twice: median 4 s.
    assert spacing.steps(8_000) == 80 and spacing.steps() == 20
