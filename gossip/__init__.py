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
    "address": ("format_address", "parse_address"),
    "averaging": ("AveragingStatistics", "Exchange", "Result"),
    "channel": ("MAX_RECORD", "ChannelStatistics", "SecureChannel", "connect", "serve"),
    "config": ("AveragingConfig", "Limits", "MembershipConfig", "NodeConfig", "Timeouts"),
    "correction": ("check_correction",),
    "download": ("Download",),
    "errors": ("BadMessage", "ChannelClosed", "DownloadFailed", "GossipError", "HandshakeClosed",
               "HandshakeError", "IdentityClash", "IdentityError", "LocalProtocolError",
               "PeerGone", "PeerTimeout", "ProcessLost", "RemoteProtocolError",
               "ReplicasDiverged", "SchemaMismatch", "WireError"),
    "groups": ("one_error",),
    "handshake": ("CIPHERS", "DEFAULT_CIPHER", "PROTOCOL_VERSION", "Swarm"),
    "identity": ("Identity", "PeerId"),
    "member": ("Member", "State"),
    "messages": ("MAX_COUNT", "MAX_SHARDS"),
    "network": ("Network", "TcpNetwork"),
    "node": ("SwarmNode", "open_swarm"),
    "outer": ("check_outer",),
    "nodegroup": ("NodeGroup", "NodeGroupStatistics"),
    "replica": ("Counters", "Replica"),
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
    from .address import format_address, parse_address
    from .averaging import AveragingStatistics, Exchange, Result
    from .channel import MAX_RECORD, ChannelStatistics, SecureChannel, connect, serve
    from .config import AveragingConfig, Limits, MembershipConfig, NodeConfig, Timeouts
    from .correction import check_correction
    from .download import Download
    from .errors import (BadMessage, ChannelClosed, DownloadFailed, GossipError, HandshakeClosed,
                         HandshakeError, IdentityClash, IdentityError, LocalProtocolError,
                         PeerGone, PeerTimeout, ProcessLost, RemoteProtocolError,
                         ReplicasDiverged, SchemaMismatch, WireError)
    from .groups import one_error
    from .handshake import CIPHERS, DEFAULT_CIPHER, PROTOCOL_VERSION, Swarm
    from .identity import Identity, PeerId
    from .member import Member, State
    from .messages import MAX_COUNT, MAX_SHARDS
    from .network import Network, TcpNetwork
    from .node import SwarmNode, open_swarm
    from .outer import check_outer
    from .nodegroup import NodeGroup, NodeGroupStatistics
    from .replica import Counters, Replica
    from .roster import Roster, RosterStatistics, open_roster
    from .rotation import Holds, RotationStatistics
    from .simnet import SimNetwork
    from .tensors import StateSchema
    from .threaded import Averager
    from .transfer import receive_state, send_state
