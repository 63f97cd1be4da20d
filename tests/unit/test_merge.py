"""Tests for daemon.merge (``gossipd average`` and ``export``): exact weighted means, dtype
handling, input kinds, schema mismatches named by key and file, refused weights and files,
the output, and one checkpoint's model exported alone."""

from __future__ import annotations

import logging
import os
import pickle
import stat
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

from daemon import checkpoint, merge
from daemon.merge import MergeError


def write_plain(path: Path, obj: Any) -> Path:
    torch.save(obj, path)
    return path


def sd(w: list[float], n: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(w, dtype=dtype), "bias": torch.tensor([w[0] * 2], dtype=dtype),
            "n": torch.tensor(n)}


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])


# --- arithmetic -------------------------------------------------------------------------


def test_two_files_equal_weights(tmp_path: Path) -> None:
    a = write_plain(tmp_path / "a.pt", sd([1.0, 2.0, -3.0], n=4))
    b = write_plain(tmp_path / "b.pt", sd([3.0, 6.0, 5.0], n=9))
    out = merge.average_files([a, b], tmp_path / "out.pt")
    assert_exact(out, sd([2.0, 4.0, 1.0], n=9))
    assert_exact(torch.load(tmp_path / "out.pt", weights_only=True), out)


def test_three_files_with_weights(tmp_path: Path) -> None:
    paths = [write_plain(tmp_path / f"{i}.pt", sd(w)) for i, w in
             enumerate([[0.0, 8.0], [4.0, 0.0], [8.0, 16.0]])]
    # weights 1:2:1 -> 0.25, 0.5, 0.25, all exact in binary
    out = merge.average_files(paths, tmp_path / "out.pt", weights=[1, 2, 1])
    assert_exact(out, sd([4.0, 6.0]))
    # unnormalized weights give the same result as normalized ones
    assert_exact(merge.average_files(paths, tmp_path / "o2.pt", weights=[0.25, 0.5, 0.25]), out)


