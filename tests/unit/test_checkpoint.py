"""Tests for daemon.checkpoint: round trips, the file layout, every truncation and flipped
byte caught before unpickling, fallback to the previous checkpoint, pruning, repeats of a step
under names of their own, crash safety, RNG capture, and refusal of hostile pickles by
weights_only."""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import random
import stat
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from daemon import checkpoint
from daemon.checkpoint import CheckpointError
from gossip.messages import MAX_COUNT

TRAILER = 48  # payload length (8) + SHA-256 (32) + END_MAGIC (8)


def frame(payload: bytes, header: bytes = checkpoint.FORMAT) -> bytes:
    """A checkpoint built from the documented layout, independently of save()."""
    digest = hashlib.sha256(header + payload).digest()
    return header + payload + struct.pack("<Q", len(payload)) + digest + checkpoint.END_MAGIC


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def make_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 4)).square().mean().backward()
        opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "counters": {"step": 3, "samples": 48, "weight": 0.75},
        "rng": checkpoint.capture_rng(),
        "meta": {"entry": "tests:task", "schema": "ab" * 16, "time": 1234.5},
    }


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.fixture
def no_torch_load(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        pytest.fail("torch.load reached on data that failed verification")

    monkeypatch.setattr(torch, "load", refuse)


@pytest.fixture(scope="module")
def tiny_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = checkpoint.save(tmp_path_factory.mktemp("tiny"), {"x": torch.tensor([1.0, 2.0])},
                           step=1, keep=1)
    return path.read_bytes()


# --- round trip and layout ------------------------------------------------------------


def test_round_trip(tmp_path: Path) -> None:
    state = make_state()
    path = checkpoint.save(tmp_path, state, step=3, keep=2)
    assert path == tmp_path / "checkpoint-000000000003.ckpt"
    loaded = checkpoint.load(path)
    assert_same(state, loaded)
    for t in loaded["model"].values():
        assert t.device.type == "cpu"

    # The loaded state goes back into a fresh model and optimizer.
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model.load_state_dict(loaded["model"])
    torch.optim.AdamW(model.parameters()).load_state_dict(loaded["optimizer"])


def test_layout_matches_documentation(tmp_path: Path) -> None:
    state = {"x": torch.arange(10.0), "n": 7}
    data = checkpoint.save(tmp_path, state, step=0, keep=1).read_bytes()
    assert data.startswith(b"GOSSIPCK\x01\x00\x00\x00") and data.endswith(b"GOSSIPND")
    payload = data[len(checkpoint.FORMAT):-TRAILER]
    assert data == frame(payload)
    assert_same(torch.load(io.BytesIO(payload), weights_only=True), state)


def test_modes_and_names(tmp_path: Path) -> None:
    directory = tmp_path / "a" / "ckpt"
    path = checkpoint.save(directory, {"x": 1}, step=42, keep=1)
    assert stat.S_IMODE(directory.stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0
    assert path.name == "checkpoint-000000000042.ckpt"


@pytest.mark.parametrize("kwargs", [
    {"step": -1, "keep": 1}, {"step": MAX_COUNT + 1, "keep": 1}, {"step": True, "keep": 1},
    {"step": 1.0, "keep": 1}, {"step": 1, "keep": 0}, {"step": 1, "keep": -2},
])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        checkpoint.save(tmp_path, {"x": 1}, **kwargs)
    assert checkpoints_and_temps(tmp_path) == []


def checkpoints_and_temps(directory: Path) -> list[str]:
    return sorted(os.listdir(directory)) if directory.exists() else []


# --- damage is caught before torch.load -----------------------------------------------

HEADER = len(checkpoint.FORMAT)
CUTS = {
    "empty": lambda n: 0, "one": lambda n: 1, "in-magic": lambda n: 5,
    "header-1": lambda n: HEADER - 1, "header": lambda n: HEADER, "header+1": lambda n: HEADER + 1,
    "middle": lambda n: n // 2, "before-trailer": lambda n: n - TRAILER,
    "in-length": lambda n: n - TRAILER + 4, "in-digest": lambda n: n - 20,
    "before-end-magic": lambda n: n - 8, "last": lambda n: n - 1,
}


@pytest.mark.parametrize("cut", list(CUTS))
def test_truncation_detected(tmp_path: Path, no_torch_load: None, cut: str) -> None:
    data = checkpoint.save(tmp_path, make_state(), step=1, keep=1).read_bytes()
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(data[:CUTS[cut](len(data))])
    with pytest.raises(CheckpointError, match="bad.ckpt"):
        checkpoint.load(bad)


@pytest.mark.parametrize("where", list(CUTS))
def test_flipped_byte_detected(tmp_path: Path, no_torch_load: None, where: str) -> None:
    data = bytearray(checkpoint.save(tmp_path, make_state(), step=1, keep=1).read_bytes())
    i = min(CUTS[where](len(data)), len(data) - 1)
    data[i] ^= 0x01
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        checkpoint.load(bad)


def test_every_truncation_and_every_flip_detected(tmp_path: Path, tiny_bytes: bytes,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(tiny_bytes)
    assert_same(checkpoint.load(bad), {"x": torch.tensor([1.0, 2.0])})
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load reached"))
    for n in range(len(tiny_bytes)):
        bad.write_bytes(tiny_bytes[:n])
        with pytest.raises(CheckpointError):
            checkpoint.load(bad)
    for i in range(len(tiny_bytes)):
        for bit in (0x01, 0x80):
            data = bytearray(tiny_bytes)
            data[i] ^= bit
            bad.write_bytes(bytes(data))
            with pytest.raises(CheckpointError):
                checkpoint.load(bad)
    bad.write_bytes(tiny_bytes + b"\0")  # appended bytes, too
    with pytest.raises(CheckpointError):
        checkpoint.load(bad)


@pytest.mark.parametrize("data,reason", [
    (b"PK\x03\x04" + b"\0" * 100, "bad magic"),
    (frame(b"x" * 10, header=b"GOSSIPCK\x02\x00\x00\x00"), "format version 2"),
    (frame(b"x" * 10)[:-1] + b"X", "end magic"),
])
def test_reasons(tmp_path: Path, no_torch_load: None, data: bytes, reason: str) -> None:
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(data)
    with pytest.raises(CheckpointError, match=reason) as info:
        checkpoint.load(bad)
    assert info.value.path == bad and reason in info.value.reason


def test_missing_file_is_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint.load(tmp_path / "nope.ckpt")


def test_payload_not_a_dict(tmp_path: Path) -> None:
    bad = tmp_path / "list.ckpt"
    bad.write_bytes(frame(torch_bytes([torch.zeros(2)])))
    with pytest.raises(CheckpointError, match="not a dict"):
        checkpoint.load(bad)


class Evil:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def test_malicious_torch_payload_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    # save() happily pickles it: the checksum is valid, so only weights_only stands in the way.
    path = checkpoint.save(tmp_path / "ck", {"x": torch.zeros(1), "evil": Evil(marker)},
                           step=1, keep=1)
    with pytest.raises(CheckpointError, match=r"weights_only.*\.system"):
        checkpoint.load(path)
    assert not marker.exists()


def test_malicious_plain_pickle_payload_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.ckpt"
    payload = pickle.dumps({"evil": Evil(marker)}, protocol=2)
    bad.write_bytes(frame(payload))
    with pytest.raises(CheckpointError, match=r"weights_only.*\.system"):
        checkpoint.load(bad)
    assert not marker.exists()
    pickle.loads(payload)  # the payload is live: plain pickle runs the command
    assert marker.exists()


# --- directory: latest, pruning, temp files, crashes ----------------------------------


def test_load_latest_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert checkpoint.load_latest(tmp_path / "missing") is None
    assert checkpoint.load_latest(tmp_path) is None
    first = checkpoint.save(tmp_path, {"step": 1}, step=1, keep=5)
    second = checkpoint.save(tmp_path, {"step": 2}, step=2, keep=5)
    assert checkpoint.load_latest(tmp_path) == (second, {"step": 2})

    second.write_bytes(second.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="daemon.checkpoint"):
        assert checkpoint.load_latest(tmp_path) == (first, {"step": 1})
    [record] = [r for r in caplog.records if "checkpoint unusable" in r.getMessage()]
    assert str(second) in record.getMessage() and "trying the previous one" in record.getMessage()

    first.write_bytes(b"garbage")
    assert checkpoint.load_latest(tmp_path) is None


def test_unusable_checkpoints_are_set_aside_and_never_crowd_out_good_ones(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=3)
    for step in (20, 30):  # the two newest are torn
        path = tmp_path / f"checkpoint-{step:012d}.ckpt"
        path.write_bytes(path.read_bytes()[:40])
    resumed, state = checkpoint.load_latest(tmp_path)
    assert state == {"step": 10}
    assert sorted(p.name for p in tmp_path.glob("*.corrupt")) == [
        "checkpoint-000000000020.ckpt.corrupt", "checkpoint-000000000030.ckpt.corrupt"]
    # Training resumes from step 10: its new checkpoints are the ones kept, not the torn ones.
    for step in (11, 12, 13):
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=2)
    assert [checkpoint.load(p)["step"] for p in checkpoint.checkpoints(tmp_path)] == [12, 13]


def test_keep_prunes_oldest(tmp_path: Path) -> None:
    for step in range(1, 6):
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [
        "checkpoint-000000000004.ckpt", "checkpoint-000000000005.ckpt"]
    # An older step is never pruned as it is written, even when newer ones fill `keep`.
    older = checkpoint.save(tmp_path, {"step": 3}, step=3, keep=1)
    assert checkpoint.checkpoints(tmp_path) == [older, tmp_path / "checkpoint-000000000005.ckpt"]


def test_any_step_a_peer_can_give_names_a_checkpoint_in_step_order(tmp_path: Path) -> None:
    # The protocol's counters go up to MAX_COUNT (16 digits): past 10^12 names grow longer
    # than 12 digits, and the order is the steps', not the names'.
    for step in (10**12 - 1, 10**12, MAX_COUNT):  # by name, 10^12 would sort first
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=3)
    # (MAX_COUNT is a jump from 10^12: that one is set aside, below.)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [
        "checkpoint-999999999999.ckpt", f"checkpoint-{MAX_COUNT}.ckpt"]
    resumed, state = checkpoint.load_latest(tmp_path)
    assert state == {"step": MAX_COUNT}


