"""gossip: decentralized averaging of PyTorch models over an authenticated peer-to-peer swarm.

This module is the whole public API; everything else is an implementation detail.
"""

from .averaging import AveragingConfig as AveragingConfig
from .averaging import AveragingStatistics as AveragingStatistics
from .averaging import Exchange as Exchange
from .averaging import Result as Result
from .channel import MAX_RECORD as MAX_RECORD
from .channel import ChannelStatistics as ChannelStatistics
from .channel import SecureChannel as SecureChannel
from .channel import Timeouts as Timeouts
from .channel import connect as connect
from .channel import serve as serve
from .download import Download as Download
from .errors import AveragingFailed as AveragingFailed
from .errors import ChannelClosed as ChannelClosed
from .errors import GossipError as GossipError
from .errors import HandshakeError as HandshakeError
from .errors import IdentityError as IdentityError
from .errors import LocalProtocolError as LocalProtocolError
from .errors import PeerGone as PeerGone
from .errors import PeerTimeout as PeerTimeout
from .errors import RemoteProtocolError as RemoteProtocolError
from .errors import SchemaMismatch as SchemaMismatch
from .errors import WireError as WireError
from .handshake import PROTOCOL_VERSION as PROTOCOL_VERSION
from .handshake import Swarm as Swarm
from .identity import Identity as Identity
from .identity import PeerId as PeerId
from .limits import Limits as Limits
from .member import Member as Member
from .member import MembershipConfig as MembershipConfig
from .member import State as State
from .network import Network as Network
from .node import SwarmNode as SwarmNode
from .node import open_swarm as open_swarm
from .network import TcpNetwork as TcpNetwork
from .replica import Counters as Counters
from .roster import Roster as Roster
from .roster import RosterStatistics as RosterStatistics
from .roster import open_roster as open_roster
from .simnet import SimNetwork as SimNetwork
from .tensors import StateSchema as StateSchema
from .threaded import Averager as Averager
from .transfer import receive_state as receive_state
from .transfer import send_state as send_state

__version__ = "0.1.0"
