"""Deadlines that follow the link: :class:`gossip.linkrate.LinkRates` (pure, no trio), the
channel's stall guard, and the defaults' arithmetic for a thin link."""

from __future__ import annotations

import math

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip import exchange
from gossip.channel import MAX_RECORD
from gossip.config import AveragingConfig, Timeouts
from gossip.errors import PeerGone, PeerTimeout
from gossip.groups import phase_deadline, phase_deadline_at
from gossip.exchange import Deadlines
from gossip.linkrate import ALPHA, MIN_RATE, MIN_SAMPLE, SLACK, STALL, LinkRates
from gossip.messages import Accept, Offer
from gossip.tensors import StateSchema, TensorSpec
from tests.util import pair

MB = 1_000_000


# ---- LinkRates -------------------------------------------------------------------------


def test_an_unknown_host_gets_the_floor() -> None:
    rates = LinkRates(floor=5e4)
    assert rates.measured("10.0.0.2") is None
    assert rates.rate("10.0.0.2") == 5e4
    assert rates.deadline("10.0.0.2", 10.0, 100 * MB) == pytest.approx(10.0 + 2000.0)


def test_a_measured_host_gets_its_rate_over_the_slack_but_never_below_the_floor() -> None:
    rates = LinkRates(floor=5e4)
    rates.observe("fast", 100 * MB, 1.0, complete=True)  # 100 MB/s
    assert rates.measured("fast") == 100 * MB
    assert rates.rate("fast") == 100 * MB / SLACK
    assert rates.deadline("fast", 10.0, 100 * MB) == pytest.approx(10.0 + SLACK)
    rates.observe("thin", 10 * MB, 1000.0, complete=True)  # 10 kB/s: below the floor
    assert rates.rate("thin") == 5e4


def test_completed_samples_are_averaged_and_a_timed_out_one_replaces_the_mean() -> None:
    rates = LinkRates(floor=1.0)
    rates.observe("h", 10 * MB, 1.0, complete=True)
    rates.observe("h", 20 * MB, 1.0, complete=True)
    assert rates.measured("h") == pytest.approx(10 * MB + ALPHA * 10 * MB)
    # The link slowed: what the timed-out transfer carried is the new estimate at once ...
    rates.observe("h", 2 * MB, 2.0, complete=False)
    assert rates.measured("h") == pytest.approx(1 * MB)
    # ... and never raises one (it only says the link is at most that fast).
    rates.observe("h", 90 * MB, 1.0, complete=False)
    assert rates.measured("h") == pytest.approx(1 * MB)


@pytest.mark.parametrize("nbytes, seconds, host", [
    (MIN_SAMPLE - 1, 1.0, "h"),  # a few round trips, not the link
    (MIN_SAMPLE, 0.0, "h"), (MIN_SAMPLE, -1.0, "h"), (MIN_SAMPLE, math.nan, "h"),
    (MIN_SAMPLE, math.inf, "h"), (MIN_SAMPLE, 1.0, ""),  # a stream that could not tell
])
def test_samples_that_say_nothing_about_the_link_are_ignored(nbytes: int, seconds: float,
                                                             host: str) -> None:
    rates = LinkRates()
    rates.observe(host, nbytes, seconds, complete=True)
    assert len(rates) == 0 and rates.rate(host) == MIN_RATE


def test_the_table_forgets_the_least_recently_used_host() -> None:
    rates = LinkRates(capacity=3)
    for host in ("a", "b", "c"):
        rates.observe(host, MB, 1.0, complete=True)
    rates.observe("a", MB, 1.0, complete=True)  # a is used again: b is the oldest now
    rates.observe("d", MB, 1.0, complete=True)
    assert len(rates) == 3
    assert rates.measured("b") is None and rates.measured("a") is not None


@pytest.mark.parametrize("floor", [0.0, -1.0, math.inf, math.nan])
def test_a_bad_floor_is_refused(floor: float) -> None:
    with pytest.raises(ValueError, match="floor"):
        LinkRates(floor=floor)


# ---- the defaults on the thin link ---------------------------------------------