def test_a_step_that_jumps_cannot_prune_every_checkpoint_from_before_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A peer that gave us step 2^53 - 1: every later save is named by it or above, and with
    # `keep` 1 the first of them would delete the last good checkpoint.
    for step in (1000, 2000):  # honest progress: no jump
        checkpoint.save(tmp_path, {"step": step}, step=step, keep=1)
    assert not list(tmp_path.glob("*.before-jump"))
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        for _ in range(3):
            checkpoint.save(tmp_path, {"step": MAX_COUNT}, step=MAX_COUNT, keep=1)
    kept = tmp_path / f"checkpoint-000000002000.ckpt{checkpoint.BEFORE_JUMP}"
    assert checkpoint.load(kept) == {"step": 2000}  # whole, and readable
    assert "step jumped from 2000" in caplog.text and kept.name in caplog.text
    # load_latest does not resume from it by itself: that is the operator's choice.
    assert checkpoint.load_latest(tmp_path)[1] == {"step": MAX_COUNT}
    # The three saves at MAX_COUNT are repeats (the first is the jump, the others are not:
    # the newest is at MAX_COUNT by then), and keep=1 keeps the last.
    assert checkpoint.checkpoints(tmp_path) == [tmp_path / f"checkpoint-{MAX_COUNT}.2.ckpt"]
    assert len(list(tmp_path.glob("*.before-jump"))) == 1


