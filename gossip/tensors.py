"""A model's state as one flat buffer, and the operations on it.

Theory of operation
-------------------
A state is the float entries of a model's ``state_dict`` that its :class:`StateSchema` lists
(:mod:`gossip.schema`). On the host it lives in one flat, contiguous, 1-D float32 tensor
(:func:`new_flat`), whatever the dtypes and devices of the live tensors, each entry at its
schema offset. :func:`snapshot` fills it from the model (device to host, cast to float32),
:func:`load_` copies it back and :func:`add_` adds a flat delta into the live tensors in place;
the float32 delta is added in the live tensor's dtype with a single rounding. The reductions
(:func:`all_finite`, :func:`norm`, :func:`sum_of_squares`) go chunk by chunk, so none makes a
model-sized temporary. What a flat buffer becomes on the wire is :mod:`gossip.codec`'s.

Memory for one exchange: the local snapshot and the received state, two float32 copies of the
model (the delta is then computed in place in the received buffer). Nothing here does I/O or
imports trio; the functions are synchronous and CPU-heavy, so trio code runs them in a thread.

The schema's and the codec's names are importable from here too (``tensors.StateSchema``,
``tensors.encode_chunks``), as they were before each had a module of its own.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Union

import torch

from .codec import CODECS, StateDecoder, check_flat, encode_chunks, encoded_nbytes, itemsize
from .errors import SchemaMismatch
from .schema import DTYPES, StateSchema, TensorSpec, float_items, spec_of

__all__ = [
    "new_flat", "snapshot", "unflatten", "add_", "load_", "live", "views",
    "all_finite", "norm", "sum_of_squares", "REDUCE_CHUNK",
    # from gossip.schema and gossip.codec
    "DTYPES", "TensorSpec", "StateSchema", "CODECS", "StateDecoder", "itemsize",
    "encoded_nbytes", "encode_chunks",
]

# Chunk size (elements) for the reductions: their temporaries stay small, and a chunk (1 MiB
# of float32) stays in cache from one operation on it to the next.
REDUCE_CHUNK = 1 << 18

Target = Union[torch.nn.Module, Mapping[str, torch.Tensor]]


def _tensors(target: Target, schema: StateSchema,
             flat: torch.Tensor | None) -> list[torch.Tensor]:
    """The live tensors of ``target`` in schema order, after checking them and ``flat``."""
    if isinstance(target, torch.nn.Module):
        target = target.state_dict()
    elif not isinstance(target, Mapping):
        raise TypeError(f"expected a torch.nn.Module or a state dict, not {type(target).__name__}")
    items = float_items(target)
    if len(items) != len(schema.entries):
        raise SchemaMismatch(f"model has {len(items)} float tensors, schema has "
                             f"{len(schema.entries)} ({schema.fingerprint_hex})")
    for (name, t), spec in zip(items, schema.entries):
        if spec_of(name, t) != spec:
            raise SchemaMismatch(f"model tensor {spec_of(name, t)} does not match schema {spec}")
    if flat is not None:
        check_flat(flat, schema)
    return [t for _, t in items]


def new_flat(schema: StateSchema, pin_memory: bool = False) -> torch.Tensor:
    """A new flat buffer for ``schema``: a 1-D float32 CPU tensor of ``schema.numel`` zeros.

    Page-locked (faster device copies) when ``pin_memory`` is true and CUDA is available. Any
    contiguous CPU float32 tensor of the right size works as a flat buffer, pinned or not:
    :func:`~gossip.codec.encode_chunks` aliases its memory, so no ``bytearray`` is needed.
    """
    pin = pin_memory and torch.cuda.is_available()
    return torch.zeros(schema.numel, dtype=torch.float32, pin_memory=pin)


def snapshot(target: Target, schema: StateSchema, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy the float entries of a model (any devices, any float dtypes) into a flat buffer.

    Args:
        target: a module or a state dict; must match ``schema``.
        schema: the local schema.
        out: the flat buffer to fill; a new one from :func:`new_flat` if omitted.

    Returns:
        The filled flat buffer.

    Raises:
        SchemaMismatch: the model or ``out`` does not match ``schema``.
    """
    flat = new_flat(schema) if out is None else out
    tensors = _tensors(target, schema, flat)
    with torch.no_grad():
        for t, view in zip(tensors, _views(flat, schema)):
            view.copy_(t)
    return flat