def test_the_defaults_give_a_5_mbit_link_time_for_a_100_mb_model_with_its_correction() -> None:
    # 25M parameters in fp32 with the drift correction: 200 MB each way, 320 s at 625 kB/s.
    config, link = AveragingConfig(), 625_000
    nbytes = 2 * 100 * MB
    assert config.transfer_deadline(nbytes) > 6 * nbytes / link
    # A state download (fp32, no correction), likewise.
    assert config.transfer_deadline(nbytes // 2) > 6 * (nbytes // 2) / link
    # Once measured, the link is still given 4x what it needs.
    rates = LinkRates(config.min_rate)
    rates.observe("volunteer", nbytes, nbytes / link, complete=True)
    assert rates.deadline("volunteer", config.transfer_timeout, nbytes) == pytest.approx(
        config.transfer_timeout + SLACK * nbytes / link)
    # A full record crosses the floor's rate within the record deadline, and a payload
    # that stops is dropped in STALL seconds whatever its size.
    assert MAX_RECORD / config.min_rate < Timeouts().record
    assert config.stall_timeout == STALL == 10.0


# ---- the stall guard -------------------------------------------------------------------


async def test_no_byte_for_the_stall_seconds_between_records_drops_the_peer(
        autojump_clock: MockClock) -> None:
    alice, bob, _ = await pair(record_timeout=30.0)
    async with trio.open_nursery() as nursery:
        async def three_records_then_silence() -> None:
            for _ in range(3):
                await alice.send(b"x" * 1000)
                await trio.sleep(2.0)  # under the stall: fine

        nursery.start_soon(three_records_then_silence)
        with bob.stall_guard(5.0):
            for _ in range(3):
                assert await bob.receive() == b"x" * 1000
            last = trio.current_time()
            with pytest.raises(PeerTimeout, match=r"stall \(no byte for 5 s\)"):
                await bob.receive()
        assert trio.current_time() - last == pytest.approx(5.0)
    with pytest.raises(PeerGone, match="earlier error"):
        await bob.receive()  # the channel is broken


async def test_the_stall_deadline_moves_with_every_byte_inside_a_record(
        autojump_clock: MockClock) -> None:
    # A record trickling one byte a second never stalls; the record deadline ends it.
    alice, bob, tap = await pair(record_timeout=30.0)
    tap.captured = []
    await alice.send(b"z" * 100)
    [record] = tap.captured

    async def trickle() -> None:
        try:
            for byte in record:
                await tap.inner.send_all(bytes([byte]))
                await trio.sleep(1.0)
        except trio.BrokenResourceError:
            pass  # bob gave up on it

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trickle)
        start = trio.current_time()
        with bob.stall_guard(5.0), pytest.raises(PeerTimeout, match="record"):
            await bob.receive()
        assert trio.current_time() - start == pytest.approx(30.0)
        nursery.cancel_scope.cancel()


async def test_a_stall_inside_a_record_is_caught_before_the_record_deadline(
        autojump_clock: MockClock) -> None:
    alice, bob, tap = await pair(record_timeout=30.0)
    tap.captured = []
    await alice.send(b"z" * 100)
    [record] = tap.captured
    await tap.inner.send_all(record[:50])
    with bob.stall_guard(5.0), pytest.raises(PeerTimeout, match="stall"):
        start = trio.current_time()
        await bob.receive()
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_without_a_guard_the_wait_for_a_record_is_the_callers(
        autojump_clock: MockClock) -> None:
    alice, bob, _ = await pair()
    with bob.stall_guard(5.0):
        pass  # a guard ends with its block
    with trio.move_on_after(3600) as scope:
        await bob.receive()
    assert scope.cancelled_caught
    with pytest.raises(ValueError):
        with bob.stall_guard(0.0):
            pass


async def test_a_peer_that_accepts_and_sends_nothing_fails_the_transfer_at_the_stall(
        autojump_clock: MockClock) -> None:
    schema = StateSchema((TensorSpec("w", (4,), "float32"),))
    deadlines = Deadlines(offer=5.0, transfer=100.0, min_rate=1.0, commit=5.0, stall=3.0)
    alice, bob, _ = await pair()

    async def check(*_: object) -> object:
        raise AssertionError("no payload came")

    async with trio.open_nursery() as nursery:
        async def silent() -> None:
            await bob.receive_message()
            await bob.send_message(Accept(1, 1, 0.0, False))
            await trio.sleep_forever()

        nursery.start_soon(silent)
        start = trio.current_time()
        with pytest.raises(PeerTimeout, match=r"transfer, a stall \(no byte for 3 s\)"):
            await exchange.initiate(alice, Offer(schema.fingerprint, "fp32", 1, 1, 0.0, False),
                                    torch.zeros(4), torch.zeros(4), schema, check, deadlines)
        assert trio.current_time() - start == pytest.approx(3.0)
        nursery.cancel_scope.cancel()


# ---- the error boundary ------------------------------------------------------------------


async def test_a_phase_deadline_that_passes_is_a_peer_timeout_naming_the_phase(
        autojump_clock: MockClock) -> None:
    start = trio.current_time()
    with pytest.raises(PeerTimeout, match="peer ab12cd34 timed out during offer") as caught:
        with phase_deadline(5.0, "ab12cd34", "offer"):
            await trio.sleep_forever()
    assert (caught.value.peer, caught.value.phase) == ("ab12cd34", "offer")
    assert caught.value.__suppress_context__  # no TooSlowError behind it in the log
    assert trio.current_time() - start == pytest.approx(5.0)
    with pytest.raises(PeerTimeout, match="during commit"):
        with phase_deadline_at(start + 7.0, "ab12cd34", "commit"):
            await trio.sleep_forever()
    assert trio.current_time() == pytest.approx(start + 7.0)


async def test_a_phase_deadline_lets_the_blocks_own_errors_through(
        autojump_clock: MockClock) -> None:
    with phase_deadline(5.0, "ab12cd34", "transfer") as scope:
        await trio.sleep(1.0)
    assert not scope.cancelled_caught
    with pytest.raises(PeerTimeout, match="during record"):
        with phase_deadline(5.0, "ab12cd34", "transfer"):
            raise PeerTimeout("ab12cd34", "record")
    with trio.move_on_after(1.0) as outer:  # an outer scope's cancel is not this phase's
        with phase_deadline(5.0, "ab12cd34", "transfer"):
            await trio.sleep_forever()
    assert outer.cancelled_caught
