"""What a round makes at the spacing in use (gossip.plan, gossip.rounds): a table of settings
and spacings to choices, the once-a-round outer step, and the spacing a round of several
exchanges takes on a measured link."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gossip.codec import encoded_nbytes
from gossip.config import LARGE_SPACING, ROUND_PEERS, AveragingConfig
from gossip.outer import Outer
from gossip.plan import EXCHANGE_MOMENTUM, ROUND_MOMENTUM, Plan, plan
from gossip.rounds import Rounds

CLOSE = Plan(1, False, EXCHANGE_MOMENTUM)  # today's rounds: one exchange, the step at each
WIDE = Plan(ROUND_PEERS, True, ROUND_MOMENTUM, "int8", correct=False)

TABLE = [
    # (settings, spacing in use, plan)
    ({}, 1, CLOSE),
    ({}, None, CLOSE),  # rounds by time alone count as close
    ({}, LARGE_SPACING - 1, CLOSE),
    ({}, LARGE_SPACING, WIDE),
    ({}, 1280, WIDE),
    ({"peers": 2}, 500, Plan(2, True, ROUND_MOMENTUM, "int8", False)),
    ({"peers": 2}, 1, Plan(2, False, EXCHANGE_MOMENTUM)),
    ({"outer_cadence": "exchange"}, 500,
     Plan(ROUND_PEERS, False, EXCHANGE_MOMENTUM, "int8", False)),
    ({"outer_cadence": "round"}, 1, Plan(1, True, ROUND_MOMENTUM)),
    ({"outer_momentum": 0.3}, 500, Plan(ROUND_PEERS, True, 0.3, "int8", False)),
    ({"outer_momentum": 0.0}, 1, Plan(1, False, 0.0)),
    # The codec: the default gives way at wide spacing, a chosen one never.
    ({"wide_codec": "fp32"}, 500, Plan(ROUND_PEERS, True, ROUND_MOMENTUM, "fp32", False)),
    ({"codec": "bf16"}, 500, Plan(ROUND_PEERS, True, ROUND_MOMENTUM, None, False)),
    ({"codec": "mod4/8"}, 500, Plan(ROUND_PEERS, True, ROUND_MOMENTUM, None, False)),
]


@pytest.mark.parametrize("settings, spacing, expected", TABLE,
                         ids=[f"{s}@{h}" for s, h, _ in TABLE])
def test_the_plan_follows_the_spacing_unless_a_setting_says(settings, spacing, expected):
    assert plan(AveragingConfig(**settings), spacing) == expected


def vector(seed: int, n: int = 10) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_once_a_round_the_step_is_nesterov_on_all_that_moved_since_the_last() -> None:
    """At a round's first commit the step is torch's Nesterov SGD step on the pseudo-gradient
    -(state + w (peer - state) - anchor): whatever moved the state since the last round
    (local steps, the round's other exchanges applied as plain averages) and this exchange's
    move, and the queued change lands the node on the new anchor."""
    lr, mu, w = 0.7, ROUND_MOMENTUM, 0.5
    outer = Outer(10, lr, None)  # "auto": the momentum comes with each step
    state = vector(0)
    anchor = torch.nn.Parameter(state.clone())
    sgd = torch.optim.SGD([anchor], lr=lr, momentum=mu, nesterov=True)
    for k in range(4):
        if k:
            state = state + vector(10 + k)  # everything since the last round
        peer = state + vector(20 + k)
        anchor.grad = -(state + w * (peer - state) - anchor.detach())
        sgd.step()
        change = peer - state
        outer.step(state, change, w, mu)
        state = state + change
        assert torch.allclose(state, anchor.detach(), atol=1e-5)
        assert torch.allclose(outer.state_dict()["anchor"], anchor.detach(), atol=1e-5)


def test_an_outer_step_needs_a_momentum_from_its_settings_or_its_caller() -> None:
    with pytest.raises(ValueError, match="momentum"):
        Outer(10, 0.7, None).step(vector(1), vector(2), 0.5)
    fixed, auto = Outer(10, 0.7, 0.5), Outer(10, 0.7, None)
    for k in range(2):  # a fixed setting wins over the plan's
        fixed.step(vector(1 + k), vector(3 + k), 0.5, 0.99)
        auto.step(vector(1 + k), vector(3 + k), 0.5, 0.5)
    assert torch.equal(fixed.state_dict()["velocity"], auto.state_dict()["velocity"])


NUMEL = 1_000_000


def payload(chosen: Plan) -> int:
    """A 1M-parameter model's payload under ``chosen``: fp32 with the correction's estimate at
    close spacing, int8 without it at wide."""
    return encoded_nbytes(chosen.codec or "fp32", NUMEL, 1 + chosen.correct)


def measured(rounds: Rounds, close: float, exchanges: list[Plan] | None = None) -> None:
    """Feed ``rounds``' meter a step of 1 s and nine committed exchanges that would make the
    close plan's rounds ``close`` steps apart, each of the payloads of a plan of
    ``exchanges`` in turn (default: all close)."""
    assert rounds.meter is not None
    rounds.meter.stepped(0, 0.0)
    rounds.meter.stepped(100, 100.0)
    seconds_per_byte = close / 2 / payload(CLOSE)
    made = exchanges or [CLOSE]
    for k in range(9):
        nbytes = payload(made[k % len(made)])
        rounds.meter.exchanged(seconds_per_byte * nbytes, nbytes)


@pytest.mark.parametrize("others, peers", [(7, ROUND_PEERS), (2, 2), (1, 1), (0, 1)])
def test_a_measured_spacing_counts_each_exchange_of_a_round(others, peers) -> None:
    """With every = "auto" a round of several exchanges is spaced that many of its own
    exchanges apart, twice (the link carries them all), and a round has no more exchanges
    than there are peers to make them with."""
    rounds = Rounds(AveragingConfig(every="auto"), random.Random(0), lambda: others, payload)
    measured(rounds, 1000)  # rounds of one fp32 exchange with the estimate: 1,000 steps
    wide = payload(WIDE) / payload(CLOSE)  # int8 without the estimate: 0.13 of the bytes
    assert peers * 1000 * wide >= LARGE_SPACING  # wide, with any number of peers
    assert rounds.plan() == dataclasses.replace(WIDE, peers=peers)
    assert rounds.steps() == pytest.approx(peers * 1000 * wide, abs=peers)  # ceil each


@pytest.mark.parametrize("close", [10, 40, 100, 160, 1000])
@pytest.mark.parametrize("history", ["close", "wide", "both"])
def test_the_measured_plan_does_not_flip_with_its_own_payloads(close, history) -> None:
    """The plan is chosen on the link, not on the durations of the plan's own exchanges: the
    wide plan's exchanges are 7.5 times smaller, so in seconds alone they would measure a
    close spacing, and the close plan's a wide one. Whatever plan the exchanges measured
    were made under, the same link gives the same plan and spacing: the wide plan exactly
    where its own rounds come out LARGE_SPACING apart or more."""
    made = {"close": [CLOSE], "wide": [WIDE], "both": [CLOSE, WIDE]}[history]
    rounds = Rounds(AveragingConfig(every="auto"), random.Random(0), lambda: 7, payload)
    measured(rounds, close, made)
    wide_spacing = ROUND_PEERS * close * payload(WIDE) / payload(CLOSE)
    if wide_spacing >= LARGE_SPACING:
        assert rounds.plan() == WIDE
        assert rounds.steps() == pytest.approx(wide_spacing, abs=ROUND_PEERS)  # ceil each
    else:
        assert rounds.plan() == CLOSE
        assert rounds.steps() == pytest.approx(close, abs=1)


def test_an_unmeasured_link_starts_close() -> None:
    rounds = Rounds(AveragingConfig(every="auto"), random.Random(0), lambda: 7, payload)
    assert rounds.plan() == CLOSE and rounds.steps() == 1


def test_a_fixed_every_is_the_spacing_whatever_the_peers() -> None:
    rounds = Rounds(AveragingConfig(every=100), random.Random(0), lambda: 7, payload)
    assert rounds.steps() == 100 and rounds.plan() == WIDE
