"""SWIM + Lifeguard membership as a pure state machine: the transition table row by row, then
each timer (probe, suspicion, gossip, push-pull, reconnect) driven by tick(now) at explicit
times, and the decoder's strictness.

A test plays every other member itself: it builds datagrams with :func:`packet`, hands them
to :meth:`Membership.receive`, and decodes the ``Send`` effects that come back.
"""

import math
import random
from dataclasses import replace

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.config import MembershipConfig
from gossip.errors import WireError
from gossip.claims import sign_alive, sign_left
from gossip.member import State
from gossip.membership import (
    MAX_PACKET,
    Changed,
    Membership,
    PushPullWith,
    Send,
)
from gossip.probing import helper_wait
from gossip.messages import (
    MAX_PARTS,
    MAX_COUNT,
    MAX_SHARDS,
    Ack,
    Alive,
    Dead,
    Left,
    MemberState,
    Nack,
    Packet,
    Ping,
    PingReq,
    Suspect,
)
from gossip.suspicion import suspicion_bounds
from gossip.wire import decode, encode
from tests.util import mutate, seeded_identity

IDENTITIES = [seeded_identity(i) for i in range(400)]
KEYS = {i.peer_id: i for i in IDENTITIES}  # each member signs its own Alive and Left
PEERS = [i.peer_id for i in IDENTITIES]
ME, A, B, C, D, E, F, G = PEERS[:8]
ADDR = {p: f"10.0.{i // 256}.{i % 256}:7000" for i, p in enumerate(PEERS)}
CFG = MembershipConfig()
EPS = 1e-6
UPDATES = (Alive, Suspect, Dead, Left)


def short(message) -> str:
    """A test id: the message type and incarnation, e.g. ``Suspect(3)``."""
    if not isinstance(message, UPDATES):
        return None  # pytest's default
    return f"{type(message).__name__}({message.incarnation})"


def packet(sender, *messages) -> bytes:
    return encode(Packet(sender, tuple(encode(m) for m in messages)))


def alive(peer, inc=0, **meta) -> Alive:
    """``peer``'s own announcement at ``inc``, signed."""
    fields = dict(address=ADDR[peer], version=1, step=0, ready=False) | meta
    return sign_alive(KEYS[peer], inc, **fields)


def left(peer, inc) -> Left:
    """``peer``'s own departure at ``inc``, signed."""
    return sign_left(KEYS[peer], inc)


def feed(m, now, sender, *messages):
    return m.receive(now, ADDR[sender], packet(sender, *messages))


def machine(n=4, *, seed=0, config=CFG, now=0.0) -> Membership:
    """Us, having heard Alive(0) from the first ``n`` other peers."""
    m = Membership(KEYS[ME], ADDR[ME], now, config, random.Random(seed))
    for p in PEERS[1 : n + 1]:
        feed(m, now, p, alive(p))
    return m


def datagrams(effects) -> list[tuple[str, list]]:
    """(address, messages) of every Send, checking each against the size limits."""
    out = []
    for e in effects:
        if isinstance(e, Send):
            assert len(e.data) <= MAX_PACKET
            p = decode(e.data)
            assert isinstance(p, Packet) and p.sender == ME
            out.append((e.address, [decode(part) for part in p.parts]))
    return out


def sent(effects, kind) -> list[tuple[str, object]]:
    return [(a, x) for a, msgs in datagrams(effects) for x in msgs if isinstance(x, kind)]


def is_gossip(messages) -> bool:
    return all(isinstance(x, UPDATES) for x in messages)


def first_probe(m, start=0.0):
    """Tick at each deadline until the first Ping: (time, address, ping, all its messages)."""
    t = start
    for _ in range(1000):
        t = max(t, m.next_deadline())
        probes = [(a, msgs) for a, msgs in datagrams(m.tick(t)) if isinstance(msgs[0], Ping)]
        if probes:
            (address, messages), = probes
            return t, address, messages[0], messages
    raise AssertionError("no probe")


def probe_at(m, t):
    """Tick at ``t``, which must send exactly one Ping: (address, ping)."""
    pings = sent(m.tick(t), Ping)
    assert len(pings) == 1, pings
    return pings[0]


def state(m, peer):
    member = m.get(peer)
    return None if member is None else (member.state, member.incarnation)


# ---- the transition table ------------------------------------------------------------------

INC = 2  # X's incarnation before the message; the message carries 1, 2 or 3
X, Y, Z = A, B, C
SETUP = {  # how X gets into each state at INC
    None: [],
    State.ALIVE: [alive(X, INC)],
    State.SUSPECT: [alive(X, INC), Suspect(X, INC, Y)],
    State.DEAD: [alive(X, INC), Dead(X, INC, Y)],
    State.LEFT: [alive(X, INC), left(X, INC)],
}
MESSAGES = {
    Alive: lambda i: alive(X, i, step=7),
    Suspect: lambda i: Suspect(X, i, Z),
    Dead: lambda i: Dead(X, i, Z),
    Left: lambda i: left(X, i),
}
AL, SU, DE, LE = State
__ = None  # unchanged
# (message, current state): the new state for i < inc, i == inc, i > inc.
TABLE = {
    (Alive, None): (AL, AL, AL),  # added
    (Alive, AL): (__, __, AL),
    (Alive, SU): (__, __, AL),
    (Alive, DE): (__, __, AL),
    (Alive, LE): (__, __, AL),
    (Suspect, None): (__, __, __),
    (Suspect, AL): (__, SU, SU),  # timer starts
    (Suspect, SU): (__, SU, SU),  # confirmation counted
    (Suspect, DE): (__, __, __),
    (Suspect, LE): (__, __, __),
    (Dead, None): (__, __, __),
    (Dead, AL): (__, DE, DE),
    (Dead, SU): (__, DE, DE),
    (Dead, DE): (__, __, __),
    (Dead, LE): (__, __, __),
    (Left, None): (__, __, __),
    (Left, AL): (__, LE, LE),
    (Left, SU): (__, LE, LE),
    (Left, DE): (__, LE, LE),
    (Left, LE): (__, __, __),
}
ROWS = [
    pytest.param(kind, current, i, new,
                 id=f"{kind.__name__}({i})-{getattr(current, 'name', 'unknown')}")
    for (kind, current), news in TABLE.items()
    for i, new in zip((INC - 1, INC, INC + 1), news)
]


