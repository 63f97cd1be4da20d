"""Tests for the state download's metadata: encode_meta / decode_meta, strict and bounded."""

from __future__ import annotations

import datetime
import decimal
import math

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gossip.download import decode_meta, encode_meta
from gossip.errors import RemoteProtocolError
from gossip.messages import MAX_META
from gossip.wire import MAX_DEPTH
from tests.util import mutate

BUFFERS = {"bn.num_batches_tracked": 1234, "other": -(2**63), "top": 2**63 - 1}
TASK = {"name": "mnist", "lr": 0.25, "layers": [784, 128, 10], "nested": {"a": None, "b": True},
        "blob": b"\x00\x01"}


def canonical(obj: object) -> bytes:
    return cbor2.dumps(obj, canonical=True)


# --- round trips ----------------------------------------------------------------------


def test_round_trip() -> None:
    data = encode_meta(BUFFERS, TASK)
    assert data == canonical({"buffers": BUFFERS, "task": TASK})
    assert decode_meta(data) == (BUFFERS, TASK)


def test_round_trip_of_empty_metadata() -> None:
    assert decode_meta(encode_meta({}, {})) == ({}, {})


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
    | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=20,
)
buffers_st = st.dictionaries(st.text(max_size=12), st.integers(-(2**63), 2**63 - 1), max_size=5)
tasks_st = st.dictionaries(st.text(max_size=8), json_like, max_size=5)


@settings(max_examples=100, deadline=None)
@given(buffers_st, tasks_st)
def test_round_trip_of_arbitrary_metadata(buffers: dict, task: dict) -> None:
    try:
        data = encode_meta(buffers, task)
    except ValueError:
        # Only metadata that a joiner would refuse: nested deeper than the decoder allows, or
        # an integer beyond 64 bits.
        with pytest.raises(RemoteProtocolError, match="depth|beyond 64 bits"):
            decode_meta(canonical({"buffers": buffers, "task": task}))
        return
    assert len(data) <= MAX_META
    assert decode_meta(data) == (buffers, task)


# --- decode_meta refuses --------------------------------------------------------------


