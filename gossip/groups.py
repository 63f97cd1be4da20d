"""Exception groups from nurseries, turned back into the one error that matters.

trio wraps whatever escapes a nursery in an exception group. Callers of this library expect
one typed error (a :class:`~gossip.errors.GossipError`), so the drivers unwrap groups at
their boundary with these context managers.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .errors import ChannelClosed

__all__ = ["one_error", "first_error", "leaves"]


def leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions in ``group`` and its nested groups, depth first."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


@contextmanager
def one_error() -> Iterator[None]:
    """Raise the one exception of a nursery's group as itself: a background failure reaches
    the caller as one typed error, not as a group around it. A group of several stays one."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = leaves(group)
        if len(found) == 1:
            raise found[0] from None
        raise


@contextmanager
def first_error() -> Iterator[None]:
    """Raise the error that ended a send-and-receive pair as itself. When one side fails it
    closes the channel and the other then fails with :class:`ChannelClosed` (or is
    cancelled): that is a consequence, and the cause is what gets raised."""
    try:
        yield
    except BaseExceptionGroup as group:
        found = [e for e in leaves(group) if not isinstance(e, trio.Cancelled)]
        causes = [e for e in found if not isinstance(e, ChannelClosed)] or found
        if not causes:
            raise
        raise causes[0] from None
