"""gossip: decentralized averaging of PyTorch models over an authenticated peer-to-peer swarm.

This module is the API a training program needs: :func:`open_swarm` (trio) and
:class:`Averager` (plain scripts), their settings, identities, what an exchange reports, and
the errors. Three modules are public as modules, each by its own ``__all__``:
:mod:`gossip.lowlevel`, the building blocks under ``open_swarm`` (channels, state transfer,
membership alone, the replica); :mod:`gossip.config`, whose ``setting()`` declares settings
as the library declares its; :mod:`gossip.devices`, the one resolver of device names; and
:mod:`gossip.testing`, the fault toolkit and the simulated network. Everything else is an
implementation detail.

Each name is imported on first use (PEP 562, :mod:`gossip.lazy`). Most of the API needs torch,
whose import takes seconds, and every ``import gossip.<module>`` runs this file first: eager
imports here would make ``gossip.address`` or ``gossip.identity`` cost as much as all of it,
and ``gossipd status`` wait seconds for a reply that takes milliseconds. The
``TYPE_CHECKING`` block names the same API for type checkers and readers;
``tests/unit/test_imports.py`` checks that it and :data:`_API` agree, and
``tests/unit/test_public_api.py`` that it stays at most 40 names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import namespace

__version__ = "0.1.0"

# The public API: module -> the names it gives. Keep the TYPE_CHECKING block in step.
_API: dict[str, tuple[str, ...]] = {
    "averaging": ("AveragingStatistics", "Exchange", "Result"),
    "config": ("AveragingConfig", "Limits", "MembershipConfig", "NodeConfig", "Timeouts"),
    "download": ("Download",),
    "errors": ("BadMessage", "ChannelClosed", "DownloadFailed", "GossipError", "HandshakeClosed",
               "HandshakeError", "IdentityClash", "IdentityError", "LocalProtocolError",
               "PeerGone", "PeerTimeout", "ProcessLost", "RemoteProtocolError",
               "ReplicasDiverged", "SchemaMismatch", "WireError"),
    "handshake": ("Swarm",),
    "identity": ("Identity", "PeerId"),
    "member": ("Member", "State"),
    "messages": ("MAX_SHARDS",),
    "node": ("SwarmNode", "open_swarm"),
    "nodegroup": ("NodeGroup", "NodeGroupStatistics"),
    "pipeline": ("Pipeline", "Stages"),
    "threaded": ("Averager",),
}
# Names this module gave before they moved: they still load, with a DeprecationWarning.
_MOVED = {
    **dict.fromkeys(("CIPHERS", "ChannelStatistics", "Counters", "DEFAULT_CIPHER", "Holds",
                     "MAX_COUNT", "MAX_RECORD", "Network", "PROTOCOL_VERSION", "Replica",
                     "Roster", "RosterStatistics", "RotationStatistics", "SecureChannel",
                     "StateSchema", "TcpNetwork", "check_correction", "check_outer", "connect",
                     "format_address", "one_error", "open_roster", "parse_address",
                     "receive_state", "send_state", "serve"), "gossip.lowlevel"),
    "SimNetwork": "gossip.testing",
}
__getattr__, __dir__, __all__ = namespace(__name__, _API, moved=_MOVED)

if TYPE_CHECKING:
    from .averaging import AveragingStatistics, Exchange, Result
    from .config import AveragingConfig, Limits, MembershipConfig, NodeConfig, Timeouts
    from .download import Download
    from .errors import (BadMessage, ChannelClosed, DownloadFailed, GossipError, HandshakeClosed,
                         HandshakeError, IdentityClash, IdentityError, LocalProtocolError,
                         PeerGone, PeerTimeout, ProcessLost, RemoteProtocolError,
                         ReplicasDiverged, SchemaMismatch, WireError)
    from .handshake import Swarm
    from .identity import Identity, PeerId
    from .member import Member, State
    from .messages import MAX_SHARDS
    from .node import SwarmNode, open_swarm
    from .nodegroup import NodeGroup, NodeGroupStatistics
    from .pipeline import Pipeline, Stages
    from .threaded import Averager
