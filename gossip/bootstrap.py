"""Joining a swarm through its bootstrap addresses, and joining again when left alone.

Theory of operation
-------------------
A node given bootstrap addresses joins by a push-pull (:mod:`gossip.roster`) with any one of
them: one answering is enough. :class:`Joiner` tries them in random order; while none
answers it waits with exponential backoff (``join_retry_min`` doubling up to
``join_retry_max``, each wait drawn from half to one and a half times that) and tries again,
for as long as the roster runs. An address that leads back to this very node
(:class:`gossip.clash.Myself`) does not count as a failure: a node whose bootstrap list
names only itself is the swarm's first.

Once in, the loop stays: every ``reconnect_interval`` it checks whether we are alone (every
member gone, or cut off from us) and then joins again the same way. It also runs the
dial-back check (:class:`gossip.reachability.ReachabilityCheck`) after each join and
whenever that check is due.

What the operator is told: each failed attempt's reason goes into :class:`JoinTrouble`
(:attr:`gossip.roster.Roster.trouble`), saying what to check (:func:`why_not`); a WARNING
says it at once, then at a slowing pace (:data:`FIRST_WARNING_GAP` doubling up to
:data:`MAX_WARNING_GAP`), with INFO lines in between, so an hour of retries is some eight
warnings, not sixty.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import trio

from .clash import Myself
from .config import MembershipConfig
from .errors import (
    GossipError,
    HandshakeClosed,
    HandshakeError,
    IdentityClash,
    PeerGone,
    PeerTimeout,
)
from .identity import PeerId
from .membership import Membership
from .reachability import ReachabilityCheck

__all__ = ["JoinTrouble", "Joiner", "why_not", "FIRST_WARNING_GAP", "MAX_WARNING_GAP"]

# The roster's log: these lines were always the roster's, and operators filter on its name.
log = logging.getLogger("gossip.roster")

FIRST_WARNING_GAP = 30.0  # s from the first "cannot join" warning to the next
MAX_WARNING_GAP = 600.0  # s: the warnings' gap doubles up to this


@dataclass(frozen=True)
class JoinTrouble:
    """Bootstrap attempts that have failed since ``since`` (trio time), and why each
    address failed the last time: what to tell the operator."""

    since: float
    attempts: int  # rounds over the bootstrap list
    reasons: dict[str, str]  # address -> what went wrong, and what to check


class Joiner:
    """The join loop of one roster (:meth:`run`), and what it found out.

    Args:
        bootstrap: some members' addresses; none: we start the swarm, and are joined.
        push_pull: a joining push-pull with an address; returns the peer that answered.
            Raises :class:`~gossip.clash.Myself` for this very node, or another
            :class:`~gossip.errors.GossipError`.
        wake: tells the roster's ticker that the machine's next deadline moved earlier.
        reach: the dial-back check to run after joining.
    """

    def __init__(self, bootstrap: Sequence[str], config: MembershipConfig, *,
                 push_pull: Callable[[str], Awaitable[PeerId]], wake: Callable[[], None],
                 reach: ReachabilityCheck) -> None:
        self._bootstrap = list(bootstrap)
        self._config = config
        self._push_pull = push_pull
        self._wake = wake
        self._reach = reach
        self._joined = trio.Event()
        if not self._bootstrap:
            self._joined.set()  # the swarm's first node
        self._stopped = False  # we leave: stop at the next turn, check nothing more
        self._trouble: JoinTrouble | None = None  # bootstrap attempts failing since
        self._warned_at = -math.inf  # when the last join warning was logged
        self._warning_gap = FIRST_WARNING_GAP  # until the next one; doubles each time
        self._through: PeerId | None = None  # the member our last join went through

    @property
    def joined(self) -> bool:
        """Whether a bootstrap address has answered (always, if there were none)."""
        return self._joined.is_set()

    async def wait_joined(self) -> None:
        """Return once a bootstrap address answered (at once if there were none)."""
        await self._joined.wait()

    @property
    def trouble(self) -> JoinTrouble | None:
        """Why no bootstrap address has let us in, while that lasts."""
        return self._trouble

    def stop(self) -> None:
        """We leave: the loop ends at its next turn and starts no dial-back check."""
        self._stopped = True

    async def run(self, m: Membership) -> None:
        """Push-pull with a bootstrap address until one answers, backing off while none
        does; afterwards join again whenever we find ourselves alone (every member gone or
        cut off), checking every ``reconnect_interval``. Returns once :meth:`stop` is called.

        Args:
            m: the roster's machine: who is alive, its rng, and the news that we joined.
        """
        config = self._config
        delay = config.join_retry_min
        while not self._stopped:
            if self._joined.is_set() and m.alive_count() > 1:
                delay = config.join_retry_min
                self._trouble = None  # company came back, through others' push-pulls
                self._warning_gap = FIRST_WARNING_GAP
                if self._reach.due(trio.current_time()):
                    await self._reach.run(m, self._through)
                await trio.sleep(config.reconnect_interval)
            elif await self._try_bootstrap(m):
                self._joined.set()
                self._trouble = None
                self._warning_gap = FIRST_WARNING_GAP
                if not self._stopped:
                    await self._reach.run(m, self._through)
                # Alone even so (the bootstrap list named only us, or its members have
                # nobody else): look again later, not in a loop.
                await trio.sleep(config.reconnect_interval)
            else:
                self._warn(delay)
                await trio.sleep(delay * (0.5 + m.rng.random()))
                delay = min(delay * 2, config.join_retry_max)

    async def _try_bootstrap(self, m: Membership) -> bool:
        """Push-pull with the bootstrap addresses in random order until one answers. True
        if one did, or if every one of them is this very node (we are the first). Each
        failure's reason goes into :attr:`trouble`."""
        bootstrap = self._bootstrap
        myself = 0
        reasons: dict[str, str] = {}
        for address in m.rng.sample(bootstrap, len(bootstrap)):
            try:
                peer = await self._push_pull(address)
            except Myself:
                myself += 1
                continue
            except GossipError as exc:
                reasons[address] = why_not(exc, self._config.push_pull_timeout)
                log.info("bootstrap did not answer address=%s: %s", address, reasons[address])
                continue
            log.info("joined swarm via=%s peer=%s members=%d", address, peer.short,
                     m.alive_count())
            self._through = peer
            m.joined(trio.current_time())
            self._wake()  # the next push-pull moved earlier
            return True
        if myself == len(bootstrap):
            return True
        now = trio.current_time()
        since, attempts = (now, 0) if self._trouble is None else (self._trouble.since,
                                                                 self._trouble.attempts)
        self._trouble = JoinTrouble(since, attempts + 1, reasons)
        return False

    def _warn(self, delay: float) -> None:
        """Say why we cannot join, at WARNING: at once, then at a slowing pace (the gap
        doubles from FIRST_WARNING_GAP up to MAX_WARNING_GAP); INFO in between."""
        trouble, now = self._trouble, trio.current_time()
        assert trouble is not None
        where = "; ".join(f"{address}: {why}" for address, why in trouble.reasons.items())
        if now - self._warned_at < self._warning_gap:
            log.info("no bootstrap address answered; retrying in about %.1f s", delay)
            return
        self._warned_at = now
        self._warning_gap = min(self._warning_gap * 2, MAX_WARNING_GAP)
        state = ("cannot join the swarm" if not self._joined.is_set()
                 else "alone: every member is gone, and no bootstrap address answers")
        log.warning("%s: %d attempt(s) in %.0f s failed; %s; retrying in about %.0f s",
                    state, trouble.attempts, now - trouble.since, where, delay)


def why_not(exc: GossipError, timeout: float) -> str:
    """What a failed bootstrap attempt means, and what the operator should check."""
    if isinstance(exc, IdentityClash):
        return f"{exc} (a copied identity key?)"
    if isinstance(exc, HandshakeClosed):
        return (f"{exc}: check that our swarm key and swarm.cipher are this swarm's, and the "
                "address")
    if isinstance(exc, HandshakeError):
        return f"{exc}: check swarm.name and the address"
    if isinstance(exc, PeerTimeout):
        return (f"no answer within {timeout:g} s: a firewall that drops packets, a wrong "
                "address, or an overloaded node?")
    if isinstance(exc, PeerGone):
        return f"{exc}: is the node there running, the address and port right, the port open?"
    return str(exc)
