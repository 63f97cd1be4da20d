"""Tests for gossip.pipeline and gossip.stages: a model cut into stages, in two real gloo
processes on 127.0.0.1, against the same model trained whole in one process.

One run checks several things (each start of a process imports torch): for each schedule, a
two-stage node trains 50 steps with AdamW, a BatchNorm, clipping, the drift correction and
deltas queued on the speaker's host copy; one process trains the whole model on the same
micro-batches with the same deltas. Their losses, parameters, corrections and optimizer
states agree to float tolerance. The rest is checked in this process, without a group.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gossip import GossipError, Stages
from gossip.pipeline import (_check_untied, micro_batches, sequential_step, split_optimizer,
                             split_order, stage_bounds)
from tests.unit.test_nodegroup import finish, ranks


TRAIN = r"""
import json, os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from gossip import nodegroup
from gossip.pipeline import Pipeline, Stages, sequential_step
from gossip.replica import Replica

out, device = sys.argv[1], torch.device(sys.argv[2])
nodegroup.SYNC_SPACING = 0.0  # apply each delta at the next boundary
dist.init_process_group("gloo")
rank = dist.get_rank()
STEPS, QUEUED = 50, (5, 20, 21, 40)


def build():
    torch.manual_seed(0)
    # No bias before the BatchNorm: its gradient is rounding noise, which Adam scales up.
    model = nn.Sequential(nn.Linear(8, 32, bias=False), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                          nn.Tanh(), nn.Linear(32, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def data():
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        yield torch.randn(30, 8, generator=g), torch.randint(0, 3, (30,), generator=g)


def deltas(replica):
    noise = torch.Generator().manual_seed(7)
    out = {}
    for step in QUEUED:
        d = replica.buffer()
        n = replica.schema.numel
        d[:n].normal_(generator=noise).mul_(0.05)
        d[n:].normal_(generator=noise).mul_(0.001)
        out[step] = d
    return out


def run(train, replica, before):
    queued = deltas(replica) if replica is not None else {}
    losses = []
    for step, batch in enumerate(data()):
        before()
        losses.append(float(train(batch)))
        if replica is not None:
            replica.advance(1, 30)
            if step in queued:
                replica.queue(queued[step], scale=0.5, correction=0.5, step_move=0,
                              weight=None, sent_weight=1.0)
    return losses


seen = {}
for schedule in ("1f1b", "gpipe"):
    stages = Stages(loss=F.cross_entropy, micro_batches=4, schedule=schedule, clip_norm=0.5)
    model, opt = build()
    pipe = Pipeline(model, opt, stages, device=device, correction=True)
    group = pipe.boundaries
    replica = Replica(model, optimizer=opt) if rank == 0 else None
    group.start(replica)
    losses = run(pipe.step, replica, group.boundary)
    group.settle(optimizer=True)
    if rank == 0:
        group.finish()
        ref, ref_opt = build()
        ref.to(device)  # the whole model where the stages train
        ref_replica = Replica(ref, optimizer=ref_opt)
        step = sequential_step(ref, ref_opt, stages)
        ref_losses = run(lambda b: step(tuple(t.to(device) for t in b)), ref_replica,
                         ref_replica.apply_pending)
        ref_replica.apply_pending()
        a, b = opt.state_dict(), ref_opt.state_dict()
        seen[schedule] = {
            "losses": max(abs(x - y) for x, y in zip(losses, ref_losses)),
            "spread": max(ref_losses) - min(ref_losses),
            "params": max(float((x - y.cpu()).abs().max()) for x, y in
                          zip(model.state_dict().values(), ref.state_dict().values())),
            "correction": max(float((x - y).abs().max()) for x, y in zip(
                replica.correction_state().values(), ref_replica.correction_state().values())),
            "c_norm": sum(float(c.norm()) for c in ref_replica.correction_state().values()),
            "optimizer": max(float((a["state"][k][m] - b["state"][k][m].cpu()).abs().max())
                             for k in b["state"] for m in ("exp_avg", "exp_avg_sq")),
            "states": [len(a["state"]), len(b["state"])],
            "syncs": group.statistics().syncs,
        }
    else:
        group.boundary()
        seen[schedule] = {"stopped": group.stopped, "boundaries": group.statistics().boundaries}
    pipe.close()
with open(f"{out}/seen-{rank}.json", "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
os._exit(0)
"""


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_two_stages_train_as_one_process_does_through_deltas(tmp_path: Path,
                                                             device: str) -> None:
    # On CUDA both stages share GPU 0 over gloo: the stages' copies to and from the host,
    # the activations through it, the correction and optimizer state on the device.
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    outputs = finish(ranks(script, 2, str(tmp_path), device))
    for rank in (0, 1):
        assert (tmp_path / f"seen-{rank}.json").exists(), outputs
    speaker = json.loads((tmp_path / "seen-0.json").read_text())
    stage = json.loads((tmp_path / "seen-1.json").read_text())
    for schedule in ("1f1b", "gpipe"):
        seen = speaker[schedule]
        assert seen["spread"] > 0.1  # it trained, and the deltas moved it
        tolerance = 1e-5 if device == "cpu" else 1e-4  # a GPU's kernels may sum otherwise
        assert seen["losses"] < tolerance and seen["params"] < tolerance, seen
        assert seen["c_norm"] > 0 and seen["correction"] < tolerance / 10, seen
        assert seen["optimizer"] < tolerance / 10 and seen["states"][0] == seen["states"][1] == 7, seen
        assert seen["syncs"] >= 5  # the start, four deltas (a publish and a take each), a settle
        assert stage[schedule] == {"stopped": True, "boundaries": 50}


def sequential(*sizes: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:])))


def test_stages_are_cut_where_asked_or_by_parameters() -> None:
    model = sequential(4, 64, 64, 2, 2)  # 320, 4160, 130, 6 parameters
    assert stage_bounds(model, 2) == [(0, 2), (2, 4)]
    assert stage_bounds(model, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert stage_bounds(model, 2, [1]) == [(0, 1), (1, 4)]
    assert stage_bounds(model, 1) == [(0, 4)]
    for split in ([0], [4], [2, 3], []):
        with pytest.raises(GossipError, match="increasing module indices"):
            stage_bounds(model, 2, split)
    with pytest.raises(GossipError, match="at least 5 modules"):
        stage_bounds(model, 5)
    with pytest.raises(GossipError, match="must be an nn.Sequential"):
        stage_bounds(nn.Linear(2, 2), 2)


def test_a_parameter_in_two_stages_is_refused() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with pytest.raises(GossipError, match="parameter 2.weight is in stages 0 and 1"):
        _check_untied(model, [(0, 2), (2, 3)])
    _check_untied(model, [(0, 3)])


def test_stages_declarations_are_checked() -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        Stages(loss=F.cross_entropy, micro_batches=0)
    with pytest.raises(ValueError, match="schedule"):
        Stages(loss=F.cross_entropy, schedule="zb")
    with pytest.raises(ValueError, match="clip_norm"):
        Stages(loss=F.cross_entropy, clip_norm=float("nan"))
    with pytest.raises(ValueError, match="loss"):
        Stages(loss=None)  # type: ignore[arg-type]
    assert Stages(loss=F.mse_loss, split=[2]).split == (2,)


def test_micro_batches_cover_the_batch_with_their_shares() -> None:
    x, y = torch.arange(10.0).view(10, 1), torch.arange(10)
    parts = micro_batches((x, y), 4)
    assert [len(a) for a, _, _ in parts] == [3, 3, 2, 2]
    assert sum(share for _, _, share in parts) == pytest.approx(1.0)
    assert torch.equal(torch.cat([b for _, b, _ in parts]), y)
    assert len(micro_batches((x[:2], y[:2]), 4)) == 2  # never an empty one
    with pytest.raises(GossipError, match="input, target"):
        micro_batches({"x": x}, 2)


def test_the_sequential_step_is_the_whole_batchs_step_for_a_mean_loss() -> None:
    torch.manual_seed(0)
    a = sequential(5, 7, 3)
    b = sequential(5, 7, 3)
    b.load_state_dict(a.state_dict())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1)
    x, y = torch.randn(11, 5), torch.randint(0, 3, (11,))
    loss = sequential_step(a, opt_a, Stages(loss=F.cross_entropy, micro_batches=3))((x, y))
    whole = F.cross_entropy(b(x), y)
    opt_b.zero_grad()
    whole.backward()
    opt_b.step()
    assert float(loss) == pytest.approx(whole.item(), rel=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)


def test_a_stages_optimizer_keeps_its_groups_settings_and_state() -> None:
    model = sequential(3, 4, 2)
    opt = torch.optim.AdamW([{"params": model[0].parameters(), "lr": 0.1},
                             {"params": model[1].parameters(), "weight_decay": 0.5}], lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    copy = sequential(3, 4, 2)
    part = nn.Sequential(model[1])
    keep = {id(p): q for p, q in zip(part.parameters(), copy[1].parameters())}
    made = split_optimizer(opt, keep)
    assert len(made.param_groups) == 1
    assert made.param_groups[0]["weight_decay"] == 0.5 and made.param_groups[0]["lr"] == 0.01
    torch.testing.assert_close(made.state[copy[1].weight]["exp_avg"],
                               opt.state[model[1].weight]["exp_avg"])
    assert split_order(opt, part) == ([2, 3], [1])


FINISHED_EARLY = r"""
import os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from gossip.pipeline import Pipeline, Stages

dist.init_process_group("gloo")
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
pipe = Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), Stages(loss=F.mse_loss),
                correction=False)
if dist.get_rank() == 0:
    pipe.boundaries.finish()  # stopped before its node was ready: no start()
else:
    pipe.boundaries.start(None)
    print("stopped" if pipe.boundaries.stopped else "started", flush=True)
pipe.close()
dist.destroy_process_group()
os._exit(0)
"""


def test_a_speaker_that_finishes_before_starting_stops_its_stages(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(FINISHED_EARLY)
    procs = ranks(script, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outputs = finish(procs)
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[1].strip().splitlines()[-1] == "stopped"


MISMATCHED = r"""
import os, sys
import torch, torch.distributed as dist, torch.nn as nn, torch.nn.functional as F
from gossip import GossipError, ProcessLost
from gossip.pipeline import Pipeline, Stages

dist.init_process_group("gloo")
rank = dist.get_rank()
model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
pipe = Pipeline(model, torch.optim.SGD(model.parameters(), lr=0.1), Stages(loss=F.mse_loss),
                correction=False)
# Stage 1 draws other batches: first of another shape (4 micro-batches of 2 and 1 rows, not
# 2 rows each), then of another size (2 micro-batches, not 4).
for rows in ([8, 8], [8, 6], [8, 2]):
    try:
        pipe.step((torch.randn(rows[rank], 4), torch.randn(rows[rank], 2)))
        print("stepped", flush=True)
    except (GossipError, ProcessLost) as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
        break
os._exit(0)
"""


def test_stages_that_draw_different_batches_stop_with_an_error(tmp_path: Path) -> None:
    script = tmp_path / "mismatched.py"
    script.write_text(MISMATCHED)
    outputs = finish(ranks(script, 2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True))
    lines = [out.strip().splitlines() for out in outputs]
    assert lines[1][-2:] == ["stepped", "GossipError: stages 0 and 1 drew batches of other "
                             "shapes: every stage must draw the same batches (seed their "
                             "order from ctx.seed)"], outputs
    assert lines[0][0] == "stepped" and lines[0][-1].startswith("ProcessLost: a stage's"), outputs


def test_a_weight_tied_inside_one_stage_is_one_entry_of_its_slice() -> None:
    from gossip.stages import _layout
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(3, 3), shared, nn.ReLU(), shared, nn.BatchNorm1d(3))
    stages, total = _layout(model, [(0, 1), (1, 5)], correction=True)
    names = [(e.kind, e.name) for e in stages[1]]
    assert ("param", "1.weight") in names and not any(n.startswith("3.") for _, n in names)
    assert ("buffer", "4.running_mean") in names and ("c", "1.weight") in names
    assert len(names) == len(set(names)) and total % 64 == 0


def test_a_stage_forgets_a_gradient_average_that_is_not_finite() -> None:
    from gossip.correction import Correction
    from gossip.tensors import StateSchema
    model = nn.Linear(2, 2)
    correction = Correction(model, StateSchema.from_module(model))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = torch.full((2, 2), float("nan"))
    model.bias.grad = torch.ones(2)
    correction.before_step(opt)
    assert correction.counts[1] == 1
    correction.forget_unfinite()
    assert correction.counts[1] == 0
    assert all(float(g.abs().sum()) == 0 for _, _, g in correction.named())
