"""Tests for gossip.averaging: the config's validation, and real exchanges between two nodes
over TCP on 127.0.0.1 (open_swarm with rounds only on demand, ``interval=None``)."""

from __future__ import annotations

import dataclasses
import math
import random
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Callable

import pytest
import torch
import trio

from gossip import tensors
from gossip.averaging import AveragingConfig, Exchange, Result
from gossip.member import MembershipConfig
from gossip.network import TcpNetwork
from gossip.node import SwarmNode, open_swarm
from tests.util import SWARM, Signal

DEADLINE = 60.0  # s for anything on real sockets: generous, the machine may be loaded

# --- AveragingConfig ------------------------------------------------------------------

BAD_VALUES = [
    ("interval", 0.0), ("interval", -1.0), ("interval", math.inf), ("interval", math.nan),
    ("weight", 0.0), ("weight", -0.5), ("weight", 1.5), ("weight", math.nan),
    ("codec", "fp8"), ("codec", "FP32"), ("codec", ""),
    ("attempts", 0), ("attempts", -1), ("attempts", 1.5), ("attempts", True),
    ("backoff", 0.0), ("backoff", -1.0), ("backoff", math.inf), ("backoff", math.nan),
    ("backoff", "1"),
    ("clip", -0.1), ("clip", math.inf), ("clip", math.nan),
    ("clip_window", 0), ("clip_window", 2.0),
    ("clip_min_history", 0), ("clip_min_history", 64), ("clip_min_history", None),
    ("max_norm_ratio", 0.0), ("max_norm_ratio", -1.0), ("max_norm_ratio", math.inf),
    ("strikes", 0), ("strikes", "3"),
    ("quarantine", -1.0), ("quarantine", math.inf), ("quarantine", math.nan),
    ("offer_timeout", 0.0), ("offer_timeout", math.nan),
    ("transfer_timeout", 0.0), ("transfer_timeout", -5.0),
    ("min_rate", 0.0), ("min_rate", math.inf),
    ("commit_timeout", 0.0), ("commit_timeout", None),
    ("start", "checkpoint"), ("start", ""), ("start", None),
    ("download_wait", -1.0), ("download_wait", math.inf), ("download_wait", math.nan),
    # Wrong types, as a config file or a command line could give them.
    ("interval", "5"), ("interval", True), ("weight", "0.5"), ("weight", True),
    ("clip", "1"), ("quarantine", "1"), ("download_wait", "1"), ("backoff", True),
    ("min_rate", None), ("by_samples", "no"), ("by_samples", 1), ("by_samples", None),
]


@pytest.mark.parametrize("field, value", BAD_VALUES, ids=[f"{f}={v!r}" for f, v in BAD_VALUES])
def test_config_refuses_a_bad_value_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"averaging\\.{field}"):
        AveragingConfig(**{field: value})


def test_every_field_has_a_bad_value_in_the_table() -> None:
    checked = {f for f, _ in BAD_VALUES}
    assert checked == {f.name for f in dataclasses.fields(AveragingConfig)}


@pytest.mark.parametrize("changes", [
    {}, {"interval": None}, {"interval": 0.01}, {"weight": 1.0}, {"weight": 1e-6},
    {"codec": "bf16"}, {"codec": "fp16"}, {"clip": 0.0}, {"quarantine": 0.0},
    {"download_wait": 0.0}, {"clip_window": 1, "clip_min_history": 1},
    {"clip_window": 8, "clip_min_history": 8}, {"start": "own"}, {"start": "download"},
    {"by_samples": True}, {"min_rate": 1}, {"attempts": 1, "strikes": 1},
], ids=repr)
def test_config_takes_the_edge_values(changes: dict) -> None:
    config = AveragingConfig(**changes)
    for name, value in changes.items():
        assert getattr(config, name) == value


def test_transfer_deadline_is_the_timeout_plus_bytes_over_the_rate() -> None:
    config = AveragingConfig(transfer_timeout=10.0, min_rate=1e6)
    assert config.transfer_deadline(0) == 10.0
    assert config.transfer_deadline(100_000_000) == pytest.approx(110.0)  # the comment's example
    assert AveragingConfig(transfer_timeout=2.0, min_rate=250.0).transfer_deadline(1000) == 6.0


