"""Tests for gossip.exchange: one exchange, both sides, over a handshaken in-memory channel pair
(no nodes, no network): what is swapped, when each side commits, and who is at fault when it
does not. Deadlines run on trio's virtual clock. The rules alone (gossip.exchange_state, pure)
are tested first, without a channel."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import trio
from trio.testing import MockClock

from gossip import exchange
from gossip.errors import LocalProtocolError, PeerTimeout, RemoteProtocolError
from gossip.exchange import Deadlines, Outcome
from gossip.exchange_state import ExchangeState, Phase, Refusal, Result, Side
from gossip.messages import Accept, Close, Commit, Offer, StateHeader
from gossip.mismatch import describe
from gossip.mixing import DeltaHistory, judge
from gossip.tensors import StateSchema, TensorSpec
from tests.util import pair

SCHEMA = StateSchema((TensorSpec("w", (3,), "float32"), TensorSpec("b", (2,), "float32")))
N = SCHEMA.numel
DEADLINES = Deadlines(offer=5.0, transfer=10.0, min_rate=1e6, commit=5.0)


def offer(correction: bool = True) -> Offer:
    return Offer(SCHEMA.fingerprint, "fp32", 10, 320, 0.0, correction)


def payload(value: float, parts: int = 2) -> torch.Tensor:
    """A snapshot of ``parts`` parts: the state ``value``, the estimate ``-value``."""
    return torch.cat([torch.full((N,), value), torch.full((N,), -value)][:parts])


@dataclass
class Recorded:
    refused: str | None = None
    fraction: float = 0.0


def recorder(seen: list[torch.Tensor], refuse: str | None = None,
             fraction: float = 0.0) -> exchange.Check:
    async def check(theirs: torch.Tensor, parts: int, peer: Offer | Accept) -> Recorded:
        seen.append(theirs.clone())
        return Recorded(refuse, fraction)

    return check


# ---- the rules, without a channel ------------------------------------------------------------


def accepted(correction: bool = True) -> ExchangeState:
    """An initiator's exchange whose offer was just accepted."""
    state = ExchangeState(Side.INITIATOR, offer())
    assert state.answered(Accept(20, 640, 0.0, correction), SCHEMA) is None
    return state


@pytest.mark.parametrize("close, ending", [(Close(Close.BUSY, "later"), Result.BUSY),
                                           (Close(Close.REJECTED, "never"), Result.REJECTED),
                                           (Close(Close.SHUTDOWN, "bye"), Result.REJECTED)])
def test_an_offer_answered_by_close_ends_busy_or_rejected(close: Close, ending: Result) -> None:
    state = ExchangeState(Side.INITIATOR, offer())
    assert state.answered(close, SCHEMA) == Outcome(ending, close.reason)
    assert state.phase is Phase.ENDED and state.outcome == Outcome(ending, close.reason)


def test_a_schema_info_ends_rejected_saying_what_differs() -> None:
    other = StateSchema((TensorSpec("w", (4,), "float32"),))
    outcome = ExchangeState(Side.INITIATOR, offer()).answered(describe(other), SCHEMA)
    assert outcome is not None and outcome.ending is Result.REJECTED
    assert outcome.reason.startswith("schema differs: ")


@pytest.mark.parametrize("answer, why", [
    (Commit(0.0), "expected Accept, got Commit"),
    (Accept(1, 1, 2.0, False), "mixing mode"),
])
def test_an_answer_out_of_turn_is_the_peers_fault(answer: object, why: str) -> None:
    with pytest.raises(RemoteProtocolError, match=why):
        ExchangeState(Side.INITIATOR, offer()).answered(answer, SCHEMA)  # type: ignore[arg-type]


def test_an_accepted_offer_swaps_what_the_accept_says() -> None:
    state = accepted(correction=False)
    assert state.phase is Phase.TRANSFER and state.parts == 1
    assert state.peer == Accept(20, 640, 0.0, False)


def test_a_verdict_that_takes_the_payload_commits_by_the_smaller_fraction() -> None:
    state = accepted()
    assert state.judged(Recorded(fraction=0.5)) == Commit(0.5)
    assert state.phase is Phase.COMMIT
    outcome = state.committed(Commit(0.25))
    assert (outcome.ending, outcome.parts, outcome.fraction) == (Result.COMMITTED, 2, 0.25)
    assert outcome.verdict == Recorded(fraction=0.5)


def test_a_verdict_that_refuses_the_payload_says_close_and_ends_invalid() -> None:
    state = accepted()
    assert state.judged(Recorded("not finite")) == Close(Close.REJECTED,
                                                          "invalid state: not finite")
    assert state.outcome is not None and state.outcome.ending is Result.INVALID
    assert state.outcome.reason == "not finite" and state.phase is Phase.ENDED


