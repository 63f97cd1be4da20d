"""The dial-back check's pieces: the member's admission of requests (how often, how many at
once), and its answers, over the simulated network (the whole check, with NAT'd hosts, is in
tests/sim/test_outbound.py)."""

import functools

import pytest
import trio

from gossip.endpoints import connect, serve
from gossip.config import Timeouts
from gossip.identity import Identity
from gossip.messages import Close, DialBack
from gossip.errors import GossipError
from gossip.reachability import (GAP, MAX_REMEMBERED, MAX_RUNNING, RATE, DialBacks, answer,
                                 ask, budget, dial_back_address)
from gossip.testing.simnet import SimNetwork
from tests.util import SWARM

NONCE = bytes(range(16))


def test_one_request_per_peer_and_per_target_address_per_gap():
    d = DialBacks()
    assert d.refusal("p", "10.0.0.1:7070", 0.0) is None
    d.done()
    assert "again within" in d.refusal("p", "10.0.0.2:7070", GAP - 1)
    # Fresh identities are free, addresses are not: another peer id for it waits too.
    assert "again within" in d.refusal("fresh", "10.0.0.1:7070", GAP - 1)
    # Another port of the same host is another node (daemons sharing a machine).
    assert d.refusal("other", "10.0.0.1:7071", GAP - 1) is None
    d.done()
    assert d.refusal("p", "10.0.0.1:7070", GAP) is None
    d.done()


def test_a_bounded_number_at_once_and_a_bounded_rate_for_everyone():
    d = DialBacks()
    for i in range(MAX_RUNNING):
        assert d.refusal(f"q{i}", f"10.0.1.{i}:1", 0.0) is None
    assert d.refusal("other", "10.0.2.1:1", 0.0) == "busy with other dial-backs"
    for _ in range(MAX_RUNNING):
        d.done()
    assert d.refusal("other", "10.0.2.1:1", 0.0) == "too many dial-backs just now"
    assert d.refusal("other", "10.0.2.1:1", 1 / RATE) is None


def test_the_memory_of_requests_is_bounded():
    d = DialBacks()
    for i in range(3 * MAX_REMEMBERED):
        assert d.refusal(f"p{i}", f"h{i}:1", float(i) / RATE) is None
        d.done()
    assert len(d._by_peer) == len(d._by_address) == MAX_REMEMBERED


async def run_check(net: SimNetwork, requester_host: str, *, nat: bool = False,
                    listen: bool = True):
    """A requester at ``requester_host`` asks a member at m:1 to dial it back."""
    member, requester = Identity.generate(), Identity.generate()
    timeouts = Timeouts(connect=1.0, handshake=1.0)
    reached = trio.Event()
    answered: list[bool] = []

    async def member_side(channel) -> None:
        first = await channel.receive_message()
        address = f"{requester_host}:1"
        answered.append(await answer(channel, first, address, network=net.host("m"),
                                     identity=member, swarm=SWARM, timeouts=timeouts))

    async def requester_side(channel) -> None:
        first = await channel.receive_message()
        if first == DialBack(NONCE):
            reached.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, net.host("m"), "m:1", member_side,
                                              identity=member, swarm=SWARM))
        if listen:
            await nursery.start(functools.partial(serve, net.host(requester_host),
                                                  f"{requester_host}:1", requester_side,
                                                  identity=requester, swarm=SWARM))
        if nat:
            net.nat(requester_host)
        result = await ask(net.host(requester_host), member.peer_id, "m:1", identity=requester,
                           swarm=SWARM, timeouts=timeouts, nonce=NONCE, reached=reached)
        nursery.cancel_scope.cancel()
    return result, reached.is_set(), answered


async def test_a_reachable_requester_is_dialed_back(autojump_clock):
    (tried, detail), reached, answered = await run_check(SimNetwork(1), "r")
    assert tried and reached and answered == [True]
    assert detail.startswith("dialed back by")


async def test_a_requester_behind_a_nat_is_told_the_dial_failed(autojump_clock):
    start = trio.current_time()
    (tried, detail), reached, answered = await run_check(SimNetwork(1), "r", nat=True)
    assert tried and not reached and answered == [False]
    assert detail.endswith("could not dial us: no channel to r:1 within 2 s")  # never how
    assert trio.current_time() - start < 2.5  # the dial's deadline, then its answer


@pytest.mark.parametrize("closed", [True, False], ids=["closed port", "silent port"])
async def test_how_a_dial_back_failed_shows_neither_in_the_answer_nor_in_its_time(
        autojump_clock, closed: bool):
    # A port nobody listens on fails at once; one behind a NAT that drops the dial, at the
    # deadline. The answer comes at the deadline either way, with the same words.
    start = trio.current_time()
    net = SimNetwork(1)
    (tried, detail), reached, answered = await run_check(net, "r", nat=not closed,
                                                         listen=not closed)
    assert tried and not reached and answered == [False]
    assert detail.endswith("could not dial us: no channel to r:1 within 2 s")
    assert 2.0 <= trio.current_time() - start < 2.1


@pytest.mark.parametrize("source, announced, expected", [
    ("10.0.0.5", "10.0.0.5:7000", "10.0.0.5:7000"),
    ("10.0.0.5", "192.168.1.20:7070", "10.0.0.5:7070"),  # another host's: its own, not that
    ("10.0.0.5", "example.org:22", "10.0.0.5:22"),  # a name is never resolved for it
    ("::1", "[::1]:7000", "[::1]:7000"),
    ("", "10.0.0.5:7000", None),  # the channel cannot tell: no dial
])
def test_a_dial_back_goes_to_the_requesters_own_host(source, announced, expected):
    assert dial_back_address(source, announced) == expected


async def ask_a_member_that(behaves, *, timeouts=Timeouts()):
    net, member, requester = SimNetwork(1), Identity.generate(), Identity.generate()

    async def member_side(channel) -> None:
        await channel.receive_message()
        await behaves(channel)

    outcome: list = []
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, net.host("m"), "m:1", member_side,
                                              identity=member, swarm=SWARM))
        try:  # caught here, before the nursery could wrap it: what the roster sees
            outcome.append(await ask(net.host("r"), member.peer_id, "m:1", identity=requester,
                                     swarm=SWARM, timeouts=timeouts, nonce=NONCE,
                                     reached=trio.Event()))
        except Exception as exc:  # noqa: BLE001 - the test looks at its type
            outcome.append(exc)
        nursery.cancel_scope.cancel()
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


async def test_a_member_that_closes_without_answering_is_one_typed_error(autojump_clock):
    async def hang_up(channel) -> None:
        await channel.aclose()

    try:
        await ask_a_member_that(hang_up)
    except GossipError:
        pass  # not an exception group: the roster catches GossipError
    else:
        raise AssertionError("no error")


async def test_a_member_that_takes_the_request_and_goes_silent_is_a_verdict(autojump_clock):
    timeouts = Timeouts(connect=1.0, handshake=1.0)
    start = trio.current_time()
    tried, detail = await ask_a_member_that(lambda channel: trio.sleep_forever(),
                                            timeouts=timeouts)
    assert tried and "gave no answer" in detail
    assert trio.current_time() - start == budget(timeouts)


async def test_a_refusal_to_try_is_no_verdict(autojump_clock):
    async def busy(channel) -> None:
        await channel.send_message(Close(Close.BUSY, "you are not in my member table yet"))

    tried, detail = await ask_a_member_that(busy)
    assert not tried and "did not try: you are not in my member table yet" in detail
