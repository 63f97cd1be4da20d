"""The outer step: committed exchanges applied through Nesterov momentum. Pure torch.

Theory of operation
-------------------
Plain averaging moves a node from its snapshot ``s`` to ``s + δ``, where ``δ = w·(s_peer − s)``
is the (clipped) move towards the peer (:mod:`gossip.mixing`). Seen from the state ``φ`` the
node was left in by its previous exchange (its *anchor*), the whole move since then is::

    u = (s − φ) + δ        the local progress since the last exchange, plus the move to the peer

and plain averaging is ``φ ← φ + u``. That is the outer step of DiLoCo with learning rate 1 and
no momentum, where ``−u`` is the *pseudo-gradient* of the local steps. DiLoCo, Streaming DiLoCo
and NoLoCo (which does it with one random peer, as we do) apply it through SGD with Nesterov
momentum instead::

    v ← μ·v + u            φ ← φ + α·(u + μ·v)

The node then queues ``φ_new − s`` (the anchor's new value less the snapshot: steps it took
during the exchange stay on top, as with plain averaging), and ``φ_new`` becomes the anchor.
The next snapshot less the anchor is again exactly the progress since this exchange, because
what is queued is the difference to the anchor and is applied in full (spread over steps by
:class:`~gossip.replica.Replica`, which snapshots include).

When it is taken (:mod:`gossip.plan`): at close spacing at every committed exchange, started
or answered, as above (:meth:`Outer.step`); at wide spacing once a round, at the round's
first commit, the exchanges between (answered, or the round's later ones) applied as plain
averages and so part of the next step's ``u``. Its lr is ``α``, its momentum the plan's unless a setting fixes it.

Defaults at close spacing: α = 0.7 and μ = 0.5, NoLoCo's settings for pairwise syncs. In a
steady state (the same ``u`` each time) the step is ``α/(1 − μ) = 1.4 u``: a node's progress
is carried 1.4 times as far as plain averaging carries it, and the consensus between two nodes
still contracts: two nodes that only meet each other and do not train reach each other's state
with a factor of ``√(αμ²)`` ≈ 0.42 left per exchange, their difference changing sign (the
momentum overshoots) but never growing (tests/unit/test_outer.py). Once a round, μ = 0.9
(DiLoCo's) carries the progress 7 times as far, and the pulls towards partners enter it only
as the average they make over the round.

A key holder's influence: ``δ`` is checked and clipped before it gets here, so a single
exchange's move enters ``v`` bounded as before; momentum spreads it over the next steps, with
a total of ``α/(1 − μ)`` times the move: a constant factor on the same bound, 1.4 at close
spacing and 7 once a round, where the round's other exchanges dilute it.

What it costs: the anchor and the velocity, two float32 vectors of the model's size on the
host (beside the exchange's own buffers), and one pass over the model at commit, made chunk by
chunk so each chunk stays in cache. A node that takes another's state (a download) or starts
fresh has no anchor: its first exchange takes its snapshot as the anchor, so the step starts
from the move to the peer alone. Neither vector ever leaves the node; both go into checkpoints.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from .tensors import REDUCE_CHUNK, StateSchema

__all__ = ["Outer", "check_outer", "check_outer_state"]


class Outer:
    """A node's outer optimizer: its anchor ``φ`` and velocity ``v`` (host float32 vectors of
    ``numel`` elements, made at the first step). One exchange at a time calls :meth:`step`
    (the averager's rule), in a worker thread for a large model; an internal lock keeps a
    checkpoint's :meth:`state_dict` from reading a step half done.

    Args:
        numel: the schema's element count (the state part of a flat buffer).
        lr: the outer learning rate ``α`` (> 0).
        momentum: the Nesterov momentum ``μ`` (in [0, 1)); None: given at each step, by the
            spacing (:mod:`gossip.plan`).
    """

    def __init__(self, numel: int, lr: float, momentum: float | None) -> None:
        if not lr > 0 or momentum is not None and not 0 <= momentum < 1:
            raise ValueError(f"outer lr must be > 0 and momentum in [0, 1), not {lr}, {momentum}")
        self.numel = numel
        self.lr = lr
        self.momentum = momentum
        self._anchor: torch.Tensor | None = None
        self._velocity: torch.Tensor | None = None
        self._lock = threading.Lock()

    @property
    def anchored(self) -> bool:
        """Whether an exchange has set the anchor since the start or the last reset."""
        return self._anchor is not None

    def step(self, own: torch.Tensor, delta: torch.Tensor, scale: float,
             momentum: float | None = None) -> None:
        """Turn the move of one committed exchange into the outer step, in place.

        Args:
            own: the snapshot the exchange sent (``numel`` values; not modified).
            delta: ``s_peer − s`` (``numel`` values); on return it holds the whole change to
                queue, to be applied with scale 1.
            scale: the fraction of ``delta`` the exchange moves by (``w``, clipped).
            momentum: this step's ``μ``, where the outer step was made without one.
        """
        if own.numel() != self.numel or delta.numel() != self.numel:
            raise ValueError(f"expected {self.numel} values, got {own.numel()} and {delta.numel()}")
        mu = self.momentum if self.momentum is not None else momentum
        if mu is None or not 0 <= mu < 1:
            raise ValueError(f"outer momentum must be in [0, 1), not {mu}")
        with self._lock:
            self._step(own, delta, scale, mu)

    def _step(self, own: torch.Tensor, delta: torch.Tensor, scale: float, mu: float) -> None:
        if self._anchor is None or self._velocity is None:
            self._anchor = own.clone()
            self._velocity = torch.zeros_like(own)
        lr = self.lr
        for start in range(0, self.numel, REDUCE_CHUNK):
            part = slice(start, start + REDUCE_CHUNK)
            d, anchor, velocity = delta[part], self._anchor[part], self._velocity[part]
            progress = torch.sub(own[part], anchor)
            d.mul_(scale).add_(progress)  # u: the whole move since the last exchange
            velocity.mul_(mu).add_(d)  # v ← μ·v + u
            d.add_(velocity, alpha=mu).mul_(lr)  # the step α·(u + μ·v)
            anchor.add_(d)  # φ ← φ + step
            d.sub_(progress)  # queued: φ_new − s

    def reset(self) -> None:
        """Forget the anchor and the velocity (the node took another model's state)."""
        with self._lock:
            self._anchor = self._velocity = None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The anchor and velocity, copied, for a checkpoint (empty with no anchor yet)."""
        with self._lock:
            if self._anchor is None or self._velocity is None:
                return {}
            return {"anchor": self._anchor.clone(), "velocity": self._velocity.clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take what :meth:`state_dict` gave (checked first: :func:`check_outer_state`)."""
        check_outer_state(self.numel, state)
        anchor = velocity = None
        if state:
            anchor = state["anchor"].detach().to("cpu", torch.float32, copy=True)
            velocity = state["velocity"].detach().to("cpu", torch.float32, copy=True)
        with self._lock:
            self._anchor, self._velocity = anchor, velocity


def check_outer(model: torch.nn.Module, state: object) -> None:
    """Check an outer state saved with a checkpoint (from
    :meth:`~gossip.replica.Replica.outer_state`) against ``model``, before resuming from it:
    the check :func:`gossip.open_swarm` makes when it takes it, made early.

    Raises:
        ValueError: as :func:`check_outer_state`.
    """
    check_outer_state(StateSchema.from_module(model).numel, state)


def check_outer_state(numel: int, state: object) -> None:
    """Check an outer state saved with a checkpoint against a schema of ``numel`` elements.

    Raises:
        ValueError: not a table holding nothing or exactly a finite float ``anchor`` and
            ``velocity`` of ``numel`` values (a damaged or foreign checkpoint).
    """
    if not isinstance(state, Mapping):
        raise ValueError(f"an outer state is a table of tensors, not {type(state).__name__}")
    if not state:
        return
    if set(state) != {"anchor", "velocity"}:
        raise ValueError(f"an outer state holds anchor and velocity, not {sorted(map(str, state))}")
    for name in ("anchor", "velocity"):
        value = state[name]
        if (not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() != numel
                or not value.is_floating_point() or not bool(torch.isfinite(value).all())):
            raise ValueError(f"outer {name}: expected {numel} finite floats")
