"""gossip.testing: fault injection for swarms, in-process and between real processes.

Not imported by ``import gossip``: a test suite imports it explicitly. :class:`SimNetwork` is
the in-memory network on trio's clock that the simulated swarms run on, for tests of your own
that put nodes on it directly (``open_swarm(..., network=net.host("a"))``). docs/FAULTS.md is the
guide; real daemon processes are started and killed with :mod:`daemon.testing`, and the
pytest fixtures come with the package (``sim_swarm``, ``daemon_swarm``, ``fault_proxies``).
"""

from .hostile import Flood as Flood
from .hostile import HostilePeer as HostilePeer
from .hostile import Outcome as Outcome
from .hostile import Outsider as Outsider
from .hostile import Reaction as Reaction
from .proxy import FaultProxy as FaultProxy
from .proxy import open_fault_proxy as open_fault_proxy
from .proxyclient import ProxyClient as ProxyClient
from .proxyclient import ProxyError as ProxyError
from .proxyctl import ProxyServer as ProxyServer
from .proxyctl import open_proxy_server as open_proxy_server
from .proxyfaults import Faults as Faults
from .proxyfaults import ProxyStatistics as ProxyStatistics
from .sim import SimExchange as SimExchange
from .sim import SimNode as SimNode
from .sim import SimSwarm as SimSwarm
from .sim import open_sim_swarm as open_sim_swarm
from .simnet import SimNetwork as SimNetwork

__all__ = [
    "Flood", "HostilePeer", "Outcome", "Outsider", "Reaction", "FaultProxy",
    "open_fault_proxy", "ProxyClient", "ProxyError", "ProxyServer", "open_proxy_server",
    "Faults", "ProxyStatistics", "SimExchange", "SimNode", "SimSwarm", "open_sim_swarm",
    "SimNetwork",
]