@pytest.mark.parametrize("kind, current, i, new", ROWS)
def test_transition_table(kind, current, i, new):
    m = machine(0) if current is None else machine(3)  # X, Y, Z; X re-announced at INC
    feed(m, 1.0, Y, *SETUP[current])
    assert state(m, X) == (None if current is None else (current, INC))
    before = m.get(X)
    message = MESSAGES[kind](i)
    effects = feed(m, 2.0, Y, message)
    changed = [e.member for e in effects if isinstance(e, Changed) and e.member.peer == X]
    if new is None:
        assert m.get(X) == before
        assert not changed
        return
    # Anyone's word (Suspect, Dead) counts at most at the incarnation X signed: X's next
    # Alive always out-ranks it. X's own (Alive, Left) takes the incarnation it says.
    inc = i if kind in (Alive, Left) else min(i, INC)
    passed_on = message if inc == i else kind(X, inc, message.by)
    if (kind, current) == (Suspect, SU):
        # Still suspect; a new suspector counts as a confirmation and is passed on.
        assert m.get(X).state == SU and not changed
        gossip = sent(m.tick(2.0), Suspect)
        assert any(x == passed_on for _, x in gossip) == (i >= INC)
    else:
        assert state(m, X) == (new, inc)
        assert [(c.state, c.incarnation) for c in changed] == [(new, inc)]
        assert passed_on in [x for _, x in sent(m.tick(2.0), kind)]  # passed on
    if kind is Alive and new is not None:
        assert m.get(X).step == 7 and m.get(X).address == ADDR[X]
        assert m.get(X).heard == 2.0  # the step is as of the announcement just taken


def lifeguard_timeout(n_alive, confirmations):
    """The suspicion timeout gossip.suspicion promises, from suspicion_bounds."""
    low, high = suspicion_bounds(n_alive, CFG.probe_interval, CFG.suspicion_mult,
                                 CFG.suspicion_max_mult)
    k = int(CFG.suspicion_mult) - 2
    if n_alive - 2 < k:  # too few members to supply the confirmations
        return low
    return max(low, high - (high - low) * math.log(confirmations + 1) / math.log(k + 1))


@pytest.mark.parametrize(
    "n, confirmers, counted",
    [
        (4, [], 0),
        (4, [C], 1),
        (4, [C, D], 2),
        (4, [C, D, E], 2),  # no use beyond `expected`
        (4, [B, C, C], 1),  # the first reporter and repeats do not count
        (19, [], 0),  # log10(20) > 1: longer bounds
        (19, [C, D], 2),
        (1, [C, D], 0),  # N = 2: nobody to confirm; the minimum at once
    ],
)
def test_the_suspicion_timer_fires_dead(n, confirmers, counted):
    m = machine(n)
    feed(m, 1.0, B, Suspect(A, 0, B))
    for k, by in enumerate(confirmers):
        feed(m, 1.1 + 0.1 * k, by, Suspect(A, 0, by))
    deadline = 1.0 + lifeguard_timeout(n + 1, counted)
    m.tick(deadline - EPS)
    assert state(m, A) == (State.SUSPECT, 0)
    effects = m.tick(deadline + EPS)
    assert state(m, A) == (State.DEAD, 0)
    assert Changed(m.get(A)) in effects
    assert m.counters.deaths == 1
    later = m.tick(deadline + CFG.gossip_interval)
    assert Dead(A, 0, ME) in [x for _, x in sent(effects + later, Dead)]


# ---- about ourselves -----------------------------------------------------------------------

OUR_INC = 1  # after set_meta(ready=True) below


def announced(m, inc):
    me = m.myself()
    return sign_alive(KEYS[ME], inc, me.address, me.version, me.step, me.ready, me.shard,
                      me.shards)


