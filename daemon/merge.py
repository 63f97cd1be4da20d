"""``gossipd average`` and ``gossipd export``: a model's files, offline. ``average`` merges
separately trained replicas by hand; ``export`` turns one checkpoint into a plain state dict.

Theory of operation
-------------------
Each input is a gossipd checkpoint (its ``"model"`` entry) or a file written by
``torch.save(model.state_dict())``, or by ``torch.save({"model": sd})`` /
``torch.save({"state_dict": sd})`` as many training scripts do. Files are read only with
``torch.load(weights_only=True, map_location="cpu")`` (checkpoints through
:func:`daemon.checkpoint.load`, which verifies them first), so a file from a stranger can
refuse to load but cannot run code.

All inputs must have the same schema: the same keys, and for each key the same shape and
dtype. The first difference is refused with a :class:`MergeError` naming the key and both
files; nothing is cast or broadcast to make a mismatch fit.

Floating-point entries are averaged with weights normalized to sum to 1 (equal by default),
accumulated in float64 and rounded once to the entry's dtype, so fp16/bf16 inputs lose
nothing to intermediate rounding (complex entries likewise in complex128). Integer and bool
entries are counters or flags, not weights (BatchNorm's ``num_batches_tracked``): the result
takes their elementwise maximum (logical or for bool), so a counter never goes backwards,
and a difference is logged. Non-finite values are not refused: a buffer may hold -inf on
purpose (an attention mask); NaN in an input gives NaN in the output.

The output is a plain ``torch.save``'d state dict in key order, written atomically (temp
file, fsync, ``os.replace``: :func:`daemon.files.atomic_write`) with mode 0600, and never over
one of the inputs. Memory: every input is held at once, plus one float64 accumulator for the
largest entry.

A checkpoint is not a ``torch.save`` file (a header and a trailer frame the payload:
:mod:`daemon.checkpoint`) and holds the optimizer, counters and RNG states besides the model.
:func:`export_file` verifies one and writes its ``"model"`` entry alone, the same way as an
average: what ``torch.load(path, weights_only=True)`` returns and the task's model takes in
``load_state_dict``.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from . import checkpoint
from .files import atomic_write

__all__ = ["MergeError", "read_state_dict", "average", "average_files", "export_file"]

log = logging.getLogger(__name__)


class MergeError(Exception):
    """The inputs of a merge cannot be averaged: the user's files are unreadable, not state
    dicts, or of different schemas, or the weights are invalid. One line, naming the file."""


def _is_state_dict(obj: object) -> bool:
    return (isinstance(obj, Mapping) and len(obj) > 0
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read one model state dict from a checkpoint or a plain ``torch.save`` file.

    Args:
        path: the file.

    Returns:
        The state dict (CPU tensors), in the file's key order.

    Raises:
        MergeError: the file is missing or unreadable, fails checkpoint verification, is
            refused by ``torch.load(weights_only=True)``, or holds no mapping of str to Tensor
            (at the top level, or under ``"model"`` or ``"state_dict"``).
    """
    path = Path(path)
    if _is_checkpoint(path):
        try:
            obj: Any = checkpoint.load(path)
        except checkpoint.CheckpointError as exc:
            raise MergeError(f"{path}: {exc.reason}") from exc
    else:
        try:
            obj = torch.load(path, weights_only=True, map_location="cpu")
        except OSError as exc:
            raise MergeError(f"{path}: cannot read: {exc.strerror or exc}") from exc
        except Exception as exc:  # torch.load raises many types on foreign bytes
            raise MergeError(f"{path}: refused by torch.load(weights_only=True): "
                             f"{checkpoint.torch_load_reason(exc)}") from exc

    if _is_state_dict(obj):
        return dict(obj)
    if isinstance(obj, Mapping):
        for key in ("model", "state_dict"):
            if _is_state_dict(obj.get(key)):
                return dict(obj[key])
    raise MergeError(f"{path}: holds a {type(obj).__name__}, not a state dict (a non-empty "
                     "mapping of str to Tensor, at the top or under 'model' or 'state_dict')")


