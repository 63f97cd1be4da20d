"""Who has proved its identity to this node, and the handshakes that prove more of them.

Theory of operation
-------------------
A record heard in gossip is only a claim: anyone with the swarm key can announce identities
it does not hold. Every channel that completes its handshake, whichever side dialled, is a
proof that the peer holds its identity key; :class:`Proving` keeps those proofs (when and
from which host each peer first proved itself: :class:`~gossip.standing.Proofs`), and
:meth:`Proving.prove` makes more: a handshake with each of a sample of the members a joiner
heard of, on a channel that carries only a ``Close(0)`` (no table, so that nobody learns of
the joiner any sooner than gossip tells it). What counts identities (standing, the step's
estimate, the data shards) counts proven members only.

A member whose proof failed is not dialled again for ``push_pull_interval`` (a joiner that
retries its download every second would otherwise wait on the same dead or invented members
each time); the failures remembered are bounded by :data:`MAX_UNPROVABLE`. A second caller
waits for a proof another has in flight rather than count it failed. The roster
(:mod:`gossip.roster`) owns one and answers the averager's questions from it.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict

import trio

from .channel import SecureChannel
from .config import NodeConfig
from .endpoints import connect
from .errors import GossipError
from .groups import phase_deadline
from .handshake import Swarm
from .identity import Identity
from .member import Member
from .messages import Close
from .network import Network
from .standing import Proofs, host_of

__all__ = ["Proving", "PROVE_SAMPLE", "MAX_UNPROVABLE"]

log = logging.getLogger(__name__)

PROVE_SAMPLE = 8  # members a joiner proves by a handshake each before it counts them
MAX_UNPROVABLE = 4096  # members whose failed proof is remembered (not retried for a while)


class Proving:
    """The proofs of identity a node holds, and the handshakes that add to them.

    Args:
        network, identity, swarm: what a proof's channel is dialled with.
        config: the node's settings (the push-pull deadline and interval, the timeouts).
        rng: the sample of members to prove is drawn from it.
    """

    def __init__(self, network: Network, identity: Identity, swarm: Swarm, config: NodeConfig,
                 rng: random.Random) -> None:
        self._network = network
        self._identity = identity
        self._swarm = swarm
        self._config = config.membership
        self._timeouts = config.timeouts
        self._rng = rng
        self._proofs = Proofs()
        self._unprovable: OrderedDict[str, float] = OrderedDict()  # peer: not before then
        self._proving: dict[str, trio.Event] = {}  # peer: its proof in flight, set when ended

    def __contains__(self, peer: object) -> bool:
        """Whether ``peer`` has proved its identity to us."""
        return peer in self._proofs

    def proved(self, channel: SecureChannel) -> None:
        """``channel`` completed its handshake: its peer proved its identity."""
        if channel.peer != self._identity.peer_id:
            self._proofs.proved(channel.peer, trio.current_time(), channel.host)

    def since(self, peer: str) -> float | None:
        """When ``peer`` first proved its identity to us, or None if it has not."""
        return self._proofs.since(peer)

    def host(self, member: Member) -> str:
        """The host ``member`` last proved itself from, or its address's if it never did."""
        host = self._proofs.host(member.peer)
        return host_of(member) if host is None else host

    async def prove(self, members: list[Member], most: int = PROVE_SAMPLE) -> None:
        """Complete a handshake with up to ``most`` of ``members`` not yet proven (a random
        sample, :data:`PROVE_SAMPLE` at a time; the channel carries only a ``Close(0)``), so
        that what counts identities can count them. Failures are only logged: a record whose
        address is not its own, say, stays unproven. Returns when every attempt has ended,
        all within one push-pull deadline. Members that announce they take no connections
        are tried too, after the others (a member whose dial-back check has not run yet
        announces so). A member whose attempt failed is not tried again
        for ``push_pull_interval`` (a joiner retrying its download every second would
        otherwise wait on the same dead or invented members each time)."""
        now = trio.current_time()
        sample: list[Member] = []
        # Another caller's attempts in flight (the download's and the shard choice's run at
        # once after a join): wait for those rather than skip them as failed.
        pending = [self._proving[m.peer] for m in members if m.peer in self._proving]
        for reachable in (True, False):  # those that say they take connections first
            unproven = [m for m in members if m.peer not in self._proofs
                        and m.peer not in self._proving and m.reachable == reachable
                        and self._unprovable.get(m.peer, now) <= now]
            room = most - len(sample)
            sample += unproven if len(unproven) <= room else self._rng.sample(unproven, room)
        limiter = trio.CapacityLimiter(PROVE_SAMPLE)
        deadline = now + self._config.push_pull_timeout  # all of them

        async def one(member: Member, done: trio.Event) -> None:
            # Marked unprovable until it succeeds, so that an attempt cut by the deadline
            # counts as failed too.
            self._unprovable.pop(member.peer, None)
            self._unprovable[member.peer] = now + self._config.push_pull_interval
            if len(self._unprovable) > MAX_UNPROVABLE:
                self._unprovable.popitem(last=False)
            try:
                async with limiter:
                    with phase_deadline(self._config.push_pull_timeout, member.address, "proof"):
                        channel = await connect(self._network, member.address,
                                                identity=self._identity, swarm=self._swarm,
                                                allow=frozenset({member.peer}),
                                                timeouts=self._timeouts)
                        self.proved(channel)
                        self._unprovable.pop(member.peer, None)
                        async with channel:
                            await channel.send_closing(Close(Close.NORMAL, "proved"))
            except GossipError as exc:
                log.debug("channel to prove peer=%s failed: %s", member.peer.short, exc)
            finally:
                if self._proving.get(member.peer) is done:
                    del self._proving[member.peer]
                done.set()

        with trio.move_on_at(deadline):
            async with trio.open_nursery() as nursery:
                for member in sample:
                    self._proving[member.peer] = done = trio.Event()
                    nursery.start_soon(one, member, done)
                for event in pending:
                    nursery.start_soon(event.wait)
