"""Task entries (``package.module:function`` or ``path/to/file.py:function``) as text.

Apart from :mod:`daemon.task` because it needs no torch: the config's checks and the light
commands (``gossipd status``, ``init``) use it, and must start in a fraction of a second.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["entry_file", "is_file_entry", "parse_entry"]


def parse_entry(entry: str) -> tuple[str, str]:
    """Split a task entry into its target and its function: ``package.module:function`` (a
    module on the Python path) or ``path/to/file.py:function`` (a file). A target that ends in
    ``.py`` or holds a ``/`` is a file path: ``x.py``, ``./x.py``, ``../x.py``, ``sub/x.py`` or
    an absolute path; anything else must be a dotted module name.

    Raises:
        ValueError: ``entry`` is of neither form (the message says why).
    """
    target, sep, function = entry.rpartition(":")
    form = f"expected 'module:function' or 'path/to/file.py:function', got {entry!r}"
    if not sep or not target or not function.isidentifier():
        raise ValueError(form)
    if is_file_entry(target):
        if not target.endswith(".py"):
            raise ValueError(f"expected 'path/to/file.py:function' (a task file ends in .py), "
                             f"got {entry!r}")
    elif not all(part.isidentifier() for part in target.split(".")):
        raise ValueError(form)
    return target, function


def is_file_entry(target: str) -> bool:
    """Whether an entry's target (the part before ``:``) names a file rather than a module."""
    return target.endswith(".py") or "/" in target


def entry_file(entry: str, base: str | os.PathLike[str]) -> Path | None:
    """The absolute path of an entry's task file, a relative one taken from ``base``; None for
    a module entry (or a malformed one)."""
    try:
        target, _ = parse_entry(entry)
    except ValueError:
        return None
    return Path(os.path.abspath(Path(base) / target)) if is_file_entry(target) else None
