"""Which shard of the data a node trains on when ``task.shard = "auto"``.

Theory of operation
-------------------
Every member announces the shard it trains on: ``shard`` of ``shards`` in its ``Alive``
(docs/PROTOCOL.md section 8.4; ``shards`` 0 announces none). A node configured with ``shard =
"auto"`` that has no choice of its own yet chooses as soon as it has joined the swarm (the
join's push-pull hands it the whole member table of the node it joined through): the shard
that the fewest alive members announce (:func:`choose_shard`). A member that cuts the data
another way (another ``shards``) or announces nothing is not counted: it covers none of these
shards. Ties are broken at random with a generator seeded by the node's peer id, so that
joiners arriving together spread over the tied shards, and a node that chooses again from the
same view picks the same shard. The first node of a swarm (no bootstrap address) has nobody to
ask and takes shard 0.

It chooses before downloading its first weights, not after: a download can take minutes, and
a node that has not chosen announces nothing, so joiners arriving meanwhile would not count it
and might pick its shard. Joiners whose choices are less than a gossip round apart (well under
a second on a LAN) can still pick alike.

The choice is kept in ``<data_dir>/shard`` (:func:`read_choice`, :func:`write_choice`) and
holds for as long as ``task.shards`` does: a node never changes shard while it runs, nor when it
restarts, so its model and its optimizer's state keep seeing the data they have seen. So a
swarm that grows has its joiners fill the least-covered shards first; one that shrinks leaves
the shards of the nodes that left uncovered until joiners take them. Moving running nodes to
cover a shard would cost each of them a change of data mid-training, and several nodes seeing
the same gap at once would all move to it, which is why nothing here does.

Only members that proved their identity to the chooser count (:func:`announced`): anyone with
the swarm key can announce invented members in one push-pull, and seven such records claiming
shards 0 to 2 sent the next two joiners both to shard 3, leaving 1 and 2 without a real node.
So the chooser first completes a handshake with a sample of up to :data:`SAMPLE` of the
members it heard of (an invented record's address is not its own: that handshake fails and it
stays unproven) and counts those that answered, plus the members it already had a channel
with, each shard once per host they proved themselves from (identities are free, addresses
are not: a key holder's identities on one address add at most one to each shard, which
steers nobody). Members that announce they accept no connections are dialled too, after the
others (one whose dial-back check has not run yet announces so); one behind a NAT counts once
it has connected to the chooser. With a larger swarm than the sample, coverage is estimated
from the sample.

Choosing costs up to :data:`SAMPLE` handshakes (eight at once, all within one push-pull
deadline) and O(members + shards), once per start.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable
from pathlib import Path

from gossip import MAX_SHARDS
from gossip.lowlevel import Roster

from .files import atomic_write

__all__ = ["CHOICE_FILE", "SAMPLE", "announced", "coverage", "choose_shard", "describe",
           "read_choice", "write_choice"]

log = logging.getLogger(__name__)

CHOICE_FILE = "shard"  # under node.data_dir: "INDEX/COUNT\n", e.g. "3/8\n"
MAX_CHOICE_FILE = 64  # bytes read from it at most
SHOWN = 32  # shards listed one by one in describe(); more are summed up
SAMPLE = 32  # members a chooser proves (a handshake each) before it counts their shards


async def announced(roster: Roster, most: int = SAMPLE) -> list[tuple[int, int]]:
    """The ``(shard, shards)`` of the alive members that have proved their identity to us,
    after a handshake with up to ``most`` of those that had not, each claim counted once per
    host the members proved themselves from (see the module docstring)."""
    await roster.prove(roster.alive(), most=most)
    seen = {(roster.proven_host(m), m.shard, m.shards) for m in roster.alive(proven=True)}
    return [(shard, shards) for _, shard, shards in sorted(seen)]


def coverage(shards: int, announced: Iterable[tuple[int, int]]) -> list[int]:
    """How many members train on each of ``shards`` shards.

    Args:
        shards: the count this node cuts the data into (``task.shards``).
        announced: each alive member's ``(shard, shards)``. A member whose ``shards`` differs
            (0 included: it announces none) is not counted.

    Returns:
        ``counts[i]``: the members announcing shard ``i`` of ``shards``.
    """
    counts = [0] * shards
    for shard, count in announced:
        if count == shards and 0 <= shard < shards:
            counts[shard] += 1
    return counts


def choose_shard(shards: int, announced: Iterable[tuple[int, int]], rng: random.Random) -> int:
    """The shard to train on: one of those the fewest members announce, chosen with ``rng``
    among them (seed it with the peer id: see the module docstring).

    Args:
        shards: ``task.shards``, 1..MAX_SHARDS.
        announced: each alive member's ``(shard, shards)``, as :func:`coverage` takes them.
        rng: breaks ties.

    Raises:
        ValueError: ``shards`` is out of range.
    """
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards must be in 1..{MAX_SHARDS}, got {shards}")
    counts = coverage(shards, announced)
    fewest = min(counts)
    return rng.choice([i for i, n in enumerate(counts) if n == fewest])


def describe(counts: list[int]) -> str:
    """``counts`` (from :func:`coverage`) for a log line: each shard's members, or a summary
    beyond :data:`SHOWN` shards."""
    if len(counts) <= SHOWN:
        return "members per shard " + " ".join(map(str, counts))
    uncovered = counts.count(0)
    return f"{uncovered} of {len(counts)} shards uncovered, the most covered by {max(counts)}"


def read_choice(path: Path, shards: int) -> int | None:
    """The shard chosen by an earlier run, if it was chosen among as many ``shards``.

    Returns:
        The shard; None if there is no choice, it was made for another ``shards`` (the node
        chooses again), or the file is damaged (said in a warning; the node chooses again).

    Raises:
        OSError: the file exists but cannot be read.
    """
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CHOICE_FILE + 1)
    except FileNotFoundError:
        return None
    index, sep, count = data.decode("ascii", "replace").strip().partition("/")
    if (len(data) > MAX_CHOICE_FILE or not sep or not index.isdigit() or not count.isdigit()
            or not int(index) < int(count)):
        log.warning("shard choice file %s is damaged (expected INDEX/COUNT such as 3/8); "
                    "choosing again", path)
        return None
    if int(count) != shards:
        log.info("shard choice file %s is for %s shards, task.shards is %d: choosing again",
                 path, count, shards)
        return None
    return int(index)


def write_choice(path: Path, shard: int, shards: int) -> None:
    """Keep the choice for the next run, written atomically (:func:`daemon.files.atomic_write`):
    a crash leaves the old choice or the new.

    Raises:
        OSError: it cannot be written.
    """
    atomic_write(path, f"{shard}/{shards}\n".encode("ascii"))
