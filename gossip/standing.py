"""How much a peer's state may move this node: its standing, and the newcomers' budget. Pure.

Theory of operation
-------------------
Anyone who holds the swarm key can mint identities, so a node cannot take "a peer I have not
barred" to mean "a peer I can trust": a key holder with a fresh identity for every offer is
never barred. What an identity cannot fake is *time* and *our own choice*. An exchange has one
of three standings:

* ``CHOSEN``: we made the offer, to a peer we picked at random among the alive, ready members
  (:func:`pick`). An attacker's share of these is its share of the member table's hosts,
  whatever its offer rate. Its state is applied within the clip bound, and its distance (clipped) feeds
  the history the bound comes from (:class:`~gossip.mixing.DeltaHistory`), which is why the
  bound cannot be driven by offers.
* ``MEMBER``: it offered, and it has a record with us: it proved its identity to us (a
  channel with us completed its handshake, :class:`Proofs`) and has been an alive member of
  our table for at least ``trust_after`` seconds since, without interruption, or we once
  picked it for a round of ours and committed (:class:`Records`; a swarm that starts together
  has most of these within a few rounds, long before ``trust_after``). Applied within the
  offers' clip bound (one median step: :data:`~gossip.mixing.OFFER_CLIP`); its distance does
  not enter the history. A record heard in gossip alone is never
  one: anyone with the key can announce fifty identities in one push-pull, and counted from
  the announcement they all stood after ``trust_after``; counted from a channel, each costs a
  handshake with every node it would move, and then the members' budget below.
* ``NEWCOMER``: it offered, and it has no record: it is not in our table, or proved itself
  or joined less than ``trust_after`` ago, and we never picked it. The exchange runs and commits as any other (the checks, the strikes and the peer's
  benefit are unchanged: it learns from us), but *we apply nothing*: its state moves us by
  zero. Fresh identities therefore buy no influence at all. An honest newcomer still counts:
  the members that pick it for their own rounds apply its state as ``CHOSEN``, and after
  ``trust_after`` its own offers count too.

A standing says *whether* a state may move us; a peer's **seniority** says by how much of the
mixing weight (:func:`seniority`). A peer that joined the swarm after us, less than
``trust_after`` ago, moves us by that fraction of the weight that its time in our member table
is of ``trust_after`` (of our own age, if we are younger than that): a peer we pick a second
after it joined moves us by a tenth of the usual step, one that has been there ten seconds by
all of it. Peers that started with us (in our table within half of ``trust_after`` of our own
start: daemons launched together, whose imports take a few seconds more or less) count in
full from the start. Why: a joiner downloads
the swarm's state and then trains on its own data alone until its first exchanges, and data
the swarm has not seen moves it far in those steps (measured on the daemon's digits task: 12
times the usual distance between two members after 60 steps). Taken at half weight, such a
state pulled a member 20 points of held-out accuracy below where it stood before the join;
taken at a weight that grows while the joiner's own rounds pull it back to the swarm, it
moves nobody below it (tests/sim/test_join.py). Identities are free, so the same ramp also
costs a fresh identity the influence an old one has.

A newcomer still takes our one exchange slot for the length of an exchange, and identities
cost nothing, so newcomers' offers are also rate-limited *by source host*, across identities
(:class:`NewcomerBudget`): one token per round this node starts, at most
:data:`NEWCOMER_BURST` saved, so the newcomers behind one address get at most as many
exchanges with us as one honest node that picked us every round. Members' offers have a
budget of their own by source host, for the same reason in the other currency: a member's
state *does* move us (within the clip bound), so the members behind one address could add
up, offer after offer, to far more than that address's share of the swarm. Each host earns
:data:`MEMBER_SHARE` over the number of other hosts that take offers (reachable, and proved
to us) per round of ours (an honest host, which picks one of those, or us, at each of its
rounds, earns about twice what it spends), at most :data:`MEMBER_BURST` saved. So whatever identities a key holder proves, the offers from its
addresses move us at most about twice as often as its addresses' share of the table, on
top of that share of our own rounds. Over the budget, an offer is answered busy ("later"),
not refused. (``trust_after = 0``, a swarm whose key holders are all trusted, lifts this
budget with the rest of the newcomers' rule.)

Hosts, not identities, are also what counts where the member table decides (:func:`pick`,
:func:`step_ceiling`): a peer for our rounds is a host chosen uniformly, then one of its
members, and the step ceiling is a median over hosts. Identities cost nothing and addresses
do, so a key holder who fills the table with identities on one address weighs as one host.
Addresses and steps in the table are claims, not proofs: a claimed address that is not the
claimant's leads to rounds that fail to connect, not to poison, and what counts members
(the step ceiling, the members' budget, a joiner's shard and download ceiling) counts only
those that proved themselves to us, by the host they proved it from (:class:`Proofs`), so
invented members count for nothing there. PROTOCOL.md section 12 says what that leaves a liar.
"""

