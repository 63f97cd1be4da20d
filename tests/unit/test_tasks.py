"""Tests for the bundled tasks (daemon.tasks.digits, daemon.tasks.charlm) and the example
script that uses the library API directly."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from daemon.task import Context, Shard, Task, TaskError
from daemon.tasks import charlm, digits

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None,
                                   reason="the digits task needs scikit-learn")
TASKS = [pytest.param(digits, id="digits", marks=needs_sklearn),
         pytest.param(charlm, id="charlm")]


pytestmark = pytest.mark.usefixtures("one_thread")


def make(module, seed: int = 0, **options) -> Task:
    return module.task(Context(seed=seed, device=CPU, options=options))


def weights(task: Task) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in task.model.parameters()])


def train(task: Task, steps: int, shard: Shard = Shard()) -> list[float]:
    return [float(task.step(b)) for b in itertools.islice(task.batches(shard), steps)]


# ---- both tasks -------------------------------------------------------------------------


@pytest.mark.parametrize("module", TASKS)
def test_initial_weights_depend_only_on_the_seed(module):
    assert torch.equal(weights(make(module, seed=3)), weights(make(module, seed=3)))
    assert not torch.equal(weights(make(module, seed=3)), weights(make(module, seed=4)))


@pytest.mark.parametrize("module", TASKS)
def test_batches_are_deterministic_per_seed_and_shard(module):
    def first(seed: int, shard: Shard) -> torch.Tensor:
        return next(make(module, seed=seed).batches(shard))[0]

    assert torch.equal(first(0, Shard(1, 2)), first(0, Shard(1, 2)))
    assert not torch.equal(first(0, Shard(1, 2)), first(1, Shard(1, 2)))
    assert not torch.equal(first(0, Shard(0, 2)), first(0, Shard(1, 2)))


@pytest.mark.parametrize("module", TASKS)
def test_evaluate_restores_the_mode(module):
    task = make(module)
    task.model.train()
    first = task.evaluate()
    assert task.model.training
    task.model.eval()
    assert task.evaluate() == first  # fixed held-out data
    assert not task.model.training


@pytest.mark.parametrize("module", TASKS)
def test_unknown_and_bad_options_are_errors(module):
    with pytest.raises(TaskError, match="lrr"):
        make(module, lrr=0.1)
    with pytest.raises(TaskError, match="batch_size"):
        make(module, batch_size=0)
    with pytest.raises(TaskError, match="batch_size"):
        make(module, batch_size=2.5)
    with pytest.raises(TaskError, match="lr"):
        make(module, lr=float("nan"))
    assert make(module, lr=1).batch_size > 0  # an integer where a float is expected is fine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("module", TASKS)
def test_evaluate_follows_the_model_to_the_gpu(module):
    task = make(module)
    cpu = task.evaluate()
    task.model.cuda()
    gpu = task.evaluate()
    assert gpu.keys() == cpu.keys()
    assert all(gpu[k] == pytest.approx(cpu[k], abs=1e-3) for k in cpu)


# ---- digits -----------------------------------------------------------------------------


@needs_sklearn
def test_digits_batches():
    task = make(digits)
    assert task.batch_size == 32
    x, y = next(task.batches(Shard()))
    assert x.dtype == torch.float32 and x.shape == (32, 64)
    assert y.dtype == torch.int64 and y.shape == (32,)
    assert 0 <= x.min() and x.max() <= 1
    assert make(digits, batch_size=8).batch_size == 8


@needs_sklearn
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_digits_shards_partition_the_training_set(count):
    _, y_train, _, _ = digits.load()
    parts = [digits.shard_indices(y_train, Shard(i, count)) for i in range(count)]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(y_train)))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


@needs_sklearn
def test_digits_split_is_fixed_and_disjoint():
    x_train, y_train, x_test, y_test = digits.load()
    assert len(x_test) == 359 and len(x_train) == 1797 - 359
    assert np.array_equal(digits.load()[3], y_test)
    train_rows = {r.tobytes() for r in x_train}
    # a handful of digits occur twice in the data set; nearly all test images are unseen
    assert sum(r.tobytes() in train_rows for r in x_test) <= 5


@needs_sklearn
def test_digits_shards_are_label_skewed():
    _, y_train, _, _ = digits.load()
    halves = [set(y_train[digits.shard_indices(y_train, Shard(i, 2))]) for i in range(2)]
    assert len(halves[0] & halves[1]) <= 1  # at most the class cut at the boundary
    majority = [Counter(y_train[digits.shard_indices(y_train, Shard(i, 5))]).most_common(1)[0][0]
                for i in range(5)]
    assert len(set(majority)) == 5


@needs_sklearn
def test_digits_batches_come_from_the_shard():
    task = make(digits)
    x_train, y_train, _, _ = digits.load()
    mine = digits.shard_indices(y_train, Shard(1, 3))
    rows = {r.tobytes() for r in x_train[mine]}
    for x, y in itertools.islice(task.batches(Shard(1, 3)), 50):  # several epochs
        assert set(y.tolist()) <= set(y_train[mine].tolist())
        assert all(r.numpy().tobytes() in rows for r in x)


@needs_sklearn
def test_digits_learns():
    task = make(digits)
    before = task.evaluate()
    losses = train(task, 300)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) / 4
    after = task.evaluate()
    assert after["accuracy"] > 0.8 > before["accuracy"]
    assert after["loss"] < before["loss"]


def test_digits_without_scikit_learn(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import raises ImportError
    with pytest.raises(TaskError, match=r"pip install 'gossipd\[demo\]'"):
        make(digits)


@needs_sklearn
def test_digits_too_many_shards():
    with pytest.raises(TaskError, match="empty"):
        next(make(digits).batches(Shard(1999, 2000)))


# ---- charlm -----------------------------------------------------------------------------


def test_charlm_batches():
    task = make(charlm)
    assert task.batch_size == 16
    x, y = next(task.batches(Shard()))
    assert x.dtype == y.dtype == torch.int64
    assert x.shape == y.shape == (16, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one byte


def test_charlm_files():
    files = charlm.stdlib_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert len({f.parent for f in files}) == 1  # the top of the standard library only
    assert "site-packages" not in str(files[0])
    assert sum(f.stat().st_size for f in files[:-1]) < charlm.MAX_BYTES
    train_files, held_out = charlm.split_files(files)
    assert set(train_files).isdisjoint(held_out)
    assert sorted(train_files + held_out) == files
    assert 0.03 < len(held_out) / len(files) < 0.07


@pytest.mark.parametrize("count", [1, 2, 3])
def test_charlm_shards_partition_the_training_files(count):
    train_files, _ = charlm.split_files(charlm.stdlib_files())
    parts = [charlm.shard_files(train_files, Shard(i, count)) for i in range(count)]
    assert sorted(itertools.chain(*parts)) == train_files
    assert sum(map(len, parts)) == len(train_files)


def test_charlm_batches_come_from_the_shard():
    train_files, _ = charlm.split_files(charlm.stdlib_files())
    text = b"".join(f.read_bytes() for f in charlm.shard_files(train_files, Shard(2, 3)))
    x, y = next(make(charlm).batches(Shard(2, 3)))
    for row, last in zip(x, y[:, -1]):
        assert bytes(row.tolist() + [int(last)]) in text


def test_charlm_learns():
    task = make(charlm)
    before = task.evaluate()
    assert before["bits_per_char"] == pytest.approx(before["loss"] / np.log(2))
    losses = train(task, 150)
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 0.5
    assert task.evaluate()["loss"] < before["loss"] - 1


def test_charlm_options():
    task = make(charlm, d_model=32, heads=2, layers=1, context=16, batch_size=4)
    x, _ = next(task.batches(Shard()))
    assert x.shape == (4, 16)
    assert np.isfinite(train(task, 3)).all()
    with pytest.raises(TaskError, match="divide"):
        make(charlm, d_model=30, heads=4)


def test_charlm_stdlib_corpus_holds_every_package_but_the_tests():
    files = charlm.stdlib_files("stdlib")
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [f.relative_to(root).parts for f in files]
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any(charlm.SKIPPED.intersection(p) for p in parts)
    packages = {charlm.package_of(f) for f in files}
    assert {"email", "asyncio", "pydoc_data", "json"} <= packages  # the docs are topics.py
    assert set(charlm.stdlib_files()) < set(files)  # the top-level files are among them
    assert sum(f.stat().st_size for f in files) > 2 * charlm.MAX_BYTES


@pytest.mark.parametrize("count", [1, 3, 8])
def test_charlm_package_shards_keep_each_package_whole_and_balance_the_bytes(count):
    train_files, _ = charlm.split_files(charlm.stdlib_files("stdlib"))
    parts = [charlm.shard_files(train_files, Shard(i, count), "package") for i in range(count)]
    assert sorted(itertools.chain(*parts)) == train_files
    homes: dict[str, set[int]] = {}
    for i, part in enumerate(parts):
        for f in part:
            homes.setdefault(charlm.package_of(f), set()).add(i)
    assert all(len(shards) == 1 for shards in homes.values())
    size = {f: f.stat().st_size for f in train_files}
    sizes = [sum(size[f] for f in part) for part in parts]
    # Greedy by size: no shard exceeds the smallest by more than the largest package.
    packages: dict[str, int] = {}
    for f in train_files:
        packages[charlm.package_of(f)] = packages.get(charlm.package_of(f), 0) + size[f]
    assert max(sizes) - min(sizes) <= max(packages.values())


def test_charlm_package_shards_differ_in_kind():
    train_files, _ = charlm.split_files(charlm.stdlib_files("stdlib"))

    def distribution(files: list[Path]) -> np.ndarray:
        text = np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
        counts = np.bincount(text, minlength=256).astype(float)
        return counts / counts.sum()

    def farthest(by: str) -> float:
        """The largest total-variation distance of a shard's bytes from the whole text's."""
        whole = distribution(train_files)
        return max(0.5 * np.abs(distribution(charlm.shard_files(train_files, Shard(i, 8), by))
                                - whole).sum() for i in range(8))

    # Cut by file every shard reads like the whole (0.07 at most on Python 3.11); cut by
    # package one is mostly codec tables (0.38) and the others lean their own way.
    assert farthest("package") > 3 * farthest("file")


def test_charlm_word_options_are_checked():
    with pytest.raises(TaskError, match="corpus must be one of top, stdlib"):
        make(charlm, corpus="books")
    with pytest.raises(TaskError, match="shard_by must be one of file, package"):
        make(charlm, shard_by="line")
    task = make(charlm, corpus="stdlib", eval_windows=4, d_model=16, heads=2, layers=1,
                context=16, batch_size=2)
    assert np.isfinite(task.evaluate()["loss"])


def test_charlm_too_many_shards():
    with pytest.raises(TaskError, match="too many shards"):
        next(make(charlm).batches(Shard(999, 1000)))


# ---- examples/own_script.py ---------------------------------------------------------------


def test_own_script_help():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "own_script.py"), "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "--bootstrap" in out and "--key-hex" in out and "--steps" in out


def test_evaluating_turns_gradients_off_and_restores_the_mode() -> None:
    from daemon.task import evaluating

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    for training in (True, False):
        model.train(training)
        with evaluating(model) as device:
            assert device == torch.device("cpu")
            assert not model.training and not torch.is_grad_enabled()
        assert model.training is training and torch.is_grad_enabled()


def test_classifier_step_takes_one_optimizer_step_and_returns_a_detached_loss() -> None:
    from daemon.task import classifier_step

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    step = classifier_step(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    first = step((x, y))
    assert first.requires_grad is False and first.dim() == 0
    torch.testing.assert_close(first, torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(x, *before), y))
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert step((x, y)) < first  # a descent step on the same batch