@pytest.mark.parametrize(
    "message, refuted_at",
    [
        (Suspect(ME, OUR_INC - 1, A), None),
        (Suspect(ME, OUR_INC, A), OUR_INC + 1),
        (Suspect(ME, OUR_INC + 5, A), OUR_INC + 1),  # anyone's word: from our own
        (Suspect(ME, MAX_COUNT, A), OUR_INC + 1),
        (Dead(ME, OUR_INC - 1, A), None),
        (Dead(ME, OUR_INC, A), OUR_INC + 1),
        (Dead(ME, OUR_INC + 5, A), OUR_INC + 1),
        (Dead(ME, MAX_COUNT, A), OUR_INC + 1),
        (left(ME, OUR_INC - 1), None),
        (left(ME, OUR_INC), OUR_INC + 1),
        (left(ME, OUR_INC + 5), OUR_INC + 6),
        (alive(ME, OUR_INC, ready=True), None),  # exactly what we announced
        (alive(ME, OUR_INC, ready=True, step=9), OUR_INC + 1),
        (alive(ME, OUR_INC, ready=False), OUR_INC + 1),
        (alive(ME, OUR_INC, ready=True, address="10.9.9.9:1"), OUR_INC + 1),
        (alive(ME, OUR_INC + 3, ready=True), OUR_INC + 4),  # a restarted node's old self
        (alive(ME, OUR_INC - 1, step=9), None),  # stale
    ],
    ids=short,
)
def test_refutation(message, refuted_at):
    m = machine(2)
    m.set_meta(0.5, ready=True)
    assert m.incarnation == OUR_INC
    m.tick(0.5)  # gossip our announcement
    feed(m, 1.0, A, message)
    refutations = [x for _, x in sent(m.tick(1.0), Alive)
                   if x.peer == ME and x.incarnation > OUR_INC]
    if refuted_at is None:
        assert m.incarnation == OUR_INC and not refutations
        assert m.counters.refutations == 0
    else:
        assert m.incarnation == refuted_at
        assert announced(m, refuted_at) in refutations
        assert m.myself().ready  # a refutation re-announces our real metadata
        assert m.counters.refutations == 1


def test_refuting_a_suspicion_costs_local_health():
    m = machine(2)
    feed(m, 1.0, A, Suspect(ME, 0, A))
    assert m.awareness == 1


@pytest.mark.parametrize("message", [Suspect(ME, 3, A), Dead(ME, 3, A), left(ME, 3),
                                     alive(ME, 3, step=4)], ids=short)
def test_nothing_is_refuted_once_leaving(message):
    m = machine(2)
    m.leave(1.0)
    feed(m, 1.5, A, message)
    assert m.incarnation == 0
    assert not [x for _, x in sent(m.tick(2.0), Alive) if x.peer == ME and x.incarnation]


def test_an_echo_of_our_announcement_after_a_quiet_step_change_is_not_refuted():
    m = machine(2)
    m.set_meta(1.0, step=5)  # within meta_interval: not announced
    assert m.incarnation == 0
    feed(m, 1.5, A, alive(ME, 0))  # our own Alive(0), relayed back by A
    assert m.incarnation == 0 and m.counters.refutations == 0


def test_a_members_step_is_dated_by_the_announcement_that_brought_it():
    m = machine(2)  # A announced Alive(0) at 0.0
    assert (m.get(A).step, m.get(A).heard) == (0, 0.0)
    feed(m, 3.0, B, alive(A, 1, step=40))  # relayed: when we took it is what dates it
    assert (m.get(A).step, m.get(A).heard) == (40, 3.0)
    feed(m, 5.0, B, alive(A, 1, step=40))  # the same announcement again is no news
    feed(m, 6.0, A, Suspect(A, 1, B))  # nor is a suspicion: it says nothing of the step
    assert (m.get(A).step, m.get(A).heard) == (40, 3.0)


@pytest.mark.parametrize("message", [Suspect(ME, MAX_COUNT, A), Dead(ME, MAX_COUNT, A),
                                     left(ME, MAX_COUNT), alive(ME, MAX_COUNT)], ids=short)
def test_a_claim_at_the_largest_incarnation_raises_nothing_but_wire_error(message):
    m = machine(2)
    try:
        feed(m, 1.0, A, message)
    except WireError:
        pass
    assert m.incarnation <= MAX_COUNT


# ---- probing -------------------------------------------------------------------------------


def test_an_ack_before_the_timeout_is_a_success():
    m = machine(4)
    t0, address, ping, _ = first_probe(m)
    assert t0 < CFG.probe_interval  # the first probe is spread over one interval
    assert address == ADDR[ping.target] and ping.target in (A, B, C, D)
    feed(m, t0 + 0.1, ping.target, Ack(ping.seq))
    assert not sent(m.tick(t0 + CFG.probe_timeout), PingReq)
    assert not sent(m.tick(t0 + CFG.probe_interval - EPS), Ping)
    _, second = probe_at(m, t0 + CFG.probe_interval)
    assert second.target != ping.target and second.seq != ping.seq
    assert state(m, ping.target) == (State.ALIVE, 0)
    assert (m.counters.probes, m.counters.probes_failed, m.awareness) == (2, 0, 0)


def test_no_ack_asks_alive_helpers_then_suspects_the_target():
    m = machine(5)
    t0, _, ping, _ = first_probe(m)
    target = ping.target
    suspect, *helpers = [p for p in (A, B, C, D, E) if p != target]
    feed(m, t0 + 0.1, helpers[0], Suspect(suspect, 0, helpers[0]))  # suspects cannot help
    assert not sent(m.tick(t0 + CFG.probe_timeout - EPS), PingReq)
    requests = sent(m.tick(t0 + CFG.probe_timeout), PingReq)
    assert sorted(a for a, _ in requests) == sorted(ADDR[h] for h in helpers)
    assert {x for _, x in requests} == {PingReq(ping.seq, target, ADDR[target])}
    m.tick(t0 + CFG.probe_interval - EPS)
    assert state(m, target) == (State.ALIVE, 0)
    effects = m.tick(t0 + CFG.probe_interval)
    assert state(m, target) == (State.SUSPECT, 0)
    assert Suspect(target, 0, ME) in [x for _, x in sent(effects, Suspect)]
    assert (m.counters.probes_failed, m.counters.suspicions) == (1, 1)


