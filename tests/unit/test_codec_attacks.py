"""Attacks through the codecs (PROTOCOL.md section 12): a zero state in ``mod4`` at the
largest period, periods inflated by a far-off state, and a lossy codec forced under ``auto``
by hosts that fake slow links. Each test fails if its attack works."""

from __future__ import annotations

import copy
import random

import torch

from gossip import lowbit
from gossip.codec import LowbitDecoder, encoded_nbytes
from gossip.feedback import Codecs
from gossip.linkrate import MIN_SAMPLE, LinkRates
from gossip.mixing import DeltaHistory, judge
from gossip.schema import StateSchema, TensorSpec
from gossip.testing.hostile import HostilePeer, Reaction
from tests.unit.test_averaging import DEADLINE, exchange, mlp, two_nodes
from tests.unit.test_lowbit_exchange import MOD, renudge
from tests.util import SWARM

NUMEL = 64 * 50
MAX_PERIOD_BF16 = b"\x7f\x7f"  # 3.3895314e38, the largest finite bfloat16, little-endian


def histories(distance: float | None, own_norm: float) -> tuple[DeltaHistory, DeltaHistory]:
    """A state history of 8 exchanges at ``distance`` (None: empty), and an empty estimate's."""
    state = DeltaHistory()
    for _ in range(8 if distance is not None else 0):
        state.add(distance, own_norm)
    return state, DeltaHistory()


def verdict_on(received: torch.Tensor, own: torch.Tensor, distance: float | None):
    return judge(received.clone(), own, 1, 0.5, histories(distance, float(own.norm())),
                 clip=5.0, max_norm_ratio=100.0)


def test_a_zero_state_at_the_largest_period_is_judged_as_the_same_state_in_fp32() -> None:
    # Every cell at the largest period with codes 0 decodes to exactly 0 wherever the
    # receiver's values are below half that period: the zero state. It is a finite state of
    # the schema like any other, which fp32 carries as well; mod adds nothing to what a peer
    # can send, and the checks of section 9.4 judge the decoded state.
    own = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    cells = (MAX_PERIOD_BF16 + bytes(lowbit.BLOCK * 4 // 8)) * (NUMEL // lowbit.BLOCK)
    assert len(cells) == encoded_nbytes("mod4", NUMEL)
    schema = StateSchema((TensorSpec("w", (NUMEL,), "float32"),))
    decoder = LowbitDecoder(schema, "mod4", own)
    decoder.feed(cells)
    decoder.finish()
    zero = decoder.result()
    assert torch.equal(zero, torch.zeros(NUMEL))
    honest = 0.01 * float(own.norm())
    for history in (None, honest):
        assert verdict_on(zero, own, history) == verdict_on(torch.zeros(NUMEL), own, history)
    # With a history, the step it makes is the clip's: c x clip x the median distance.
    state = verdict_on(zero, own, honest).state
    assert state.refused is None and state.clipped
    assert state.scale * state.distance <= 0.5 * 5.0 * honest * (1 + 1e-6)


def warmed(spread: float) -> Codecs:
    codecs = Codecs(NUMEL, "mod4")
    codecs.committed("int8", torch.full((NUMEL,), spread), 1)
    return codecs


def test_a_far_off_state_inflates_a_blocks_period_by_at_most_the_margin() -> None:
    # A key holder sends a state that is honest but in three blocks, a hundred times the
    # honest spread off there (well within the norm check). Taken as measured, those blocks'
    # periods would be 800 times the honest ones in the victim's next payloads to everyone.
    honest = 2.0 ** -7  # exact in float32
    codecs = warmed(honest)
    far = torch.full((NUMEL,), honest)
    far[: 3 * lowbit.BLOCK] = 100 * honest
    for exchanges in (1, 2):
        codecs.committed("mod4", far, 1)
        spread = codecs._spreads[0]
        assert float(spread[:3].max()) <= honest * lowbit.MARGIN ** exchanges * (1 + 1e-6)
        assert float(spread[3:].max()) == honest
    periods = lowbit.periods(torch.zeros(NUMEL), codecs._spreads[0])
    assert float(periods.max()) <= 2 * lowbit.MARGIN * honest * lowbit.MARGIN ** 2 * 1.01
    # The next honest exchange measures them back down, at once.
    codecs.committed("mod4", torch.full((NUMEL,), honest), 1)
    assert float(codecs._spreads[0].max()) == honest
    # A newcomer's exchange, whose state the victim does not take, measures nothing at all.
    codecs.committed("mod4", far, 1, taken=False)
    assert float(codecs._spreads[0].max()) == honest


async def test_a_newcomer_sets_no_period_of_a_mod4_node() -> None:
    model_a = mlp(31)
    model_b = copy.deepcopy(model_a)
    renudge(model_b, 7, 0.01)
    async with two_nodes(model_a, model_b, MOD) as (a, b, done):
        await exchange(b, a, done)  # int8: a measures every block
        before = a._averaging.codecs._spreads[0].clone()
        hostile = HostilePeer(SWARM, copy.deepcopy(model_a), patience=DEADLINE,
                              rng=random.Random(3))
        far = hostile.honest.clone()
        far[: lowbit.BLOCK] += 10.0 * float(before.max())
        outcome = await hostile.send_state(a.address, far, "far off in one block")
        assert outcome.reaction is Reaction.ACCEPTED, outcome  # a newcomer's: it commits
        assert torch.equal(a._averaging.codecs._spreads[0], before)


def test_hosts_that_fake_slow_links_force_no_lossy_codec_on_the_others() -> None:
    # Twenty key holders on twenty hosts trickle their payloads at 2 kB/s; one honest host
    # carried its transfers at 100 MB/s. The victim, under "auto", meets a new honest host.
    numel = 1 << 20
    codecs = Codecs(numel, "auto")
    codecs.committed("int8", torch.full((numel,), 0.01), 2)
    codecs.stepped(0, 0.0)
    codecs.stepped(10, 1.0)  # 0.1 s a step: a budget of codec_steps (20) x 0.1 = 2 s
    rates = LinkRates()
    for host in range(20):
        rates.observe(f"10.0.0.{host}", MIN_SAMPLE, MIN_SAMPLE / 2e3, complete=True)
    fp32 = encoded_nbytes("fp32", numel, 2)
    rates.observe("192.0.2.1", fp32, fp32 / 1e8, complete=True)
    # The faker's own host gets what its link was measured at: the fewest bytes...
    assert codecs.offer(2, rates.measured("10.0.0.3"), rates.known()) == "mod4/16:0"
    # ...and a host never measured what the fastest measured link carries, not the fakers'.
    assert codecs.offer(2, rates.measured("192.0.2.99"), rates.known()) == "fp32"
