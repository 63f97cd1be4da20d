"""Soak: two daemons exchanging as fast as they can, for well over a thousand exchanges.

A leak of anything per exchange (a buffer, a task, a socket, a log record kept in memory)
shows as resident memory or descriptors that grow with the count. The first exchanges are a
warm-up (allocator pools, torch's caches, the first checkpoint), so growth is measured from
exchange WARMUP on.
"""

from __future__ import annotations

import pytest

from daemon.testing import DaemonSwarm, wait_for

WARMUP = 100  # exchanges before the baseline is taken
EXCHANGES = 1000  # exchanges measured after it
GROWTH = 0.05  # most relative growth of resident memory allowed over them
FAST_AS_IT_CAN = [
    "averaging.interval=0.01",  # both sides offer all the time; collisions answer BUSY
    "limits.peer_rate=1000",  # the default per-peer limit (10/s) is for honest swarms
    "limits.peer_burst=1000",
    # and so is the budget of members' offers per host (two per round of ours, at most two
    # saved): a pair offering as fast as it can is answered busy most of the time under it.
    "averaging.trust_after=0",
    "metrics.interval=5",
]


@pytest.mark.slow
def test_memory_and_descriptors_stay_flat_over_a_thousand_exchanges(tmp_path) -> None:
    with DaemonSwarm(tmp_path) as swarm:
        a = swarm.add("a", settings=FAST_AS_IT_CAN).start()
        wait_for(lambda: a.last("start"), 120, [a], "a to start")
        b = swarm.add("b", bootstrap=[a], settings=FAST_AS_IT_CAN).start()
        both = [a, b]
        # a takes part in every exchange of a two-node swarm, at one end or the other.
        wait_for(lambda: a.committed() >= WARMUP, 300, both, f"{WARMUP} exchanges")
        before = {d.name: (d.memory()["rss"], d.open_files()) for d in both}
        start = a.committed()
        wait_for(lambda: a.committed() >= start + EXCHANGES, 480, both,
                 f"{EXCHANGES} more exchanges")
        rss = {d.name: d.memory()["rss"] for d in both}
        # Exchanges in flight hold channels (ours, and a peer's offer being answered busy: two
        # at once happens), so one reading may be up to two high. A leak is a count that never
        # comes back: wait for each to come back within one of where it stood.
        for d in both:
            fd0 = before[d.name][1]
            wait_for(lambda d=d, fd0=fd0: d.open_files() <= fd0 + 1, 30, both,
                     f"{d.name}'s descriptors back within one of {fd0}")
        after = {d.name: (rss[d.name], d.open_files()) for d in both}
        total = a.committed()
        failed = sum(e["result"] != "committed" for e in a.of("exchange"))

    print(f"\nsoak: {total} exchanges committed at a ({failed} not committed: busy or failed)")
    print(f"{'daemon':<8}{'rss@100 MiB':>13}{'rss@end MiB':>13}{'growth':>9}{'fds@100':>9}"
          f"{'fds@end':>9}")
    for name in before:
        (rss0, fd0), (rss1, fd1) = before[name], after[name]
        print(f"{name:<8}{rss0 / 2**20:>13.1f}{rss1 / 2**20:>13.1f}{rss1 / rss0 - 1:>9.2%}"
              f"{fd0:>9}{fd1:>9}")
    for name in before:
        (rss0, fd0), (rss1, fd1) = before[name], after[name]
        assert rss1 < rss0 * (1 + GROWTH), f"{name}: resident memory grew {rss1 / rss0 - 1:.1%}"
        # Came back within one (waited for above); one in flight may have opened since.
        assert fd1 <= fd0 + 2, f"{name}: descriptors went from {fd0} to {fd1}"