@pytest.mark.parametrize("nacks, awareness", [(0, 3), (1, 2), (2, 1), (3, 0)])
def test_missing_nacks_raise_the_awareness_score(nacks, awareness):
    m = machine(4)
    t0, _, ping, _ = first_probe(m)
    requests = sent(m.tick(t0 + CFG.probe_timeout), PingReq)
    assert len(requests) == CFG.indirect_checks
    helpers = [p for p in (A, B, C, D) if ADDR[p] in {a for a, _ in requests}]
    for h in helpers[:nacks]:
        feed(m, t0 + 0.7, h, Nack(ping.seq))
    m.tick(t0 + CFG.probe_interval)
    assert m.awareness == awareness


def test_a_failed_probe_with_nobody_to_ask_raises_the_score_by_one():
    m = machine(1)
    t0, *_ = first_probe(m)
    assert not sent(m.tick(t0 + CFG.probe_timeout), PingReq)
    m.tick(t0 + CFG.probe_interval)
    assert m.awareness == 1 and state(m, A) == (State.SUSPECT, 0)


def test_a_duplicated_nack_does_not_make_a_failed_probe_improve_health():
    m = machine(5)
    t0, _, first, _ = first_probe(m)
    m.tick(t0 + CFG.probe_timeout)
    t1 = t0 + CFG.probe_interval
    # The failure (score 3), the next probe, and the first verification of the new suspect.
    (_, ping), = [(a, p) for a, p in sent(m.tick(t1), Ping) if p.target != first.target]
    assert m.awareness == 3
    helpers = [a for a, _ in sent(m.tick(t1 + 4 * CFG.probe_timeout), PingReq)]
    assert len(helpers) == 3
    source = {ADDR[p]: p for p in PEERS}
    for address in helpers + helpers[:1]:  # every helper answers, and one Nack arrives twice
        feed(m, t1 + 2.5, source[address], Nack(ping.seq))
    m.tick(t1 + 4 * CFG.probe_interval)
    assert m.awareness == 3


def test_awareness_stretches_the_probe_schedule_and_a_success_lowers_it():
    m = machine(4)
    t0, _, first, _ = first_probe(m)
    suspect = first.target  # the failed probe makes it a suspect, which we verify apart
    m.tick(t0 + CFG.probe_timeout)
    t1 = t0 + CFG.probe_interval
    # The failure, the next probe and the suspect's first verification, in one tick.
    (_, ping), = [(a, p) for a, p in sent(m.tick(t1), Ping) if p.target != suspect]
    assert m.awareness == 3
    scale = m.awareness + 1
    assert not sent(m.tick(t1 + scale * CFG.probe_timeout - EPS), PingReq)
    feed(m, t1 + 1.9, ping.target, Ack(ping.seq))
    assert m.awareness == 2
    assert not sent(m.tick(t1 + scale * CFG.probe_timeout), PingReq)
    probes = [p for _, p in sent(m.tick(t1 + scale * CFG.probe_interval - EPS), Ping)
              if p.target != suspect]
    assert not probes
    t2 = t1 + scale * CFG.probe_interval
    _, ping = probe_at(m, t2)
    feed(m, t2 + 0.1, ping.target, Ack(ping.seq))
    assert m.awareness == 1
    probes = [p for _, p in sent(m.tick(t2 + 3 * CFG.probe_interval - EPS), Ping)
              if p.target != suspect]
    assert not probes
    probe_at(m, t2 + 3 * CFG.probe_interval)


def probe_round_robin(m, count, *, after=None):
    """Run ``count`` probes, each Acked at once: their targets. ``after(k)`` runs after the
    k-th. The next probe is due one interval after the last (the score stays 0)."""
    t, _, ping, _ = first_probe(m)
    targets = []
    for k in range(count):
        if k:
            t += CFG.probe_interval  # as the machine computes it, to the last bit
            _, ping = probe_at(m, t)
        targets.append(ping.target)
        feed(m, t + 0.1, ping.target, Ack(ping.seq))
        if after:
            after(t + 0.2, k)
    return targets


def test_round_robin_probes_each_member_once_per_round():
    targets = probe_round_robin(machine(6), 18)
    for r in range(3):
        assert sorted(targets[6 * r : 6 * r + 6]) == sorted(PEERS[1:7])


def test_a_newcomer_is_probed_in_the_round_it_joins():
    for seed in range(20):
        m = machine(6, seed=seed)
        join = lambda now, k: k == 2 and feed(m, now, G, alive(G))  # noqa: E731
        targets = probe_round_robin(m, 7, after=join)
        assert sorted(targets) == sorted(PEERS[1:8]), f"seed {seed}: {targets}"


def test_a_lone_suspector_reaches_dead_on_its_own_evidence_well_before_the_maximum():
    # Our own probe of X fails and nobody else ever reports on X (we miss their gossip).
    # Our unanswered verification pings are our own confirmation: X is dead within two
    # periods plus the one-confirmation timeout, not at the Lifeguard maximum.
    m = machine(8)
    x = PEERS[1]
    m._on_suspect(1.0, Suspect(x, 0, ME))
    m._drain()
    suspicion = m._suspicions[x]
    low, high, k = suspicion.minimum, suspicion.maximum, suspicion.expected
    assert suspicion.deadline == pytest.approx(1.0 + high)
    now = 1.0
    while m.get(x).state == State.SUSPECT:
        now = m.next_deadline()
        assert now < 1.0 + high, "waited out the maximum"
        for address, messages in datagrams(m.tick(now)):
            for message in messages:  # everyone answers but x
                if isinstance(message, Ping) and message.target != x:
                    m.receive(now, address, packet(message.target, Ack(message.seq)))
    one = high - (high - low) * math.log(2) / math.log(k + 1)
    assert m.get(x).state == State.DEAD
    assert now <= 1.0 + 2 * CFG.probe_interval + one + EPS