# --- two nodes over TCP ---------------------------------------------------------------

# Membership settles quickly on loopback; a short leave keeps each test's exit short, and a
# patient probe keeps a loaded machine from making a node suspect (not alive) mid-test.
MEMBERSHIP = MembershipConfig(gossip_interval=0.05, leave_timeout=0.5, probe_interval=5.0,
                              probe_timeout=4.0)


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4),
                               torch.nn.BatchNorm1d(4))


def flat(model: torch.nn.Module) -> torch.Tensor:
    return tensors.snapshot(model, tensors.StateSchema.from_module(model))


def sees_ready(node: SwarmNode, other: SwarmNode) -> bool:
    return any(m.peer == other.peer_id for m in node.roster.alive(ready=True))


async def until(condition: Callable[[], bool], node: SwarmNode) -> None:
    """Wait until ``condition`` holds, re-checking at each change of ``node``'s roster."""
    while not condition():
        await node.roster.wait_changed()


async def enter_node(stack: AsyncExitStack, model: torch.nn.Module, config: AveragingConfig,
                     bootstrap: list[str], seed: str,
                     on_exchange: Callable[[Exchange], None]) -> SwarmNode:
    """open_swarm on 127.0.0.1, port 0, entered on ``stack``."""
    return await stack.enter_async_context(open_swarm(
        model, SWARM, listen="127.0.0.1:0", network=TcpNetwork(), bootstrap=bootstrap,
        config=config, membership=MEMBERSHIP, rng=random.Random(seed), on_exchange=on_exchange))


@asynccontextmanager
async def two_nodes(
    model_a: torch.nn.Module, model_b: torch.nn.Module, config_a: AveragingConfig,
    config_b: AveragingConfig | None = None, *, seed: int = 0,
) -> AsyncIterator[tuple[SwarmNode, SwarmNode, Signal]]:
    """A (starts the swarm) and B (joins it with its own state), each seeing the other ready,
    and a signal that fires when an exchange ends at either."""
    config_a = dataclasses.replace(config_a, interval=None)
    config_b = dataclasses.replace(config_b or config_a, interval=None, start="own")
    exchanged = Signal()
    async with AsyncExitStack() as stack:
        a = await enter_node(stack, model_a, config_a, [], f"{seed}a", exchanged.fire)
        b = await enter_node(stack, model_b, config_b, [a.address], f"{seed}b", exchanged.fire)
        with trio.fail_after(DEADLINE):
            await a.wait_ready()
            await b.wait_ready()
            await until(lambda: sees_ready(b, a), b)
            await until(lambda: sees_ready(a, b), a)
        yield a, b, exchanged


async def exchange(initiator: SwarmNode, responder: SwarmNode, exchanged: Signal) -> None:
    """One committed round, both sides done with it (the responder finishes a moment after
    the initiator's round returns)."""
    before = responder.statistics().committed
    with trio.fail_after(DEADLINE):
        assert await initiator.average_now() is Result.COMMITTED
        await exchanged.wait_until(lambda: responder.statistics().committed == before + 1)


async def test_two_nodes_land_on_the_midpoint() -> None:
    model_a, model_b = mlp(1), mlp(2)
    model_a(torch.randn(16, 8))  # BatchNorm: running stats differ too, and a batch count
    s_a, s_b = flat(model_a), flat(model_b)
    count_a = int(model_a[3].num_batches_tracked)
    async with two_nodes(model_a, model_b, AveragingConfig()) as (a, b, exchanged):
        await exchange(b, a, exchanged)
        assert a.replica.pending == 1 and b.replica.pending == 1
        torch.testing.assert_close(flat(model_a), s_a, rtol=0, atol=0)  # not until a step
        # A second round, the other way: both already hold the midpoint (committed, not yet
        # applied), so it moves nobody.
        await exchange(a, b, exchanged)
        assert a.step() == 2 and b.step() == 2
        midpoint = (s_a + s_b) / 2
        torch.testing.assert_close(flat(model_a), midpoint)
        torch.testing.assert_close(flat(model_b), midpoint)
        assert int(model_a[3].num_batches_tracked) == count_a  # counters are not averaged
        assert int(model_b[3].num_batches_tracked) == 0

        stats_a, stats_b = a.statistics(), b.statistics()
        for stats in (stats_a, stats_b):
            assert (stats.committed, stats.busy, stats.rejected, stats.invalid, stats.failed,
                    stats.no_peer, stats.quarantined) == (2, 0, 0, 0, 0, 0, 0)
            assert stats.pending == 0 and stats.ready and stats.step == 1
            assert stats.last_exchange is not None and stats.mean_duration > 0
            assert stats.last_distance == pytest.approx(0.0, abs=1e-5)  # the second round
        # Both payloads crossed: each side moved at least the other's state.
        payload = a.replica.schema.encoded_size("fp32")
        assert stats_a.bytes_sent > 2 * payload and stats_a.bytes_received > 2 * payload
        assert stats_a.bytes_sent == stats_b.bytes_received
        assert stats_b.bytes_sent == stats_a.bytes_received


