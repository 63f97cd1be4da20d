"""What only a member can say of itself: forged membership claims, in the pure state machine.

A swarm-key holder seals whatever it likes (PROTOCOL.md section 12). These tests play one:
Left, Alive, Suspect and Dead at 2^53 - 1 about another member and about ourselves, with a
proof that is missing its point in each way it can (another member's key, a key that is not
the peer's, a signature of something else), and check that no claim puts a member out of
reach of its own refutation. The helpers are tests/unit/test_membership.py's.
"""

import random
from dataclasses import replace

import pytest

from gossip.claims import proven, row_claim, sign_alive, sign_left
from gossip.member import State
from gossip.membership import Membership
from gossip.messages import MAX_COUNT, Alive, Dead, Left, Suspect
from tests.unit.test_membership import (ADDR, CFG, KEYS, ME, PEERS, A, B, C, alive, feed,
                                        left, machine, sent, state)

HUGE = MAX_COUNT
FORGER = PEERS[9]  # a key holder: it signs with its own key only


def forged(claim: Alive | Left, how: str) -> Alive | Left:
    """``claim`` as a forger can write it: signed by its own key (``own-key``), with the
    member's key but its own signature (``wrong-signature``), or the member's genuine proof of
    another claim (``replayed-signature``: the member's Alive at 0 / Left at 0)."""
    mine = KEYS[FORGER]
    if how == "own-key":
        return replace(claim, key=mine.public_key,
                       signature=(sign_alive(mine, 0, ADDR[FORGER], 1, 0, False)
                                  if isinstance(claim, Alive) else sign_left(mine, 0)).signature)
    if how == "wrong-signature":
        return replace(claim, signature=mine.sign(b"anything"))
    genuine = alive(claim.peer, 0) if isinstance(claim, Alive) else left(claim.peer, 0)
    return replace(claim, key=genuine.key, signature=genuine.signature)


HOW = ["own-key", "wrong-signature", "replayed-signature"]


@pytest.mark.parametrize("how", HOW)
def test_a_forged_left_about_a_member_is_refused_and_counted(how):
    m = machine(3)
    bogus = forged(Left(B, HUGE, key=KEYS[B].public_key, signature=bytes(64)), how)
    assert not proven(bogus)
    feed(m, 1.0, FORGER, bogus)
    assert state(m, B) == (State.ALIVE, 0)
    assert m.claims.refused == 1
    assert not [x for _, x in sent(m.tick(1.0), Left)]  # and not passed on


@pytest.mark.parametrize("how", HOW)
def test_a_forged_alive_about_a_member_is_refused(how):
    m = machine(3)
    bogus = forged(replace(alive(B, 0), incarnation=HUGE, address="203.0.113.9:1"), how)
    feed(m, 1.0, FORGER, bogus)
    assert state(m, B) == (State.ALIVE, 0) and m.get(B).address == ADDR[B]
    assert m.claims.refused == 1


def test_a_forged_alive_about_a_stranger_is_not_added():
    m = machine(3)
    stranger = PEERS[20]
    feed(m, 1.0, FORGER, forged(alive(stranger, 3), "own-key"))
    assert m.get(stranger) is None and m.claims.refused == 1


@pytest.mark.parametrize("kind", [Suspect, Dead])
def test_suspect_or_dead_at_the_largest_incarnation_stays_refutable(kind):
    m = machine(3)
    feed(m, 1.0, B, alive(B, 4))
    feed(m, 1.0, FORGER, kind(B, HUGE, FORGER))
    down = State.SUSPECT if kind is Suspect else State.DEAD
    assert state(m, B) == (down, 4)  # applied at what B signed, not at 2^53 - 1
    assert kind(B, 4, FORGER) in [x for _, x in sent(m.tick(1.0), kind)]  # passed on so
    feed(m, 2.0, B, alive(B, 5))  # B refutes as it always can
    assert state(m, B) == (State.ALIVE, 5)


@pytest.mark.parametrize("claim", [Suspect(ME, HUGE, FORGER), Dead(ME, HUGE, FORGER)],
                         ids=["suspect", "dead"])