def test_buddy_system_a_ping_to_a_suspect_carries_the_suspicion():
    m = machine(1)
    feed(m, 0.0, B, Suspect(A, 0, B))
    _, address, ping, messages = first_probe(m)
    assert address == ADDR[A]
    # Right behind the Ping, so that the suspect hears it in time to refute: by us this time.
    assert messages[:2] == [ping, Suspect(A, 0, ME)]


def test_a_ping_is_answered_only_by_its_target():
    m = machine(2)
    assert sent(feed(m, 1.0, A, Ping(41, ME)), Ack) == [(ADDR[A], Ack(41))]
    assert not sent(feed(m, 1.0, A, Ping(42, B)), Ack)  # meant for someone else at our address


# ---- helping another member probe ----------------------------------------------------------

ELSEWHERE = "192.0.2.9:7000"  # where the requester says the target is, not in our table


def ask_for_help(m, now=5.0):
    """A asks us to probe B: the Ping we send (to the address A gave)."""
    (address, ping), = sent(feed(m, now, A, PingReq(77, B, ELSEWHERE)), Ping)
    assert address == ELSEWHERE and ping.target == B
    return ping


def test_a_helper_forwards_the_targets_ack_with_the_requesters_seq():
    m = machine(3)
    ping = ask_for_help(m)
    assert sent(feed(m, 5.1, B, Ack(ping.seq)), Ack) == [(ADDR[A], Ack(77))]
    assert not sent(m.tick(5.0 + CFG.probe_timeout), Nack)  # answered: no Nack follows
    assert not sent(feed(m, 5.2, B, Ack(ping.seq)), Ack)  # only forwarded once


def test_a_helper_nacks_when_the_target_stays_silent():
    m = machine(3)
    ask_for_help(m)
    wait = helper_wait(CFG)
    # Early enough that the Nack reaches the requester before its period ends.
    assert wait + CFG.probe_timeout < CFG.probe_interval
    assert not sent(m.tick(5.0 + wait - EPS), Nack)
    assert sent(m.tick(5.0 + wait), Nack) == [(ADDR[A], Nack(77))]
    assert not sent(m.tick(5.0 + 2 * CFG.probe_timeout), Nack)


def test_a_helper_uses_its_own_seq():
    m = machine(3)
    seqs = {ask_for_help(m).seq for _ in range(5)}  # five requests with the same seq 77
    assert len(seqs) == 5


def test_a_request_to_probe_ourselves_is_ignored():
    m = machine(2)
    assert not datagrams(feed(m, 5.0, A, PingReq(77, ME, ADDR[ME])))


# ---- gossip --------------------------------------------------------------------------------


def test_gossip_goes_to_gossip_nodes_members_every_gossip_interval():
    config = replace(CFG, retransmit_mult=50)  # enough to keep updates queued throughout
    m = machine(6, config=config)
    t = 0.0
    for _ in range(5):
        rounds = [d for d in datagrams(m.tick(t)) if is_gossip(d[1])]
        assert len({a for a, _ in rounds}) == len(rounds) == config.gossip_nodes
        assert {a for a, _ in rounds} <= {ADDR[p] for p in PEERS[1:7]}
        assert not [d for d in datagrams(m.tick(t + config.gossip_interval - EPS))
                    if is_gossip(d[1])]
        t += config.gossip_interval


def test_each_update_is_sent_retransmit_limit_times_in_all():
    m = machine(6)
    limit = m.retransmit_limit()
    counts: dict[bytes, int] = {}
    for k in range(400):  # 20 s, every probe answered
        now = 0.05 * k
        for _, messages in datagrams(m.tick(now)):
            for x in messages:
                if isinstance(x, UPDATES):
                    counts[encode(x)] = counts.get(encode(x), 0) + 1
                if isinstance(x, Ping):
                    feed(m, now, x.target, Ack(x.seq))
    assert m.pending_broadcasts == 0
    initial = {encode(alive(p)) for p in PEERS[:7]}  # ours and six members' announcements
    assert set(counts) == initial
    assert set(counts.values()) == {limit}


# ---- push-pull merge -----------------------------------------------------------------------


def record(peer, inc, st, address=None):
    """``peer``'s row at ``inc`` in state ``st``, with the proof a table carries."""
    a = alive(peer, inc, address=address or ADDR[peer])
    proof = left(peer, inc) if st == State.LEFT else a
    return MemberState(peer, inc, int(st), a.address, 1, 0, False, key=proof.key,
                       signature=proof.signature)