async def test_the_first_distance_is_the_distance_between_the_states() -> None:
    model_a, model_b = mlp(3), mlp(4)
    distance = float(torch.linalg.vector_norm(flat(model_a) - flat(model_b)))
    async with two_nodes(model_a, model_b, AveragingConfig()) as (a, b, exchanged):
        await exchange(a, b, exchanged)
        assert a.statistics().last_distance == pytest.approx(distance, rel=1e-5)
        assert b.statistics().last_distance == pytest.approx(distance, rel=1e-5)


async def test_local_steps_during_the_exchange_are_kept() -> None:
    model_a, model_b = mlp(5), mlp(6)
    s_a, s_b = flat(model_a), flat(model_b)
    async with two_nodes(model_a, model_b, AveragingConfig()) as (a, b, exchanged):
        await exchange(a, b, exchanged)
        with torch.no_grad():  # a local "optimizer step" after the snapshot was taken
            model_a[0].bias.add_(1.0)
        a.step()
        b.step()
        offset = torch.zeros_like(s_a)
        views = tensors.unflatten(offset, a.replica.schema)
        views["0.bias"].fill_(1.0)
        torch.testing.assert_close(flat(model_a), (s_a + s_b) / 2 + offset)
        torch.testing.assert_close(flat(model_b), (s_a + s_b) / 2)


async def test_bf16_exchange_lands_within_bf16_rounding_of_the_midpoint() -> None:
    model_a, model_b = mlp(7), mlp(8)
    s_a, s_b = flat(model_a), flat(model_b)
    async with two_nodes(model_a, model_b, AveragingConfig(codec="bf16")) as (a, b, exchanged):
        await exchange(a, b, exchanged)
        a.step()
        b.step()
        stats = a.statistics()
        assert stats.bytes_received < a.replica.schema.encoded_size("fp32")  # half the bytes
        assert stats.bytes_received > a.replica.schema.encoded_size("bf16")
    midpoint = (s_a + s_b) / 2
    for model, own, theirs in ((model_a, s_a, s_b), (model_b, s_b, s_a)):
        got = flat(model)
        # Exactly: own + (bf16(theirs) - own) / 2 ...
        wire = theirs.to(torch.bfloat16).float()
        torch.testing.assert_close(got, own + 0.5 * (wire - own))
        # ... so within half a bf16 rounding of the peer's values from the midpoint.
        error = (got - midpoint).abs()
        assert bool((error <= theirs.abs() * 2.0**-9 + 1e-7).all())
    assert not torch.equal(flat(model_a), flat(model_b))  # it really went through bf16


async def test_push_sum_pair_lands_on_the_sample_weighted_mean() -> None:
    model_a, model_b = mlp(9), mlp(10)
    s_a, s_b = flat(model_a), flat(model_b)
    config = AveragingConfig(by_samples=True)
    async with two_nodes(model_a, model_b, config) as (a, b, exchanged):
        a.step(samples=30)  # weight 31
        b.step(samples=10)  # weight 11
        assert (a.statistics().weight, b.statistics().weight) == (31.0, 11.0)
        await exchange(b, a, exchanged)
        a.step()
        b.step()
        mean = (31 * s_a + 11 * s_b) / 42
        torch.testing.assert_close(flat(model_a), mean)
        torch.testing.assert_close(flat(model_b), mean)
        for node, samples in ((a, 30), (b, 10)):
            stats = node.statistics()
            assert stats.weight == 21.0  # (31 + 11) / 2: the sum of weights is kept
            assert stats.samples == samples
            assert stats.step == 2