def test_three_files_equal_weights_match_float64_reference(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    states = [{"w": torch.randn(100, generator=g)} for _ in range(3)]
    want = sum(s["w"].double() * (1 / 3) for s in states).float()
    got = merge.average(states)
    assert torch.equal(got["w"], want)
    assert torch.allclose(got["w"], torch.stack([s["w"] for s in states]).mean(0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_dtypes_preserved_and_averaged_in_float64(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    states = [{"w": torch.randn(64, generator=g).to(dtype)} for _ in range(3)]
    weights = [1.0, 3.0, 4.0]  # normalized: 1/8, 3/8, 1/2, exact in binary
    total = sum(weights)
    want = sum(s["w"].double() * (w / total) for s, w in zip(states, weights)).to(dtype)
    got = merge.average(states, weights)
    assert got["w"].dtype == dtype and torch.equal(got["w"], want)


def test_fp16_near_max_does_not_overflow() -> None:
    a = torch.tensor([60000.0], dtype=torch.float16)
    b = torch.tensor([65504.0], dtype=torch.float16)  # fp16's largest finite value
    assert torch.isinf(a + b).all()  # what summing in fp16 would do
    got = merge.average([{"w": a}, {"w": b}])["w"]
    assert got.dtype == torch.float16 and got.item() == 62752.0


def test_integer_and_bool_entries_take_max(caplog: pytest.LogCaptureFixture) -> None:
    states = [{"n": torch.tensor([3, 7]), "f": torch.tensor([True, False])},
              {"n": torch.tensor([5, 2]), "f": torch.tensor([False, False])}]
    with caplog.at_level(logging.INFO, logger="daemon.merge"):
        got = merge.average(states)
    assert_exact(got, {"n": torch.tensor([5, 7]), "f": torch.tensor([True, False])})
    assert "key=n" in caplog.text


def test_inputs_not_modified_and_output_is_fresh() -> None:
    states = [sd([1.0, 2.0]), sd([3.0, 4.0])]
    copies = [{k: v.clone() for k, v in s.items()} for s in states]
    got = merge.average(states)
    for s, c in zip(states, copies):
        assert_exact(s, c)
    got["w"].add_(100)
    assert_exact(states[0], copies[0])


# --- input kinds ------------------------------------------------------------------------


def test_mixed_input_kinds(tmp_path: Path) -> None:
    ck = checkpoint.save(tmp_path / "ck", {"model": sd([1.0, 1.0]), "counters": {"step": 5}},
                         step=5, keep=1)
    paths = [
        ck,
        write_plain(tmp_path / "plain.pt", sd([2.0, 2.0])),
        write_plain(tmp_path / "model.pt", {"model": sd([3.0, 3.0]), "epoch": 3}),
        write_plain(tmp_path / "sd.pt", {"state_dict": sd([6.0, 6.0]), "step": 1}),
    ]
    out = merge.average_files(paths, tmp_path / "out.pt")
    assert_exact(out, sd([3.0, 3.0]))


def test_output_loads_into_model(tmp_path: Path) -> None:
    def make(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
        model.train()
        for _ in range(seed + 1):  # differing num_batches_tracked and running stats
            model(torch.randn(8, 5))
        return model

    models = [make(s) for s in (1, 2)]
    paths = [write_plain(tmp_path / f"m{i}.pt", m.state_dict()) for i, m in enumerate(models)]
    out_path = tmp_path / "avg.pt"
    merge.average_files(paths, out_path, weights=[3.0, 1.0])

    loaded = torch.load(out_path, weights_only=True)
    fresh = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.Linear(7, 3))
    fresh.load_state_dict(loaded, strict=True)
    a, b = (m.state_dict() for m in models)
    got = fresh.state_dict()
    assert list(got) == list(a)
    for k in a:
        if a[k].is_floating_point():
            want = (a[k].double() * 0.75 + b[k].double() * 0.25).float()
            assert torch.equal(got[k], want), k
        else:
            assert torch.equal(got[k], torch.maximum(a[k], b[k])), k
    assert got["1.num_batches_tracked"].item() == 3
    assert stat.S_IMODE(out_path.stat().st_mode) & 0o077 == 0
    assert sorted(os.listdir(tmp_path)) == ["avg.pt", "m0.pt", "m1.pt"]  # no temp left


# --- refusals ---------------------------------------------------------------------------

MISMATCHES: dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]] = {
    "missing key": (lambda s: s.pop("bias"), "key 'bias' missing"),
    "extra key": (lambda s: s.__setitem__("extra", torch.zeros(1)), "key 'extra' not in"),
    "shape": (lambda s: s.__setitem__("w", torch.zeros(3)), r"key 'w' has shape \(3,\)"),
    "dtype": (lambda s: s.__setitem__("w", torch.zeros(2, dtype=torch.float64)),
              "key 'w' has dtype torch.float64"),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_schema_mismatch_names_key_and_file(tmp_path: Path, kind: str) -> None:
    mutate, message = MISMATCHES[kind]
    other = sd([1.0, 2.0])
    mutate(other)
    paths = [write_plain(tmp_path / "good.pt", sd([0.0, 0.0])),
             write_plain(tmp_path / "good2.pt", sd([0.0, 0.0])),
             write_plain(tmp_path / "odd.pt", other)]
    with pytest.raises(MergeError, match=message) as info:
        merge.average_files(paths, tmp_path / "out.pt")
    text = str(info.value)
    assert "odd.pt" in text and "good.pt" in text and "\n" not in text
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("weights", [
    [1.0, float("nan")], [1.0, float("inf")], [1.0, -1.0], [1.0, 0.0], [1.0], [1.0, 1.0, 1.0],
    [True, 1.0], [1.0, "2"],
])
def test_bad_weights_refused(weights: list[Any]) -> None:
    with pytest.raises(MergeError, match="weight"):
        merge.average([sd([1.0, 2.0]), sd([3.0, 4.0])], weights)


def test_huge_weights_do_not_overflow() -> None:
    got = merge.average([sd([0.0, 4.0]), sd([4.0, 0.0])], [1e308, 1e308])
    assert_exact(got, sd([2.0, 2.0]))


def test_fewer_than_two_refused(tmp_path: Path) -> None:
    with pytest.raises(MergeError, match="at least 2"):
        merge.average([sd([1.0, 2.0])])
    with pytest.raises(MergeError, match="at least 2"):
        merge.average_files([write_plain(tmp_path / "a.pt", sd([1.0]))], tmp_path / "out.pt")


class Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


BAD_FILES: dict[str, Callable[[Path], None]] = {
    "ints": lambda p: torch.save({"a": 1, "b": 2}, p),
    "list": lambda p: torch.save([torch.zeros(2)], p),
    "empty dict": lambda p: torch.save({}, p),
    "model not sd": lambda p: torch.save({"model": {"a": 1}}, p),
    "mixed": lambda p: torch.save({"w": torch.zeros(2), "step": 3}, p),
    "plain pickle": lambda p: p.write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=2)),
    "empty file": lambda p: p.write_bytes(b""),
    "text": lambda p: p.write_text("hello"),
    "torn checkpoint": lambda p: p.write_bytes(
        checkpoint.save(p.parent / "ck", {"model": sd([1.0])}, step=1, keep=1).read_bytes()[:-1]),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_non_state_dict_file_refused(tmp_path: Path, kind: str) -> None:
    bad = tmp_path / "bad.pt"
    BAD_FILES[kind](bad)
    with pytest.raises(MergeError, match="bad.pt") as info:
        merge.read_state_dict(bad)
    assert "\n" not in str(info.value)


def test_malicious_pickle_refused_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    torch.save({"w": torch.zeros(2), "evil": Evil(marker)}, bad)
    with pytest.raises(MergeError, match=r"evil.pt.*weights_only.*\.system"):
        merge.read_state_dict(bad)
    bad.write_bytes(pickle.dumps(Evil(marker), protocol=2))
    with pytest.raises(MergeError, match="evil.pt"):
        merge.read_state_dict(bad)
    assert not marker.exists()


def test_unreadable_files_refused(tmp_path: Path) -> None:
    with pytest.raises(MergeError, match="missing.pt: cannot read"):
        merge.read_state_dict(tmp_path / "missing.pt")
    with pytest.raises(MergeError, match="cannot read"):
        merge.read_state_dict(tmp_path)


def test_refuses_to_overwrite_an_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = write_plain(tmp_path / "a.pt", sd([1.0, 2.0]))
    b = write_plain(tmp_path / "b.pt", sd([3.0, 4.0]))
    before = a.read_bytes()
    with pytest.raises(MergeError, match="refusing to overwrite"):
        merge.average_files([a, b], a)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MergeError, match="refusing to overwrite"):
        merge.average_files([a, b], Path("sub/../b.pt"))
    os.link(a, tmp_path / "hard.pt")
    with pytest.raises(MergeError, match="refusing to overwrite"):
        merge.average_files([tmp_path / "hard.pt", b], a)
    assert a.read_bytes() == before


def test_unwritable_output_is_merge_error(tmp_path: Path) -> None:
    a = write_plain(tmp_path / "a.pt", sd([1.0, 2.0]))
    b = write_plain(tmp_path / "b.pt", sd([3.0, 4.0]))
    with pytest.raises(MergeError, match="dir does not exist"):
        merge.average_files([a, b], tmp_path / "no" / "such" / "dir" / "out.pt")


# --- export -----------------------------------------------------------------------------


def test_export_writes_the_model_alone_and_returns_the_state(tmp_path: Path) -> None:
    ck = checkpoint.save(tmp_path / "ck", {"model": sd([1.0, 2.0], n=3),
                                           "counters": {"step": 5}}, step=5, keep=1)
    out = tmp_path / "model.pt"
    state = merge.export_file(ck, out)
    assert state["counters"] == {"step": 5}
    assert_exact(torch.load(out, weights_only=True), sd([1.0, 2.0], n=3))


@pytest.mark.parametrize("content", [{"counters": {"step": 5}}, {"model": {"w": 1.0}}],
                         ids=["no-model", "not-tensors"])
def test_export_refuses_a_checkpoint_without_a_model(tmp_path: Path, content: Any) -> None:
    ck = checkpoint.save(tmp_path / "ck", content, step=5, keep=1)
    with pytest.raises(MergeError, match="'model' entry"):
        merge.export_file(ck, tmp_path / "model.pt")
    assert not (tmp_path / "model.pt").exists()