@pytest.mark.parametrize(
    "setup, remote, result",
    [
        ([], record(D, 3, State.ALIVE), (State.ALIVE, 3)),
        ([Suspect(A, 0, B)], record(A, 1, State.ALIVE), (State.ALIVE, 1)),
        ([], record(A, 0, State.LEFT), (State.LEFT, 0)),
        ([], record(A, 0, State.SUSPECT), (State.SUSPECT, 0)),
        # The sender's view may be stale, and its word counts at most at what A signed.
        ([], record(A, 2, State.DEAD), (State.SUSPECT, 0)),
        ([Dead(A, 0, B)], record(A, 0, State.DEAD), (State.DEAD, 0)),
        ([left(A, 0)], record(A, 0, State.DEAD), (State.LEFT, 0)),
        ([], record(A, 0, State.ALIVE, "10.9.9.9:1"), (State.ALIVE, 0)),  # not newer
    ],
    ids=["alive-new", "alive-newer", "left", "suspect", "dead", "dead-stays",
         "left-stays", "alive-same"],
)
def test_merge(setup, remote, result):
    m = machine(3)
    if setup:
        feed(m, 0.5, B, *setup)
    m.merge(1.0, [remote], C)
    assert state(m, remote.peer) == result
    if result == (State.SUSPECT, remote.incarnation) and not setup:
        # Suspected in the name of the peer that sent the table.
        assert Suspect(remote.peer, remote.incarnation, C) in [x for _, x in
                                                               sent(m.tick(1.0), Suspect)]
    assert m.get(remote.peer).address == ADDR[remote.peer]  # "10.9.9.9:1" was not newer


def test_merge_ignores_news_of_the_death_of_a_stranger():
    # A member we never knew, or already forgot, stays forgotten: bringing it back on news of
    # its death would pass it around between nodes that reap it at different times.
    m = machine(2)
    effects = m.merge(1.0, [record(F, 4, State.DEAD, "198.51.100.7:9"),
                            record(G, 1, State.SUSPECT)], A)
    assert m.get(F) is None and m.get(G) is None and effects == []


def test_merge_of_ourselves_as_dead_makes_us_refute():
    m = machine(2)
    m.merge(1.0, [record(ME, 0, State.DEAD)], A)
    assert m.incarnation == 1
    assert announced(m, 1) in [x for _, x in sent(m.tick(1.0), Alive)]


def test_full_state_round_trips_through_merge():
    m = machine(3)
    feed(m, 0.5, A, Suspect(B, 0, A), left(C, 0))
    other = Membership(KEYS[F], ADDR[F], 0.0, CFG, random.Random(1))
    other.merge(1.0, m.full_state(), ME)
    # Only what is news of the living crosses: C's departure and B's suspicion are about
    # members the other node never knew.
    assert {(x.peer, x.state) for x in other.members()} == {(ME, State.ALIVE), (A, State.ALIVE)}


def test_our_record_in_a_push_pull_is_what_we_announced():
    m = machine(2)
    m.set_meta(1.0, step=7)  # within meta_interval: not announced yet
    me = m.full_state()[0]
    assert (me.incarnation, me.step) == (0, 0)
    # Handed back to us by a peer's table, it is our own news: no refutation.
    m.merge(2.0, [me], A)
    assert m.incarnation == 0 and m.counters.refutations == 0


# ---- leaving, evidence, metadata -----------------------------------------------------------


def test_leave_announces_at_once_stops_probing_and_abandons_the_probe():
    m = machine(3)
    t0, _, ping, _ = first_probe(m)
    effects = m.leave(t0 + 0.1)
    assert m.leaving
    lefts = sent(effects, Left)
    assert lefts and {x for _, x in lefts} == {left(ME, 0)}
    later = [e for k in range(1, 100) for e in m.tick(t0 + 0.1 * k)]
    assert not sent(later, Ping) and not sent(later, PingReq)
    assert state(m, ping.target) == (State.ALIVE, 0)  # the abandoned probe accuses nobody
    assert left(ME, 0) in [x for _, x in sent(later, Left)]  # still gossiped


def test_metadata_changes_after_leaving_do_not_undo_the_departure():
    m = machine(2)
    m.leave(1.0)
    effects = m.set_meta(1.1, ready=True) + m.tick(1.0 + CFG.gossip_interval)
    assert not [x for _, x in sent(effects, Alive) if x.peer == ME]
    assert left(ME, 0) in [x for _, x in sent(effects, Left)]


def test_report_failure_probes_that_peer_at_once_when_idle():
    m = machine(5)
    t0, _, ping, _ = first_probe(m)
    feed(m, t0 + 0.1, ping.target, Ack(ping.seq))
    suspect = next(p for p in (A, B, C, D, E) if p != ping.target)
    assert m.report_failure(t0 + 0.2, suspect) == []
    assert state(m, suspect) == (State.ALIVE, 0)  # evidence is not a verdict
    assert m.next_deadline() <= t0 + 0.2
    address, urgent = probe_at(m, t0 + 0.2)
    assert (address, urgent.target) == (ADDR[suspect], suspect)
    feed(m, t0 + 0.3, suspect, Ack(urgent.seq))
    assert state(m, suspect) == (State.ALIVE, 0)


def test_report_failure_during_a_probe_waits_for_the_next_slot():
    m = machine(5)
    t0, _, ping, _ = first_probe(m)
    suspect = next(p for p in (A, B, C, D, E) if p != ping.target)
    m.report_failure(t0 + 0.1, suspect)
    feed(m, t0 + 0.2, ping.target, Ack(ping.seq))
    assert not sent(m.tick(t0 + 0.3), Ping)
    assert probe_at(m, t0 + CFG.probe_interval)[1].target == suspect


def test_report_failure_about_the_current_target_or_a_stranger_changes_nothing():
    m = machine(3)
    t0, _, ping, _ = first_probe(m)
    deadline = m.next_deadline()
    assert m.report_failure(t0 + 0.1, ping.target) == []
    assert m.report_failure(t0 + 0.1, F) == []
    assert m.next_deadline() == deadline