def test_checkpoints_kept_from_before_jumps_are_at_most_keep(tmp_path: Path) -> None:
    steps = [10]
    for _ in range(3):
        steps.append(checkpoint.jump_bound(steps[-1]) + 1)
    for step in steps:  # each a jump from the one before: three are set aside
        checkpoint.save(tmp_path, {}, step=step, keep=2)
    kept = sorted(p.name for p in tmp_path.glob("*.before-jump"))
    assert kept == [f"checkpoint-{s:012d}.ckpt{checkpoint.BEFORE_JUMP}" for s in steps[1:3]]


def test_checkpoints_ignores_other_names_and_stale_temps_are_removed(tmp_path: Path) -> None:
    temps = [".checkpoint-000000000009.ckpt.abc.tmp", ".checkpoint-000000000009.3.ckpt.abc.tmp"]
    names = ["checkpoint-9.ckpt", "checkpoint-000000000009.ckpt.bak",
             "checkpoint-0000000000009.ckpt", "checkpoint-0000000000009.1.ckpt",
             "checkpoint-000000000009.0.ckpt", "checkpoint-000000000009.01.ckpt",
             "checkpoint-000000000009..ckpt", "checkpoint-000000000009.-1.ckpt",
             "checkpoint-000000000009.1a.ckpt", "checkpoint-000000000009.1.ckpt.bak",
             "checkpoint-000000000009.1.2.ckpt", "notes.txt"]
    for name in temps + names:
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "checkpoint-000000000008.ckpt").mkdir()
    assert checkpoint.checkpoints(tmp_path) == []
    path = checkpoint.save(tmp_path, {"x": 1}, step=1, keep=1)
    assert checkpoint.checkpoints(tmp_path) == [path]
    assert not any((tmp_path / name).exists() for name in temps)
    assert all((tmp_path / name).read_bytes() == b"x" for name in names)
    # None of those names is one save writes, so none makes a save at 9 a repeat.
    assert checkpoint.save(tmp_path, {"x": 9}, step=9, keep=9).name == (
        "checkpoint-000000000009.ckpt")
    # A directory in the way of the plain name holds it as a file would.
    assert checkpoint.save(tmp_path, {"x": 8}, step=8, keep=9).name == (
        "checkpoint-000000000008.1.ckpt")
    assert all((tmp_path / name).read_bytes() == b"x" for name in names)


