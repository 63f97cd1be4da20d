"""What the membership state machine asks its driver to do: the effects it returns.

:class:`~gossip.membership.Membership` does no I/O: each of its inputs returns a list of
effects, in the order they arose, and the driver (:mod:`gossip.roster`) carries them out in
that order: a sealed datagram to send (:class:`Send`), a table swap over a secure channel
(:class:`PushPullWith`), and news of a member for whoever watches the table
(:class:`Changed`). Like h11's events, they are plain frozen data, so a test reads them as it
reads messages. (The membership's own probe cycle has effects of its own, internal to it:
:mod:`gossip.probing`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .identity import PeerId
from .member import Member

__all__ = ["Send", "PushPullWith", "Changed", "Effect"]


@dataclass(frozen=True)
class Send:
    """Effect: seal ``data`` and send it as one datagram to ``address``."""

    address: str
    data: bytes


@dataclass(frozen=True)
class PushPullWith:
    """Effect: swap full tables with ``peer`` at ``address`` over a secure channel, then
    :meth:`~gossip.membership.Membership.merge` what it sent. ``peer`` None: a bootstrap
    address, anyone."""

    address: str
    peer: PeerId | None


@dataclass(frozen=True)
class Changed:
    """Effect: ``member``'s state, address or metadata changed (or it is new)."""

    member: Member


Effect = Union[Send, PushPullWith, Changed]
