"""gossip.lowlevel: the building blocks under :func:`gossip.open_swarm`, for programs that put
a node together another way.

A training script needs only ``gossip`` (:func:`~gossip.open_swarm`, :class:`~gossip.Averager`
and their settings). What is here is for programs that go below that, as ``gossipd`` itself
does: a secure channel to a peer and a server of them (``connect``, ``serve``,
``SecureChannel``), a model's state sent over one (``StateSchema``, ``snapshot``,
``send_state``, ``receive_state``),
membership without averaging (``open_roster``), the network seam and its TCP implementation,
the replica a node averages and its counters, the checks of the drift correction's and the
outer step's settings, and the limits and constants of the wire protocol
(docs/PROTOCOL.md). ``gossip.testing`` has the simulated network.

Each name loads on first use, as ``gossip``'s do (:mod:`gossip.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import namespace

# module -> the names it gives. Keep the TYPE_CHECKING block in step (tests/unit/test_imports.py).
_API: dict[str, tuple[str, ...]] = {
    "address": ("format_address", "parse_address"),
    "channel": ("MAX_RECORD", "ChannelStatistics", "SecureChannel"),
    "correction": ("check_correction",),
    "endpoints": ("connect", "serve"),
    "groups": ("one_error",),
    "handshake": ("CIPHERS", "DEFAULT_CIPHER", "PROTOCOL_VERSION"),
    "messages": ("MAX_COUNT",),
    "network": ("Network", "TcpNetwork"),
    "outer": ("check_outer",),
    "pipeline": ("sequential_step",),
    "replica": ("Counters", "Replica"),
    "roster": ("Roster", "RosterStatistics", "open_roster"),
    "rotation": ("Holds", "RotationStatistics"),
    "schema": ("StateSchema",),
    "stages": ("StageGroup",),
    "tensors": ("snapshot",),
    "transfer": ("receive_state", "send_state"),
}
__getattr__, __dir__, __all__ = namespace(__name__, _API)

if TYPE_CHECKING:
    from .address import format_address, parse_address
    from .channel import MAX_RECORD, ChannelStatistics, SecureChannel
    from .correction import check_correction
    from .endpoints import connect, serve
    from .groups import one_error
    from .handshake import CIPHERS, DEFAULT_CIPHER, PROTOCOL_VERSION
    from .messages import MAX_COUNT
    from .network import Network, TcpNetwork
    from .outer import check_outer
    from .pipeline import sequential_step
    from .replica import Counters, Replica
    from .roster import Roster, RosterStatistics, open_roster
    from .rotation import Holds, RotationStatistics
    from .schema import StateSchema
    from .stages import StageGroup
    from .tensors import snapshot
    from .transfer import receive_state, send_state