# --- repeats: saves at a step that already has a checkpoint --------------------------------


def name(step: int, k: int = 0) -> str:
    """The name the module docstring gives the k-th repeat of ``step``, written out here."""
    return f"checkpoint-{step:012d}.ckpt" if k == 0 else f"checkpoint-{step:012d}.{k}.ckpt"


def test_saves_at_one_step_never_replace_each_other(tmp_path: Path) -> None:
    # A node ahead of the swarm trains on at one step: each save is a different state.
    paths, contents = [], []
    for v in (1, 2, 3):
        paths.append(checkpoint.save(tmp_path, {"v": v}, step=7, keep=5))
        contents.append(paths[-1].read_bytes())
    assert [p.name for p in paths] == [name(7), name(7, 1), name(7, 2)]
    assert checkpoint.checkpoints(tmp_path) == paths  # oldest first: the plain name, 1, 2
    assert [checkpoint.load(p) for p in paths] == [{"v": 1}, {"v": 2}, {"v": 3}]
    assert [p.read_bytes() for p in paths] == contents  # each file as it was written
    assert sorted(os.listdir(tmp_path)) == sorted(p.name for p in paths)  # no temp left


def test_repeats_are_ordered_by_step_then_k_not_by_name(tmp_path: Path) -> None:
    for v in range(12):  # the plain name, then 1 to 11: by name, .10 and .11 sort before .2
        checkpoint.save(tmp_path, {"v": v}, step=5, keep=20)
    checkpoint.save(tmp_path, {"v": 12}, step=6, keep=20)
    checkpoint.save(tmp_path, {"v": 13}, step=4, keep=20)  # an older step: the plain name
    expected = [name(4)] + [name(5)] + [name(5, k) for k in range(1, 12)] + [name(6)]
    listed = [p.name for p in checkpoint.checkpoints(tmp_path)]
    assert listed == expected and sorted(listed) != expected
    assert [checkpoint.load(tmp_path / n)["v"] for n in expected] == [13, *range(13)]