def raw_map(*items: bytes, head: bytes | None = None) -> bytes:
    """A CBOR map of already encoded keys and values, in the order given (two per entry)."""
    return (head or bytes([0xA0 + len(items) // 2])) + b"".join(items)


KEY_TASK, KEY_BUFFERS, EMPTY = canonical("task"), canonical("buffers"), canonical({})
ZERO_BUFFER = canonical({"buffers": {"x": 0}, "task": {}})

REFUSED = {
    "empty": b"",
    "garbage": b"\xff\xfe\xfd",
    "truncated": encode_meta(BUFFERS, TASK)[:-1],
    "trailing bytes": encode_meta(BUFFERS, TASK) + b"\x00",
    "two maps": encode_meta({}, {}) * 2,
    # canonical CBOR sorts keys shorter first: "task" before "buffers"
    "keys out of canonical order": raw_map(KEY_BUFFERS, EMPTY, KEY_TASK, EMPTY),
    "non-shortest int": ZERO_BUFFER.replace(b"\x61x\x00", b"\x61x\x18\x00"),
    "non-shortest length": ZERO_BUFFER.replace(b"\x64task", b"\x78\x04task"),
    "indefinite map": raw_map(KEY_TASK, EMPTY, KEY_BUFFERS, EMPTY, head=b"\xbf") + b"\xff",
    "duplicate keys": raw_map(KEY_TASK, EMPTY, KEY_BUFFERS, EMPTY, KEY_TASK, EMPTY),
    "invalid utf-8": raw_map(KEY_TASK, raw_map(b"\x62\xff\xfe", canonical(1)),
                             KEY_BUFFERS, EMPTY),
    "not a map": canonical([{}, {}]),
    "missing task": canonical({"buffers": {}}),
    "missing buffers": canonical({"task": {}}),
    "an extra key": canonical({"buffers": {}, "task": {}, "x": 1}),
    "buffers not a map": canonical({"buffers": [1], "task": {}}),
    "task not a map": canonical({"buffers": {}, "task": [1]}),
    "a float buffer": canonical({"buffers": {"n": 1.0}, "task": {}}),
    "a bool buffer": canonical({"buffers": {"n": True}, "task": {}}),
    "a string buffer": canonical({"buffers": {"n": "1"}, "task": {}}),
    "a null buffer": canonical({"buffers": {"n": None}, "task": {}}),
    "a non-string buffer name": canonical({"buffers": {1: 1}, "task": {}}),
    "a buffer of 2**63": canonical({"buffers": {"n": 2**63}, "task": {}}),
    "a buffer below -2**63": canonical({"buffers": {"n": -(2**63) - 1}, "task": {}}),
    "a bignum buffer": canonical({"buffers": {"n": 2**100}, "task": {}}),
    # Task metadata is plain values: no CBOR tags (dates, sets, decimals...), text keys.
    "a tagged date in task": canonical({"buffers": {}, "task": {
        "t": datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)}}),
    "a set in task": canonical({"buffers": {}, "task": {"s": {1, 2}}}),
    "a decimal in task": canonical({"buffers": {}, "task": {"d": decimal.Decimal("1.5")}}),
    "an unknown tag in task": canonical({"buffers": {}, "task": {"x": cbor2.CBORTag(999, 1)}}),
    "an int key in task": canonical({"buffers": {}, "task": {1: "x"}}),
    "an int key deep in task": canonical({"buffers": {}, "task": {"a": [{2: 0}]}}),
}


def test_the_refusal_table_is_built_right() -> None:
    # Each hand-made encoding differs from a valid one only in the way its name says.
    assert ZERO_BUFFER.hex() == "a2647461736ba06762756666657273a1617800"
    assert decode_meta(ZERO_BUFFER) == ({"x": 0}, {})
    assert raw_map(KEY_TASK, EMPTY, KEY_BUFFERS, EMPTY) == encode_meta({}, {})
    assert cbor2.loads(REFUSED["keys out of canonical order"]) == {"buffers": {}, "task": {}}
    assert cbor2.loads(REFUSED["non-shortest int"]) == {"buffers": {"x": 0}, "task": {}}
    assert cbor2.loads(REFUSED["non-shortest length"]) == {"buffers": {"x": 0}, "task": {}}
    assert cbor2.loads(REFUSED["indefinite map"]) == {"buffers": {}, "task": {}}


@pytest.mark.parametrize("data", REFUSED.values(), ids=REFUSED.keys())
def test_decode_meta_refuses(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_meta(data)


def nested(depth: int) -> object:
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def test_decode_meta_refuses_nesting_beyond_the_limit() -> None:
    # The outer map and the task map are two levels; the deepest allowed task value has
    # MAX_DEPTH - 2 container levels.
    deepest = {"buffers": {}, "task": {"x": nested(MAX_DEPTH - 2)}}
    assert decode_meta(canonical(deepest)) == ({}, deepest["task"])
    too_deep = {"buffers": {}, "task": {"x": nested(MAX_DEPTH - 1)}}
    with pytest.raises(RemoteProtocolError):
        decode_meta(canonical(too_deep))
    with pytest.raises(RemoteProtocolError):
        decode_meta(b"\x81" * 10_000 + b"\x00")  # far too deep: refused, not a RecursionError


def test_decode_meta_takes_the_extreme_64_bit_buffers() -> None:
    meta = {"buffers": {"lo": -(2**63), "hi": 2**63 - 1}, "task": {}}
    assert decode_meta(canonical(meta)) == (meta["buffers"], {})


def test_decoded_nan_in_task_metadata_is_data_not_an_error() -> None:
    buffers, task = decode_meta(encode_meta({}, {"loss": math.nan}))
    assert buffers == {} and math.isnan(task["loss"])


# --- encode_meta refuses --------------------------------------------------------------


class Opaque:
    pass


def cyclic() -> list:
    loop: list = []
    loop.append(loop)
    return loop


NOT_ENCODABLE = {
    "an object": ({}, {"x": Opaque()}),
    "a cycle": ({}, {"x": cyclic()}),
    "a function": ({}, {"x": print}),
    "too deep for joiners": ({}, {"x": nested(MAX_DEPTH)}),
    "a buffer out of range": ({"n": 2**63}, {}),
    "a non-int buffer": ({"n": 1.5}, {}),
    "a bool buffer": ({"n": False}, {}),
    "a non-string buffer name": ({1: 1}, {}),
    "a set": ({}, {"s": {1, 2}}),
    "a date": ({}, {"t": datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)}),
    "an int key": ({}, {1: "x"}),
}


@pytest.mark.parametrize("buffers, task", NOT_ENCODABLE.values(), ids=NOT_ENCODABLE.keys())
def test_encode_meta_refuses_what_joiners_could_not_take(buffers: dict, task: dict) -> None:
    with pytest.raises(ValueError):
        encode_meta(buffers, task)


def test_encode_meta_refuses_oversized_metadata() -> None:
    overhead = len(encode_meta({}, {"x": b""}))
    fits = MAX_META - overhead - 2  # its header grows from 1 byte (empty) to 3 (long)
    assert len(encode_meta({}, {"x": b"a" * fits})) == MAX_META
    with pytest.raises(ValueError, match=str(MAX_META)):
        encode_meta({}, {"x": b"a" * (fits + 1)})


# --- fuzzing --------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from([encode_meta(BUFFERS, TASK), encode_meta({}, {}),
                     encode_meta({"n": 7}, {"deep": nested(MAX_DEPTH - 2), "f": 1.5})]),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(0, 3),
)
def test_mutated_meta_raises_only_remote_protocol_error(data: bytes, flips, cut: int) -> None:
    data = mutate(data, flips, cut)
    try:
        buffers, task = decode_meta(data)
    except RemoteProtocolError:
        return
    # Accepted: then it is exactly the canonical encoding of what came out.
    assert canonical({"buffers": buffers, "task": task}) == data
    assert all(type(k) is str and type(v) is int for k, v in buffers.items())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_remote_protocol_error(data: bytes) -> None:
    try:
        decode_meta(data)
    except RemoteProtocolError:
        pass


def test_an_integer_beyond_64_bits_is_refused_and_never_printed() -> None:
    # A bignum in a peer's metadata: refused at decode (printing 10**20000 raises in Python).
    data = canonical({"buffers": {}, "task": {"seed": 10**20000}})
    with pytest.raises(RemoteProtocolError, match="task.seed holds an integer beyond 64 bits"):
        decode_meta(data)
    with pytest.raises(ValueError):
        encode_meta({}, {"seed": 2**64})
