"""When a node starts its rounds, and what each one makes: :class:`Rounds`.

Theory of operation
-------------------
A node starts a *round* once it has taken ``every`` local optimizer steps (x ``JITTER``, so a
swarm that steps in lockstep does not offer in lockstep) since it started its last one, or
``interval`` seconds (likewise jittered) after its last one ended, whichever comes first: the
period is counted in steps, because a second is thousands of steps of a small model and a
fraction of one of a large model, and the time bound keeps an idle node mixing. A round that
takes longer than ``every`` steps (a slow link) is followed at once by the next; training never
waits for the network. The first round's time bound is a quarter interval (``FIRST_JITTER``),
so that a node that just joined, or a misconfigured one, learns at once whether it can
exchange.

With ``every = "auto"`` the node measures its step time and its committed exchanges' durations
and sizes (:mod:`gossip.spacing`): the spacing is two exchanges long per exchange a round makes
(it starts that many and is picked about as often), so its link is kept busy without queueing
its own rounds behind it, and the time bound is at least the median exchange, so an idle node
too leaves its link free half the time for its peers' offers. Which plan's rounds it runs is
chosen on the link measured, each plan with its own payloads: the wide plan where its rounds
come out ``LARGE_SPACING`` steps apart or more, else the close plan. So the choice is stable:
it does not flip with the smaller payloads the wide plan sends. (With ``codec = "auto"`` a
payload's size is picked per peer at the offer, so the exchanges count as they were measured.)

What a round makes is :mod:`gossip.plan`'s, from the spacing in use: how many exchanges, and
when the outer step is taken with what momentum.
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import replace
from typing import Awaitable, Callable

import trio

from .config import LARGE_SPACING, AveragingConfig
from .plan import Plan, plan
from .replica import Replica
from .spacing import MAX_SPACING, Spacing

__all__ = ["FIRST_JITTER", "JITTER", "Rounds", "wait_local_steps"]

JITTER = (0.75, 1.25)  # a round's steps and pause are drawn this many times the setting
FIRST_JITTER = (0.0, 0.25)  # the first round's pause, of the interval


class Rounds:
    """A node's round schedule: the spacing in use, each round's plan, and the loop that
    starts them.

    Args:
        config: the averaging settings (``every``, ``interval`` and what ``plan`` reads).
        rng: the node's random generator (the jitters).
        others: how many peers a round could exchange with now (a round makes no more
            exchanges than that, and the spacing counts no more).
        payload: the bytes of each payload of an exchange under a plan (None: not known
            before the offer); with ``every = "auto"`` the spacing of each plan is measured
            on exchanges scaled to it.
    """

    def __init__(self, config: AveragingConfig, rng: random.Random,
                 others: Callable[[], int], payload: Callable[[Plan], int | None]) -> None:
        self.config = config
        self._rng = rng
        self._others = others
        self._payload = payload
        self.meter = Spacing() if config.every == "auto" else None  # every = "auto" only
        self._every = None if isinstance(config.every, str) else config.every  # when fixed

    def steps(self) -> float | None:
        """The local steps between our rounds in use: ``every``, or measured with ``"auto"``
        (then as many exchange lengths as the plan has exchanges, twice)."""
        return self._every if self.meter is None else self._measured()[1]

    def plan(self) -> Plan:
        """A round's choices at the spacing in use (:func:`gossip.plan.plan`), with no more
        exchanges than there are peers."""
        if self.meter is None:
            return self._capped(plan(self.config, self._every))
        return self._measured()[0]

    def _capped(self, chosen: Plan) -> Plan:
        return replace(chosen, peers=max(1, min(chosen.peers, self._others())))

    def _measured(self) -> tuple[Plan, int]:
        """With ``every = "auto"``: the wide plan where its own rounds (its exchanges, of its
        payloads, on the measured link) are ``LARGE_SPACING`` steps apart or more, else the
        close plan; and the spacing of the plan's rounds. Between the two (a link on which
        the close plan's rounds would be wide, the wide plan's close) the close plan runs,
        at its spacing."""
        meter = self.meter
        assert meter is not None

        def spacing(chosen: Plan) -> int:
            return min(meter.steps(self._payload(chosen)) * chosen.peers, MAX_SPACING)

        wide = self._capped(plan(self.config, math.inf))
        steps = spacing(wide)
        if steps >= LARGE_SPACING:
            return wide, steps
        close = self._capped(plan(self.config, 0))
        return close, spacing(close)

    async def run(self, replica: Replica, ready: trio.Event,
                  start_round: Callable[[], Awaitable[object]]) -> None:
        """Call ``start_round()`` every :meth:`steps` local steps of ``replica``, counted from the
        start of the last round, or once ``interval`` seconds pass after the last round's end,
        whichever comes first (each jittered), from when ``ready`` is set until cancelled."""
        interval = self.config.interval
        if self._every is None and self.meter is None and interval is None:
            await trio.sleep_forever()
        await ready.wait()
        first, pause = True, interval
        since, began = replica.local_steps, trio.current_time()  # the last round's start
        while True:
            if self.meter is not None:
                self.meter.stepped(since, began)
                if interval is not None:
                    pause = max(interval, self.meter.exchange or 0.0)
            every = self.steps()
            steps = None if every is None else max(1, round(every * self._rng.uniform(*JITTER)))
            spread = FIRST_JITTER if first else JITTER
            seconds = math.inf if pause is None else pause * self._rng.uniform(*spread)
            with trio.move_on_after(seconds):  # an idle node pauses between its rounds
                if steps is None:
                    await trio.sleep_forever()
                await wait_local_steps(replica, since + steps)
            first = False
            since, began = replica.local_steps, trio.current_time()
            await start_round()


async def wait_local_steps(replica: Replica, target: int) -> None:
    """Return once the trainer has counted ``target`` local steps of ``replica`` (it may count
    them in any thread)."""
    reached = trio.Event()
    token, here = trio.lowlevel.current_trio_token(), threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == here:
            reached.set()
        else:
            try:
                token.run_sync_soon(reached.set)
            except trio.RunFinishedError:
                pass  # the node is gone; nobody waits any more

    replica.watch(target, wake)
    await reached.wait()
