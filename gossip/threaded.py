"""The synchronous facade: averaging for ordinary (non-trio) training scripts.

Theory of operation
-------------------
:class:`Averager` runs :func:`gossip.node.open_swarm` in a trio event loop on a background
thread of its own. The training script keeps the main thread and calls :meth:`Averager.step`
after each optimizer step: it counts the step and adds whatever deltas the background side
has queued, under the replica's lock, and never waits for the network. Calls that need the
event loop (:meth:`Averager.statistics`, :meth:`Averager.average_now`) go through trio's
thread portal.

Starting waits until the node is ready: joined, and holding its initial state (downloaded
from the swarm, or its own for the first node), so the first step trains the swarm's weights.
Closing stops averaging, leaves the swarm gracefully and joins the thread. A failure of the
background side is raised by the next call from the script (and by :meth:`close`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import trio

from .averaging import AveragingStatistics, Result
from .errors import GossipError
from .handshake import Swarm
from .node import SwarmNode, open_swarm

__all__ = ["Averager"]

log = logging.getLogger(__name__)


class Averager:
    """Average ``model`` with a swarm from a synchronous training loop.

    ::

        with gossip.Averager(model, swarm, listen="0.0.0.0:7070", bootstrap=[...]) as avg:
            for batch in data:
                loss = train_step(model, batch)
                avg.step(samples=len(batch))   # applies pending deltas; never blocks
                lr = schedule(avg.global_step)

    Args:
        model: the live module (CPU or CUDA).
        swarm: the swarm's name and key.
        ready_timeout: seconds to wait for the node to be ready (None: as long as it takes;
            a joiner retries its bootstrap addresses meanwhile and logs each attempt).
        **options: every keyword argument of :func:`gossip.node.open_swarm`.

    Raises:
        GossipError: the node failed to start, or was not ready within ``ready_timeout``
            (:class:`~gossip.errors.PeerTimeout`).
    """

    def __init__(self, model: torch.nn.Module, swarm: Swarm, *,
                 ready_timeout: float | None = None, **options: Any) -> None:
        self._model = model
        self._swarm = swarm
        self._options = options
        self._node: SwarmNode | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._started = threading.Event()  # the node is ready, or the thread ended
        self._thread = threading.Thread(target=self._main, name="gossip-averager", daemon=True)
        self._thread.start()
        if not self._started.wait(ready_timeout):
            self.close()
            raise GossipError(f"the node was not ready within {ready_timeout} s")
        self._check()

    # ---- the training script's side ---------------------------------------------------

    def step(self, samples: int = 0) -> int:
        """Count one optimizer step over ``samples`` samples and add the queued deltas to the
        model. Never blocks on the network.

        Returns:
            The number of exchanges whose deltas were applied.

        Raises:
            GossipError: the background side failed.
        """
        self._check()
        assert self._node is not None
        return self._node.step(samples)

    @property
    def global_step(self) -> int:
        """The step the swarm agrees on, for learning-rate schedules: this node's optimizer
        steps, moved towards its peers' at each exchange (never back)."""
        assert self._node is not None
        return self._node.global_step

    @property
    def lock(self) -> threading.RLock:
        """Held by the background side while it copies the model. Hold it around
        ``optimizer.step()`` if snapshots must never straddle an optimizer step (it is
        re-entrant: the drift correction's hook takes it inside the step)."""
        assert self._node is not None
        return self._node.replica.lock

    @property
    def node(self) -> SwarmNode:
        """The node (for its roster and replica); use its async methods only via trio."""
        assert self._node is not None
        return self._node

    def statistics(self) -> AveragingStatistics:
        self._check()
        return trio.from_thread.run_sync(self.node.statistics, trio_token=self._token)

    def average_now(self) -> Result:
        """Run one averaging round now and wait for it (this one does block)."""
        self._check()
        return trio.from_thread.run(self.node.average_now, trio_token=self._token)

    def close(self) -> None:
        """Stop averaging, leave the swarm and end the background thread. Idempotent.

        Raises:
            GossipError: the background side had failed.
        """
        if self._thread.is_alive() and self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        self._check()

    def __enter__(self) -> "Averager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- the background thread --------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            if isinstance(self._error, GossipError):
                raise self._error
            raise GossipError(f"the averaging thread failed: {self._error!r}") from self._error

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # reported to the script by its next call
            log.error("averaging thread failed: %r", exc)
            self._error = exc
        finally:
            self._started.set()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with open_swarm(self._model, self._swarm, **self._options) as node:
            self._node = node
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._when_ready, node)
                await self._stop.wait()  # close() sets it, ready or not
                nursery.cancel_scope.cancel()

    async def _when_ready(self, node: SwarmNode) -> None:
        await node.wait_ready()
        self._started.set()