from __future__ import annotations

import enum
import functools
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from .address import parse_address
from .member import Member
from .messages import MAX_COUNT as MAX_STEP

__all__ = ["FOUNDING", "Standing", "standing", "seniority", "Records", "pick", "step_ceiling",
           "PeerSteps", "by_host", "host_of", "step_move", "MOVE_SLACK", "LEAD_RATE",
           "NewcomerBudget", "NEWCOMER_BURST", "MEMBER_SHARE", "MEMBER_BURST", "MAX_HOSTS",
           "MAX_RECORDS", "PROOFS_PER_HOST", "Proofs"]

NEWCOMER_BURST = 2  # newcomer exchanges one host may have saved up
MEMBER_SHARE = 2.0  # x 1/hosts: the member exchanges one host earns per round of ours
MEMBER_BURST = 2  # member exchanges one host may have saved up
FOUNDING = 0.5  # x trust_after: a peer we saw this soon after our start started with us
MAX_HOSTS = 4096  # hosts whose budget is remembered; the one seen longest ago goes first
MAX_RECORDS = 4096  # peers whose record is remembered; the one recorded longest ago goes first
PROOFS_PER_HOST = 16  # proofs remembered per host; that host's quietest goes first


class Standing(enum.Enum):
    """How far a received state may move us (see the module docstring)."""

    CHOSEN = "chosen"
    MEMBER = "member"
    NEWCOMER = "newcomer"


def standing(initiated: bool, alive_since: float | None, now: float, trust_after: float, *,
             chosen_before: bool = False) -> Standing:
    """The standing of one exchange.

    Args:
        initiated: we made the offer (to a member we picked).
        alive_since: since when the peer has been alive in our member table without a
            break *and* proved to us it holds its identity (the later of the two), or None
            if it is not alive there or never proved itself (:class:`Proofs`).
        now: the current time.
        trust_after: seconds a member must have been alive for its offers to count.
        chosen_before: we once picked the peer for a round and committed with it.
    """
    if initiated:
        return Standing.CHOSEN
    if chosen_before or alive_since is not None and now - alive_since >= trust_after:
        return Standing.MEMBER
    return Standing.NEWCOMER


def seniority(alive_for: float | None, own_age: float, trust_after: float) -> float:
    """The fraction of the mixing weight a peer's state gets, in [0, 1]: its time in our
    member table over ``trust_after``, or over our own age if we are younger. 1 for a peer
    that was in our table within :data:`FOUNDING` x ``trust_after`` of our own start (it
    started with us: a swarm that starts together mixes in full from the first exchange),
    when ``trust_after`` is 0, or when the peer is not alive in our table (``alive_for``
    None: a member we once picked, say, whose standing already decided).

    Args:
        alive_for: seconds the peer has been alive in our member table without a break.
        own_age: seconds since this node started.
        trust_after: the ``averaging.trust_after`` setting.
    """
    if alive_for is None or trust_after <= 0 or own_age - alive_for <= FOUNDING * trust_after:
        return 1.0
    horizon = min(trust_after, own_age)
    if horizon <= 0:
        return 1.0
    return min(1.0, max(alive_for, 0.0) / horizon)


class Records:
    """The peers we picked for a round of ours and committed with, the newest
    :data:`MAX_RECORDS` of them: a record no identity can give itself."""

    def __init__(self, max_peers: int = MAX_RECORDS) -> None:
        self._max = max_peers
        self._peers: OrderedDict[str, None] = OrderedDict()

    def add(self, peer: str) -> None:
        self._peers.pop(peer, None)
        self._peers[peer] = None
        if len(self._peers) > self._max:
            self._peers.popitem(last=False)

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers


