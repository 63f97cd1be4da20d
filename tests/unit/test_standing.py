"""Tests for gossip.standing: which exchanges may move us, by how much, the newcomers' budget,
and the member table counted by host. Pure."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.identity import PeerId
from gossip.member import Member, State
from gossip.messages import MAX_COUNT
from gossip.standing import (
    MOVE_SLACK, NEWCOMER_BURST, NewcomerBudget, PeerSteps, Proofs, Records, Standing, pick,
    seniority, standing, step_ceiling, step_move,
)

def member(i: int, host: str, step: int = 0) -> Member:
    return Member(PeerId(f"{i:026d}"), f"{host}:7070", 1, State.ALIVE, 1, step, True, 0.0)


def members(steps_by_host: list[tuple[str, int]]) -> list[Member]:
    return [member(i, host, step) for i, (host, step) in enumerate(steps_by_host)]


@pytest.mark.parametrize("initiated, since, now, expected", [
    (True, None, 0.0, Standing.CHOSEN),  # our own pick: never a stranger's offer
    (True, 99.0, 100.0, Standing.CHOSEN),
    (False, None, 1000.0, Standing.NEWCOMER),  # not alive in our table at all
    (False, 50.0, 100.0, Standing.NEWCOMER),  # alive for 50 s of the 60 needed
    (False, 40.0, 100.0, Standing.MEMBER),  # exactly 60 s
    (False, 0.0, 100.0, Standing.MEMBER),
], ids=repr)
def test_standing(initiated: bool, since: float | None, now: float, expected: Standing) -> None:
    assert standing(initiated, since, now, trust_after=60.0) is expected


def test_trust_after_zero_trusts_every_alive_member_at_once() -> None:
    assert standing(False, 100.0, 100.0, trust_after=0.0) is Standing.MEMBER
    assert standing(False, None, 100.0, trust_after=0.0) is Standing.NEWCOMER


def test_newcomers_of_one_host_share_a_burst_then_one_exchange_per_round() -> None:
    budget = NewcomerBudget()
    assert [budget.allow("10.0.0.9") for _ in range(NEWCOMER_BURST + 1)] == (
        [True] * NEWCOMER_BURST + [False])
    assert budget.allow("10.0.0.8")  # another host has its own bucket
    budget.round()
    assert budget.allow("10.0.0.9")
    assert not budget.allow("10.0.0.9")
    for _ in range(10):  # rounds while nobody asks save up to the burst, no more
        budget.round()
    assert [budget.allow("10.0.0.9") for _ in range(NEWCOMER_BURST + 1)] == (
        [True] * NEWCOMER_BURST + [False])


def test_the_budget_table_is_bounded_and_forgets_the_host_seen_longest_ago() -> None:
    budget = NewcomerBudget(burst=1, max_hosts=3)
    for host in ("a", "b", "c"):
        assert budget.allow(host)
    assert not budget.allow("a")  # "a" is now the most recent, "b" the oldest
    assert budget.allow("d")  # a fourth host: "b" is forgotten
    assert budget.allow("b")  # forgotten means a full bucket again
    assert not budget.allow("a")


def test_a_budget_refilled_by_a_fraction_per_round_allows_one_offer_per_whole_token() -> None:
    budget = NewcomerBudget(burst=2)
    assert budget.allow("h") and budget.allow("h") and not budget.allow("h")
    for _ in range(3):  # a third of a token a round: one offer after three rounds
        assert not budget.allow("h")
        budget.round(1 / 3)
    assert budget.allow("h") and not budget.allow("h")


def test_proofs_keep_the_first_time_and_the_latest_host_and_forget_the_quietest() -> None:
    proofs = Proofs(max_peers=2)
    proofs.proved("a", 1.0, "10.0.0.1")
    proofs.proved("b", 2.0, "10.0.0.2")
    proofs.proved("a", 5.0, "10.0.0.3")  # a's second channel: its time stays, its host moves
    assert (proofs.since("a"), proofs.host("a")) == (1.0, "10.0.0.3")
    proofs.proved("c", 6.0, "10.0.0.4")  # b was proved least recently: it goes
    assert "b" not in proofs and proofs.since("b") is None and proofs.host("b") is None
    assert "a" in proofs and "c" in proofs


def test_a_flood_of_identities_from_one_host_pushes_out_only_that_hosts_proofs() -> None:
    proofs = Proofs(max_peers=100, per_host=3)
    proofs.proved("honest", 0.0, "10.0.0.1")
    for i in range(1000):
        proofs.proved(f"fresh{i}", 1.0 + i, "10.0.0.66")
    assert "honest" in proofs
    assert [f"fresh{i}" in proofs for i in range(996, 1000)] == [False, True, True, True]


def test_a_proof_from_an_unknown_address_keeps_the_host_proved_before() -> None:
    proofs = Proofs()
    proofs.proved("a", 1.0, "10.0.0.1")
    proofs.proved("a", 2.0, "")  # the socket could not say where it came from
    assert proofs.host("a") == "10.0.0.1"
    proofs.proved("b", 3.0, "")
    assert proofs.host("b") == ""  # a host of its own, not the address its record claims


def test_the_step_ceiling_counts_the_hosts_a_host_function_says() -> None:
    # Three identities claiming three hosts, all proved from one: one host, one vote.
    ms = members([("10.0.0.1", 100), ("10.0.0.2", 100), ("10.0.0.3", 100), ("10.0.0.9", 5),
                  ("10.0.0.8", 6)])
    assert step_ceiling(ms) == 100
    proved_from = {m.peer: "x" if m.step == 100 else m.address for m in ms}
    assert step_ceiling(ms, lambda m: proved_from[m.peer]) == 6


@pytest.mark.parametrize("burst, hosts", [(0, 1), (1, 0)])
def test_the_budget_refuses_bad_sizes(burst: int, hosts: int) -> None:
    with pytest.raises(ValueError):
        NewcomerBudget(burst, hosts)


# --- step_ceiling ---------------------------------------------------------------------


@pytest.mark.parametrize("announced, ceiling", [
    ([], 0), ([7], 7), ([3, 9], 3), ([5, 1, 9], 5), ([4, 1, 9, 8], 4),
    ([100, 101, 99, MAX_COUNT], 100), ([100, MAX_COUNT, MAX_COUNT], MAX_COUNT),
], ids=repr)
def test_step_ceiling_is_the_lower_median_with_a_member_per_host(announced: list[int],
                                                                   ceiling: int) -> None:
    assert step_ceiling(members([(f"10.0.0.{i}", s) for i, s in enumerate(announced)])) == ceiling


def test_step_ceiling_counts_a_host_once_however_many_identities_it_has() -> None:
    # Three honest hosts near step 100; one host announcing forty liars at the largest step.
    table = members([("10.0.0.1", 100), ("10.0.0.2", 102), ("10.0.0.3", 98)]
                    + [("10.6.6.6", MAX_COUNT)] * 40)
    assert step_ceiling(table) == 100
    # Nodes that share a host (one machine, or 127.0.0.1 in tests) are one host's median.
    assert step_ceiling(members([("127.0.0.1", 5), ("127.0.0.1", 9), ("127.0.0.1", 7)])) == 7


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=20), st.data())
def test_liar_hosts_fewer_than_the_honest_cannot_lift_the_ceiling(honest: list[int], data) -> None:
    liars = data.draw(st.lists(st.lists(st.integers(0, MAX_COUNT), min_size=1, max_size=5),
                               max_size=len(honest)))
    table = [("honest%d" % i, s) for i, s in enumerate(honest)]
    table += [("liar%d" % i, s) for i, group in enumerate(liars) for s in group]
    assert step_ceiling(members(table)) <= max(honest)


# --- pick -------------------------------------------------------------------------------


def test_pick_chooses_a_host_then_a_member_of_it() -> None:
    rng = random.Random(1)
    table = members([("10.0.0.1", 0), ("10.0.0.2", 0)] + [("10.6.6.6", 0)] * 20)
    hosts = collections.Counter(pick(table, rng).address for _ in range(3000))
    # A third each, not 20/22 for the host with twenty identities.
    for count in hosts.values():
        assert 850 < count < 1150, hosts
    assert pick([], rng) is None


def test_a_peer_we_chose_before_has_a_record_at_once() -> None:
    assert standing(False, 99.0, 100.0, trust_after=60.0, chosen_before=True) is Standing.MEMBER
    assert standing(False, None, 100.0, trust_after=60.0, chosen_before=True) is Standing.MEMBER


def test_records_are_bounded_and_forget_the_oldest() -> None:
    records = Records(max_peers=2)
    for peer in ("a", "b", "a", "c"):  # "a" again: the newest, so "b" goes first
        records.add(peer)
    assert "a" in records and "c" in records and "b" not in records


# --- the step -------------------------------------------------------------------------------

def test_a_gap_is_closed_half_way_at_a_time_and_never_counted_twice() -> None:
    # Ahead of the swarm by 8: each exchange takes half of what is left of the gap from the
    # steps to come (a debt), so the step heads to the swarm's and never past it.
    step, debt = 108, 0
    for want in (104, 102, 101, 101):
        debt -= step_move(step - debt, 100, 100)
        assert step - debt == want
    assert step_move(100, 0, 100) == 0  # at the swarm's step a liar's 0 moves nothing
    assert step_move(90, 10**9, 100) == 5  # from below: half way to the median, no further
    # However far the median lies (liars holding it), one move at most doubles the step.
    assert step_move(10**6, 2**53 - 1, 2**53 - 1) == 10**6 + MOVE_SLACK
    assert step_move(0, 10**9, 10**9) == MOVE_SLACK


def test_the_swarms_step_ages_by_our_own_training_not_by_our_step() -> None:
    seen = PeerSteps(window=8, least=4)
    for host, step, local in [("a", 100, 0), ("b", 110, 10), ("c", 1000, 10), ("d", 105, 5)]:
        seen.add(host, "p" + host, step, local)
    # Peers' steps aged to our 20 local steps: 120, 120, 1010, 120: a liar's is outvoted.
    assert seen.swarm(20) == 120
    assert seen.swarm(20) == seen.swarm(20)  # asking moves nothing: only training ages it
    assert PeerSteps(least=4).swarm(0) is None  # too few hosts: the caller falls back


def test_a_host_counts_once_however_often_it_commits() -> None:
    # A liar that is always free to commit fills the rounds, not the hosts.
    seen = PeerSteps(window=32, least=4)
    for host in "abcd":
        seen.add(host, "p" + host, 100, 0)
    for i in range(40):  # ... and however many identities it holds there
        seen.add("liar", f"fake{i}", 2**53 - 1, 0)
    assert seen.swarm(0) == 100
    # Liars on as many hosts as the honest: the lower median is still an honest step ...
    for host in "xyz":
        seen.add(host, "p" + host, 2**53 - 1, 0)
    assert seen.swarm(0) == 100
    seen.add("w", "pw", 2**53 - 1, 0)  # ... and on more, no longer
    assert seen.swarm(0) == 2**53 - 1


def test_honest_nodes_sharing_a_host_count_as_its_lower_median() -> None:
    # Several daemons on one machine (or every node of a test on 127.0.0.1) and a liar
    # among them: the host's step is the lower median of its peers'.
    seen = PeerSteps(least=4)
    seen.add("127.0.0.1", "b", 2**53 - 1, 0)
    assert seen.swarm(0, hosts=1, members=3) is None  # one of three: the caller falls back
    for peer, step in [("c", 40), ("d", 44)]:
        seen.add("127.0.0.1", peer, step, 0)
    assert seen.swarm(0, hosts=1, members=3) == 44
    seen.add("127.0.0.1", "b", 2**53 - 1, 0)  # again and again: still one peer's step
    assert seen.swarm(0, hosts=1, members=3) == 44


def test_with_few_hosts_in_the_table_the_estimate_needs_them_all() -> None:
    seen = PeerSteps(least=4)
    seen.add("a", "pa", 100, 0)
    assert seen.swarm(0, hosts=2, members=2) is None
    seen.add("b", "pb", 90, 0)
    assert seen.swarm(0, hosts=2, members=2) == 90  # both known: their lower median
    assert seen.swarm(0, hosts=10, members=10) is None  # a larger table needs 4
    seen.add("a", "pa", 120, 5)  # the latest from a peer replaces its older one
    assert seen.swarm(5, hosts=2, members=2) == 95


# --- seniority: how much of the mixing weight a peer's state gets -----------------------


@pytest.mark.parametrize("alive_for,own_age,trust_after,expected", [
    (0.0, 100.0, 10.0, 0.0),  # joined just now: its state moves us by nothing yet
    (1.0, 100.0, 10.0, 0.1),  # a second in: a tenth of the usual step
    (5.0, 100.0, 10.0, 0.5),
    (10.0, 100.0, 10.0, 1.0),  # trust_after in: all of it
    (50.0, 100.0, 10.0, 1.0),
    (1.5, 8.0, 10.0, 0.1875),  # we are younger than trust_after: over our own age
    (2.0, 6.5, 10.0, 1.0),  # seen 4.5 s after our start: it started with us
    (99.5, 100.0, 10.0, 1.0),
    (0.0, 0.0, 10.0, 1.0),  # both started at once
    (0.0, 100.0, 0.0, 1.0),  # trust_after 0: no ramp
    (None, 100.0, 10.0, 1.0),  # not alive in our table: its standing decided alone
])
def test_seniority_ramps_up_a_peer_that_joined_after_us(alive_for: float | None,
                                                       own_age: float, trust_after: float,
                                                       expected: float) -> None:
    assert seniority(alive_for, own_age, trust_after) == pytest.approx(expected)
