"""daemon.sharding: the choice of a shard for ``task.shard = "auto"``, as a table, and the file
that keeps it."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from daemon.sharding import choose_shard, coverage, describe, read_choice, write_choice
from gossip.messages import MAX_SHARDS


@pytest.mark.parametrize("shards, announced, expected", [
    (1, [], {0}),
    (4, [], {0, 1, 2, 3}),  # nobody yet: any shard
    (4, [(0, 4), (1, 4), (2, 4)], {3}),
    (4, [(0, 4), (1, 4), (2, 4), (3, 4)], {0, 1, 2, 3}),  # all covered once: any
    (4, [(0, 4), (0, 4), (1, 4), (2, 4), (3, 4), (3, 4)], {1, 2}),
    (4, [(3, 8), (5, 8), (0, 2), (1, 2), (0, 0), (0, 0)], {0, 1, 2, 3}),  # other cuts, none
    (4, [(0, 4), (1, 4), (2, 4), (0, 2), (1, 2), (3, 8)], {3}),  # only the 4-way cut counts
    (2, [(0, 2)] * 5 + [(1, 2)] * 4, {1}),
    (3, [(0, 3), (2, 3), (0, 0)], {1}),
], ids=["one-shard", "empty-swarm", "one-gap", "all-covered", "two-gaps", "other-counts",
        "mixed-counts", "skewed", "no-shard-member"])
def test_choose_shard_takes_a_least_covered_one(shards, announced, expected):
    chosen = {choose_shard(shards, announced, random.Random(seed)) for seed in range(64)}
    assert chosen == expected  # every tied shard can be chosen, no other one ever is


def test_the_same_seed_and_view_choose_the_same_shard():
    # The daemon seeds with the peer id: a node that chooses again, nothing changed, agrees.
    announced = [(0, 16), (5, 16)]
    picks = {choose_shard(16, announced, random.Random("some peer id")) for _ in range(5)}
    assert len(picks) == 1


def test_joiners_spread_over_tied_shards():
    # Four joiners that see the same empty swarm pick with their own seeds: not all alike.
    picks = [choose_shard(8, [], random.Random(f"peer{i}")) for i in range(4)]
    assert len(set(picks)) > 1


@pytest.mark.parametrize("shards", [0, -1, MAX_SHARDS + 1])
def test_choose_shard_refuses_a_count_out_of_range(shards):
    with pytest.raises(ValueError, match="shards"):
        choose_shard(shards, [], random.Random(0))


def test_coverage_and_describe():
    counts = coverage(4, [(0, 4), (0, 4), (3, 4), (9, 4), (1, 2)])  # (9, 4) cannot be: skipped
    assert counts == [2, 0, 0, 1]
    assert describe(counts) == "members per shard 2 0 0 1"
    assert describe([0] * 40 + [3] * 10) == "40 of 50 shards uncovered, the most covered by 3"


def test_a_choice_is_kept_for_its_shard_count(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "shard"
    assert read_choice(path, 8) is None  # none yet
    write_choice(path, 3, 8)
    assert path.read_text() == "3/8\n"
    assert read_choice(path, 8) == 3
    with caplog.at_level(logging.INFO, logger="daemon.sharding"):
        assert read_choice(path, 4) is None  # task.shards changed: choose again
    assert "is for 8 shards, task.shards is 4" in caplog.text
    write_choice(path, 0, 4)  # replaced whole
    assert read_choice(path, 4) == 0
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("text", ["", "3", "3/", "/8", "8/8", "-1/8", "a/8", "3/8/1",
                                  "3 / 8", "٣/8", "1" * 80 + "/8"])
def test_a_damaged_choice_is_chosen_again(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                          text: str) -> None:
    path = tmp_path / "shard"
    path.write_text(text)
    with caplog.at_level(logging.WARNING, logger="daemon.sharding"):
        assert read_choice(path, 8) is None
    assert "damaged" in caplog.text