class Proofs:
    """When each peer first proved to us that it holds its identity key: a channel between
    us completed its handshake, whichever side dialled. Gossip says who exists; only this
    says who can speak for an identity, so standing (:func:`standing`), the step's estimate
    and the data shards count from here. Bounded to the :data:`MAX_RECORDS` peers proved
    most recently (a peer's every channel renews its place, not its time), and to
    :data:`PROOFS_PER_HOST` per host: a flood of fresh identities from one address pushes
    out that address's own quietest records, never another host's."""

    def __init__(self, max_peers: int = MAX_RECORDS, per_host: int = PROOFS_PER_HOST) -> None:
        self._max, self._per_host = max_peers, per_host
        self._first: OrderedDict[str, tuple[float, str]] = OrderedDict()  # time, host
        self._hosts: dict[str, OrderedDict[str, None]] = {}  # host: its peers, quietest first

    def proved(self, peer: str, now: float, host: str) -> None:
        """A channel with ``peer``, whose other end was at ``host`` (empty if unknown: then
        the host it proved itself from before, if any), completed its handshake at ``now``."""
        first, before = self._first.pop(peer, (now, None))
        host = host or before or ""
        if before is not None:
            self._drop_from(before, peer)
        self._first[peer] = (first, host)
        peers = self._hosts.setdefault(host, OrderedDict())
        peers[peer] = None
        if len(peers) > self._per_host:
            self._forget(next(iter(peers)))
        if len(self._first) > self._max:
            self._forget(next(iter(self._first)))

    def _forget(self, peer: str) -> None:
        _, host = self._first.pop(peer)
        self._drop_from(host, peer)

    def _drop_from(self, host: str, peer: str) -> None:
        peers = self._hosts.get(host)
        if peers is not None:
            peers.pop(peer, None)
            if not peers:
                del self._hosts[host]

    def since(self, peer: str) -> float | None:
        """When ``peer`` first proved itself, or None if it never did (or was forgotten)."""
        proof = self._first.get(peer)
        return None if proof is None else proof[0]

    def host(self, peer: str) -> str | None:
        """The host ``peer``'s latest proof came from (its channel's other end: not a claim,
        unlike the address in its record), or None if it never proved itself."""
        proof = self._first.get(peer)
        return None if proof is None else proof[1]

    def __contains__(self, peer: object) -> bool:
        return peer in self._first


def by_host(members: Iterable[Member],
            host: Callable[[Member], str] | None = None) -> list[list[Member]]:
    """``members`` grouped by host, hosts in first-seen order: the host part of their
    address, or what ``host`` says (the host a member proved itself from, say)."""
    groups: dict[str, list[Member]] = {}
    for member in members:
        groups.setdefault(host_of(member) if host is None else host(member), []).append(member)
    return list(groups.values())


def host_of(member: Member) -> str:
    """The host part of a member's address: what counts once, however many identities it
    holds."""
    return _host(member.address)


@functools.lru_cache(maxsize=MAX_HOSTS)
def _host(address: str) -> str:
    # Every round and every commit groups the whole member table: parse each address once.
    return parse_address(address)[0]


def pick(members: Sequence[Member], rng: random.Random) -> Member | None:
    """A member for a round: a host uniformly among the hosts of ``members``, then one of
    its members uniformly; None if there are none. With one member per host (the usual
    swarm) this is a uniform choice among members."""
    hosts = by_host(members)
    return rng.choice(rng.choice(hosts)) if hosts else None


def step_ceiling(members: Iterable[Member], host: Callable[[Member], str] | None = None) -> int:
    """The highest step one exchange or one download may give this node: the lower median,
    over the hosts of ``members`` (the other alive, ready members that proved themselves to
    us; ``host`` as for :func:`by_host`), of each host's lower median announced step; 0 if
    there are none (then the step does not move).

    A max would let one liar move everyone's learning-rate schedule to its end; the lower
    median cannot pass an honest host's step while at least half of the hosts are honest.
    No slack is added for honest progress: a slack compounds (nodes raised by it announce
    it, which raises the median by it again), and the median alone lets a node that lags
    catch up with the majority, which is what lining schedules up needs.
    """
    return _lower_median([_lower_median([m.step for m in group])
                          for group in by_host(members, host)])


MOVE_SLACK = 100_000  # a move up is at most our step plus this (step_move)
# Moves up add to a step at most MOVE_SLACK in all, earned back at this many steps per
# optimizer step of the node's own (gossip.replica): whoever holds the median, a step runs at
# most 1 + LEAD_RATE times the node's own pace past that, and a node four times slower than
# the swarm's median keeps up with it.
LEAD_RATE = 3


