"""Outbound-only members in the pure membership state machine: nobody dials or probes a
member that announced ``reachable = False``; it keeps its record alive with heartbeats, a
reachable node suspects it when they stop, and it hears the suspicion in the answer to its
own pings. The test plays every other member, as tests/unit/test_membership.py does."""

import random

from gossip.config import MembershipConfig
from gossip.member import State
from gossip.membership import Membership, PushPullWith
from gossip.probing import OVERDUE_HEARTBEATS
from gossip.messages import Ack, Alive, Dead, Ping, PingReq, Suspect
from gossip.suspicion import suspicion_bounds
from tests.unit.test_membership import ADDR, KEYS, ME, PEERS, alive, datagrams, feed, sent

CFG = MembershipConfig()
REACHABLE = PEERS[1:4]
OUTBOUND = PEERS[4:7]


def swarm_machine(*, reachable=True, seed=0) -> Membership:
    """Us, knowing three reachable and three outbound-only members, all alive."""
    m = Membership(KEYS[ME], ADDR[ME], 0.0, CFG, random.Random(seed), reachable=reachable)
    for p in REACHABLE:
        feed(m, 0.0, p, alive(p))
    for p in OUTBOUND:
        feed(m, 0.0, p, alive(p, reachable=False))
    return m


def run(m, until, *, answer=True, heartbeat=(), start=0.0):
    """Tick ``m`` at each deadline until ``until``. Reachable members Ack every Ping (when
    ``answer``); each peer in ``heartbeat`` announces itself every meta_interval. Returns
    every effect."""
    effects, t = [], start
    beats = {p: (start + CFG.meta_interval, 1) for p in heartbeat}
    while True:
        due = min([m.next_deadline(), *(at for at, _ in beats.values())])
        if due > until:
            return effects
        t = max(t, due)
        for p, (at, inc) in list(beats.items()):
            if at <= t:
                effects += feed(m, t, p, alive(p, inc, reachable=False))
                beats[p] = (at + CFG.meta_interval, inc + 1)
        out = m.tick(t)
        effects += out
        if answer:
            for address, ping in sent(out, Ping):
                target = next(p for p in PEERS if ADDR[p] == address)
                if target in REACHABLE and ping.target == target:
                    effects += feed(m, t + 0.01, target, Ack(ping.seq))


def test_an_outbound_only_member_is_never_probed_gossiped_to_or_dialed():
    m = swarm_machine()
    feed(m, 0.0, REACHABLE[0], alive(PEERS[9]))  # news to gossip
    effects = run(m, 2 * CFG.push_pull_interval, heartbeat=OUTBOUND)
    addresses = {a for a, _ in datagrams(effects)}
    assert addresses and not addresses & {ADDR[p] for p in OUTBOUND}
    dialed = {e.address for e in effects if isinstance(e, PushPullWith)}
    assert dialed and not dialed & {ADDR[p] for p in OUTBOUND}
    assert all(request.target not in OUTBOUND for _, request in sent(effects, PingReq))


def test_helpers_are_reachable_members_only():
    m = swarm_machine()
    effects = run(m, 30.0, answer=False, heartbeat=OUTBOUND)
    helpers = {a for a, _ in sent(effects, PingReq)}
    assert helpers and helpers <= {ADDR[p] for p in REACHABLE}


def test_heartbeats_keep_an_outbound_member_alive_and_silence_makes_it_dead():
    m = swarm_machine()
    beating, silent = OUTBOUND[0], OUTBOUND[1:]
    overdue = OVERDUE_HEARTBEATS * CFG.meta_interval
    run(m, overdue - 1.0, heartbeat=[beating])
    assert all(m.get(p).state == State.ALIVE for p in OUTBOUND)
    effects = run(m, overdue + CFG.probe_interval + 0.1, heartbeat=[beating], start=overdue - 1.0)
    assert m.get(beating).state == State.ALIVE
    assert all(m.get(p).state == State.SUSPECT for p in silent)
    assert {s.peer for _, s in sent(effects, Suspect)} == set(silent)  # gossiped
    _, high = suspicion_bounds(m.alive_count(), CFG.probe_interval, CFG.suspicion_mult,
                               CFG.suspicion_max_mult)
    end = overdue + CFG.probe_interval + high + 1.0
    run(m, end, heartbeat=[beating], start=overdue + CFG.probe_interval + 0.1)
    assert m.get(beating).state == State.ALIVE
    assert all(m.get(p).state == State.DEAD for p in silent)


