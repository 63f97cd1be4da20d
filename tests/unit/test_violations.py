"""Violations of an exchange that count as strikes (PROTOCOL.md sections 7.4 and 9.8): a
``Commit`` answered with one that does not decode, and a payload of any codec cut into
records smaller than :data:`gossip.lowbit.MIN_RECORD`. On real loopback sockets."""

from __future__ import annotations

import copy
import dataclasses
import random
from contextlib import AsyncExitStack

import cbor2
import torch
import trio
import trio.testing

from gossip import lowbit
from gossip.config import AveragingConfig
from gossip.messages import Commit
from gossip.testing.hostile import HostilePeer, Reaction
from tests.unit.test_averaging import DEADLINE, enter_node, exchange, flat, two_nodes
from tests.unit.test_lowbit_exchange import renudge
from tests.util import SWARM

# Rounds only when asked. The attacker is no member, so a newcomer to the target: each attack
# below comes after a round of the target's own, which earns its host a newcomer token.
TARGET = AveragingConfig(every=None, interval=None, start="own", outer=False,
                         correction=False)


def nudged(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A replica of ``model`` a little apart, as two nodes of one swarm are."""
    other = copy.deepcopy(model)
    renudge(other, seed, 0.01)
    return other


async def test_a_commit_out_of_range_is_a_strike_and_three_quarantine() -> None:
    # The attacker holds the target's Commit and may apply the exchange; the target, holding
    # no valid Commit of its own peer's, applies nothing. The same one-sided exchange as a
    # lost message, but provably the peer's doing: a strike, not a failure.
    model = torch.nn.Linear(8, 8)
    before = flat(model)
    out_of_range = cbor2.dumps([Commit.TAG, 1.5], canonical=True)
    async with AsyncExitStack() as stack:
        a = await enter_node(stack, model, TARGET, [], "a", lambda _: None)
        hostile = HostilePeer(SWARM, nudged(model, 1), patience=DEADLINE, rng=random.Random(0))
        with trio.fail_after(DEADLINE):
            for strike in range(1, TARGET.strikes + 1):
                await a.average_now()  # no peer: but a token for the newcomers' host
                outcome = await hostile.bad_commit(a.address, out_of_range)
                # Its Commit came: the attacker could apply the exchange.
                assert outcome.reaction is Reaction.ACCEPTED, outcome
                await trio.testing.wait_all_tasks_blocked()
                stats = a.statistics()
                assert (stats.invalid, stats.committed, stats.failed) == (strike, 0, 0)
            assert a.statistics().quarantined == 1
            await a.average_now()
            refused = await hostile.bad_commit(a.address, out_of_range)
            assert refused.reaction is Reaction.REJECTED and "quarantine" in refused.reason
        a.step()
        torch.testing.assert_close(flat(model), before, rtol=0, atol=0)  # nothing applied


async def test_a_mod_payload_in_records_below_the_least_is_a_strike() -> None:
    model = torch.nn.Linear(256, 512)  # a mod4 payload of 70 kB: five least records
    config = dataclasses.replace(TARGET, codec="mod4")
    async with two_nodes(model, nudged(model, 2), config) as (a, b, done):
        small = HostilePeer(SWARM, nudged(model, 3), codec="mod4", patience=DEADLINE,
                            rng=random.Random(2))
        with trio.fail_after(DEADLINE):
            # An exchange with an honest member measures a's spreads (a newcomer's would
            # not): a takes mod4 offers from then on.
            await exchange(b, a, done)
            assert lowbit.nbytes(lowbit.Spec(4), a.replica.schema.numel) > 4 * lowbit.MIN_RECORD
            # Records that cut the payload anywhere, each of at least the least, are honest.
            cut = await small.small_records(a.address, lowbit.MIN_RECORD + 3)
            assert cut.reaction is Reaction.ACCEPTED, cut
            for size in (1, lowbit.MIN_RECORD - 1):
                await a.average_now()
                outcome = await small.small_records(a.address, size)
                assert outcome.reaction is Reaction.CLOSED, outcome
            await trio.testing.wait_all_tasks_blocked()
            stats = a.statistics()
            # b's exchange, the cut one, and the rounds of a's own that earned the attacker
            # its newcomer tokens (each with b); the two records under the least, refused.
            assert (stats.committed, stats.invalid) == (4, 2)


async def test_a_payload_of_any_codec_in_records_below_the_least_is_a_strike() -> None:
    # Element-wise and int8 records must hold whole elements or cells, which 4 and 68 bytes
    # do: without the least, a payload cut so would cost the target an AEAD open per element.
    model = torch.nn.Linear(256, 512)
    for codec, fine in (("fp32", 4), ("int8", 68)):
        config = dataclasses.replace(TARGET, codec=codec)
        async with two_nodes(model, nudged(model, 2), config) as (a, b, done):
            small = HostilePeer(SWARM, nudged(model, 3), codec=codec, patience=DEADLINE,
                                rng=random.Random(2))
            with trio.fail_after(DEADLINE):
                await a.average_now()
                whole = await small.small_records(a.address, lowbit.MIN_RECORD + fine)
                assert whole.reaction is Reaction.ACCEPTED, (codec, whole)
                await a.average_now()
                outcome = await small.small_records(a.address, fine)
                assert outcome.reaction is Reaction.CLOSED, (codec, outcome)
                await trio.testing.wait_all_tasks_blocked()
                stats = a.statistics()
                assert (stats.committed, stats.invalid) == (3, 1), (codec, stats)
