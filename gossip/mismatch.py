"""Saying how two nodes' models differ, when their schema fingerprints do.

Theory of operation
-------------------
A ``StateRequest`` or an ``Offer`` carries only its sender's schema fingerprint (PROTOCOL.md
section 7.1): enough to refuse, not to say why. The refusing node is the one that could know
both schemas, but it holds only the other's fingerprint; the refused node holds its own schema
and nothing of the other's. So the refusing node sends its own, bounded, in a
:class:`~gossip.messages.SchemaInfo` just before ``Close(REJECTED)`` (:func:`describe`), and
the refused node compares it with its own (:func:`difference`) and logs what differs::

    fc1.weight: (64, 64) here, (128, 64) there

The description is the schema's length and its first entries, as many as fit in one message
beside the task metadata: a model of a few hundred tensors fits whole (an entry is its name and
some ten bytes). A list cut short is said to be: a difference past its end is counted, not
named. The refused node trusts the description no further than its decoder makes it (names
printable and unique, shapes and dtypes bounded), so that a peer can spoil the text of one log
line and nothing else.

The task metadata (what the application publishes with its state: the daemon's task entry,
seed and options) travels too, and :func:`task_difference` names the keys whose values differ:
other task options are the usual reason why two nodes of one swarm build different models.

Pure: no I/O, no trio.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Mapping
from typing import Any

import cbor2

from .messages import MAX_DIMS, MAX_SCHEMA_ENTRIES, MAX_TEXT, SchemaInfo
from .tensors import StateSchema, TensorSpec
from .wire import MAX_MESSAGE, encode

__all__ = ["SHOWN", "describe", "listed", "difference", "task_difference", "explain"]

SHOWN = 4  # differences named in one text; the rest are counted
_SLACK = 16  # bytes an array's header and the count may grow by as entries are added
_PLAIN = re.compile(r"[\w.\-\[\]]{1,80}")  # a name shown as is in a log line: nothing to forge
_VALUE = reprlib.Repr()
_VALUE.maxstring = _VALUE.maxother = 40
_VALUE.maxlist = _VALUE.maxdict = 4


def describe(schema: StateSchema, meta: bytes = b"") -> SchemaInfo:
    """The :class:`SchemaInfo` a node sends about its own ``schema``: its first entries, as
    many as fit in one message beside ``meta`` (the task metadata, canonical CBOR as in
    ``StateInfo``; empty: none), up to :data:`MAX_SCHEMA_ENTRIES`. The list stops early at an
    entry the message cannot hold (a name over 256 characters or not printable, more than
    :data:`MAX_DIMS` dimensions), so that what is listed is always the schema's start."""
    budget = MAX_MESSAGE - len(encode(SchemaInfo(len(schema.entries), (), meta))) - _SLACK
    entries = []
    for e in schema.entries[:MAX_SCHEMA_ENTRIES]:
        if len(e.name) > MAX_TEXT or not e.name.isprintable() or len(e.shape) > MAX_DIMS:
            break
        item = (e.name, e.shape, e.dtype)
        budget -= len(cbor2.dumps(item, canonical=True))
        if budget < 0:
            break
        entries.append(item)
    return SchemaInfo(len(schema.entries), tuple(entries), meta)


def listed(info: SchemaInfo) -> StateSchema:
    """The entries a :class:`SchemaInfo` lists, as a schema (its decoder has checked them)."""
    return StateSchema(tuple(TensorSpec(name, shape, dtype) for name, shape, dtype in info.entries))