def test_an_outbound_only_node_judges_no_outbound_member_by_silence():
    m = swarm_machine(reachable=False)
    run(m, 10 * CFG.meta_interval, heartbeat=[])
    assert all(m.get(p).state == State.ALIVE for p in OUTBOUND)
    assert all(m.get(p).state == State.ALIVE for p in REACHABLE)


def test_an_outbound_only_node_heartbeats_to_reachable_members():
    m = swarm_machine(reachable=False)
    effects = run(m, 4 * CFG.meta_interval + 0.5)
    assert m.incarnation >= 4
    mine = [(a, x) for a, x in sent(effects, Alive) if x.peer == ME]
    assert {x.incarnation for _, x in mine} >= {1, 2, 3, 4}
    assert all(not x.reachable for _, x in mine)
    assert {a for a, _ in mine} <= {ADDR[p] for p in REACHABLE}
    assert m.full_state()[0].reachable is False


def test_a_suspected_outbound_member_hears_it_in_our_ack_and_its_ping_restarts_the_timer():
    m = swarm_machine()
    target = OUTBOUND[0]
    feed(m, 1.0, REACHABLE[0], Suspect(target, 0, REACHABLE[0]))
    assert m.get(target).state == State.SUSPECT
    answer = datagrams(feed(m, 2.0, target, Ping(7, ME)))
    assert [type(x) for _, x in [(a, y) for a, msgs in answer for y in msgs]][:2] == [Ack, Suspect]
    assert answer[0][0] == ADDR[target]  # to where the ping came from
    # No verification ping ever goes to it (it cannot be reached), and while it keeps pinging
    # us the suspicion never runs out.
    _, high = suspicion_bounds(m.alive_count(), CFG.probe_interval, CFG.suspicion_mult,
                               CFG.suspicion_max_mult)
    t = 2.0
    while t < 2.0 + 3 * high:
        t += high / 3
        effects = feed(m, t, target, Ping(8, ME)) + run(m, t, start=t - high / 3)
        assert all(a != ADDR[target] or isinstance(msgs[0], Ack) for a, msgs in datagrams(effects))
    assert m.get(target).state == State.SUSPECT


def test_a_dead_outbound_member_hears_it_in_our_ack_and_its_refutation_revives_it():
    m = swarm_machine()
    target = OUTBOUND[0]
    feed(m, 1.0, REACHABLE[0], Dead(target, 0, REACHABLE[0]))
    answer = [x for _, msgs in datagrams(feed(m, 2.0, target, Ping(7, ME))) for x in msgs]
    assert isinstance(answer[1], Dead) and answer[1].peer == target
    feed(m, 2.5, target, alive(target, 1, reachable=False))
    assert m.get(target).state == State.ALIVE


def test_an_outbound_node_refutes_the_suspicion_an_ack_brings():
    m = swarm_machine(reachable=False)
    feed(m, 1.0, REACHABLE[0], Ack(1), Suspect(ME, 0, REACHABLE[0]))
    assert m.incarnation == 1


def test_becoming_reachable_is_announced_at_once():
    m = swarm_machine(reachable=False)
    effects = m.set_meta(1.0, reachable=True)
    effects += m.tick(max(1.0, m.next_deadline()))
    assert m.myself().reachable and m.incarnation == 1
    assert m.full_state()[0].reachable is True


def test_an_outbound_node_at_the_largest_incarnation_leaves_no_deadline_in_the_past():
    # An Alive of ours at 2**53 - 2 (an earlier run's, signed with our key) makes us refute
    # at MAX_COUNT, after which no heartbeat can be sent: its deadline must not stay due, or
    # the driver would spin. (Anyone else's word cannot take us there.)
    from gossip.messages import MAX_COUNT

    m = swarm_machine(reachable=False)
    feed(m, 1.0, REACHABLE[0], alive(ME, MAX_COUNT - 1, reachable=False))
    assert m.incarnation == MAX_COUNT
    t = 1.0
    for _ in range(50):
        t = max(t, m.next_deadline())
        m.tick(t)
        assert m.next_deadline() > t
