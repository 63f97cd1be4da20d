"""The piggyback queue: how often each update is sent, which goes first, and what fits."""

import pytest

from gossip.broadcast import PART_OVERHEAD, BroadcastQueue, retransmit_limit

BIG = 10_000  # a budget that fits everything


@pytest.mark.parametrize(
    "mult, members, limit",
    [
        (4, 0, 4),  # ceil(log10(1)) = 0, but every update is sent at least `mult` times
        (4, 1, 4),
        (4, 9, 4),  # log10(10) = 1
        (4, 10, 8),  # log10(11) > 1
        (4, 99, 8),
        (4, 100, 12),
        (3, 1000, 12),
        (1, 10**6, 7),
        (0, 50, 0),
    ],
)
def test_retransmit_limit_formula(mult, members, limit):
    assert retransmit_limit(mult, members) == limit


def sent_counts(queue, members, rounds, budget=BIG):
    counts: dict[bytes, int] = {}
    for _ in range(rounds):
        for payload in queue.take(budget, members):
            counts[payload] = counts.get(payload, 0) + 1
    return counts


def test_each_item_is_sent_its_quota_then_leaves():
    q = BroadcastQueue(retransmit_mult=2)
    for key in "abc":
        q.enqueue(key, key.encode() * 10)
    members = 20  # quota 2 * ceil(log10(21)) = 4
    counts = sent_counts(q, members, rounds=10)
    assert counts == {b"a" * 10: 4, b"b" * 10: 4, b"c" * 10: 4}
    assert len(q) == 0
    assert q.take(BIG, members) == []


def test_a_newer_update_about_a_member_replaces_the_older():
    q = BroadcastQueue(retransmit_mult=1)
    q.enqueue("a", b"old")
    q.take(BIG, 1)  # the old one was sent once: the new one still gets a full quota
    q.enqueue("a", b"new")
    q.enqueue("b", b"other")
    assert len(q) == 2
    assert sorted(q.take(BIG, 1)) == [b"new", b"other"]
    assert len(q) == 0


def test_least_sent_first_then_newest_first():
    q = BroadcastQueue(retransmit_mult=3)
    for key in "abc":
        q.enqueue(key, key.encode())
    one = PART_OVERHEAD + 1  # room for exactly one payload
    order = [q.take(one, 1)[0] for _ in range(6)]
    # Round one: all unsent, newest first. Round two: all sent once, most recently sent
    # first. Either way each goes once per round.
    assert order == [b"c", b"b", b"a", b"a", b"b", b"c"]
    q.enqueue("d", b"d")  # fresh news overtakes old
    assert q.take(one, 1) == [b"d"]


@pytest.mark.parametrize("budget", [0, PART_OVERHEAD, PART_OVERHEAD + 4, 25, 60, 1000])
def test_budget_is_respected(budget):
    q = BroadcastQueue(retransmit_mult=4)
    for i, size in enumerate([5, 20, 1, 40, 9, 3]):
        q.enqueue(str(i), bytes(size))
    taken = q.take(budget, 10)
    assert sum(len(p) + PART_OVERHEAD for p in taken) <= budget
    if budget > PART_OVERHEAD + 1:
        assert taken  # something always fits: a 1-byte payload is queued


def test_an_item_too_big_for_the_budget_is_skipped_not_blocking():
    q = BroadcastQueue(retransmit_mult=4)
    q.enqueue("small", b"s" * 5)
    q.enqueue("big", b"b" * 100)  # newest, so it would go first
    assert q.take(20, 3) == [b"s" * 5]
    assert len(q) == 2  # the big one waits for a datagram with room


@pytest.mark.parametrize("limit", [0, 1, 2, 5])
def test_item_limit_is_respected(limit):
    q = BroadcastQueue(retransmit_mult=4)
    for i in range(5):
        q.enqueue(str(i), b"x")
    assert len(q.take(BIG, 3, limit)) == min(limit, 5)


def test_untaken_items_are_not_counted_as_sent():
    q = BroadcastQueue(retransmit_mult=1)  # quota 1 for up to 9 members
    q.enqueue("a", b"a")
    q.enqueue("b", b"b")
    assert q.take(BIG, 3, limit=1) == [b"b"]
    assert len(q) == 1
    assert q.take(BIG, 3) == [b"a"]
    assert len(q) == 0


def test_clear():
    q = BroadcastQueue(retransmit_mult=4)
    q.enqueue("a", b"a")
    q.clear()
    assert len(q) == 0 and q.take(BIG, 3) == []
