"""A node's side of the wire codecs: which one it offers each peer, and what the ``mod``
codecs remember between exchanges. Pure torch; no trio.

Theory of operation
-------------------
**The codec of an offer.** ``averaging.codec`` names what a node offers; the initiator's
offer names the codec of both payloads and a responder takes any codec it knows, so a node on
a thin link can send few bytes to a peer on a fast one. A fixed codec is offered as it is; a
fragmented ``mod4/<F>`` names the fragment of each exchange in turn (``mod4/8:0``,
``mod4/8:1``, ...), so that every block is carried once in ``F`` of the node's exchanges.
``"auto"`` picks per peer: the first of :data:`~gossip.config.AUTO_CODECS` whose payload
crosses the link to that peer's host, at the rate its past exchanges carried
(:class:`~gossip.linkrate.LinkRates`), within ``codec_steps`` of the node's training steps.
A host never measured is taken to be as fast as the fastest of those measured; with none
measured the node offers ``int8``, whose exchange measures the link. The fastest, not a
median: key holders on many hosts that each fake a slow link (they trickle their payloads)
would pull a median down and push a lossy codec on every host the node has not measured
yet, and a payload that small (``mod4/16``, under :data:`~gossip.linkrate.MIN_SAMPLE`)
never measures the honest link it crosses, so the node would stay lossy with everyone. No
peer can make a link look faster than it is (the node's own send is timed too), so the
fastest is one honest host's at least; faked slow links weigh on exchanges with their own
hosts alone. A node whose links really differ offers a new host too much once, and that
exchange measures it. A node that does not
train (no step time yet) gives an exchange ``interval`` seconds, or 10.

**What the mod codecs remember** (:mod:`gossip.lowbit`), per vector of the payload (the state,
the drift correction's estimate):

* the **spread** of each block: the largest ``|peer − own|`` of the last committed exchange
  that carried it, from which the next periods are made (NaN: never measured). A period
  that turned out too small shows as a spread of about half that period (wrapped values
  land within it), so it grows up to ``MARGIN`` fold at the next exchange; and a block's
  spread grows by no more than that at one exchange, whatever the peer sent. A key holder
  that sends a state far off in a few blocks (within the norm check, a single block can be
  a hundred times the state's norm away) would otherwise set those blocks' periods, and the
  rounding of our next payloads to honest peers, to its own distance; capped, one exchange
  can make them ``MARGIN`` times as coarse as an honest one, and the next honest exchange
  measures them back down. An exchange with a newcomer, whose state we do not take, measures
  nothing. A swarm whose spread really jumps (a healed partition) takes a few exchanges to
  follow, as it would in ``mod`` exchanges anyway: their wrapped values measure at most
  about ``MARGIN`` times the last spread.
* the **residual** (error feedback): what rounding left out of the blocks of the last
  payload that committed. It is added to the next payload and replaced on the blocks that
  payload carries, once its exchange commits; an exchange that fails leaves it as it was,
  since its peer applied nothing.

Both are made at the first ``mod`` exchange: the residual costs one float32 vector of the
state's size on the host; while a payload is out, the residual of the blocks it carries is
kept as it stood, to be put back if the exchange fails.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable

import torch

from . import lowbit
from .codec import encoded_nbytes, lowbit_payload
from .config import AUTO_CODECS
from .spacing import Spacing

__all__ = ["Codecs", "UNMEASURED", "COLD", "IDLE_BUDGET", "PEERS"]

UNMEASURED = "int8"  # "auto" towards a host when no link at all has been measured
COLD = "int8"  # offered instead of a mod codec until every block's spread is measured
IDLE_BUDGET = 10.0  # s an exchange may take under "auto" before the step time is known
PEERS = 1024  # peers whose last codec is remembered for the status


class Codecs:
    """One node's codecs (see the module docstring).

    Args:
        numel: the schema's element count.
        setting: ``averaging.codec``.
        steps: ``averaging.codec_steps``.
        interval: ``averaging.interval`` (the budget of a node with no step time), or None.
    """

    def __init__(self, numel: int, setting: str, steps: float = 20.0,
                 interval: float | None = None) -> None:
        self.numel = numel
        self.setting = setting
        self._steps = steps
        self._idle = interval or IDLE_BUDGET
        self._family = lowbit.parse_setting(setting) if lowbit.is_lowbit_setting(setting) else None
        self._turn = 0  # the next fragment of a fragmented setting
        # Whether commits measure spreads: a node that may offer a mod codec, or one asked to
        # answer one (asked()).
        self._measure = self._family is not None or setting == "auto"
        self._pace = Spacing()  # for the step time
        self._spreads: list[torch.Tensor | None] = [None]  # the state's
        self._residual: torch.Tensor | None = None
        # While a payload is out: its spec and the residual of the blocks it carries before
        # it replaced them.
        self._pending: tuple[lowbit.Spec, torch.Tensor] | None = None
        self._used: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    # ---- which codec ---------------------------------------------------------------------

    def stepped(self, steps: int, now: float) -> None:
        """The trainer had counted ``steps`` local steps at ``now`` (for ``"auto"``)."""
        self._pace.stepped(steps, now)

    def offer(self, parts: int, rate: float | None, known: list[float] = ()) -> str:
        """The codec to offer a peer: the setting's, or under ``"auto"`` the one that fits the
        link (``rate``: bytes per second measured to the peer's host, None if never;
        ``known``: the rates measured to other hosts)."""
        if self.setting != "auto":
            return self._named(self.setting)
        if rate is None:
            if not known:
                return UNMEASURED
            rate = max(known)  # see the module docstring: a median is for the fakers to set
        step = self._pace.step
        budget = self._idle if step is None else self._steps * step
        for name in AUTO_CODECS:
            if encoded_nbytes(_wire(name), self.numel, parts) <= budget * rate:
                return self._named(name)
        return self._named(AUTO_CODECS[-1])

    def asked(self) -> None:
        """A peer offered a ``mod`` codec: measure spreads from now on, even if our own
        setting never offers one (until then a commit costs no pass over the state)."""
        self._measure = True

    def warm(self) -> bool:
        """Whether every block of the state has a spread measured: a ``mod`` payload of ours
        would have periods that fit (cold ones, from the values alone, are as coarse as the
        weights themselves). The estimate travels in int8 cells: it needs none."""
        spread = self._spreads[0]
        return spread is not None and not bool(torch.isnan(spread).any())

    def _named(self, name: str) -> str:
        """A setting's wire name: a fragmented one's next fragment; ``int8`` instead of a
        ``mod`` codec while we are not :meth:`warm` (its exchange measures every block)."""
        if not lowbit.is_lowbit_setting(name):
            return name
        if not self.warm():
            return COLD
        spec = lowbit.parse_setting(name)
        if spec.fragments == 1:
            return spec.name
        fragment, self._turn = self._turn % spec.fragments, self._turn + 1
        return lowbit.Spec(spec.bits, spec.fragments, fragment).name

    def used(self, peer: str, codec: str) -> None:
        """Our last exchange with ``peer`` (either side) used ``codec``."""
        self._used[peer] = codec
        self._used.move_to_end(peer)
        while len(self._used) > PEERS:
            self._used.popitem(last=False)

    def last(self, peer: str) -> str | None:
        """The codec of our last exchange with ``peer``, if we remember one."""
        return self._used.get(peer)

    # ---- the mod codecs' memory ----------------------------------------------------------

    def encoder(self, codec: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """For a ``mod`` codec, the function that makes our payload from our snapshot (one
        or two vectors; in a worker thread), with our periods and error feedback; None for
        the others."""
        if not lowbit.is_lowbit(codec) or not self.numel:
            return None

        def encode(flat: torch.Tensor) -> torch.Tensor:
            parts, spec = flat.numel() // self.numel, lowbit.parse(codec)
            with self._lock:
                self._restore()  # an exchange that ended neither way (cancelled)
                if self._residual is None:
                    self._residual = torch.zeros(self.numel, dtype=torch.float32)
                # The carried blocks' residual as it stands, put back if the exchange fails
                # (its peer applied nothing): 1/F of the state, not a copy of it.
                self._pending = (spec, lowbit.gather(self._residual, spec).clone())
                spreads = self._spreads[:1]
            return lowbit_payload(flat, codec, parts, spreads, residual=self._residual)

        return encode

    def committed(self, codec: str, difference: torch.Tensor, parts: int, *,
                  taken: bool = True) -> None:
        """An exchange in ``codec`` committed; ``difference`` holds ``peer − own`` for each of
        its ``parts`` vectors (as the checks left it, before any clipping). Takes the spreads
        of the blocks it carried, each at most :data:`~gossip.lowbit.MARGIN` times the one
        it replaces (see the module docstring), and, for a ``mod`` codec, the residual it
        left. ``taken``: whether we take the peer's state (False: a newcomer's, which moves
        us by nothing and so measures nothing either; the peer took ours, so the residual
        stands all the same)."""
        del parts  # only the state has periods (the estimate travels in int8)
        with self._lock:
            self._pending = None  # the payload's residual stands
        if not self._measure or not taken:
            return
        spec = lowbit.parse(codec) if lowbit.is_lowbit(codec) else None
        rows = _absmax(difference[: self.numel])
        spread = self._spreads[0]
        if spread is None:
            spread = self._spreads[0] = torch.full((lowbit.blocks(self.numel),), math.nan)
        chosen = slice(None) if spec is None else lowbit.selected(spec, self.numel)
        before = spread[chosen]
        # NaN (never measured) and 0 (identical so far) bound nothing: the first measure stands.
        cap = torch.where(before > 0, before * lowbit.MARGIN, math.inf)
        spread[chosen] = torch.minimum(rows[chosen], cap)

    def failed(self) -> None:
        """The exchange ended without a commit: the residual its payload replaced is put
        back."""
        with self._lock:
            self._restore()

    def _restore(self) -> None:
        """Put back the residual a payload replaced, if its exchange did not commit (the
        lock held)."""
        if self._pending is not None and self._residual is not None:
            spec, saved = self._pending
            lowbit.scatter(saved, spec, self._residual)
        self._pending = None

    def coverage(self, codec: str) -> float:
        """The fraction of the state's values a payload in ``codec`` carries (1 but for
        fragments)."""
        if not lowbit.is_lowbit(codec) or not self.numel:
            return 1.0
        spec = lowbit.parse(codec)
        if spec.fragments == 1:
            return 1.0
        return max(lowbit.carried(spec, self.numel), 1) / self.numel


def _absmax(vector: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """The largest ``|x|`` of each block of 64 (the last block shorter), on the host; a chunk
    of ``chunk`` values (whole blocks) at a time, so no model-sized temporary is made."""
    out = torch.empty(lowbit.blocks(vector.numel()))
    for start in range(0, vector.numel(), chunk):
        part = vector[start : start + chunk]
        pad = (-part.numel()) % lowbit.BLOCK
        rows = torch.nn.functional.pad(part.abs(), (0, pad)).view(-1, lowbit.BLOCK)
        first = start // lowbit.BLOCK
        out[first : first + rows.shape[0]] = rows.amax(dim=1).cpu()
    return out


def _wire(name: str) -> str:
    """A setting's wire name for its size (fragment 0: every fragment's size is about it)."""
    if lowbit.is_lowbit_setting(name):
        return lowbit.parse_setting(name).name
    return name
