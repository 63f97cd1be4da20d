"""Identity clashes: another process that runs with this node's identity key.

Theory of operation
-------------------
Two processes started from one identity key (a copied data directory, say) are one peer id
at two addresses. Neither can average until the operator gives one of them a new identity,
so the roster finds this out and says so (:attr:`gossip.roster.Roster.clash`).

Only a channel authenticated with our own identity key proves a clash, since no other key
holder can forge one. Such a channel comes about in three ways, and each ends in a swap of
our own records (one page each way, :mod:`gossip.tables`):

* a push-pull we start reaches our own identity (:meth:`ClashWatch.meet`): the address
  the other side gives for itself is ours when it is this very node (a bootstrap list that
  names us: :class:`Myself`), another one when it is a clash (:class:`IdentityClash`);
* a channel from our own identity reaches us (:meth:`ClashWatch.answer`): we send our
  record, and judge theirs the same way;
* a claim in gossip, a record of our peer id at another address
  (:meth:`gossip.membership.Membership.take_clash`), proves nothing: it only makes us dial
  that address as ourselves to check (:meth:`ClashWatch.check`).

A clash found is logged once, at ERROR, and then watched: one task dials the address every
``push_pull_interval`` while it still proves our identity, and clears the clash (WARNING)
once it no longer does. At most one such task runs at a time.
"""

from __future__ import annotations

import logging
from typing import Callable, NoReturn

import trio

from .channel import SecureChannel
from .endpoints import connect
from .config import NodeConfig
from .errors import GossipError, IdentityClash, PeerGone
from .groups import phase_deadline
from .handshake import Swarm
from .identity import Identity
from .messages import MemberState
from .network import Network
from .tables import receive_table, send_table

__all__ = ["ClashWatch", "Myself"]

# The roster's log: these lines were always the roster's, and operators filter on its name.
log = logging.getLogger("gossip.roster")


class Myself(PeerGone):
    """A bootstrap address that leads back to this node."""


class ClashWatch:
    """Finds, reports and watches a clash of this node's identity for a roster.

    Args:
        own_state: our own member record, as the roster's machine has it now.
        start_soon: starts a task in the roster's nursery (the watch).
        changed: tells the roster's waiters that :attr:`address` changed.
    """

    def __init__(self, network: Network, identity: Identity, swarm: Swarm, config: NodeConfig,
                 *, own_state: Callable[[], MemberState],
                 start_soon: Callable[..., None], changed: Callable[[], None]) -> None:
        self._network = network
        self._identity = identity
        self._swarm = swarm
        self._config = config.membership
        self._timeouts = config.timeouts
        self._own_state = own_state
        self._start_soon = start_soon
        self._changed = changed
        self._address: str | None = None  # proven: a channel with our identity from there
        self._watching = False  # a task checks the clash now (_watch)

    @property
    def address(self) -> str | None:
        """Where another node runs with our identity, while that is proven; else None."""
        return self._address

    async def meet(self, channel: SecureChannel, address: str, *, join: bool) -> NoReturn:
        """``address`` answered with our own identity: this very node (a bootstrap list
        that names us), or another process with our identity key. Swap our own records to
        tell which; always raises.

        Raises:
            Myself: it is this node.
            IdentityClash: another node runs with our identity (both sides log it).
        """
        mine = self._own_state()
        await send_table(channel, [mine], join=join)
        records = await receive_table(channel, await channel.receive_message())
        other = _other_address(records, mine)
        if other is None:
            raise Myself(f"{address} is this node itself")
        self.found(other)
        raise IdentityClash(other)

    async def answer(self, channel: SecureChannel, records: list[MemberState]) -> None:
        """A push-pull from our own identity sent ``records``: answer with our own record
        (so that the other side can judge too), and judge theirs."""
        mine = self._own_state()
        await send_table(channel, [mine], join=False)
        other = _other_address(records, mine)
        if other is not None:
            self.found(other)

    def found(self, address: str) -> None:
        """A channel from ``address`` proved our own identity: another process holds our
        identity key. Say so once, and keep checking until it stops."""
        if self._address is None:
            log.error("identity clash: the node at %s runs with this node's identity (peer "
                      "%s); two processes started from one identity key, as a copied data "
                      "directory has. Neither can average until one of them gets a new "
                      "identity: stop it, delete its identity key and start it again",
                      address, self._identity.peer_id.short)
            self._changed()
        self._address = address
        self.check(address)

    def check(self, address: str) -> None:
        """Dial ``address`` as ourselves, in the background, unless a check already runs."""
        if not self._watching:
            self._watching = True
            self._start_soon(self._watch, address)

    async def _watch(self, address: str) -> None:
        """Dial ``address`` as our own identity (only a holder of our key can answer so)
        until it no longer proves it: at once for a claim heard in gossip, then every
        push-pull interval while the clash stands."""
        try:
            while True:
                try:
                    with phase_deadline(self._config.push_pull_timeout, address, "push-pull"):
                        channel = await connect(self._network, address,
                                                identity=self._identity, swarm=self._swarm,
                                                allow=frozenset({self._identity.peer_id}),
                                                timeouts=self._timeouts)
                        async with channel:
                            await self.meet(channel, address, join=False)
                except IdentityClash:
                    pass  # it stands; meet recorded it
                except GossipError as exc:  # Myself, gone, timed out, or renamed
                    if self._address == address:
                        log.warning("identity clash over: %s no longer runs with this node's "
                                    "identity (%s)", address, exc)
                        self._address = None
                        self._changed()
                    else:
                        log.info("a claim to be this node from %s did not hold: %s",
                                 address, exc)
                    return
                await trio.sleep(self._config.push_pull_interval)
        finally:
            self._watching = False


def _other_address(records: list[MemberState], mine: MemberState) -> str | None:
    """The address another process gives for our identity in ``records``, if any."""
    for record in records:
        if record.peer == mine.peer and record.address != mine.address:
            return record.address
    return None
