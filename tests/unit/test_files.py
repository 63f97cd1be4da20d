"""daemon.files.atomic_write: the old file or the whole new one, never a torn one or a stray
temp file; the mode; never overwriting when exclusive."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

import pytest

from daemon.files import TEMP_SUFFIX, atomic_write


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_replaces_a_file_whole_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")
    path.chmod(0o644)
    atomic_write(path, b"new")
    assert path.read_bytes() == b"new" and mode(path) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_writes_through_a_function_and_keeps_the_mode_it_is_given(tmp_path: Path) -> None:
    path = tmp_path / "f"

    def write(f: BinaryIO) -> None:
        f.write(b"a")
        f.write(b"b")

    atomic_write(path, write, mode=0o640)
    assert path.read_bytes() == b"ab" and mode(path) == 0o640


def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"old")

    def write(f: BinaryIO) -> None:
        f.write(b"half")
        assert any(p.name.endswith(TEMP_SUFFIX) for p in tmp_path.iterdir())  # beside it
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        atomic_write(path, write)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_exclusive_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "f"
    atomic_write(path, b"first", exclusive=True)
    assert path.read_bytes() == b"first" and mode(path) == 0o600
    with pytest.raises(FileExistsError):
        atomic_write(path, b"second", exclusive=True)
    assert path.read_bytes() == b"first"


def test_a_failed_exclusive_write_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "f"

    def write(f: BinaryIO) -> None:
        raise OSError("no space left")

    with pytest.raises(OSError, match="no space left"):
        atomic_write(path, write, exclusive=True)
    assert not path.exists()


def test_owner_like_gives_roots_file_the_owner_of_another(tmp_path: Path) -> None:
    like = tmp_path / "like"
    like.write_bytes(b"")
    root = os.geteuid() == 0
    if root:
        os.chown(like, 1234, 1234)  # the daemon's user, say
    atomic_write(tmp_path / "f", b"x", owner_like=like)  # as a user: no chown attempted
    st = (tmp_path / "f").stat()
    assert (st.st_uid, st.st_gid) == ((1234, 1234) if root else (os.geteuid(), os.getegid()))