def test_a_ready_change_bumps_the_incarnation_and_is_announced_at_once():
    m = machine(2)
    m.set_meta(1.0, ready=True)
    assert m.incarnation == 1 and m.myself().ready
    assert announced(m, 1) in [x for _, x in sent(m.tick(1.0), Alive)]
    m.set_meta(1.5, ready=True)  # no change
    assert m.incarnation == 1


def test_a_shard_change_is_announced_at_once_and_crosses_push_pulls():
    m = machine(2)
    m.set_meta(1.0, shard=2, shards=4)
    assert m.incarnation == 1 and (m.myself().shard, m.myself().shards) == (2, 4)
    alive_sent = announced(m, 1)
    assert (alive_sent.shard, alive_sent.shards) == (2, 4)
    assert alive_sent in [x for _, x in sent(m.tick(1.0), Alive)]
    m.set_meta(1.5, shards=4)  # no change
    assert m.incarnation == 1
    other = Membership(KEYS[F], ADDR[F], 0.0, CFG, random.Random(1))
    feed(other, 1.0, ME, alive_sent)
    assert (other.get(ME).shard, other.get(ME).shards) == (2, 4)
    fresh = Membership(KEYS[F], ADDR[F], 0.0, CFG, random.Random(1))
    fresh.merge(2.0, m.full_state(), ME)
    assert (fresh.get(ME).shard, fresh.get(ME).shards) == (2, 4)
    assert fresh.get(A).shards == 0  # announces none


@pytest.mark.parametrize("shard, shards", [(4, 4), (1, 0), (-1, 4), (0, MAX_SHARDS + 1)])
def test_a_shard_that_could_not_be_announced_is_refused(shard, shards):
    m = machine(2)
    with pytest.raises(ValueError, match="shard"):
        m.set_meta(1.0, shard=shard, shards=shards)
    assert m.incarnation == 0 and (m.myself().shard, m.myself().shards) == (0, 0)


def test_a_step_alone_is_announced_only_after_meta_interval():
    m = machine(2, now=10.0)
    m.set_meta(10.0 + CFG.meta_interval - 1, step=5)
    assert m.incarnation == 0 and m.myself().step == 5
    m.set_meta(10.0 + CFG.meta_interval, step=6)
    assert m.incarnation == 1
    assert announced(m, 1).step == 6
    assert announced(m, 1) in [x for _, x in sent(m.tick(10.0 + CFG.meta_interval), Alive)]
    m.set_meta(10.0 + CFG.meta_interval + 1, step=7)  # the interval starts again
    assert m.incarnation == 1


def test_an_unchanged_step_is_not_announced_again():
    # Every averaging round reports the step; a node that does not train (or has not moved
    # since its last announcement) must not make the whole swarm gossip the same record.
    m = machine(2, now=10.0)
    m.set_meta(10.0 + CFG.meta_interval, step=6)
    assert m.incarnation == 1
    for k in range(2, 5):
        m.set_meta(10.0 + k * CFG.meta_interval, step=6)
    assert m.incarnation == 1
    m.set_meta(10.0 + 5 * CFG.meta_interval, step=8)
    assert m.incarnation == 2 and announced(m, 2).step == 8


# ---- housekeeping timers -------------------------------------------------------------------


@pytest.mark.parametrize("down", [Dead(A, 0, B), left(A, 0)], ids=short)
def test_dead_and_departed_members_are_reaped_after_reap_after(down):
    m = machine(3)
    feed(m, 5.0, B, down)
    m.tick(5.0 + CFG.reap_after - 1)  # the reconnect timer reaps; it is due
    assert m.get(A) is not None
    m.tick(5.0 + CFG.reap_after - 1 + CFG.reconnect_interval)
    assert m.get(A) is None
    assert state(m, B) is not None


def run_answering(m, end, step=0.5):
    """Tick every ``step`` until ``end``, answering each Ping: [(time, PushPullWith)]."""
    out = []
    for k in range(int(end / step) + 1):
        now = k * step
        effects = m.tick(now)
        for _, x in sent(effects, Ping):
            feed(m, now, x.target, Ack(x.seq))
        out += [(now, e) for e in effects if isinstance(e, PushPullWith)]
    return out


def test_push_pull_and_reconnect_timers():
    m = machine(4)
    feed(m, 0.0, A, Dead(C, 0, A), left(D, 0))
    events = run_answering(m, 200.0)
    assert all(e.address == ADDR[e.peer] for _, e in events)
    push = [t for t, e in events if e.peer in (A, B)]
    reconnect = [t for t, e in events if e.peer == C]
    assert len(push) + len(reconnect) == len(events)  # never LEFT D, never ourselves
    assert push[0] <= CFG.push_pull_interval and reconnect[0] <= CFG.reconnect_interval
    assert {b - a for a, b in zip(push, push[1:])} == {CFG.push_pull_interval}
    assert {b - a for a, b in zip(reconnect, reconnect[1:])} == {CFG.reconnect_interval}


def test_push_pull_slows_down_above_32_members():
    m = machine(40)
    push = [t for t, _ in run_answering(m, 400.0)]
    n = m.alive_count()
    interval = CFG.push_pull_interval * (math.ceil(math.log2(n / 32)) + 1)
    assert interval == 2 * CFG.push_pull_interval
    assert {b - a for a, b in zip(push, push[1:])} == {interval}


def test_a_leaving_node_neither_pushes_nor_reconnects():
    m = machine(3)
    feed(m, 0.0, A, Dead(C, 0, A))
    m.leave(0.0)
    assert run_answering(m, 100.0) == []