def test_a_commit_answered_by_close_or_something_else() -> None:
    state = accepted()
    state.judged(Recorded())
    assert state.committed(Close(Close.REJECTED, "no")).ending is Result.REJECTED
    # Anything else is the peer's violation, a strike: it holds our Commit and may apply
    # the exchange, we do not.
    state = accepted()
    state.judged(Recorded())
    outcome = state.committed(Accept(1, 1, 0.0, False))
    assert outcome.ending is Result.INVALID and state.phase is Phase.ENDED
    assert outcome.reason == "bad Commit: expected Commit, got Accept"
    state = accepted()
    state.judged(Recorded())
    outcome = state.bad_commit(RemoteProtocolError("Commit.correction: 1.5 out of range 0..1"))
    assert (outcome.ending, outcome.verdict) == (Result.INVALID, Recorded())


def test_the_responder_starts_at_the_transfer_and_its_accept_must_fit() -> None:
    state = ExchangeState(Side.RESPONDER, offer(correction=True), Accept(1, 1, 0.0, True))
    assert (state.phase, state.parts, state.peer) == (Phase.TRANSFER, 2, offer(correction=True))
    assert state.bad_payload(ValueError("short")) == Outcome(
        Result.INVALID, "bad payload: short", offer(correction=True), 2)
    with pytest.raises(ValueError, match="did not bring"):
        ExchangeState(Side.RESPONDER, offer(correction=False), Accept(1, 1, 0.0, True))


def test_a_step_out_of_turn_is_our_fault() -> None:
    state = ExchangeState(Side.INITIATOR, offer())
    with pytest.raises(LocalProtocolError, match="phase answer"):
        state.judged(Recorded())


def test_a_refusal_is_busy_or_rejected_and_says_so_in_a_close() -> None:
    assert Refusal(Result.BUSY, "later").close() == Close(Close.BUSY, "later")
    assert Refusal.of(Close(Close.REJECTED, "never")) == Refusal(Result.REJECTED, "never")
    with pytest.raises(ValueError, match="busy or rejected"):
        Refusal(Result.INVALID, "no")


# ---- both sides, over a channel -------------------------------------------------------------


async def run_both(*, offered: Offer, accepted: bool, alice_own: torch.Tensor,
                   bob_own: torch.Tensor, alice_check: exchange.Check,
                   bob_check: exchange.Check) -> tuple[Outcome, Outcome]:
    """Alice offers, Bob takes the offer (with his correction iff ``accepted``)."""
    alice, bob, _ = await pair()
    outcomes: dict[str, Outcome] = {}

    async def initiator() -> None:
        theirs = torch.full_like(alice_own, math.nan)
        outcomes["alice"] = await exchange.initiate(alice, offered, alice_own, theirs, SCHEMA,
                                                    alice_check, DEADLINES)

    async def responder() -> None:
        first = await bob.receive_message()
        assert first == offered
        accept = Accept(20, 640, 0.0, accepted)
        theirs = torch.full_like(bob_own, math.nan)
        outcomes["bob"] = await exchange.respond(bob, first, accept, bob_own, theirs, SCHEMA,
                                                 bob_check, DEADLINES)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(initiator)
        nursery.start_soon(responder)
    return outcomes["alice"], outcomes["bob"]


async def test_both_sides_swap_state_and_correction_and_commit() -> None:
    seen_a: list[torch.Tensor] = []
    seen_b: list[torch.Tensor] = []
    a, b = await run_both(offered=offer(), accepted=True, alice_own=payload(1.0),
                          bob_own=payload(2.0), alice_check=recorder(seen_a),
                          bob_check=recorder(seen_b))
    assert (a.ending, b.ending) == (Result.COMMITTED, Result.COMMITTED)
    assert (a.parts, b.parts) == (2, 2)
    assert torch.equal(seen_a[0], payload(2.0)) and torch.equal(seen_b[0], payload(1.0))
    assert isinstance(a.peer, Accept) and a.peer.step == 20  # each learns the other's bid
    assert isinstance(b.peer, Offer) and b.peer.step == 10


@pytest.mark.parametrize("accepted", [True, False])
async def test_both_sides_move_their_corrections_by_the_smaller_fraction(accepted: bool) -> None:
    # Each side's checks give its own fraction (its rate, weight and clipping); moving by the
    # same one keeps the pair's sum of corrections, and a peer can only make us move less.
    a, b = await run_both(offered=offer(), accepted=accepted, alice_own=payload(1.0),
                          bob_own=payload(2.0, parts=1 + accepted),
                          alice_check=recorder([], fraction=0.5),
                          bob_check=recorder([], fraction=0.25))
    assert (a.ending, b.ending) == (Result.COMMITTED, Result.COMMITTED)
    expected = 0.25 if accepted else 0.0  # without estimates there is nothing to move by
    assert a.fraction == b.fraction == expected


async def test_a_responder_without_a_correction_swaps_the_state_alone() -> None:
    seen_a: list[torch.Tensor] = []
    seen_b: list[torch.Tensor] = []
    a, b = await run_both(offered=offer(), accepted=False, alice_own=payload(1.0),
                          bob_own=payload(2.0, parts=1), alice_check=recorder(seen_a),
                          bob_check=recorder(seen_b))
    assert (a.ending, b.ending) == (Result.COMMITTED, Result.COMMITTED)
    assert (a.parts, b.parts) == (1, 1)
    assert torch.equal(seen_a[0], payload(2.0, parts=1))  # only the state was sent ...
    assert torch.equal(seen_b[0], payload(1.0, parts=1))  # ... either way