async def test_a_differing_codec_is_rejected_and_quarantined() -> None:
    model_a, model_b = mlp(11), mlp(12)
    s_a, s_b = flat(model_a), flat(model_b)
    async with two_nodes(model_a, model_b, AveragingConfig(codec="fp32"),
                         AveragingConfig(codec="bf16")) as (a, b, _):
        with trio.fail_after(DEADLINE):
            assert await b.average_now() is Result.REJECTED
            stats = b.statistics()
            assert (stats.rejected, stats.quarantined, stats.committed) == (1, 1, 0)
            assert await b.average_now() is Result.NO_PEER  # A is barred: nobody to try
            assert b.statistics().no_peer == 1
            # The other way round too.
            assert await a.average_now() is Result.REJECTED
            assert a.statistics().quarantined == 1
            assert await a.average_now() is Result.NO_PEER
        assert a.step() == 0 and b.step() == 0
        torch.testing.assert_close(flat(model_a), s_a, rtol=0, atol=0)
        torch.testing.assert_close(flat(model_b), s_b, rtol=0, atol=0)
        assert a.statistics().committed == 0 and b.statistics().committed == 0


async def test_differing_mixing_modes_are_rejected() -> None:
    async with two_nodes(mlp(13), mlp(14), AveragingConfig(by_samples=False),
                         AveragingConfig(by_samples=True)) as (a, b, _):
        with trio.fail_after(DEADLINE):
            assert await b.average_now() is Result.REJECTED
            assert await a.average_now() is Result.REJECTED
        assert a.statistics().quarantined == 1 and b.statistics().quarantined == 1


async def test_every_exchange_is_reported_at_both_ends_as_it_ends() -> None:
    changed = Signal()
    seen: dict[str, list[Exchange]] = {}

    def record(name: str) -> Callable[[Exchange], None]:
        seen[name] = []

        def on_exchange(exchange: Exchange) -> None:
            seen[name].append(exchange)
            changed.fire()
        return on_exchange

    model_a, model_b, model_c = mlp(15), mlp(16), mlp(17)
    distance = float(torch.linalg.vector_norm(flat(model_a) - flat(model_b)))
    own = AveragingConfig(interval=None, start="own")
    async with AsyncExitStack() as stack:
        a = await enter_node(stack, model_a, own, [], "a", record("a"))
        b = await enter_node(stack, model_b, own, [a.address], "b", record("b"))
        with trio.fail_after(DEADLINE):
            await until(lambda: sees_ready(a, b), a)
            assert await a.average_now() is Result.COMMITTED
            await changed.wait_until(lambda: len(seen["b"]) == 1)
        (mine,), (theirs,) = seen["a"], seen["b"]
        assert (mine.peer, mine.initiated, mine.result) == (b.peer_id, True, Result.COMMITTED)
        assert (theirs.peer, theirs.initiated, theirs.result) == (a.peer_id, False,
                                                                 Result.COMMITTED)
        for exchange in (mine, theirs):
            assert exchange.distance == pytest.approx(distance, rel=1e-5)
            assert exchange.duration > 0

        # Another codec: C's offers are refused before any payload, by A and then by B (the
        # round tries the next peer). Those are exchanges that ended (REJECTED) for C, and
        # none for the nodes that never took them up.
        c = await enter_node(stack, model_c, dataclasses.replace(own, codec="bf16"),
                             [a.address], "c", record("c"))
        with trio.fail_after(DEADLINE):
            await until(lambda: len(c.roster.alive(ready=True)) == 2, c)
            assert await c.average_now() is Result.REJECTED
        assert {e.peer for e in seen["c"]} == {a.peer_id, b.peer_id}
        for refused in seen["c"]:
            assert refused.initiated and refused.result is Result.REJECTED
            assert refused.distance is None
        assert len(seen["a"]) == len(seen["b"]) == 1
