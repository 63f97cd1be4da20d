"""Failure detection time, steady-state cost and false positives of gossip.membership.

Method: a discrete-event simulation in virtual time. N ``Membership`` machines (the pure
SWIM + Lifeguard state machine that gossip.roster drives) run in one process, with no trio,
no sockets and no sleeps: a heap of timed events stands in for the clock and the network.

* Node i is at ``n{i}:7000``, has an identity key derived from the seed and its own seeded
  ``random.Random``, and runs the default (LAN) ``MembershipConfig``. One probe interval
  (1 s) is one *period*, the unit of every time below.
* A ``Send`` is one sealed datagram of ``len(data) + SEAL_OVERHEAD`` bytes, delivered after
  the one-way latency (2 ms +- 0.5 ms uniform jitter) unless loss drops it (independently
  per datagram) or its destination is crashed when it arrives.
* A ``PushPullWith`` is carried out one round trip later, if both ends are still up, as
  gossip.roster does it: the responder merges the initiator's table, the initiator merges
  the responder's, the responder merges the initiator's own record. Its bytes are counted
  apart, as the encoded ``MemberState`` records (channel framing and AEAD left out).
* Each node has one pending tick at ``max(now, next_deadline())``; a receive or a merge that
  moves the deadline earlier schedules an earlier tick, and the later one goes stale.

Start: every node merges everyone's record at t = 0. That merge queues an Alive about every
member on every node, news every node already has; gossiping it away would take most of the
CPU time at N = 256 and far more at 1024, so the bench drops it (``BroadcastQueue.clear``):
the swarm starts as it is once that gossip has drained. Then a warm-up of 10 periods.

Per N, on one swarm, one after the other:

* steady: no loss, no failure, ``--steady`` periods: datagrams and their bytes per node per
  period. A node push-pulls once every 30 to 180 periods, far longer than the window, and the
  window overlaps the first round (every node starts one within 30 s of joining, whatever
  N), so push-pull cost is the mean measured bytes per exchange times the documented rate
  (``MembershipConfig.push_pull_interval``). kB/s per node counts both.
* loss: ``--loss`` (5%) of datagrams dropped for ``--periods`` periods, then 20 periods
  without loss to settle; nobody crashed. false_dead counts every time any node marks a
  live member DEAD; suspicions (started by a node's own failed probe) are informational.
* detection: crash a random node at a random time (1 to 3 periods after the previous crash
  was detected), wait until every survivor has marked it DEAD (seen in ``Changed``
  effects), repeat. At most N/16 crashes per swarm, so it stays near N; more trials run on
  reseeded copies of the warmed-up swarm (pickled). A trial's figure is the periods from
  the crash to the last survivor's DEAD; p99 is the nearest-rank 99th percentile with at
  least 100 trials, otherwise the maximum (shown as ``max``).

Usage: python bench/membership.py [--quick] [--seed 1] [--periods 150]
Progress goes to stderr; the last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import copyreg
import hashlib
import heapq
import itertools
import json
import math
import pickle
import random
import statistics
import sys
import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import gossip.membership
from gossip.config import MembershipConfig
from gossip.identity import Identity
from gossip.membership import Changed, Membership, PushPullWith, Send, State
from gossip.seal import SEAL_OVERHEAD
from gossip.wire import MAX_DATAGRAM, encode

# The warmed-up swarm is copied by pickling it, signing keys and all. Here only: a key is
# never pickled by the library.
copyreg.pickle(type(Ed25519PrivateKey.generate()),
               lambda key: (Ed25519PrivateKey.from_private_bytes, (key.private_bytes_raw(),)))

TARGET_DETECT_P99 = 15.0  # periods, cluster-wide, for N <= 256
TARGET_KBYTES_S = 50.0  # kB/s per node at N = 256
TARGET_FLAT = 1.5  # "flat in N": largest msgs/node/period at most this times the smallest
DETECT_CAP = 200.0  # periods; a crash not detected by everyone by then is reported as a bug
WARM_UP = 10  # periods run before measuring
MAX_RETICKS = 100  # ticks of one node at one instant that make a spin
SETTLE = 20  # periods without loss after the loss run, before the detection trials
CRASH_GAP = (1.0, 3.0)  # periods between one crash seen DEAD by all and the next crash
QUICK_TRIALS = {16: 30, 64: 12, 256: 8}  # detection trials per N
FULL_TRIALS = {16: 100, 64: 100, 256: 100, 1024: 12}

_TICK, _DELIVER, _PUSH_PULL = 0, 1, 2


class Swarm:
    """N membership machines on a simulated datagram network, in virtual time."""

    def __init__(self, n: int, seed: int, config: MembershipConfig, latency: float,
                 jitter: float) -> None:
        self.n = n
        self.config = config
        self.latency, self.jitter, self.loss = latency, jitter, 0.0
        self.rng = random.Random(f"{seed}:network")
        self.addresses = [f"n{i}:7000" for i in range(n)]
        self.index = {a: i for i, a in enumerate(self.addresses)}
        identities = [Identity(Ed25519PrivateKey.from_private_bytes(
            hashlib.sha256(f"{seed}:{i}".encode()).digest())) for i in range(n)]
        self.peers = [identity.peer_id for identity in identities]
        self.nodes = [Membership(identities[i], self.addresses[i], 0.0, config,
                                 random.Random(f"{seed}:node:{i}")) for i in range(n)]
        self.up = [True] * n
        self.live = n
        self.now = 0.0
        self._events: list[tuple] = []
        self._seq = 0  # tie-break for events at the same time, in the order scheduled
        self._tick_at = [math.inf] * n
        self.largest = 0  # bytes of the largest datagram (sealed); over MAX_DATAGRAM is a bug
        self.reticks = 0  # ticks after which a timer was still due (next_deadline() <= now)
        self.spins = 0  # a node ticked MAX_RETICKS times at one instant: a bug
        self._reticks: dict[int, tuple] = {}  # node -> (time, ticks in a row at that time)
        self.reset()
        # Crashed peer -> [crash time, nodes that marked it DEAD, detection time or None].
        self.crashes: dict[str, list] = {}
        self._record_size: dict = {}
        # Everyone knows everyone: merge the whole table into every node.
        table = [node.full_state()[0] for node in self.nodes]
        for i, node in enumerate(self.nodes):
            node.merge(0.0, table, self.peers[(i + 1) % n])  # effects: only Changed (new)
            node._broadcasts.clear()  # the startup gossip: see the module docstring
            self._reschedule(i)

    def snapshot(self) -> bytes:
        """Everything (machines, events in flight, randomness), pickled."""
        return pickle.dumps(self.__dict__, pickle.HIGHEST_PROTOCOL)

    @classmethod
    def restore(cls, snapshot: bytes) -> "Swarm":
        swarm = cls.__new__(cls)
        swarm.__dict__.update(pickle.loads(snapshot))
        return swarm

    def reset(self) -> None:
        """Zero the counters (each scenario measures from its own start)."""
        self.datagrams = 0
        self.bytes = 0
        self.push_pulls = 0
        self.push_pull_bytes = 0
        self.false_dead = 0  # a live member marked DEAD by someone
        self.suspect_marks = 0  # a live member marked SUSPECT by someone (first-hand or not)

    # ---- the event loop ------------------------------------------------------------------

    def run_until(self, end: float, stop=None) -> None:
        """Process events up to virtual time ``end``, or until ``stop()`` after an event."""
        events, nodes, up = self._events, self.nodes, self.up
        while events and events[0][0] <= end:
            t, _, kind, a, b, c = heapq.heappop(events)
            self.now = t
            if kind == _TICK:
                if not up[a] or self._tick_at[a] != t:
                    continue  # stale: a newer tick is pending
                self._tick_at[a] = math.inf
                self._apply(a, nodes[a].tick(t))
                if self._tick_at[a] <= t:
                    self._tick_again(a, t)
            elif kind == _DELIVER:
                if up[a]:
                    self._apply(a, nodes[a].receive(t, b, c))
            else:
                self._push_pull(a, b)
            if stop is not None and stop():
                return
        self.now = max(self.now, end)

    def _tick_again(self, i: int, t: float) -> None:
        """A tick left a timer due, so the node is ticked again at once, as the roster's
        ticker would. A few times is legitimate (a timer set to ``now`` by a later step of
        the same tick); MAX_RETICKS in a row at one instant is a spin, reported as a bug and
        broken by moving the tick 1 ms on."""
        self.reticks += 1
        last, count = self._reticks.get(i, (None, 0))
        count = count + 1 if last == t else 1
        self._reticks[i] = (t, count)
        if count > MAX_RETICKS:
            self.spins += 1
            self._tick_at[i] = t + 1e-3
            self._seq += 1
            heapq.heappush(self._events, (t + 1e-3, self._seq, _TICK, i, None, None))

    def _reschedule(self, i: int) -> None:
        at = max(self.now, self.nodes[i].next_deadline())
        if at < self._tick_at[i]:
            self._tick_at[i] = at
            self._seq += 1
            heapq.heappush(self._events, (at, self._seq, _TICK, i, None, None))

    def _apply(self, i: int, effects: list) -> None:
        for effect in effects:
            kind = type(effect)
            if kind is Send:
                size = len(effect.data) + SEAL_OVERHEAD
                self.datagrams += 1
                self.bytes += size
                if size > self.largest:
                    self.largest = size
                if self.loss and self.rng.random() < self.loss:
                    continue
                dst = self.index.get(effect.address)
                if dst is not None:
                    delay = self.latency + self.jitter * (2 * self.rng.random() - 1)
                    self._seq += 1
                    heapq.heappush(self._events, (self.now + delay, self._seq, _DELIVER, dst,
                                                  self.addresses[i], effect.data))
            elif kind is PushPullWith:
                dst = self.index.get(effect.address)
                if dst is not None:
                    self._seq += 1
                    heapq.heappush(self._events, (self.now + 2 * self.latency, self._seq,
                                                  _PUSH_PULL, i, dst, None))
            elif kind is Changed:
                self._changed(i, effect.member)
        self._reschedule(i)

    def _push_pull(self, a: int, b: int) -> None:
        """Initiator ``a`` swaps tables with responder ``b``, as gossip.roster does."""
        if not (self.up[a] and self.up[b]):
            return  # the dial fails; nothing is merged
        na, nb, now = self.nodes[a], self.nodes[b], self.now
        offered = na.full_state()
        self._apply(b, nb.merge(now, offered, self.peers[a]))
        answer = nb.full_state()
        self._apply(a, na.merge(now, answer, self.peers[b]))
        last = na.full_state()[0]
        self._apply(b, nb.merge(now, [last], self.peers[a]))
        self.push_pulls += 1
        self.push_pull_bytes += self._table_bytes(offered) + self._table_bytes(answer) \
            + self._table_bytes([last])

    def _table_bytes(self, records: list) -> int:
        sizes, total = self._record_size, 0
        for r in records:
            size = sizes.get(r)
            if size is None:
                size = sizes[r] = len(encode(r))
            total += size
        return total

    def _changed(self, i: int, member) -> None:
        crash = self.crashes.get(member.peer)
        if crash is None:
            if member.state == State.DEAD:
                self.false_dead += 1
            elif member.state == State.SUSPECT:
                self.suspect_marks += 1
        elif member.state == State.DEAD and crash[2] is None:
            crash[1].add(i)
            if len(crash[1]) == self.live:
                crash[2] = self.now

    # ---- faults ------------------------------------------------------------------------

    def crash(self, i: int) -> list:
        """Stop node ``i`` for good: it sends, receives and ticks no more."""
        self.up[i] = False
        self.live -= 1
        record = [self.now, set(), None]
        self.crashes[self.peers[i]] = record
        return record

    def refutations(self) -> int:
        return sum(node.counters.refutations for node, up in zip(self.nodes, self.up) if up)

    def suspicions(self) -> int:
        """Suspicions the live nodes started themselves (failed probes), since they began."""
        return sum(node.counters.suspicions for node, up in zip(self.nodes, self.up) if up)


# ---- scenarios ---------------------------------------------------------------------------


def copy_of(snapshot: bytes, reseed: str) -> Swarm:
    """A copy of a pickled swarm with fresh randomness, so that it diverges from the original."""
    swarm = Swarm.restore(snapshot)
    swarm.rng.seed(f"{reseed}:network")
    for i, node in enumerate(swarm.nodes):
        node.rng.seed(f"{reseed}:node:{i}")
    return swarm


def push_pull_period(config: MembershipConfig, n: int) -> float:
    """Seconds between one node's push-pulls in a swarm of ``n``, as documented on
    ``MembershipConfig.push_pull_interval``."""
    if n <= 32:
        return config.push_pull_interval
    return config.push_pull_interval * (math.ceil(math.log2(n / 32)) + 1)


def steady(swarm: Swarm, periods: int) -> dict:
    """Cost with no loss and no failure (see the module docstring for push-pulls)."""
    swarm.reset()
    period = swarm.config.probe_interval
    swarm.run_until(swarm.now + periods * period)
    per = swarm.live * periods
    exchange = swarm.push_pull_bytes / swarm.push_pulls if swarm.push_pulls else math.nan
    pp = exchange * period / push_pull_period(swarm.config, swarm.live)
    datagram_bytes = swarm.bytes / per
    return {
        "msgs_per_node_period": swarm.datagrams / per,
        "bytes_per_node_period": datagram_bytes,
        "push_pull_bytes_per_exchange": exchange,
        "push_pull_bytes_per_node_period": pp,
        "kbytes_per_s_per_node": (datagram_bytes + pp) / period / 1e3,
        "false_dead_no_loss": swarm.false_dead,
    }


def lossy(swarm: Swarm, periods: int, loss: float) -> dict:
    """``loss`` of all datagrams dropped for ``periods``, then SETTLE periods without loss
    (false deaths in the tail count too: the loss caused them)."""
    swarm.reset()
    suspicions, refutations = swarm.suspicions(), swarm.refutations()
    period = swarm.config.probe_interval
    swarm.loss = loss
    swarm.run_until(swarm.now + periods * period)
    swarm.loss = 0.0
    msgs = swarm.datagrams / (swarm.live * periods)
    swarm.run_until(swarm.now + SETTLE * period)
    return {"false_dead": swarm.false_dead, "suspicions": swarm.suspicions() - suspicions,
            "refutations": swarm.refutations() - refutations,
            "suspect_marks": swarm.suspect_marks, "msgs_per_node_period_loss": msgs}


def detection(swarms, trials: int, seed: int) -> dict:
    """Crash one random node at a time, CRASH_GAP periods after the previous one was seen
    DEAD by every survivor; at most N/16 per swarm, taken from the iterable ``swarms``."""
    times: list[float] = []
    stuck: list[str] = []
    false_dead = 0
    used = []
    for k, swarm in enumerate(swarms):
        used.append(swarm)
        swarm.reset()
        period = swarm.config.probe_interval
        pick = random.Random(f"{seed}:crash:{swarm.n}:{k}")
        for _ in range(min(max(1, swarm.n // 16), trials - len(times) - len(stuck))):
            swarm.run_until(swarm.now + pick.uniform(*CRASH_GAP) * period)
            victim = pick.choice([i for i in range(swarm.n) if swarm.up[i]])
            record = swarm.crash(victim)
            swarm.run_until(swarm.now + DETECT_CAP * period, stop=lambda: record[2] is not None)
            if record[2] is None:
                stuck.append(f"n{victim} (swarm {k}): {len(record[1])}/{swarm.live} survivors "
                             f"saw it DEAD after {DETECT_CAP:.0f} periods")
                break
            times.append((record[2] - record[0]) / period)
        false_dead += swarm.false_dead
        if len(times) + len(stuck) >= trials:
            break
    times.sort()
    if len(times) >= 100:
        p99, p99_kind = times[math.ceil(0.99 * len(times)) - 1], "p99"
    else:
        p99, p99_kind = (times[-1] if times else math.nan), "max"
    return {"detect_trials": len(times),
            "detect_median_periods": statistics.median(times) if times else math.nan,
            "detect_p99_periods": p99, "detect_p99_kind": p99_kind, "detect_stuck": stuck,
            "false_dead_no_loss": false_dead,
            "largest_datagram": max(s.largest for s in used), "spins": sum(s.spins for s in used),
            "reticks": sum(s.reticks for s in used)}


def run_size(n: int, trials: int, args, progress) -> dict:
    """Every scenario for a swarm of ``n``; returns its figures."""
    swarm = Swarm(n, args.seed, MembershipConfig(), args.latency / 1e3, args.jitter / 1e3)
    swarm.run_until(WARM_UP * swarm.config.probe_interval)
    # Copies for the detection trials beyond what one swarm takes (N/16 crashes).
    snapshot = swarm.snapshot() if trials > max(1, n // 16) else None
    progress(n, "built and warmed up")
    r = steady(swarm, args.steady)
    progress(n, f"steady: {r['msgs_per_node_period']:.2f} msgs/node/period, "
                f"{r['kbytes_per_s_per_node']:.2f} kB/s/node")
    r.update(lossy(swarm, args.periods, args.loss))
    progress(n, f"{args.loss:.0%} loss for {args.periods} periods: false_dead={r['false_dead']} "
                f"suspicions={r['suspicions']}")

    def swarms():
        yield swarm  # the one the loss run left, settled
        for k in itertools.count(1):
            yield copy_of(snapshot, f"{args.seed}:{n}:{k}")

    false_dead_no_loss = r["false_dead_no_loss"]
    r.update(detection(swarms(), trials, args.seed))
    r["false_dead_no_loss"] += false_dead_no_loss
    progress(n, f"detection: {r['detect_trials']} trials, median "
                f"{r['detect_median_periods']:.1f}, {r['detect_p99_kind']} "
                f"{r['detect_p99_periods']:.1f} periods")
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N in 16, 64, 256 only (< 40 s)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--periods", type=int, default=None,
                        help="length of the loss run, periods (default 150, --quick 60)")
    parser.add_argument("--steady", type=int, default=None,
                        help="periods measured for cost (default 30, --quick 20)")
    parser.add_argument("--loss", type=float, default=0.05, help="datagram loss, loss run")
    parser.add_argument("--latency", type=float, default=2.0, help="one-way latency, ms")
    parser.add_argument("--jitter", type=float, default=0.5, help="+- uniform jitter, ms")
    args = parser.parse_args()
    if args.periods is None:
        args.periods = 60 if args.quick else 150
    if args.steady is None:
        args.steady = 20 if args.quick else 30
    if args.steady < 20:
        parser.error("--steady must be at least 20 periods")
    trials = QUICK_TRIALS if args.quick else FULL_TRIALS
    args.source = source_digest()  # now: the file may change while this runs

    started = time.perf_counter()

    def progress(n: int, what: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f}s] n={n} {what}", file=sys.stderr, flush=True)

    results = {n: run_size(n, t, args, progress) for n, t in trials.items()}
    report(results, args, time.perf_counter() - started)


def source_digest() -> str:
    """The first 12 hex digits of the SHA-256 of the membership module's source."""
    with open(gossip.membership.__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


def report(results: dict[int, dict], args, elapsed: float) -> None:
    loss = f"{args.loss:.0%}"
    print(f"\ngossip/membership.py sha256 {args.source}, LAN profile, {args.latency:g} ms "
          f"+- {args.jitter:g} ms one way, seed {args.seed}; times in periods (1 s probe interval)")
    print(f"{'N':>5}{'trials':>7}{'det med':>8}{'det p99':>12}{'msgs/n/p':>9}{'B/n/p':>7}"
          f"{'pp B/n/p':>9}{'kB/s/n':>8}{'false_dead':>11}{'suspicions':>11}"
          f"{'msgs/n/p ' + loss:>13}")
    for n, r in results.items():
        p99 = f"{r['detect_p99_periods']:.1f}" + (" (max)" if r["detect_p99_kind"] == "max" else "")
        print(f"{n:>5}{r['detect_trials']:>7}{r['detect_median_periods']:>8.1f}{p99:>12}"
              f"{r['msgs_per_node_period']:>9.2f}{r['bytes_per_node_period']:>7.0f}"
              f"{r['push_pull_bytes_per_node_period']:>9.0f}{r['kbytes_per_s_per_node']:>8.2f}"
              f"{r['false_dead']:>11}{r['suspicions']:>11}{r['msgs_per_node_period_loss']:>13.2f}")
    print(f"det: periods from a crash until every survivor marks it DEAD; (max): fewer than 100 "
          f"trials, the largest shown as p99.\nmsgs/n/p, B/n/p: datagrams and their sealed bytes "
          f"per node per period, no loss, no failure; pp: push-pull record bytes per node per "
          f"period;\nkB/s/n: both. false_dead, suspicions (first-hand) and the last column: "
          f"{loss} loss for {args.periods} periods.")

    small = [r for n, r in results.items() if n <= 256]
    worst = max(r["detect_p99_periods"] for r in small)
    detect_ok = worst <= TARGET_DETECT_P99 and not any(r["detect_stuck"] for r in small)
    msgs = [r["msgs_per_node_period"] for r in results.values()]
    flat_ok = max(msgs) <= TARGET_FLAT * min(msgs)
    kbs = results[256]["kbytes_per_s_per_node"] if 256 in results else math.nan
    kbs_ok = kbs <= TARGET_KBYTES_S
    verdict = {True: "met", False: "NOT met"}
    print(f"target: detection p99 <= {TARGET_DETECT_P99:g} periods for N <= 256: "
          f"{verdict[detect_ok]} (worst {worst:.1f})")
    print(f"target: msgs/node/period flat in N (max <= {TARGET_FLAT:g} x min): "
          f"{verdict[flat_ok]} ({min(msgs):.2f} .. {max(msgs):.2f})")
    print(f"target: <= {TARGET_KBYTES_S:g} kB/s per node at N = 256: {verdict[kbs_ok]} "
          f"({kbs:.2f} kB/s)")
    for n, r in results.items():
        if r["false_dead_no_loss"]:
            print(f"ANOMALY n={n}: {r['false_dead_no_loss']} false deaths without loss")
        if r["largest_datagram"] > MAX_DATAGRAM:
            print(f"ANOMALY n={n}: a sealed datagram of {r['largest_datagram']} bytes "
                  f"(MAX_DATAGRAM = {MAX_DATAGRAM})")
        if r["spins"]:
            print(f"ANOMALY n={n}: {r['spins']} times a node was ticked {MAX_RETICKS} times "
                  f"at one instant with a timer still due")
        for line in r["detect_stuck"]:
            print(f"ANOMALY n={n}: detection incomplete: {line}")
    print(f"wall time {elapsed:.1f} s")

    out = {
        "seed": args.seed,
        "membership_sha256": args.source,
        "sizes": list(results),
        "loss": args.loss,
        "loss_periods": args.periods,
        "false_dead": sum(r["false_dead"] for r in results.values()),
        "false_dead_no_loss": sum(r["false_dead_no_loss"] for r in results.values()),
        "largest_datagram": max(r["largest_datagram"] for r in results.values()),
        "targets_met": {"detect_p99": detect_ok, "msgs_flat": flat_ok, "kbytes_per_s_n256": kbs_ok},
        "reticks": sum(r["reticks"] for r in results.values()),
        "wall_s": round(elapsed, 1),
    }
    keys = ("detect_median_periods", "detect_p99_periods", "detect_trials",
            "msgs_per_node_period", "bytes_per_node_period", "push_pull_bytes_per_exchange",
            "push_pull_bytes_per_node_period", "kbytes_per_s_per_node", "false_dead",
            "suspicions", "refutations", "suspect_marks", "msgs_per_node_period_loss")
    for n, r in results.items():
        for key in keys:
            value = r[key]
            out[f"{key}_n{n}"] = round(value, 3) if isinstance(value, float) else value
    print(json.dumps(out))


if __name__ == "__main__":
    main()
