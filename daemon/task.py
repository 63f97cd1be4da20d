"""What a daemon trains: the task plugin interface.

A task is named in the config as ``package.module:function`` (a module on the Python path) or
``path/to/file.py:function`` (a file; a relative path starts from ``node.data_dir``, like every
relative path in the config). The daemon calls ``function(context)`` once at start-up and gets
a :class:`Task` back: the model, its optimizer, a batch iterator for the node's shard, a step
function and, optionally, an evaluation. The daemon moves the model to the configured device
before the first step and moves each batch there too (tensors inside tuples, lists and
dicts), so a task written for the CPU also trains on a GPU.

::

    def task(ctx: Context) -> Task:
        torch.manual_seed(ctx.seed)          # every node starts from the same weights
        model = Net()
        opts = read_options(ctx.options, {"lr": 1e-3, "hidden": 64})  # typos are errors
        opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])

        def batches(shard: Shard) -> Iterator[tuple[Tensor, Tensor]]:
            ...                              # this node's part of the data; endless or one epoch

        def step(batch) -> Tensor:
            for group in opt.param_groups:   # a schedule follows the swarm's step
                group["lr"] = opts["lr"] * min(1.0, ctx.global_step() / 100)
            x, y = batch
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
            return loss

        return Task(model, opt, batches, step, batch_size=64, evaluate=...)
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from gossip import Stages
from gossip.lowlevel import sequential_step

from .entry import entry_file as entry_file
from .entry import is_file_entry as is_file_entry
from .entry import parse_entry as parse_entry

__all__ = ["Context", "Shard", "Task", "TaskError", "classifier_step", "entry_file",
           "evaluating", "is_file_entry", "load_entry", "parse_entry",
           "read_options", "to_device"]


class TaskError(Exception):
    """The task named in the config cannot be loaded or used (the operator's to fix)."""


@dataclass(frozen=True)
class Shard:
    """This node's part of the data: shard ``index`` of ``count`` (0-based)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if not (type(self.count) is int and self.count >= 1
                and type(self.index) is int and 0 <= self.index < self.count):
            raise ValueError(f"a shard is an index in [0, count): got {self.index}/{self.count}")


@dataclass(frozen=True)
class Context:
    """What the daemon tells the task function.

    Attributes:
        seed: the swarm's seed (``task.seed``, >= 0): seed the model's initialization with it
            so that every node starts from the same weights.
        device: where the daemon will train (the task may build on the CPU; the daemon moves
            the model and batches).
        options: the config's ``[task.options]`` table, as given.
        cache_dir: a directory the task may keep downloaded or prepared data in.
        global_step: ``global_step()`` is the step to schedule by (a learning rate's warm-up
            and decay): this node's optimizer steps, moved towards its peers' at every
            exchange so that the swarm's schedules stay together (a node ahead of the swarm
            holds its step while the others catch up; it never goes back). Call it in
            ``step``: it changes as training goes. It counts steps, not samples.
        process: this process's rank in its node (0..processes-1): on a node of several
            processes (``task.processes``), each trains on every ``processes``-th batch of the
            node's shard; the task needs to do nothing about it.
        processes: how many processes the node has.
    """

    seed: int
    device: torch.device
    options: Mapping[str, Any] = field(default_factory=dict)
    cache_dir: Path = Path(".")
    global_step: Callable[[], int] = field(default=lambda: 0, compare=False)
    process: int = 0
    processes: int = 1


@dataclass
class Task:
    """What to train.

    Attributes:
        model: the module the swarm averages (its parameters and floating-point buffers).
        optimizer: its optimizer; its state is checkpointed and never leaves the node.
        batches: ``batches(shard)`` returns an iterator over this node's batches: endless,
            or one epoch (a DataLoader), which the daemon calls ``batches`` again for each
            time it ends. Each call must return a new iterator.
        step: ``step(batch)`` runs one optimizer step and returns the loss (float or
            0-dim tensor).
        batch_size: samples per step (the daemon counts samples with it).
        evaluate: optional; returns metrics such as ``{"accuracy": 0.93}`` on held-out data.
        pipeline: optional (:class:`gossip.Stages`): the model, an ``nn.Sequential``, may be
            cut into pipeline stages (``task.pipeline``); its batches are then ``(input,
            target)`` pairs, and ``step`` may be None: a node of one process then takes the
            pipeline's step in one process (:func:`gossip.pipeline.sequential_step`).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batches: Callable[[Shard], Iterator[Any]]
    step: Callable[[Any], Any] | None
    batch_size: int
    evaluate: Callable[[], Mapping[str, float]] | None = None
    pipeline: Stages | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, torch.nn.Module):
            raise TaskError(f"Task.model must be a torch.nn.Module, not {type(self.model).__name__}")
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TaskError("Task.optimizer must be a torch.optim.Optimizer")
        if self.pipeline is not None and not isinstance(self.pipeline, Stages):
            raise TaskError(f"Task.pipeline must be a gossip.Stages or None, not "
                            f"{type(self.pipeline).__name__}")
        if self.step is None and self.pipeline is not None:
            self.step = sequential_step(self.model, self.optimizer, self.pipeline)
        if not callable(self.batches) or not callable(self.step):
            raise TaskError("Task.batches and Task.step must be callables (step may be None "
                            "only with Task.pipeline)")
        if type(self.batch_size) is not int or self.batch_size < 1:
            raise TaskError(f"Task.batch_size must be a positive integer, not {self.batch_size!r}")
        if self.evaluate is not None and not callable(self.evaluate):
            raise TaskError("Task.evaluate must be a callable or None")


