"""gossip.feedback: the codec a node offers each peer, and what the mod codecs remember."""

from __future__ import annotations

import math

import pytest
import torch

from gossip import lowbit
from gossip.codec import encoded_nbytes
from gossip.feedback import COLD, IDLE_BUDGET, UNMEASURED, Codecs

NUMEL = 64 * 100  # 100 blocks


def warmed(setting: str, parts: int = 1) -> Codecs:
    """Codecs that measured every block's spread in one int8 exchange."""
    codecs = Codecs(NUMEL, setting)
    codecs.committed("int8", torch.full((parts * NUMEL,), 0.01), parts)
    return codecs


def test_a_fixed_codec_is_offered_as_it_is() -> None:
    for setting in ("fp32", "bf16", "fp16", "int8"):
        assert Codecs(NUMEL, setting).offer(1, None) == setting


def test_a_mod_codec_waits_for_every_blocks_spread() -> None:
    codecs = Codecs(NUMEL, "mod4")
    assert codecs.offer(1, None) == COLD == "int8" and not codecs.warm()
    codecs.committed("int8", torch.full((NUMEL,), 0.01), 1)
    # The estimate travels in int8 cells (gossip.lowbit): only the state needs periods.
    assert codecs.warm()
    assert codecs.offer(1, None) == codecs.offer(2, None) == "mod4"


def test_fragments_are_offered_in_turn() -> None:
    codecs = warmed("mod4/4")
    assert [codecs.offer(1, None) for _ in range(6)] == [
        "mod4/4:0", "mod4/4:1", "mod4/4:2", "mod4/4:3", "mod4/4:0", "mod4/4:1"]


def auto(step: float | None) -> Codecs:
    codecs = warmed("auto", parts=2)
    if step is not None:
        codecs.stepped(0, 0.0)
        codecs.stepped(10, 10 * step)
    return codecs


def test_auto_takes_the_first_codec_that_fits_the_link() -> None:
    codecs = auto(step=0.5)  # 20 steps: 10 s an exchange
    fp32 = encoded_nbytes("fp32", NUMEL, 2)
    assert codecs.offer(2, fp32 / 10) == "fp32"
    assert codecs.offer(2, fp32 / 10 / 2) == "bf16"
    assert codecs.offer(2, fp32 / 10 / 3.5) == "int8"
    # With the estimate, mod4 is 1/5 of fp32 (its estimate travels in int8), mod4/2 1/10.
    assert codecs.offer(2, fp32 / 10 / 5) == "mod4"
    assert codecs.offer(2, fp32 / 10 / 9) == "mod4/2:0"
    assert codecs.offer(2, fp32 / 10 / 1000) == "mod4/16:1"  # none fits: the fewest bytes


def test_auto_without_a_measured_link() -> None:
    codecs = auto(step=0.5)
    assert codecs.offer(2, None) == UNMEASURED
    fp32 = encoded_nbytes("fp32", NUMEL, 2)
    # A host never measured is taken to be as fast as the fastest of those that were.
    assert codecs.offer(2, None, [1.0, fp32 / 10, fp32]) == "fp32"
    assert codecs.offer(2, None, [1.0, 2.0, fp32]) == "fp32"
    assert codecs.offer(2, None, [1.0, 2.0]) == "mod4/16:0"


def test_auto_before_the_step_time_gives_an_exchange_the_idle_budget() -> None:
    codecs = auto(step=None)
    fp32 = encoded_nbytes("fp32", NUMEL, 2)
    assert codecs.offer(2, fp32 / IDLE_BUDGET) == "fp32"
    assert codecs.offer(2, fp32 / IDLE_BUDGET / 2) == "bf16"


def test_spreads_come_from_the_blocks_a_payload_carried() -> None:
    codecs = warmed("mod4/4")
    difference = torch.zeros(NUMEL)
    difference[64 * 1 + 3] = -0.03  # block 1: fragment 1 of 4 (within MARGIN x 0.01)
    difference[64 * 2] = 0.025  # block 2: fragment 2, not carried below
    codecs.committed("mod4/4:1", difference, 1)
    spread = codecs._spreads[0]
    assert float(spread[1]) == pytest.approx(0.03)
    assert float(spread[2]) == pytest.approx(0.01) and float(spread[5]) == 0.0  # 5: fragment 1


def test_the_residual_is_kept_only_when_the_exchange_commits() -> None:
    codecs = warmed("mod4")
    state = torch.linspace(-1, 1, NUMEL)
    encode = codecs.encoder("mod4")
    assert encode is not None and codecs.encoder("int8") is None
    first = encode(state)
    codecs.failed()  # the peer applied nothing: the next payload is the same
    assert torch.equal(encode(state), first)
    # An exchange that ended neither way (cancelled) leaves nothing behind either.
    assert torch.equal(encode(state), first)
    codecs.committed("mod4", torch.full((NUMEL,), 0.01), 1)
    residual = codecs._residual
    assert residual is not None and bool(residual.abs().max() > 0)
    # What rounding left out: at most half a step of the period 2 x MARGIN x 0.01.
    step = 2 * lowbit.MARGIN * 0.01 / 16 * (1 + 2 ** -7)
    assert lowbit.MARGIN == 4.0
    assert float(residual.abs().max()) <= step / 2 * (1 + 1e-6)
    # The next payload carries it: the same state now encodes to other bytes.
    assert not torch.equal(encode(state), first)


def test_a_fixed_codec_node_measures_spreads_once_asked() -> None:
    # It answers mod offers of its peers, with a payload of its own in their codec.
    codecs = Codecs(NUMEL, "fp32")
    codecs.committed("fp32", torch.full((NUMEL,), 0.01), 1)
    assert not codecs.warm()  # nobody asked: no pass over the state
    codecs.asked()  # a peer offered mod4: it was answered busy
    codecs.committed("fp32", torch.full((NUMEL,), 0.01), 1)
    assert codecs.warm()


def test_coverage_of_a_fragment() -> None:
    codecs = Codecs(NUMEL, "mod4/4")
    assert codecs.coverage("fp32") == codecs.coverage("mod4") == 1.0
    assert codecs.coverage("mod4/4:0") == 25 / 100
    assert math.isclose(Codecs(65, "mod4/2").coverage("mod4/2:0"), 64 / 65)
    assert math.isclose(Codecs(130, "mod4/2").coverage("mod4/2:0"), 66 / 130)  # short block 2