def test_pruning_keeps_the_newest_across_repeats(tmp_path: Path) -> None:
    for v in range(4):
        checkpoint.save(tmp_path, {"v": v}, step=3, keep=2)
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [name(3, 2), name(3, 3)]
    checkpoint.save(tmp_path, {"v": 4}, step=4, keep=2)
    checkpoint.save(tmp_path, {"v": 5}, step=4, keep=2)
    checkpoints = checkpoint.checkpoints(tmp_path)
    assert [p.name for p in checkpoints] == [name(4), name(4, 1)]
    assert [checkpoint.load(p)["v"] for p in checkpoints] == [4, 5]
    # After step 3's files were all pruned, a save at 3 takes the plain name again: no file
    # holds it. Older than the newest, it is kept as it is written, as any older step is.
    older = checkpoint.save(tmp_path, {"v": 6}, step=3, keep=1)
    assert older.name == name(3)
    assert checkpoint.checkpoints(tmp_path) == [older, tmp_path / name(4, 1)]
    # That pruned step 4's plain name. k follows the largest a step has, not the first free
    # one, which would put the new file before repeat 1, the older state.
    assert not (tmp_path / name(4)).exists()
    newest = checkpoint.save(tmp_path, {"v": 7}, step=4, keep=9)
    assert newest.name == name(4, 2) and checkpoint.checkpoints(tmp_path)[-1] == newest


def test_load_latest_picks_the_latest_repeat(tmp_path: Path) -> None:
    checkpoint.save(tmp_path, {"v": 0}, step=8, keep=20)
    for v in range(1, 12):
        latest = checkpoint.save(tmp_path, {"v": v}, step=9, keep=20)
    assert latest.name == name(9, 10)
    assert checkpoint.load_latest(tmp_path) == (latest, {"v": 11})


def test_a_torn_newest_repeat_falls_back_to_the_previous_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for v in (1, 2, 3):
        checkpoint.save(tmp_path, {"v": v}, step=7, keep=5)
    torn = tmp_path / name(7, 2)
    torn.write_bytes(torn.read_bytes()[:-10])
    with caplog.at_level(logging.WARNING, logger="daemon.checkpoint"):
        assert checkpoint.load_latest(tmp_path) == (tmp_path / name(7, 1), {"v": 2})
    assert f"checkpoint unusable path={torn}" in caplog.text
    corrupt = tmp_path / (name(7, 2) + ".corrupt")
    kept = corrupt.read_bytes()
    # Resumed from repeat 1, the node saves at 7 again: the set-aside file still holds the
    # name of repeat 2, so the new one is repeat 3, and the torn one stays for a post-mortem.
    path = checkpoint.save(tmp_path, {"v": 4}, step=7, keep=5)
    assert path.name == name(7, 3) and corrupt.read_bytes() == kept
    assert checkpoint.load_latest(tmp_path) == (path, {"v": 4})


