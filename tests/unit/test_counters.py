"""One range for every counter: whatever the decoder accepts is valid everywhere downstream.

A peer's step, samples, push-sum weight and incarnation are decoded once, checked against the
protocol's range (``MAX_COUNT``, ``MAX_WEIGHT``), and then travel: merged into the replica by
an exchange or a download, counted up by training, written to and read from a checkpoint,
exported as Prometheus samples and as the JSON ``gossipd status`` prints, and sent on to the
next peer. Before the range was one, a step of 10^12 that the wire took crashed the next
checkpoint of every node it reached. The property: any value the decoder accepts flows
through all of it without an error, and comes out as a value the decoder accepts again.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import cbor2
import pytest
import torch
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import gossip
import gossip.lowlevel
from daemon import checkpoint
from daemon.metrics import Metrics
from gossip import tensors
from gossip.config import NodeConfig
from gossip.identity import PeerId
from gossip.member import Member, State
from gossip.messages import MAX_COUNT, MAX_WEIGHT, Alive, Offer, StateInfo
from gossip.replica import Counters, Replica
from gossip.testing.simnet import SimNetwork
from gossip.standing import step_ceiling, step_move
from gossip.wire import decode, encode

counts = st.one_of(st.integers(0, MAX_COUNT), st.sampled_from([0, 10**12, MAX_COUNT - 1, MAX_COUNT]))
weights = st.one_of(st.floats(0.0, MAX_WEIGHT), st.sampled_from([0.0, 1.0, MAX_WEIGHT]))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


SCHEMA = tensors.StateSchema.from_module(model())


def wire(message):
    """What a peer's message is after the trip: decoded by the receiver."""
    return decode(encode(message))


@pytest.mark.parametrize("huge", [MAX_COUNT + 1, 2**62, 2**63 - 1])
def test_the_decoder_refuses_a_counter_past_the_range(huge: int) -> None:
    with pytest.raises(gossip.WireError):
        decode(encode_unchecked(Offer, [SCHEMA.fingerprint, "fp32", huge, 0, 0.0]))
    with pytest.raises(gossip.WireError):
        decode(encode_unchecked(StateInfo, [huge, 0, 1.0, b"\xa0"]))


def encode_unchecked(cls: type, fields: list) -> bytes:
    """The bytes a peer could send for ``cls`` with these fields, unchecked by us."""
    return cbor2.dumps([cls.TAG, *fields], canonical=True)


@pytest.fixture(scope="module")
def lone_stats() -> tuple[gossip.AveragingStatistics, gossip.lowlevel.RosterStatistics]:
    """A real node's statistics, as the template the property test fills with counters."""
    async def main() -> tuple:
        net = SimNetwork(seed=1)
        async with gossip.open_swarm(model(), gossip.Swarm.generate("t"),
                                     NodeConfig(listen="a:7000"), network=net.host("a")) as node:
            await node.wait_ready()
            return node.statistics(), node.roster.statistics()
    return trio.run(main, clock=MockClock(autojump_threshold=0))


@settings(max_examples=60, deadline=None)
@given(step=counts, samples=counts, weight=weights, own=counts, incarnation=counts,
       by_samples=st.booleans(), trained=st.integers(0, 10**6))