def unflatten(flat: torch.Tensor, schema: StateSchema) -> dict[str, torch.Tensor]:
    """Views of ``flat`` shaped as the schema's entries, by name (float32, sharing memory).

    Raises:
        SchemaMismatch: ``flat`` has the wrong number of elements.
    """
    check_flat(flat, schema)
    return {spec.name: view for spec, view in zip(schema.entries, _views(flat, schema))}


def _views(flat: torch.Tensor, schema: StateSchema) -> Iterator[torch.Tensor]:
    for spec, offset in zip(schema.entries, schema.offsets):
        yield flat[offset : offset + spec.numel].view(spec.shape)


def live(target: Target, schema: StateSchema) -> list[torch.Tensor]:
    """The model's live float tensors, in schema order (the tensors :func:`snapshot` reads).

    Raises:
        SchemaMismatch: the model does not match ``schema``.
    """
    return _tensors(target, schema, None)


def views(flat: torch.Tensor, schema: StateSchema) -> list[torch.Tensor]:
    """The schema's entries as views of a flat buffer, shaped as the live tensors."""
    check_flat(flat, schema)
    return list(_views(flat, schema))


def add_(target: Target, schema: StateSchema, delta: torch.Tensor, alpha: float = 1.0) -> None:
    """Add ``alpha`` times a flat float32 delta into the model's live tensors, in place.

    Each slice moves to its tensor's device and is added in float32 (float64 for float64
    tensors), rounding once into the tensor's dtype. Runs under ``torch.no_grad()``.

    Raises:
        SchemaMismatch: the model or ``delta`` does not match ``schema``.
    """
    tensors = _tensors(target, schema, delta)
    with torch.no_grad():
        for t, view in zip(tensors, _views(delta, schema)):
            t.add_(view.to(t.device), alpha=alpha)


def load_(target: Target, schema: StateSchema, flat: torch.Tensor) -> None:
    """Copy a flat state into the model's live tensors, in place (cast to each dtype).

    Raises:
        SchemaMismatch: the model or ``flat`` does not match ``schema``.
    """
    tensors = _tensors(target, schema, flat)
    with torch.no_grad():
        for t, view in zip(tensors, _views(flat, schema)):
            t.copy_(view)


def all_finite(flat: torch.Tensor) -> bool:
    """Whether every element of a flat state is finite (no NaN, no ±inf).

    Chunk by chunk, so no model-sized temporary: a chunk whose sum is finite holds only finite
    values; a chunk whose float32 sum is not (a non-finite value, or an overflow) gets the
    exact elementwise test.
    """
    for start in range(0, flat.numel(), REDUCE_CHUNK):
        chunk = flat[start : start + REDUCE_CHUNK]
        if not bool(torch.isfinite(chunk.sum())) and not bool(chunk.isfinite().all()):
            return False
    return True


def norm(flat: torch.Tensor) -> float:
    """The Euclidean norm of a flat state (inf or NaN if it holds such values)."""
    return math.sqrt(sum_of_squares(flat))


def sum_of_squares(flat: torch.Tensor) -> float:
    """The squared Euclidean norm of a flat float32 tensor (inf or NaN if it holds such values).

    Float32 dot products chunk by chunk (relative error about 1e-6), added in float64; a chunk
    whose float32 sum of squares overflows is redone in float64, so huge values are right too.
    """
    total = 0.0
    for start in range(0, flat.numel(), REDUCE_CHUNK):
        chunk = flat[start : start + REDUCE_CHUNK]
        part = float(torch.dot(chunk, chunk))
        if math.isinf(part):
            part = float(torch.linalg.vector_norm(chunk, dtype=torch.float64)) ** 2
        total += part
    return total
