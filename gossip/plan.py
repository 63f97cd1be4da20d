"""What a node's rounds do at the spacing it runs at: how many exchanges, and when the outer
step is taken with what momentum. Pure: it imports nothing that imports trio or torch.

Theory of operation
-------------------
A node starts a round every ``every`` local steps (the spacing: fixed, or measured from the
link with ``every = "auto"``: :mod:`gossip.spacing`). Two regimes want different rounds.

Close spacing (a round every step or few): the node takes part in about two exchanges per
round, one it starts and one it answers, and each committed exchange is an outer step with
momentum 0.5 (:mod:`gossip.outer`). Every exchange is small against the training between them,
so how the moves are grouped matters little, and the settings that ``bench/efficiency.py``
measured stay as they were.

Wide spacing (``LARGE_SPACING`` steps and more: a volunteer's link, hundreds of steps between
rounds): each node walks off for hundreds of steps between rounds, and a pairwise exchange
halves its distance to one peer only. ``bench/lowcomm.py`` (a 1M-parameter LM, 8 nodes, H =
100; figures in its results and in docs/DAEMON.md's table of spacings) measured what closes
the gap to an all-reduce:

- The mixing, not the momentum. An all-reduce of plain averages (DiLoCo with outer lr 1, no
  momentum) did as well as DiLoCo's outer Nesterov step at this scale, and the swarm's mean
  model (the nodes' average, which no node holds) came within 1% of DiLoCo's anchor (level
  with it at H = 500): what a gossip node lacks is the others' share of its drift. Three
  exchanges a round, each with another peer, cut it where one could not; past that, offers
  meet peers busy in other exchanges, and a round's exchanges add load rather than mixing
  (about 60 commits a node in 2,000 steps at H = 100 with 2, 3 or 6 peers a round).
- The momentum taken once a round, on everything that moved the node since its last round
  (its local steps and every exchange, started or answered, applied as plain averages), as
  DiLoCo takes it once per sync. Taken at each exchange, the momentum integrates the pulls
  towards each partner as if they were progress, and with three exchanges a round the moves of
  the second and third, which hold no progress at all: momentum 0.9 per exchange did worse
  than 0.5, where once a round 0.9 did best (DiLoCo's published value).

What a choice costs: three exchanges a round send three times the bytes of one; on a link
that spaces rounds by its own speed (``every = "auto"``) the spacing grows with them, and a
smaller codec (``codec = "int8"``, 1/3.8 of the bytes) buys them back.

:func:`plan` turns the settings that say ``"auto"`` into these choices; a number or a word in
the settings is taken as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import LARGE_SPACING, ROUND_PEERS, AveragingConfig

__all__ = ["EXCHANGE_MOMENTUM", "Plan", "ROUND_MOMENTUM", "plan"]

EXCHANGE_MOMENTUM = 0.5  # the outer step's momentum at each exchange (NoLoCo's for pairs)
ROUND_MOMENTUM = 0.9  # once a round (DiLoCo's)


@dataclass(frozen=True)
class Plan:
    """One round's choices."""

    peers: int  # exchanges the round makes, each with another peer
    by_round: bool  # the outer step once a round, at its first commit (else at each exchange)
    momentum: float  # the outer step's Nesterov momentum
    codec: str | None = None  # the codec of our offers, where it is not the setting's
    correct: bool = True  # swap the drift correction's estimates (where the node keeps one)


def plan(config: AveragingConfig, spacing: float | None) -> Plan:
    """The choices for a round at ``spacing`` local steps since the last (None: rounds by
    time alone, counted as close)."""
    wide = spacing is not None and spacing >= LARGE_SPACING
    by_round = (config.outer_cadence == "round" if config.outer_cadence != "auto" else wide)
    peers = config.peers if isinstance(config.peers, int) else ROUND_PEERS if wide else 1
    momentum = (config.outer_momentum if not isinstance(config.outer_momentum, str)
                else ROUND_MOMENTUM if by_round else EXCHANGE_MOMENTUM)
    # Only the default codec gives way: one the user chose (bf16, int8, mod4, auto) stays.
    codec = config.wide_codec if wide and config.codec == "fp32" else None
    return Plan(peers, by_round, momentum, codec, correct=not wide)
