"""The error boundary: what trio raises, turned into the one typed error callers expect.

Callers of this library catch one typed error (a :class:`~gossip.errors.GossipError`), never
trio's own exceptions, so the drivers convert those where they arise, with these context
managers:

* exception groups: trio wraps whatever escapes a nursery in one; :func:`one_error` and
  :func:`first_error` unwrap it to the error that matters;
* deadlines: ``trio.fail_after`` raises ``trio.TooSlowError``, which names neither the peer
  nor the phase; :func:`phase_deadline` and :func:`phase_deadline_at` set a deadline and
  raise :class:`~gossip.errors.PeerTimeout` ``(peer, phase)`` when it passes, so a deadline
  is converted where it is set and no ``TooSlowError`` leaves the library.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import trio

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

from .errors import ChannelClosed, PeerTimeout

__all__ = ["one_error", "first_error", "leaves", "phase_deadline", "phase_deadline_at"]


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


@contextmanager
def phase_deadline_at(deadline: float, peer: object, phase: str) -> Iterator[trio.CancelScope]:
    """``trio.fail_at(deadline)`` at the error boundary: a deadline that passes raises
    :class:`~gossip.errors.PeerTimeout` ``(peer, phase)``, not ``trio.TooSlowError``, so the
    caller's callers catch :class:`~gossip.errors.GossipError` alone.

    Raises:
        PeerTimeout: ``deadline`` (on trio's clock) passed inside the block.
    """
    try:
        with trio.fail_at(deadline) as scope:
            yield scope
    except trio.TooSlowError:
        raise PeerTimeout(peer, phase) from None


@contextmanager
def phase_deadline(seconds: float, peer: object, phase: str) -> Iterator[trio.CancelScope]:
    """``trio.fail_after(seconds)`` at the error boundary: as :func:`phase_deadline_at`.

    Raises:
        PeerTimeout: ``seconds`` passed inside the block.
    """
    with phase_deadline_at(trio.current_time() + seconds, peer, phase) as scope:
        yield scope