def difference(ours: StateSchema, theirs: StateSchema, *, count: int | None = None) -> str:
    """What differs between our schema and a peer's, in words for a log line: the first
    :data:`SHOWN` differing tensors, then how many more.

    Args:
        ours: our schema.
        theirs: the peer's, or its start (a :class:`SchemaInfo` cut short).
        count: how many entries the peer's schema has in all; default ``len(theirs)``.

    Returns:
        For instance ``"2 tensors differ (4 here, 4 there): fc1.weight: (64, 64) here,
        (128, 64) there; fc1.bias: (64,) here, (128,) there"``.
    """
    total = len(theirs.entries) if count is None else max(count, len(theirs.entries))
    cut = total > len(theirs.entries)
    mine = {e.name: e for e in ours.entries}
    there = {e.name: e for e in theirs.entries}
    items = [_changed(mine[e.name], e) for e in theirs.entries
             if e.name in mine and mine[e.name] != e]
    items += [f"{_name(e.name)} {_spec(e)} only there" for e in theirs.entries
              if e.name not in mine]
    missing = [e for e in ours.entries if e.name not in there]
    if not cut:
        items += [f"{_name(e.name)} {_spec(e)} only here" for e in missing]
    sizes = f"{len(ours.entries)} here, {total} there"
    listing = f"; they listed their first {len(theirs.entries)}" if cut else ""
    if items:
        more = f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
        noun = "tensor differs" if len(items) == 1 and not cut else "tensors differ"
        return (f"{'at least ' if cut else ''}{len(items)} {noun} ({sizes}{listing}): "
                + "; ".join(items[:SHOWN]) + more)
    if cut:
        return (f"the {len(theirs.entries)} tensors they listed agree with ours ({sizes}): "
                f"{len(missing)} of ours are past the end of their list")
    if [e.name for e in ours.entries] != [e.name for e in theirs.entries]:
        return f"the same tensors in another order ({sizes})"
    return f"no tensor differs ({sizes}), though the fingerprints do"


def task_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str:
    """The task metadata keys whose values differ (nested tables as dotted keys), in words:
    ``"options.hidden: 64 here, 128 there"``; "" when none does."""
    mine, there = _flat(ours, ""), _flat(theirs, "")
    items = []
    for key in sorted(mine.keys() | there.keys()):
        a, b = mine.get(key, _ABSENT), there.get(key, _ABSENT)
        if a != b or type(a) is not type(b):
            items.append(f"{_name(key)}: {_show(a)} here, {_show(b)} there")
    more = f"; and {len(items) - SHOWN} more" if len(items) > SHOWN else ""
    return "; ".join(items[:SHOWN]) + more


def explain(ours: StateSchema, info: SchemaInfo, our_task: Mapping[str, Any] | None = None,
            their_task: Mapping[str, Any] | None = None) -> str:
    """The whole text of a schema refusal: :func:`difference` of the listed tensors, then
    :func:`task_difference` when both sides' task metadata is known and differs."""
    text = difference(ours, listed(info), count=info.count)
    if our_task is not None and their_task is not None:
        tasks = task_difference(our_task, their_task)
        if tasks:
            text += f"; task metadata differs: {tasks}"
    return text


# ---- helpers ----------------------------------------------------------------------------

_ABSENT = object()


def _spec(e: TensorSpec) -> str:
    return f"{e.shape} {e.dtype}"


def _changed(mine: TensorSpec, theirs: TensorSpec) -> str:
    """``name: (64, 64) here, (128, 64) there``, with the dtypes when those differ."""
    def side(e: TensorSpec) -> str:
        parts = [str(e.shape)] if e.shape != mine.shape or e.shape != theirs.shape else []
        return " ".join(parts + ([e.dtype] if mine.dtype != theirs.dtype else []))
    return f"{_name(mine.name)}: {side(mine)} here, {side(theirs)} there"


def _flat(table: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):  # an empty table adds no key: as good as absent
            out.update(_flat(value, name + "."))
        else:
            out[name] = value
    return out


def _name(name: str) -> str:
    """A tensor name or a metadata key as a log line shows it: as is when it is made of the
    characters names are made of, quoted otherwise. A peer chooses its names: a printable
    one such as ``x peer=abc`` would otherwise put a field of its choosing into our log line."""
    return name if _PLAIN.fullmatch(name) else _VALUE.repr(name)




def _show(value: Any) -> str:
    if value is _ABSENT:
        return "not given"
    try:
        return _VALUE.repr(value)
    except ValueError:  # an int too long to print: refused at decode, but never fail here
        return f"<{type(value).__name__}>"