class PeerSteps:
    """Where the swarm's step is, from the peers we picked for our own rounds: the latest
    step we committed with each peer, aged by the optimizer steps we have taken since, the
    lower median over each host's peers, and the lower median of those over the last
    ``window`` hosts.

    Only exchanges we initiated count, to a peer we picked at random (a channel proved it
    holds its identity), and each *host* counts once, however often it commits and however
    many identities it holds. Counting rounds let a member that is always free (it starts no
    rounds of its own and takes every offer) fill the window while honest peers were busy:
    one such host of five held 17 of 32 rounds and moved every node's step to 2^53 − 1. Over
    hosts, the median stays among the honest values while under half of the hosts lie,
    whatever they do with their time. Several honest nodes on one host (a machine with
    several GPUs, or a test on one address) count as that host's lower median. Aged by our
    own optimizer steps, not by our step, which exchanges move: an estimate that moved with our
    step would let a peer that offers again and again ratchet it (and us) upwards. Fresher
    than the members' announcements (:func:`step_ceiling`), which may be ``meta_interval``
    old.
    """

    def __init__(self, window: int = 32, least: int = 4, per_host: int = 8) -> None:
        # host: {peer: (its step, our local steps then)}, both the most recent last
        self._seen: OrderedDict[str, OrderedDict[str, tuple[int, int]]] = OrderedDict()
        self._window = window
        self._least = least
        self._per_host = per_host

    def add(self, host: str, peer: str, step: int, local: int) -> None:
        """A committed round of ours with ``peer`` at ``host``: its step, and our optimizer
        steps then."""
        peers = self._seen.pop(host, None) or OrderedDict()
        peers.pop(peer, None)
        peers[peer] = (step, local)
        if len(peers) > self._per_host:
            peers.popitem(last=False)
        self._seen[host] = peers
        if len(self._seen) > self._window:
            self._seen.popitem(last=False)

    def swarm(self, local: int, hosts: int | None = None,
              members: int | None = None) -> int | None:
        """The swarm's step now, given our optimizer steps now; None until ``least`` hosts
        and ``least`` peers are known, or all of them when the member table holds fewer
        (``hosts`` and ``members``, other than us)."""
        def known(total: int | None) -> int:
            return self._least if total is None else max(1, min(self._least, total))

        if (len(self._seen) < known(hosts)
                or sum(len(peers) for peers in self._seen.values()) < known(members)):
            return None
        aged = [_lower_median([step + local - then for step, then in peers.values()])
                for peers in self._seen.values()]
        return min(max(_lower_median(aged), 0), MAX_STEP)


def step_move(own: int, peer: int, swarm: int | None) -> int:
    """How far one committed exchange moves our step: half way to the peer's, where the
    peer's counts only as far as it lies between our step and the swarm's (``swarm``, from
    :class:`PeerSteps` or :func:`step_ceiling`; None: no move). ``own`` is where our step
    is headed (less the debt still to pay: :attr:`~gossip.replica.Counters.heading`), so that
    repeated exchanges do not count one gap twice. Every honest pair therefore
    moves towards the other and towards the swarm's median, so nodes that train at different
    speeds agree on a step that advances at the pace of the swarm's median node; a liar
    moves nobody past the median, up or down. A negative move is a debt the replica pays
    from its next steps (the step never goes back). A move up is at most ``own`` plus
    :data:`MOVE_SLACK`: no single exchange more than doubles a step, whoever holds the median
    (a node far behind still catches up in a few exchanges, its gap halving or its step
    doubling at each)."""
    if swarm is None:
        return 0
    target = min(max(peer, min(own, swarm)), max(own, swarm))
    half = abs(target - own) // 2
    return min(half, max(own, 0) + MOVE_SLACK) if target >= own else -half


def _lower_median(values: list[int]) -> int:
    if not values:
        return 0
    return sorted(values)[(len(values) - 1) // 2]


class NewcomerBudget:
    """Token buckets keyed by source host, refilled by ``refill`` tokens per round of ours
    (one for newcomers; :data:`MEMBER_SHARE` over the hosts for members, set by the caller
    at each round).

    Counting in rounds rather than seconds ties the budget to this node's own pace, whatever
    it is (a node that starts no rounds of its own lends newcomers only their first
    :data:`NEWCOMER_BURST` exchanges, until they have been members for ``trust_after``).
    A host the table forgot starts again with a full bucket.
    """

    def __init__(self, burst: int = NEWCOMER_BURST, max_hosts: int = MAX_HOSTS) -> None:
        if burst < 1 or max_hosts < 1:
            raise ValueError("need burst >= 1 and max_hosts >= 1")
        self._burst = burst
        self._max_hosts = max_hosts
        self._earned = 0.0  # tokens every host has earned since we started
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, earned then

    def round(self, refill: float = 1.0) -> None:
        """This node started a round: every host earns ``refill`` tokens."""
        self._earned += max(refill, 0.0)

    def allow(self, host: str) -> bool:
        """Whether an offer from ``host`` may have an exchange now (spends a token if so)."""
        tokens, then = self._buckets.pop(host, (float(self._burst), self._earned))
        tokens = min(float(self._burst), tokens + self._earned - then)
        allowed = tokens >= 1.0 - 1e-9  # a sum of fractions may fall a rounding short of 1
        self._buckets[host] = (tokens - allowed, self._earned)
        if len(self._buckets) > self._max_hosts:
            self._buckets.popitem(last=False)
        return allowed