def test_any_counter_the_decoder_accepts_flows_through_merge_checkpoint_metrics_and_status(
    lone_stats, step: int, samples: int, weight: float, own: int, incarnation: int,
    by_samples: bool, trained: int,
) -> None:
    template, roster_stats = lone_stats
    # 1. Decoded: a peer's offer, its download answer and its membership announcement.
    weight = weight if not by_samples else max(weight, 1.0)
    offer = wire(Offer(SCHEMA.fingerprint, "fp32", step, samples, weight))
    info = wire(StateInfo(step, samples, weight, b"\xa0"))
    alive = wire(Alive("a" * 26, incarnation, "10.0.0.9:7070", 1, step, True, key=b"k" * 32,
                       signature=b"s" * 64))
    members = [Member(PeerId(alive.peer), alive.address, alive.incarnation, State.ALIVE,
                      alive.version, alive.step, alive.ready, 0.0)]

    # 2. Merged: an exchange with that peer, a download from it, then more training.
    m = model()
    replica = Replica(m, by_samples=by_samples)
    replica.restore(Counters(own, own, float(max(own, 1))))
    ceiling = step_ceiling(members)
    mine = replica.counters()
    delta = torch.zeros(SCHEMA.numel)
    merged = (mine.weight + offer.weight) / 2 if by_samples else None
    move = step_move(mine.heading, offer.step, ceiling)
    replica.queue(delta, scale=0.5, step_move=move, weight=merged,
                  sent_weight=mine.weight if by_samples else 0.0)
    replica.load(tensors.snapshot(m, SCHEMA), step=min(info.step, ceiling), buffers={})
    replica.advance(trained, trained * 32)
    counters = replica.counters()
    assert 0 <= counters.step <= MAX_COUNT and 0 <= counters.samples <= MAX_COUNT
    assert 0 < counters.weight <= MAX_WEIGHT
    assert counters.step <= max(own, ceiling) + trained or counters.step == MAX_COUNT

    # 3. Sent on: what we tell the next peer decodes there.
    wire(Offer(SCHEMA.fingerprint, "fp32", counters.step, counters.samples,
               counters.weight if by_samples else 0.0))

    # 4. A checkpoint of it, read back and restored (the daemon's path: daemon.train).
    with tempfile.TemporaryDirectory() as tmp:
        state = {"counters": {"step": counters.step, "samples": counters.samples,
                              "weight": counters.weight}}
        path = checkpoint.save(Path(tmp), state, step=counters.step, keep=1)
        loaded = checkpoint.load(path)["counters"]
        back = Counters(int(loaded["step"]), int(loaded["samples"]), float(loaded["weight"]))
        assert back == counters
        Replica(model(), by_samples=by_samples).restore(back)

    # 5. Metrics and status: Prometheus samples are floats, status is JSON; both exact.
    stats = dataclasses.replace(template, step=counters.step, samples=counters.samples,
                                weight=counters.weight)
    roster = dataclasses.replace(roster_stats, incarnation=alive.incarnation)
    node = _Node(stats, _Roster(roster))
    metrics = Metrics()
    snap = metrics.sample(node)  # type: ignore[arg-type]
    assert metrics.registry.get_sample_value("gossip_step") == counters.step
    status = json.loads(json.dumps(snap, default=str))
    assert status["step"] == counters.step and status["samples"] == counters.samples


@dataclasses.dataclass
class _Roster:
    stats: gossip.lowlevel.RosterStatistics

    def statistics(self) -> gossip.lowlevel.RosterStatistics:
        return self.stats


@dataclasses.dataclass
class _Node:
    """What Metrics.sample reads of a node: its statistics and its roster's."""

    stats: gossip.AveragingStatistics
    roster: _Roster

    def statistics(self) -> gossip.AveragingStatistics:
        return self.stats


def test_training_counts_saturate_at_the_range() -> None:
    replica = Replica(model(), by_samples=True)
    replica.restore(Counters(MAX_COUNT - 1, MAX_COUNT - 1, MAX_WEIGHT - 1))
    replica.advance(10, 10**9)
    assert replica.counters() == Counters(MAX_COUNT, MAX_COUNT, MAX_WEIGHT)


@pytest.mark.parametrize("counters", [Counters(MAX_COUNT + 1, 0, 1.0),
                                      Counters(0, MAX_COUNT + 1, 1.0),
                                      Counters(0, 0, MAX_WEIGHT * 2), Counters(-1, 0, 1.0),
                                      Counters(0, 0, 0.0)], ids=repr)
def test_restoring_counters_out_of_the_range_is_refused(counters: Counters) -> None:
    with pytest.raises(ValueError, match="range"):
        Replica(model(), by_samples=True).restore(counters)
