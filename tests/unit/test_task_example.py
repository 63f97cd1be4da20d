"""The task that docs/TASKS.md writes from scratch (examples/tasks/friedman.py): it loads the
way the daemon loads it, trains, and is shown in the document exactly as it is in the file;
and the document names every field and helper of daemon.task."""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
from pathlib import Path

import pytest
import torch

import daemon.task
from daemon.config import load
from daemon.task import Context, Shard, Task, TaskError, load_entry

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tasks" / "friedman.py"
CONFIG = ROOT / "examples" / "friedman.toml"
TASKS_MD = ROOT / "docs" / "TASKS.md"
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def config(tmp_path):
    """The example config with its data directory in tmp_path, the task file copied there
    (as the config's comment says to do)."""
    shutil.copy(EXAMPLE, tmp_path / EXAMPLE.name)
    return load(CONFIG, [f"node.data_dir={tmp_path}"])


def build(config, step=lambda: 0) -> Task:
    """The task as ``gossipd run`` builds it from the config."""
    fn = load_entry(config.task.entry, config.data_dir())
    return fn(Context(config.task.seed, CPU, dict(config.task.options),
                      config.data_dir() / "cache", step))


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", TASKS_MD.read_text(), re.S | re.M)


def test_the_example_trains_as_the_daemon_loads_it(config):
    steps = [0]
    task = build(config, lambda: steps[0])
    before = task.evaluate()
    shard = Shard(config.task.shard, config.task.shards)
    losses = []
    for batch in itertools.islice(task.batches(shard), 300):
        losses.append(float(task.step(batch)))
        steps[0] += 1  # what the swarm's step does as this node steps alone
    after = task.evaluate()
    assert sum(losses[-20:]) < sum(losses[:20]) / 3
    assert after["mse"] < before["mse"] / 3
    assert after["r2"] > 0.6 > before["r2"]


def test_the_learning_rate_follows_the_swarm_step(config):
    swarm_step = [0]
    task = build(config, lambda: swarm_step[0])
    batch = next(task.batches(Shard()))
    task.step(batch)
    warmup, lr = config.task.options["warmup"], config.task.options["lr"]
    assert task.optimizer.param_groups[0]["lr"] == pytest.approx(lr / warmup)
    swarm_step[0] = 10 * warmup  # a download or an exchange moved the step on
    task.step(batch)
    assert task.optimizer.param_groups[0]["lr"] == pytest.approx(lr)


def test_the_example_shards_its_data(config):
    task = build(config)
    first = [next(task.batches(Shard(i, 2)))[0] for i in range(2)]
    rows = [{r.numpy().tobytes() for r in x} for x in first]
    assert rows[0].isdisjoint(rows[1])
    with pytest.raises(TaskError, match="fewer than a batch"):
        next(task.batches(Shard(0, 1000)))  # 8 samples a shard, 64 a batch
    with pytest.raises(TaskError, match="hiden"):
        load_entry(config.task.entry, config.data_dir())(Context(0, CPU, {"hiden": 8}))


def test_the_document_shows_the_example_whole():
    assert EXAMPLE.read_text() in code_blocks("python")
    assert CONFIG.read_text() in code_blocks("toml")


def test_the_document_names_every_field_and_helper():
    text = TASKS_MD.read_text()
    for cls in (Task, Shard, Context):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"docs/TASKS.md: no row for {cls.__name__}.{f.name}"
    for name in daemon.task.__all__:
        assert f"`{name}" in text, f"docs/TASKS.md does not mention daemon.task.{name}"
