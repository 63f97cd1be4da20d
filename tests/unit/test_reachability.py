"""The dial-back check's pieces: the member's admission of requests (how often, how many at
once), and its answers, over the simulated network (the whole check, with NAT'd hosts, is in
tests/sim/test_outbound.py)."""

import functools

import trio

from gossip.channel import Timeouts, connect, serve
from gossip.identity import Identity
from gossip.messages import Close, DialBack
from gossip.reachability import MAX_REMEMBERED, MAX_RUNNING, PEER_GAP, DialBacks, answer, ask
from gossip.simnet import SimNetwork
from tests.util import SWARM

NONCE = bytes(range(16))


def test_one_request_per_peer_per_gap_and_a_bounded_number_at_once():
    d = DialBacks()
    assert d.refusal("p", 0.0) is None
    assert "again within" in d.refusal("p", PEER_GAP - 1)
    d.done()
    assert d.refusal("p", PEER_GAP) is None
    d.done()
    for i in range(MAX_RUNNING):
        assert d.refusal(f"q{i}", 0.0) is None
    assert d.refusal("other", 0.0) == "busy with other dial-backs"
    d.done()
    assert d.refusal("other", 0.0) is None


def test_the_memory_of_requests_is_bounded():
    d = DialBacks()
    for i in range(3 * MAX_REMEMBERED):
        assert d.refusal(f"p{i}", float(i)) is None
        d.done()
    assert len(d._last) == MAX_REMEMBERED


async def run_check(net: SimNetwork, requester_host: str, *, member_knows: bool = True,
                    nat: bool = False):
    """A requester at ``requester_host`` asks a member at m:1 to dial it back."""
    member, requester = Identity.generate(), Identity.generate()
    timeouts = Timeouts(connect=1.0, handshake=1.0)
    reached = trio.Event()
    answered: list[bool] = []

    async def member_side(channel) -> None:
        first = await channel.receive_message()
        address = f"{requester_host}:1" if member_knows else None
        answered.append(await answer(channel, first, address, network=net.host("m"),
                                     identity=member, swarm=SWARM, timeouts=timeouts))

    async def requester_side(channel) -> None:
        first = await channel.receive_message()
        if first == DialBack(NONCE):
            reached.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, net.host("m"), "m:1", member_side,
                                              identity=member, swarm=SWARM))
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
    assert "could not dial us: r:1: peer r:1 timed out during connect" in detail
    assert trio.current_time() - start < 2.0  # the connect deadline, then its answer


async def test_a_member_that_does_not_know_the_requester_dials_nobody(autojump_clock):
    (tried, detail), reached, answered = await run_check(SimNetwork(1), "r", member_knows=False)
    assert tried and not reached and answered == [False]
    assert "not in my member table" in detail


async def test_a_refusal_to_try_is_no_verdict(autojump_clock):
    net, member, requester = SimNetwork(1), Identity.generate(), Identity.generate()

    async def busy(channel) -> None:
        await channel.receive_message()
        await channel.send_message(Close(Close.BUSY, "busy with other dial-backs"))

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve, net.host("m"), "m:1", busy,
                                              identity=member, swarm=SWARM))
        tried, detail = await ask(net.host("r"), member.peer_id, "m:1", identity=requester,
                                  swarm=SWARM, timeouts=Timeouts(), nonce=NONCE,
                                  reached=trio.Event())
        nursery.cancel_scope.cancel()
    assert not tried and "did not try" in detail