def test_anyones_word_about_us_is_refuted_from_our_own_incarnation(claim):
    m = machine(3)
    feed(m, 1.0, FORGER, claim)
    assert m.incarnation == 1 and m.counters.refutations == 1  # not 2^53 - 1, nor frozen
    m.set_meta(2.0, ready=True)
    assert m.incarnation == 2  # still announcing


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("kind", ["left", "alive"])
def test_a_forged_claim_of_ours_is_refused_not_refuted(kind, how):
    m = machine(3)
    claim = left(ME, HUGE) if kind == "left" else replace(alive(ME, 0), incarnation=HUGE)
    feed(m, 1.0, FORGER, forged(claim, how))
    assert m.incarnation == 0 and m.counters.refutations == 0 and m.claims.refused == 1


def test_a_key_that_is_not_the_peers_is_refused_whatever_it_signs():
    # The forger's key and signature are both good, for its own key: the peer id says no.
    mine = KEYS[FORGER]
    fake = sign_left(mine, HUGE)
    claim = Left(B, HUGE, key=fake.key, signature=fake.signature)
    assert not proven(claim)
    m = machine(3)
    feed(m, 1.0, FORGER, claim)
    assert state(m, B) == (State.ALIVE, 0)


def test_a_signed_left_is_still_final():
    m = machine(3)
    feed(m, 1.0, C, left(B, 0))
    assert state(m, B) == (State.LEFT, 0)
    feed(m, 2.0, FORGER, Suspect(B, HUGE, FORGER), Dead(B, HUGE, FORGER))
    feed(m, 2.0, FORGER, forged(replace(alive(B, 0), incarnation=7), "own-key"))
    assert state(m, B) == (State.LEFT, 0)
    row = next(r for r in m.full_state() if r.peer == B)
    assert row.state == State.LEFT and row_claim(row) == left(B, 0)  # its proof travels


def test_a_forged_proof_ends_its_datagram_and_costs_one_check():
    m = machine(3)
    checked = m.claims.checked  # the three members' announcements
    news = alive(PEERS[20], 0)
    feed(m, 1.0, FORGER, forged(left(B, 3), "wrong-signature"), news,
         forged(left(C, 3), "own-key"))
    assert m.get(PEERS[20]) is None  # nothing after the forgery is applied
    assert (m.claims.checked - checked, m.claims.refused) == (1, 1)


def test_an_announcement_heard_again_costs_no_check():
    m = machine(3)
    checked = m.claims.checked
    for t in range(5):
        feed(m, 1.0 + t, C, alive(A, 0), alive(B, 0), alive(C, 0))
    assert m.claims.checked == checked


def test_every_row_of_our_table_carries_a_proof_that_holds():
    m = machine(4)
    feed(m, 1.0, A, Suspect(B, 0, A), Dead(C, 0, A), left(PEERS[4], 0))
    m.leave(2.0)
    rows = m.full_state()
    assert {r.state for r in rows} == {State.SUSPECT, State.DEAD, State.LEFT, State.ALIVE}
    assert all(proven(row_claim(r)) for r in rows)


@pytest.mark.parametrize("down", [State.DEAD, State.SUSPECT, State.ALIVE, State.LEFT])
def test_a_restarted_node_takes_its_place_back(down):
    # Its earlier run reached incarnation 50 (and left, for LEFT); a member holds it so.
    # The new run starts at 0: the member's table proves 50 to it, it refutes above, and its
    # own record in the last page of the push-pull puts it back in the member's table.
    member = machine(3)  # we are the restarted node's peer here: "ME" is the member
    old = Membership(KEYS[A], ADDR[A], 0.0, CFG, random.Random(2))
    for _ in range(50):
        old.set_meta(0.0, ready=not old.myself().ready)
    member.merge(1.0, [old.own_state()], A)
    if down == State.LEFT:
        old.leave(1.0)
        member.merge(1.0, [old.own_state()], A)  # a genuine Left, then a restart
    elif down != State.ALIVE:
        feed(member, 1.0, B, (Dead if down == State.DEAD else Suspect)(A, 50, B))
    assert state(member, A) == (down, 50)
    restarted = Membership(KEYS[A], ADDR[A], 10.0, CFG, random.Random(3))
    restarted.merge(10.0, member.full_state(), ME)  # the join's second step
    assert restarted.incarnation == 51
    member.merge(10.0, [restarted.own_state()], A)  # the join's third step
    assert state(member, A) == (State.ALIVE, 51)


def test_a_restarted_node_hears_its_earlier_run_in_gossip():
    m = machine(3)
    feed(m, 1.0, B, alive(ME, 40))  # our earlier run's announcement, signed by our key
    assert m.incarnation == 41
    feed(m, 1.0, B, Dead(ME, 60, B))  # anyone's word: refuted from our own incarnation
    assert m.incarnation == 42
