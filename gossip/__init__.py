"""gossip: decentralized averaging of PyTorch models over an authenticated peer-to-peer swarm.

This module is the whole public API; everything else is an implementation detail.

Each name is imported on first use (PEP 562 ``__getattr__``). Most of the API needs torch,
whose import takes seconds, and every ``import gossip.<module>`` runs this file first: eager
imports here would make ``gossip.address`` or ``gossip.identity`` cost as much as all of it,
and ``gossipd status`` wait seconds for a reply that takes milliseconds. The
``TYPE_CHECKING`` block names the same API for type checkers and readers;
``tests/unit/test_imports.py`` checks that it and :data:`_API` agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API: module -> the names it gives. Keep the TYPE_CHECKING block in step.
_API: dict[str, tuple[str, ...]] = {
    "averaging": ("AveragingConfig", "AveragingStatistics", "Exchange", "Result"),
    "channel": ("MAX_RECORD", "ChannelStatistics", "SecureChannel", "Timeouts", "connect",
                "serve"),
    "download": ("Download",),
    "errors": ("ChannelClosed", "DownloadFailed", "GossipError", "HandshakeClosed",
               "HandshakeError", "IdentityClash", "IdentityError", "LocalProtocolError",
               "PeerGone", "PeerTimeout", "ProcessLost", "RemoteProtocolError",
               "ReplicasDiverged", "SchemaMismatch", "WireError"),
    "handshake": ("CIPHERS", "PROTOCOL_VERSION", "Swarm"),
    "identity": ("Identity", "PeerId"),
    "limits": ("Limits",),
    "member": ("Member", "MembershipConfig", "State"),
    "network": ("Network", "TcpNetwork"),
    "node": ("SwarmNode", "open_swarm"),
    "nodegroup": ("NodeGroup", "NodeGroupStatistics"),
    "replica": ("Counters",),
    "roster": ("Roster", "RosterStatistics", "open_roster"),
    "rotation": ("Holds", "RotationStatistics"),
    "simnet": ("SimNetwork",),
    "tensors": ("StateSchema",),
    "threaded": ("Averager",),
    "transfer": ("receive_state", "send_state"),
}
_HOME = {name: module for module, names in _API.items() for name in names}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # asked once: the next lookup finds it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME})


if TYPE_CHECKING:
    from .averaging import AveragingConfig, AveragingStatistics, Exchange, Result
    from .channel import (MAX_RECORD, ChannelStatistics, SecureChannel, Timeouts, connect,
                          serve)
    from .download import Download
    from .errors import (ChannelClosed, DownloadFailed, GossipError, HandshakeClosed,
                         HandshakeError, IdentityClash, IdentityError, LocalProtocolError,
                         PeerGone, PeerTimeout, ProcessLost, RemoteProtocolError,
                         ReplicasDiverged, SchemaMismatch, WireError)
    from .handshake import CIPHERS, PROTOCOL_VERSION, Swarm
    from .identity import Identity, PeerId
    from .limits import Limits
    from .member import Member, MembershipConfig, State
    from .network import Network, TcpNetwork
    from .node import SwarmNode, open_swarm
    from .nodegroup import NodeGroup, NodeGroupStatistics
    from .replica import Counters
    from .roster import Roster, RosterStatistics, open_roster
    from .rotation import Holds, RotationStatistics
    from .simnet import SimNetwork
    from .tensors import StateSchema
    from .threaded import Averager
    from .transfer import receive_state, send_state
