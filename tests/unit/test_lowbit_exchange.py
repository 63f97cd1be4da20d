"""Exchanges in the mod codecs between real nodes on loopback: where they land, how they
converge with error feedback and learned periods, fragments in turn, and a model large enough
to be encoded and decoded in worker threads while its snapshot is still being copied."""

from __future__ import annotations

import dataclasses

import torch

from gossip import lowbit
from gossip.averaging import Result
from gossip.config import AveragingConfig
from tests.unit.test_averaging import PLAIN, exchange, flat, large, mlp, two_nodes

MOD = dataclasses.replace(PLAIN, correction=False, codec="mod4")


def renudge(model: torch.nn.Module, seed: int, size: float) -> None:
    """Move every parameter of ``model`` by Gaussian noise of scale ``size``."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * size)


def nudged(model: torch.nn.Module, seed: int, size: float = 0.01) -> torch.nn.Module:
    """A replica of ``model`` a little apart, as two nodes of one swarm are."""
    other = mlp(0) if isinstance(model, torch.nn.Sequential) else large(0)
    other.load_state_dict(model.state_dict())
    renudge(other, seed, size)
    return other


def spread_bound(node) -> float:
    """The largest spread a node has measured: its periods are at most 2 x MARGIN times it."""
    return max(float(v.max()) for v in node._averaging.codecs._spreads if v is not None)


async def mod_exchange_lands_near_the_midpoint(model_a: torch.nn.Module, size: float,
                                               codec: str) -> None:
    """The first exchange (cold: int8) measures the spread; B then moves by as much again,
    and the next exchange, in ``codec``, lands within its rounding of the midpoint."""
    model_b = nudged(model_a, 1, size)
    config = dataclasses.replace(MOD, codec=codec)
    async with two_nodes(model_a, model_b, config) as (a, b, done):
        await exchange(b, a, done)
        assert b.codec_with(a.peer_id) == a.codec_with(b.peer_id) == "int8"
        a.step()
        b.step()
        renudge(model_b, 2, size)
        s_a, s_b = flat(model_a), flat(model_b)
        # The periods of the next payloads come from the spreads the first one measured.
        spread = max(spread_bound(a), spread_bound(b))
        await exchange(a, b, done)
        assert b.codec_with(a.peer_id) == a.codec_with(b.peer_id) == codec
        a.step()
        b.step()
        spec = lowbit.parse(codec)
        # Each side moved halfway to a value within half a step (period / K) of the sent one.
        step = 2 * lowbit.MARGIN * spread / spec.levels * (1 + 2 ** -7)  # bf16, rounded up
        mid = (s_a + s_b) / 2
        for node_model in (model_a, model_b):
            off = (flat(node_model) - mid).abs()
            # Where the spread held (B moved by at most as much as the first time in the
            # block), within its rounding: half a step, halved by the move. A block whose
            # largest difference grew past half its period wraps, and is off by at most half
            # that period, halved: a few of a large model's 4,096 blocks of random nudges do.
            assert float((off <= step / 4 * 1.01 + 1e-7).float().mean()) >= 0.999
            assert float(off.max()) <= step * spec.levels / 4 * 1.01


async def test_a_mod4_exchange_lands_within_its_rounding_of_the_midpoint() -> None:
    await mod_exchange_lands_near_the_midpoint(mlp(11), 0.01, "mod4")


async def test_mod_exchanges_converge_as_periods_follow_the_spread() -> None:
    # Nodes that do not train: each exchange halves their distance, and the periods, learned
    # from the last differences, shrink with it, so the rounding does not stop them short.
    model_a = mlp(12)
    model_b = nudged(model_a, 2)
    first = float((flat(model_a) - flat(model_b)).norm())
    distances = []
    async with two_nodes(model_a, model_b, MOD) as (a, b, done):
        for turn in range(24):
            await exchange(*((a, b) if turn % 2 else (b, a)), done)
            a.step()
            b.step()
            distances.append(float((flat(model_a) - flat(model_b)).norm()))
    # The rounding is a quarter of the spread or so: each exchange takes some of it off.
    assert distances[11] < 0.05 * first and distances[23] < distances[11] / 2


async def test_fragments_take_turns_and_the_rest_stays() -> None:
    model_a = mlp(13)
    model_b = nudged(model_a, 3)
    numel = flat(model_a).numel()
    async with two_nodes(model_a, model_b, dataclasses.replace(MOD, codec="mod4/4")) as (a, b, done):
        await exchange(b, a, done)  # cold: int8
        a.step()
        renudge(model_b, 4, 0.01)
        s_a = flat(model_a)
        for turn in range(5):
            await exchange(b, a, done)
            assert a.codec_with(b.peer_id) == f"mod4/4:{turn % 4}"
            if turn == 0:
                a.step()
                moved = (flat(model_a) - s_a) != 0
                carried = torch.zeros(lowbit.blocks(numel), dtype=torch.bool)
                carried[lowbit.selected(lowbit.parse("mod4/4:0"), numel)] = True
                carried = carried.repeat_interleave(lowbit.BLOCK)[:numel]
                assert bool(moved.any()) and not bool(moved[~carried].any())


async def test_a_large_models_mod_exchange_overlaps_its_snapshot() -> None:
    # Large enough that the snapshot, the encoding and the decoding run in worker threads:
    # the decoding waits for our snapshot, its reference.
    await mod_exchange_lands_near_the_midpoint(large(23), 1e-4, "mod4")


async def test_auto_offers_what_the_unmeasured_link_gets() -> None:
    model_a = mlp(14)
    model_b = nudged(model_a, 5)
    async with two_nodes(model_a, model_b, AveragingConfig(codec="auto", outer=False,
                                                           correction=False)) as (a, b, done):
        await exchange(b, a, done)
        # No link measured yet (these payloads are too small to time): int8 measures it.
        assert a.codec_with(b.peer_id) == "int8"
        assert (await a.average_now()) is Result.COMMITTED


async def test_a_fixed_codec_node_answers_mod_offers_once_it_has_measured() -> None:
    model_a = mlp(15)
    model_b = nudged(model_a, 6)
    plain = dataclasses.replace(PLAIN, correction=False)
    async with two_nodes(model_a, model_b, plain, MOD) as (a, b, done):
        await exchange(b, a, done)  # B is cold: int8, which B measures
        assert a.codec_with(b.peer_id) == "int8"
        # A (fp32) has measured nothing: nobody had asked it for a mod payload.
        assert (await b.average_now()) is Result.BUSY
        await exchange(a, b, done)  # A's own fp32 round: A measures now
        assert a.codec_with(b.peer_id) == "fp32"
        await exchange(b, a, done)
        assert a.codec_with(b.peer_id) == b.codec_with(a.peer_id) == "mod4"