def test_the_jump_rule_with_repeats(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for v in (1, 2):
        checkpoint.save(tmp_path, {"v": v}, step=1000, keep=2)
    # Up to jump_bound of the newest checkpoint's step is no jump, from the last repeat too.
    bound = checkpoint.jump_bound(1000)
    checkpoint.save(tmp_path, {"v": 3}, step=bound, keep=2)
    assert not list(tmp_path.glob("*.before-jump"))
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == [name(1000, 1), name(bound)]
    checkpoint.save(tmp_path, {"v": 4}, step=bound, keep=2)  # a repeat: no jump either
    assert not list(tmp_path.glob("*.before-jump"))
    # Past jump_bound of the newest: that one, repeat 1 of `bound`, is set aside.
    with caplog.at_level(logging.WARNING, logger=checkpoint.log.name):
        checkpoint.save(tmp_path, {"v": 5}, step=MAX_COUNT, keep=1)
    kept = tmp_path / (name(bound, 1) + checkpoint.BEFORE_JUMP)
    assert [p.name for p in tmp_path.glob("*.before-jump")] == [kept.name]
    assert checkpoint.load(kept) == {"v": 4}
    assert f"step jumped from {bound} to {MAX_COUNT}" in caplog.text
    assert checkpoint.load_latest(tmp_path) == (tmp_path / name(MAX_COUNT), {"v": 5})


def test_checkpoints_kept_from_before_jumps_are_the_newest_by_step_then_k(
        tmp_path: Path) -> None:
    data = checkpoint.save(tmp_path / "x", {"v": 0}, step=0, keep=1).read_bytes()
    aside = [name(10, k) + checkpoint.BEFORE_JUMP for k in (0, 2, 10)]
    foreign = ["checkpoint-10.ckpt.before-jump", "checkpoint-000000000010.0.ckpt.before-jump"]
    for n in aside + foreign:
        (tmp_path / n).write_bytes(data)
    checkpoint.save(tmp_path, {"v": 1}, step=20, keep=2)
    newest = checkpoint.save(tmp_path, {"v": 2}, step=checkpoint.jump_bound(20) + 1, keep=2)
    kept = sorted(p.name for p in tmp_path.glob("*.before-jump") if p.name not in foreign)
    assert kept == sorted([aside[2], name(20) + checkpoint.BEFORE_JUMP])  # by name, .10 < .2
    assert all((tmp_path / n).exists() for n in foreign)  # not ours: left alone
    assert checkpoint.checkpoints(tmp_path) == [newest]


async def test_checkpointer_repeats_a_step_under_new_names(tmp_path: Path) -> None:
    class Metrics:
        checkpoint_failures = None

        def checkpointed(self, seconds: float) -> None:
            pass

    events: list[dict[str, Any]] = []
    writer = checkpoint.Checkpointer(tmp_path, 3, Metrics(),
                                     lambda event, **fields: events.append(fields))
    for v in (1, 2):
        await writer.write({"counters": {"step": 4844}, "v": v})
    assert [e["path"] for e in events] == [str(tmp_path / name(4844)),
                                           str(tmp_path / name(4844, 1))]
    assert writer.last is not None and writer.last["path"] == events[-1]["path"]
    assert [checkpoint.load(Path(e["path"]))["v"] for e in events] == [1, 2]


class Bomb:
    """Pickling this fails: torch.save has already written part of the payload."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        raise self.exc


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_crash_while_serializing_keeps_previous(tmp_path: Path, exc: BaseException) -> None:
    good = checkpoint.save(tmp_path, make_state(), step=1, keep=1)
    state = {"model": make_state()["model"], "z": Bomb(exc)}
    with pytest.raises(type(exc)):
        checkpoint.save(tmp_path, state, step=2, keep=1)
    assert os.listdir(tmp_path) == [good.name]  # no partial final file, no temp file
    assert checkpoint.load_latest(tmp_path)[0] == good


def test_disk_full_mid_payload_keeps_previous(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    good = checkpoint.save(tmp_path, {"v": 1}, step=1, keep=1)
    written: list[int] = []

    class Full(io.BufferedWriter):  # a disk that fills up after 4 KiB of payload
        def write(self, data: Any) -> int:
            if sum(written) > 4096:
                raise OSError(28, "No space left on device")
            written.append(memoryview(data).nbytes)
            return super().write(data)

    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, "wb", buffering=0)))
    with pytest.raises(OSError, match="No space"):
        checkpoint.save(tmp_path, make_state(), step=2, keep=1)
    assert sum(written) > 4096
    assert os.listdir(tmp_path) == [good.name]
    assert checkpoint.load_latest(tmp_path) == (good, {"v": 1})


def test_crash_at_rename_keeps_previous(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = checkpoint.save(tmp_path, {"v": 1}, step=1, keep=1)

    def fail(src: Any, dst: Any) -> None:
        # The new file is complete and fsynced, but not yet in place.
        assert checkpoint.load(Path(src)) == {"v": 2}
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"v": 2}, step=2, keep=1)
    assert os.listdir(tmp_path) == [good.name]
    assert checkpoint.load_latest(tmp_path) == (good, {"v": 1})


def test_crash_at_rename_of_a_repeat_keeps_previous_and_its_temp_is_ours(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = checkpoint.save(tmp_path, {"v": 1}, step=1, keep=1)
    temps: list[str] = []

    def fail(src: Any, dst: Any) -> None:
        temps.append(Path(src).name)
        assert Path(dst).name == name(1, 1) and checkpoint.load(Path(src)) == {"v": 2}
        (tmp_path / "left").write_bytes(Path(src).read_bytes()[:30])  # as a kill -9 would
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"v": 2}, step=1, keep=1)
    monkeypatch.undo()
    [temp] = temps
    assert temp.startswith(f".{name(1, 1)}.") and temp.endswith(".tmp")
    assert set(os.listdir(tmp_path)) == {good.name, "left"}
    assert checkpoint.load_latest(tmp_path) == (good, {"v": 1})
    # A temp file that a crash left under that name is the next save's to remove.
    os.rename(tmp_path / "left", tmp_path / temp)
    path = checkpoint.save(tmp_path, {"v": 3}, step=1, keep=2)
    assert path.name == name(1, 1) and set(os.listdir(tmp_path)) == {good.name, path.name}


def test_crash_leftover_temp_does_not_shadow(tmp_path: Path) -> None:
    good = checkpoint.save(tmp_path, {"v": 1}, step=1, keep=1)
    # What a kill -9 during a write leaves: half a temp file.
    (tmp_path / ".checkpoint-000000000002.ckpt.x1y2.tmp").write_bytes(good.read_bytes()[:30])
    assert checkpoint.load_latest(tmp_path) == (good, {"v": 1})


# --- RNG --------------------------------------------------------------------------------


def draws() -> tuple[list[float], torch.Tensor]:
    return [random.random() for _ in range(5)] + [random.gauss(0, 1)], torch.rand(5)


def test_rng_round_trip(tmp_path: Path) -> None:
    random.seed(123)
    torch.manual_seed(456)
    random.gauss(0, 1)  # leaves a cached gauss_next in python's state
    saved = checkpoint.capture_rng()
    expected = draws()
    path = checkpoint.save(tmp_path, {"rng": saved}, step=1, keep=1)

    random.seed(0)
    torch.manual_seed(0)
    checkpoint.restore_rng(checkpoint.load(path)["rng"])
    again = draws()
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])


def test_rng_cuda_entry_tolerated(caplog: pytest.LogCaptureFixture) -> None:
    state = checkpoint.capture_rng()
    checkpoint.restore_rng({k: v for k, v in state.items() if k != "cuda"})
    fake = dict(state, cuda=[torch.zeros(16, dtype=torch.uint8)] * 9)
    with caplog.at_level(logging.WARNING, logger="daemon.checkpoint"):
        checkpoint.restore_rng(fake)
    assert "rng cuda state skipped" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_cuda_round_trip(tmp_path: Path) -> None:
    torch.cuda.init()
    torch.cuda.manual_seed_all(7)
    saved = checkpoint.capture_rng()
    assert len(saved["cuda"]) == torch.cuda.device_count()
    expected = torch.rand(5, device="cuda").cpu()
    path = checkpoint.save(tmp_path, {"rng": saved}, step=1, keep=1)
    torch.cuda.manual_seed_all(0)
    checkpoint.restore_rng(checkpoint.load(path)["rng"])
    assert torch.equal(torch.rand(5, device="cuda").cpu(), expected)


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("python"), lambda s: s.pop("torch"),
    lambda s: s.__setitem__("python", [3, "x", None]),
    lambda s: s.__setitem__("torch", torch.zeros(3, dtype=torch.uint8)),
    lambda s: s.__setitem__("torch", s["torch"].float()),
])
def test_rng_malformed_changes_nothing(mutate: Any) -> None:
    state = checkpoint.capture_rng()
    mutate(state)
    random.seed(5)
    before = random.getstate()
    with pytest.raises(ValueError):
        checkpoint.restore_rng(state)
    assert random.getstate() == before
