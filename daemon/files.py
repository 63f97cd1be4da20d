"""Writing a file so that a crash leaves the old one or the whole new one: :func:`atomic_write`.

Theory of operation
-------------------
The content goes to a temp file beside the target, ``.<name>.<random>.tmp`` (same directory,
so the rename cannot cross file systems), created with mode 0600 (or ``mode``) and, when
running as root, given the owner of another file (``owner_like``: a key file rewritten by
``sudo gossipd rotate-key`` stays readable by the daemon's user). It is flushed and fsynced,
renamed over the target with ``os.replace``, and the directory is fsynced, which makes the
rename itself durable: without it a power cut may bring the old name back. Until the rename
the target is untouched; on any error, cancellation included, the temp file is removed and
the error propagates.

With ``exclusive`` the target is created in place instead (``O_EXCL``): an existing file,
whatever it holds, is never replaced, and a failed write removes what it created. The file
and then its directory are fsynced as above.

One writer per target at a time: two writers' temp files never collide, but the last rename
wins. Nothing here imports torch: the light commands and :mod:`daemon.sharding` use it too.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Union

__all__ = ["atomic_write", "fsync_directory", "TEMP_SUFFIX"]

TEMP_SUFFIX = ".tmp"  # a temp file is ".<name>.<random>" + TEMP_SUFFIX, beside its target

Content = Union[bytes, Callable[[BinaryIO], None]]


def atomic_write(path: Path, content: Content, *, mode: int = 0o600, exclusive: bool = False,
                 owner_like: Path | None = None) -> None:
    """Create or replace ``path`` so that readers see the old file or the whole new one.

    Args:
        path: the final file; its directory must exist.
        content: the bytes to write, or ``write(f)``, which writes them to the binary file it
            is given.
        mode: the new file's permission bits.
        exclusive: create ``path`` in place, and fail if it exists (see the module docstring).
        owner_like: when running as root, give the new file this file's owner and group.

    Raises:
        FileExistsError: ``exclusive``, and ``path`` exists; nothing was written.
        OSError: creating, writing, syncing, renaming or changing the owner failed; ``path``
            is unchanged (with ``exclusive``: absent).
    """
    path = Path(path)
    if exclusive:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        _fill(fd, path, content, mode, owner_like)
    else:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
        temporary = Path(name)
        _fill(fd, temporary, content, mode, owner_like)
        try:
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise
    fsync_directory(path.parent)


def _fill(fd: int, path: Path, content: Content, mode: int, owner_like: Path | None) -> None:
    """Write ``content`` to the new file ``path`` open as ``fd``, set its mode and owner, and
    fsync it; on any error remove ``path``."""
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            if owner_like is not None and os.geteuid() == 0:
                st = os.stat(owner_like)
                os.fchown(f.fileno(), st.st_uid, st.st_gid)
            if callable(content):
                content(f)
            else:
                f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def fsync_directory(directory: Path) -> None:
    """Make a rename or a creation in ``directory`` durable.

    Raises:
        OSError: the directory cannot be opened or synced.
    """
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
