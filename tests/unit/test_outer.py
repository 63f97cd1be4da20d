"""The outer step (gossip.outer): Nesterov momentum over each committed exchange's move."""

from __future__ import annotations

import pytest
import torch

from gossip import AveragingConfig
from gossip.lowlevel import check_outer
from gossip.outer import Outer, check_outer_state
from gossip.replica import Replica
from gossip.tensors import REDUCE_CHUNK


def vector(seed: int, n: int = 10) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def test_the_step_is_torch_sgd_with_nesterov_on_the_pseudo_gradient() -> None:
    """Three exchanges with local progress between them: the anchor follows
    torch.optim.SGD(nesterov) stepped on the pseudo-gradient -u (u: progress + move), and the
    queued change lands the node on the new anchor."""
    lr, mu = 0.7, 0.5
    outer = Outer(10, lr, mu)
    anchor = torch.nn.Parameter(vector(0))
    sgd = torch.optim.SGD([anchor], lr=lr, momentum=mu, nesterov=True)
    state = anchor.detach().clone()  # the node's state
    for k in range(3):
        if k:  # local steps since the last exchange
            state += vector(10 + k)
        peer = vector(20 + k)
        delta = peer - state
        u = state - anchor.detach() + 0.5 * delta
        outer.step(state if k else anchor.detach().clone(), delta, 0.5)
        anchor.grad = -u
        sgd.step()
        state = state + delta
        assert torch.allclose(state, anchor.detach(), atol=1e-6)
        assert torch.allclose(outer.state_dict()["anchor"], anchor.detach(), atol=1e-6)


def test_lr_1_momentum_0_is_plain_averaging_and_builds_no_outer_state() -> None:
    own, peer = vector(1), vector(2)
    delta = peer - own
    outer = Outer(10, 1.0, 0.0)
    outer.step(own, delta, 0.5)
    assert torch.allclose(delta, 0.5 * (peer - own))
    # The replica takes the plain path itself (bit for bit: no arithmetic is added), with the
    # drift correction measured per step as without an outer step.
    for setting in (None, (1.0, 0.0), AveragingConfig(outer=False).outer_setting):
        model = torch.nn.Linear(2, 2)
        replica = Replica(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                          outer=setting)
        assert replica.outer is None and replica.outer_state() is None
        assert replica.correction is not None and not replica.correction.per_exchange
    model = torch.nn.Linear(2, 2)
    replica = Replica(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      outer=AveragingConfig().outer_setting)
    assert replica.outer is not None and replica.correction.per_exchange


@pytest.mark.parametrize("lr,mu", [(0.7, 0.5), (1.0, 0.5), (0.7, 0.9), (1.0, 0.0)])
def test_two_nodes_that_only_meet_each_other_reach_consensus(lr: float, mu: float) -> None:
    """No training: the momentum overshoots, but the distance never grows past its start and
    falls to nothing (two nodes do not orbit each other)."""
    a, b = vector(3, 1000), vector(4, 1000) * 3
    outer_a, outer_b = Outer(1000, lr, mu), Outer(1000, lr, mu)
    start = float((a - b).norm())
    distances = []
    for _ in range(40):
        da, db = b - a, a - b
        outer_a.step(a, da, 0.5)
        outer_b.step(b, db, 0.5)
        a, b = a + da, b + db
        distances.append(float((a - b).norm()))
    assert max(distances) <= start
    assert distances[-1] < 1e-3 * start


def test_progress_is_carried_further_than_plain_averaging_in_a_steady_state() -> None:
    """The same progress between every exchange and no peer difference: the step tends to
    lr / (1 - momentum) times the progress."""
    outer = Outer(4, 0.7, 0.5)
    state = torch.zeros(4)
    outer.step(state, torch.zeros(4), 0.5)  # sets the anchor
    progress = torch.ones(4)
    for _ in range(30):
        state = state + progress
        delta = torch.zeros(4)
        outer.step(state, delta, 0.5)
        step = delta + progress
        state = state + delta
    assert torch.allclose(step, torch.full((4,), 1.4), atol=1e-4)


def test_a_bounded_move_has_a_bounded_total_effect() -> None:
    """One exchange's (clipped) move, then none: its total effect on the anchor is
    lr / (1 - momentum) times the move, a constant factor on the clip's bound."""
    outer = Outer(3, 0.7, 0.5)
    state = torch.zeros(3)
    outer.step(state, torch.zeros(3), 0.5)
    move = torch.tensor([1.0, -2.0, 0.5])
    delta = move / 0.5
    outer.step(state, delta, 0.5)
    state = state + delta
    for _ in range(60):
        d = torch.zeros(3)
        outer.step(state, d, 0.5)
        state = state + d
    assert torch.allclose(state, move * 0.7 / 0.5, atol=1e-5)


def test_chunks_give_the_same_result_as_one_pass() -> None:
    n = 2 * REDUCE_CHUNK + 5
    own, peer = vector(5, n), vector(6, n)
    outer = Outer(n, 0.7, 0.5)
    outer.step(own, torch.zeros(n), 0.5)
    own2 = own + 0.1
    delta = peer - own2
    outer.step(own2, delta, 0.5)
    u = (own2 - own) + 0.5 * (peer - own2)
    want = 0.7 * (u + 0.5 * u) - (own2 - own)
    assert torch.allclose(delta, want, atol=1e-6)


def test_state_round_trip_reset_and_checks() -> None:
    outer = Outer(4, 0.7, 0.5)
    assert outer.state_dict() == {} and not outer.anchored
    outer.step(torch.ones(4), torch.ones(4), 0.5)
    saved = outer.state_dict()
    back = Outer(4, 0.7, 0.5)
    back.load_state_dict(saved)
    assert all(torch.equal(back.state_dict()[k], saved[k]) for k in saved)
    back.reset()
    assert not back.anchored
    check_outer_state(4, {})
    for bad, match in [([], "table"), ({"anchor": torch.ones(4)}, "anchor and velocity"),
                       ({"anchor": torch.ones(3), "velocity": torch.ones(4)}, "anchor"),
                       ({"anchor": torch.ones(4), "velocity": torch.tensor([1.0, 2, 3,
                                                                           float("nan")])},
                        "velocity")]:
        with pytest.raises(ValueError, match=match):
            check_outer_state(4, bad)
    with pytest.raises(ValueError, match="finite"):
        check_outer(torch.nn.Linear(1, 2), {"anchor": torch.ones(3), "velocity": torch.ones(5)})


def test_a_download_forgets_the_anchor() -> None:
    model = torch.nn.Linear(2, 2)
    replica = Replica(model, outer=(0.7, 0.5))
    assert replica.outer is not None
    replica.outer.step(torch.zeros(6), torch.ones(6), 0.5)
    assert replica.outer_state()
    replica.load(torch.zeros(6), step=0, buffers={})
    assert replica.outer_state() == {}
