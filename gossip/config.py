"""A node's settings: one tree of frozen dataclasses, each field declared once.

:class:`NodeConfig` is everything :func:`gossip.open_swarm` needs to know that is not an
object: where to listen, whom to join, whom to trust, and the averaging, membership, timeout
and limit settings. Presets are made with :func:`dataclasses.replace` from the defaults, as
memberlist does: :meth:`NodeConfig.default`, :meth:`NodeConfig.local` (one machine or a
simulated network) and :meth:`NodeConfig.wan` (nodes across the internet).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .averaging import AveragingConfig
from .channel import Timeouts
from .limits import Limits
from .member import MembershipConfig

__all__ = ["NodeConfig"]


@dataclass(frozen=True)
class NodeConfig:
    """How one node joins a swarm and behaves in it.

    Attributes:
        listen: ``host:port`` for datagrams and channels (port 0 picks one).
        advertise: the address others should dial, when not ``listen`` (say, behind NAT).
        bootstrap: some members' addresses; empty starts a new swarm.
        allow: the peer ids this node exchanges weights with (offers, downloads, both ways);
            None: any holder of the swarm key. Membership itself is open to every key holder.
        reachable: whether other members can dial ``advertise`` (or ``listen``). False, behind
            a NAT or a firewall: the node initiates every exchange and download itself and is
            never chosen by others. None: find out after joining, with a dial-back check
            (:mod:`gossip.reachability`).
        averaging: how and how often the node averages (:class:`AveragingConfig`).
        membership: failure detection and gossip timing (:class:`MembershipConfig`).
        timeouts: the channel's per-phase deadlines (:class:`Timeouts`).
        limits: inbound connections open at once, and how often one peer may open one
            (:class:`Limits`).
    """

    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    bootstrap: tuple[str, ...] = ()
    allow: frozenset[str] | None = None
    reachable: bool | None = True
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if isinstance(self.bootstrap, str):
            raise ValueError(f"bootstrap must be a sequence of addresses, not the string "
                             f"{self.bootstrap!r}")
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))
        if self.allow is not None:
            object.__setattr__(self, "allow", frozenset(self.allow))
        if self.reachable not in (True, False, None):
            raise ValueError(f"reachable must be True, False or None, not {self.reachable!r}")
        for name, cls in (("averaging", AveragingConfig), ("membership", MembershipConfig),
                          ("timeouts", Timeouts), ("limits", Limits)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, not "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def default(cls) -> NodeConfig:
        """The defaults: a LAN's membership timing, a round every step or every 10 s idle."""
        return cls()

    @classmethod
    def local(cls) -> NodeConfig:
        """For nodes on one machine or a simulated network (:mod:`gossip.testing`): every
        node starts from its own model, and an idle node averages every second."""
        base = cls.default()
        return dataclasses.replace(
            base, averaging=dataclasses.replace(base.averaging, interval=1.0, start="own"))

    @classmethod
    def wan(cls) -> NodeConfig:
        """For nodes across the internet: memberlist's patient WAN membership timing."""
        return dataclasses.replace(cls.default(), membership=MembershipConfig.wan())