# ---- datagram sizes and malformed input ----------------------------------------------------


def test_every_datagram_fits_even_with_hundreds_of_updates_queued():
    m = machine(5)
    for i, p in enumerate(PEERS[10:310]):
        address = f"host-{'x' * 200}-{i}:7000"
        m.receive(0.0, address, packet(p, alive(p, 0, address=address)))
    assert m.pending_broadcasts > 300
    sizes, parts = [], []
    for k in range(60):  # nobody answers: pings, helper requests, suspicions, gossip
        for e in m.tick(0.05 * k):
            if isinstance(e, Send):
                sizes.append(len(e.data))
                parts.append(len(decode(e.data).parts))
    assert sizes and max(sizes) <= MAX_PACKET and max(parts) <= MAX_PARTS
    assert max(sizes) > MAX_PACKET - 300  # the cap is what limited them


GOOD = alive(F, 5)
BAD_PACKETS = {
    "empty": b"",
    "garbage": b"\xff\x00\x13",
    "not-a-packet": encode(GOOD),
    "bad-sender": cbor2.dumps([5, "NOT A PEER", [encode(GOOD)]], canonical=True),
    "bad-part": encode(Packet(A, (encode(GOOD), b"\x00\x01"))),
    "bad-field": encode(Packet(A, (encode(Suspect(ME, 0, A)),
                                   cbor2.dumps([11, F, -1, A], canonical=True)))),
    "wrong-arity": encode(Packet(A, (encode(Dead(B, 0, A)), cbor2.dumps([8], canonical=True)))),
    "trailing": packet(A, GOOD) + b"\x00",
}


@pytest.mark.parametrize("data", BAD_PACKETS.values(), ids=BAD_PACKETS.keys())
def test_malformed_datagrams_raise_wire_error_and_apply_nothing(data):
    m = machine(3)
    before = (m.members(), m.myself(), m.pending_broadcasts, m.awareness, m.next_deadline())
    with pytest.raises(WireError):
        m.receive(1.0, ADDR[A], data)
    assert (m.members(), m.myself(), m.pending_broadcasts, m.awareness,
            m.next_deadline()) == before


def receive_anything(data):
    m = machine(3)
    try:
        effects = m.receive(1.0, ADDR[A], data)
    except WireError:
        return
    datagrams(effects)  # whatever we send in answer is well formed and fits


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_wire_error(data):
    receive_anything(data)


VALID = [
    packet(A, Ping(9, ME), alive(F, 2)),
    packet(A, PingReq(9, B, ADDR[B]), Suspect(B, 0, A)),
    packet(B, Ack(3), Nack(4), Dead(C, 0, B), left(A, 1)),
    packet(A, Suspect(ME, 0, A), Dead(ME, 0, A), alive(ME, 0, step=3)),
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=3),
    st.integers(0, 3),
)
def test_mutated_packets_raise_only_wire_error(data, flips, cut):
    receive_anything(mutate(data, flips, cut))


def test_a_datagram_that_came_back_to_us_is_ignored():
    m = machine(2)
    assert m.receive(1.0, ADDR[A], packet(ME, Suspect(ME, 0, ME), Ping(1, ME))) == []
    assert m.incarnation == 0


def test_a_leaving_node_lists_itself_as_left_in_push_pulls():
    m = machine(2)
    assert m.full_state()[0].state == State.ALIVE
    m.leave(1.0)
    me = m.full_state()[0]
    assert me.peer == ME and me.state == State.LEFT and me.incarnation == m.incarnation


def test_after_a_tick_nothing_is_due_at_that_instant():
    # A driver may sleep until next_deadline() right after tick(now): it must be later.
    m = machine(5)
    t = 0.0
    for _ in range(200):
        t = m.next_deadline()
        m.tick(t)
        assert m.next_deadline() > t


def test_at_the_largest_incarnation_metadata_changes_raise_nothing():
    m = machine(2)
    # An earlier run of ours at MAX_COUNT - 1: refuted at MAX_COUNT, the last one there is.
    feed(m, 1.0, A, alive(ME, MAX_COUNT - 1))
    assert m.incarnation == MAX_COUNT
    m.set_meta(2.0, ready=True, step=5)  # cannot be announced: ignored, nothing raised
    assert m.incarnation == MAX_COUNT and m.full_state()[0].incarnation == MAX_COUNT


def test_claims_to_be_us_from_elsewhere_suggest_a_clash_only_when_they_persist():
    m = machine(2)
    other = ADDR[PEERS[1]]
    # A restarted node hears its old self once (and refutes it): no clash.
    feed(m, 1.0, PEERS[1], alive(ME, 5, address=other))
    assert m.incarnation == 6 and m.take_clash() is None
    # A stale copy at a lower incarnation changes nothing.
    feed(m, 2.0, PEERS[1], alive(ME, 3, address=other))
    assert m.take_clash() is None
    # Two processes out-bid each other: the third claim at or above us suggests a clash,
    # handed out once, and counting starts again.
    feed(m, 3.0, PEERS[1], alive(ME, m.incarnation, address=other))
    feed(m, 4.0, PEERS[1], alive(ME, m.incarnation, address=other))
    assert m.take_clash() == other
    assert m.take_clash() is None
    # Our own announcement coming back is never a claim.
    feed(m, 5.0, PEERS[1], alive(ME, m.incarnation, address=ADDR[ME]))
    assert m.take_clash() is None