async def test_a_refused_payload_is_invalid_here_and_rejected_there() -> None:
    a, b = await run_both(offered=offer(), accepted=True, alice_own=payload(1.0),
                          bob_own=payload(2.0), alice_check=recorder([]),
                          bob_check=recorder([], refuse="not finite"))
    assert b.ending is Result.INVALID and b.reason == "not finite"
    assert a.ending is Result.REJECTED and "not finite" in a.reason
    assert a.parts == 2  # refused after the payloads moved: no reason to bar the offer


async def test_the_verdict_of_judge_refuses_a_correction_that_is_not_finite() -> None:
    histories = (DeltaHistory(), DeltaHistory())

    async def check(theirs: torch.Tensor, parts: int, peer: Offer | Accept):
        return judge(theirs, payload(2.0), parts, 0.5, histories, clip=5.0,
                     max_norm_ratio=100.0)

    bad = payload(1.0)
    bad[N + 1] = math.nan  # the estimate, not the state
    a, b = await run_both(offered=offer(), accepted=True, alice_own=bad, bob_own=payload(2.0),
                          alice_check=recorder([]), bob_check=check)
    assert b.ending is Result.INVALID and b.reason == "correction: non-finite values"
    assert a.ending is Result.REJECTED
    assert len(histories[0]) == len(histories[1]) == 0  # nothing of a refused payload counts


@pytest.mark.parametrize("code, ending", [(Close.BUSY, Result.BUSY),
                                          (Close.REJECTED, Result.REJECTED)])
async def test_an_offer_answered_by_close_moves_nothing(code: int, ending: Result) -> None:
    alice, bob, _ = await pair()
    async with trio.open_nursery() as nursery:
        async def answer() -> None:
            await bob.receive_message()
            await bob.send_message(Close(code, "not now"))

        nursery.start_soon(answer)
        outcome = await exchange.initiate(alice, offer(), payload(1.0), payload(0.0), SCHEMA,
                                          recorder([]), DEADLINES)
    assert outcome == Outcome(ending, "not now")


@pytest.mark.parametrize("accept, why", [
    (Accept(1, 1, 0.0, True), "did not bring"),  # a correction our offer did not bring
    (Accept(1, 1, 2.0, False), "mixing mode"),  # push-sum against our fixed weight
])
async def test_an_accept_that_contradicts_the_offer_is_a_protocol_error(accept: Accept,
                                                                        why: str) -> None:
    alice, bob, _ = await pair()
    async with trio.open_nursery() as nursery:
        async def answer() -> None:
            await bob.receive_message()
            await bob.send_message(accept)

        nursery.start_soon(answer)
        with pytest.raises(RemoteProtocolError, match=why):
            await exchange.initiate(alice, offer(correction=False), payload(1.0, 1),
                                    payload(0.0, 1), SCHEMA, recorder([]), DEADLINES)


async def test_a_payload_of_the_wrong_size_is_invalid() -> None:
    """The peer agreed to send two parts and announces one: its fault, whatever our send did."""
    alice, bob, _ = await pair()
    async with trio.open_nursery() as nursery:
        async def liar() -> None:
            await bob.receive_message()
            await bob.send_message(Accept(1, 1, 0.0, True))
            await bob.send_message(StateHeader(SCHEMA.fingerprint, "fp32", 1, 1, N * 4))

        nursery.start_soon(liar)
        outcome = await exchange.initiate(alice, offer(), payload(1.0), payload(0.0), SCHEMA,
                                          recorder([]), DEADLINES)
    assert outcome.ending is Result.INVALID and "announced" in outcome.reason


@pytest.mark.parametrize("stop_after, phase", [(1, "offer"), (2, "transfer")])
async def test_a_silent_peer_costs_one_deadline_named_by_its_phase(
        autojump_clock: MockClock, stop_after: int, phase: str) -> None:
    alice, bob, _ = await pair()
    async with trio.open_nursery() as nursery:
        async def silent() -> None:
            await bob.receive_message()
            if stop_after == 2:
                await bob.send_message(Accept(1, 1, 0.0, True))
            await trio.sleep_forever()

        nursery.start_soon(silent)
        started = trio.current_time()
        with pytest.raises(PeerTimeout, match=phase):
            await exchange.initiate(alice, offer(), payload(1.0), payload(0.0), SCHEMA,
                                    recorder([]), DEADLINES)
        waited = trio.current_time() - started
        nursery.cancel_scope.cancel()
    # The accept comes at once (virtual time), so each wait is its own phase's deadline.
    want = DEADLINES.offer if phase == "offer" else DEADLINES.transfer_for(2 * N * 4)
    assert waited == pytest.approx(want, abs=0.01)