def _is_checkpoint(path: Path) -> bool:
    """Whether ``path`` starts as a checkpoint does (not yet whether it is a sound one).

    Raises:
        MergeError: the file is missing or unreadable.
    """
    try:
        with open(path, "rb") as f:
            return f.read(len(checkpoint.MAGIC)) == checkpoint.MAGIC
    except OSError as exc:
        raise MergeError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def _normalized(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n:
        raise MergeError(f"{len(weights)} weights for {n} inputs")
    for i, w in enumerate(weights):
        real = isinstance(w, numbers.Real) and not isinstance(w, bool)
        if not real or not math.isfinite(w) or w <= 0:
            raise MergeError(f"weight #{i} is {w!r}; weights must be finite and > 0")
    # Scale by the largest first so that huge weights cannot overflow the sum.
    top = float(max(weights))
    scaled = [float(w) / top for w in weights]
    total = math.fsum(scaled)
    return [w / total for w in scaled]


def _check_schema(states: Sequence[Mapping[str, Any]], names: Sequence[str]) -> None:
    ref, ref_name = states[0], names[0]
    for key, value in ref.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise MergeError(f"{ref_name}: entry {key!r} is not a str -> Tensor entry")
        if value.layout != torch.strided:
            raise MergeError(f"{ref_name}: key {key!r} has layout {value.layout}; only dense "
                             "tensors can be averaged")
    for state, name in zip(states[1:], names[1:]):
        for key in ref:
            if key not in state:
                raise MergeError(f"{name}: key {key!r} missing (present in {ref_name})")
        for key in state:
            if key not in ref:
                raise MergeError(f"{name}: key {key!r} not in {ref_name}")
        for key, want in ref.items():
            got = state[key]
            if not isinstance(got, torch.Tensor):
                raise MergeError(f"{name}: key {key!r} is a {type(got).__name__}, not a Tensor")
            if got.shape != want.shape:
                raise MergeError(f"{name}: key {key!r} has shape {tuple(got.shape)}, "
                                 f"{ref_name} has {tuple(want.shape)}")
            if got.dtype != want.dtype:
                raise MergeError(f"{name}: key {key!r} has dtype {got.dtype}, "
                                 f"{ref_name} has {want.dtype}")
            if got.layout != want.layout:
                raise MergeError(f"{name}: key {key!r} has layout {got.layout}, "
                                 f"{ref_name} has {want.layout}")


_INTEGRAL = {torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64}


def average(states: Sequence[Mapping[str, torch.Tensor]],
            weights: Sequence[float] | None = None,
            names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """The weighted mean of state dicts of one schema.

    Args:
        states: two or more state dicts with the same keys, shapes and dtypes.
        weights: one finite, positive weight per state, normalized to sum to 1; None means
            equal weights.
        names: what to call each state in messages (file names); default ``#0``, ``#1``, ...

    Returns:
        A new state dict on the CPU in the first state's key order: floating-point entries
        are the weighted mean (computed in float64, cast back), integer and bool entries
        the elementwise maximum.

    Raises:
        MergeError: fewer than 2 states, bad weights or names, a schema difference (the first
            one, naming the key and files), or a dtype that cannot be averaged.
    """
    n = len(states)
    if n < 2:
        raise MergeError(f"need at least 2 state dicts to average, got {n}")
    names = [f"#{i}" for i in range(n)] if names is None else [str(x) for x in names]
    if len(names) != n:
        raise MergeError(f"{len(names)} names for {n} inputs")
    w = _normalized(weights, n)
    _check_schema(states, names)

    out: dict[str, torch.Tensor] = {}
    for key, first in states[0].items():
        dtype = first.dtype
        tensors = [s[key].detach().cpu() for s in states]
        if dtype.is_floating_point or dtype.is_complex:
            wide = torch.complex128 if dtype.is_complex else torch.float64
            acc = tensors[0].to(wide) * w[0]
            for t, wi in zip(tensors[1:], w[1:]):
                acc.add_(t.to(wide), alpha=wi)
            out[key] = acc.to(dtype)
        elif dtype in _INTEGRAL:
            top = tensors[0].clone()
            for t in tensors[1:]:
                top = torch.maximum(top, t)
            if not all(torch.equal(t, tensors[0]) for t in tensors[1:]):
                log.info("average integer entry differs key=%s taking=max", key)
            out[key] = top
        else:
            raise MergeError(f"{names[0]}: key {key!r} has dtype {dtype}, which cannot be "
                             "averaged")
    return out


def average_files(paths: Sequence[Path], out: Path,
                  weights: Sequence[float] | None = None) -> dict[str, torch.Tensor]:
    """Average the state dicts in ``paths`` and write the result to ``out``.

    Args:
        paths: two or more checkpoints or ``torch.save``'d state dicts.
        out: the output file, written atomically as a plain ``torch.save``'d state dict
            (loadable with ``torch.load(weights_only=True)`` and ``model.load_state_dict``).
        weights: as in :func:`average`.

    Returns:
        The averaged state dict.

    Raises:
        MergeError: ``out`` is one of the inputs, an input cannot be read or averaged, or
            ``out`` cannot be written (then it is unchanged).
    """
    paths = [Path(p) for p in paths]
    out = Path(out)
    _check_output(out, paths)
    if len(paths) < 2:
        raise MergeError(f"need at least 2 files to average, got {len(paths)} (to convert "
                         "one checkpoint to a state dict: gossipd export)")
    states = [read_state_dict(p) for p in paths]
    result = average(states, weights, names=[str(p) for p in paths])
    _write(out, result)
    log.info("average written out=%s inputs=%d keys=%d", out, len(paths), len(result))
    return result


def export_file(path: Path, out: Path) -> dict[str, Any]:
    """Write the model of the checkpoint ``path`` to ``out`` as a plain state dict.

    Args:
        path: a checkpoint (``checkpoint-<step>[.<k>].ckpt``).
        out: the output file, written atomically as a plain ``torch.save``'d state dict
            (loadable with ``torch.load(weights_only=True)`` and ``model.load_state_dict``).

    Returns:
        The checkpoint's whole state (``"model"``, ``"counters"``, ...), for the caller's
        message.

    Raises:
        MergeError: ``path`` is missing, unreadable, not a checkpoint, damaged, or holds no
            model state dict; ``out`` is ``path`` or its directory does not exist; or ``out``
            cannot be written (then it is unchanged).
    """
    path, out = Path(path), Path(out)
    if not _is_checkpoint(path):
        raise MergeError(f"{path}: not a gossipd checkpoint (those start with "
                         f"{checkpoint.MAGIC.decode()}; a torch.save file loads as it is)")
    _check_output(out, [path])
    try:
        state = checkpoint.load(path)
    except checkpoint.CheckpointError as exc:
        raise MergeError(f"{path}: {exc.reason}") from exc
    model = state.get("model")
    if not _is_state_dict(model):
        raise MergeError(f"{path}: its 'model' entry is a {type(model).__name__}, not a state "
                         "dict (a non-empty mapping of str to Tensor)")
    _write(out, dict(model))
    log.info("export written out=%s checkpoint=%s keys=%d", out, path, len(model))
    return state


def _check_output(out: Path, inputs: Sequence[Path]) -> None:
    """Refuse an output that is one of the inputs, or whose directory is missing."""
    for p in inputs:
        same = out.resolve() == p.resolve()
        if not same and out.exists() and p.exists():
            same = os.path.samefile(out, p)  # hard links and bind mounts
        if same:
            raise MergeError(f"{out}: refusing to overwrite input {p}")
    if out.is_dir():
        raise MergeError(f"{out} is a directory; name the file to write")
    if not out.parent.is_dir():
        raise MergeError(f"{out}: directory {out.parent} does not exist")


def _write(out: Path, state: Mapping[str, torch.Tensor]) -> None:
    def write(f: BinaryIO) -> None:
        torch.save(state, f)

    try:
        atomic_write(out, write)
    except OSError as exc:
        raise MergeError(f"{out}: cannot write: {exc.strerror or exc}") from exc