def read_options(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``given`` (the config's ``[task.options]``); each value a
    positive number of its default's type (an integer option takes only integers).

    Raises:
        TaskError: an unknown key (a typo, most likely) or a bad value.
    """
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise TaskError(f"unknown task option(s) {', '.join(unknown)}; "
                        f"this task takes {', '.join(defaults)}")
    opts = {**defaults, **given}
    for key, value in opts.items():
        want_int = type(defaults[key]) is int
        ok = type(value) is int or not want_int and type(value) is float
        if not ok or not (value > 0 and math.isfinite(value)):
            kind = "integer" if want_int else "number"
            raise TaskError(f"task option {key} must be a positive {kind}, not {value!r}")
    return opts


def load_entry(entry: str, base: str | os.PathLike[str] = ".") -> Callable[[Context], Task]:
    """Resolve ``package.module:function`` or ``path/to/file.py:function`` to the function.

    Args:
        entry: the config's ``task.entry`` (see :func:`parse_entry`).
        base: where a relative file path starts: the daemon passes ``node.data_dir``, as
            DAEMON.md documents for every relative path in the config. A module is found on
            the Python path, whatever ``base`` is.

    Raises:
        TaskError: the entry is malformed, or the file or module cannot be found or
            imported, or has no such function. A file's message names the path tried.
    """
    try:
        target, attr = parse_entry(entry)
    except ValueError as exc:
        raise TaskError(f"task.entry: {exc}") from None
    path = entry_file(entry, base)
    if path is not None:
        where = ("" if Path(target).is_absolute() else
                 f" (a relative task.entry starts from node.data_dir, {os.path.abspath(base)})")
        if not path.is_file():
            problem = "is not a file" if path.exists() else "does not exist"
            raise TaskError(f"task file {path} {problem}{where}")
        name = f"gossipd_task_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise TaskError(f"cannot load task file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)  # unless the module took itself out
            raise TaskError(f"task file {path} failed to import: {exc!r}") from exc
        source = f"task file {path}"
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            hint = ""
            if isinstance(exc, ModuleNotFoundError) and exc.name == target.split(".")[0]:
                hint = " (a file? write it as path/to/file.py:function)"
            raise TaskError(f"cannot import task module {target!r}: {exc}{hint}") from exc
        except Exception as exc:  # the module's own code failed (a SyntaxError, say)
            raise TaskError(f"task module {target!r} failed to import: {exc!r}") from exc
        source = f"task module {target!r}"
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise TaskError(f"{source} has no function {attr!r}")
    return fn


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a batch (nested tuples, lists and dicts) to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple):
        return tuple(to_device(b, device) for b in batch)
    if isinstance(batch, list):
        return [to_device(b, device) for b in batch]
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.device]:
    """For a task's ``evaluate``: the model in eval mode with gradients off, back in the
    mode it was in afterwards. Yields the model's device (the daemon moves the model after
    the task is built, so an evaluation moves its data there)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield next(model.parameters()).device
    finally:
        model.train(was_training)


def classifier_step(model: Callable[[torch.Tensor], torch.Tensor],
                    optimizer: torch.optim.Optimizer) -> Callable[[Any], torch.Tensor]:
    """The usual ``Task.step`` of a classifier: the cross-entropy of ``model(x)`` against the
    labels ``y`` of a batch ``(x, y)``, backward, one optimizer step; returns the loss
    (detached, so that the daemon reads it once a chunk rather than syncing every step)."""

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step
