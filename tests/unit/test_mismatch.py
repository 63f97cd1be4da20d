"""Saying what differs between two schemas: the diff text, the bounded description a refusing
node sends (SchemaInfo), and its decoder's bounds."""

from __future__ import annotations

import cbor2
import pytest

from gossip import messages as m
from gossip.download import encode_meta
from gossip.errors import WireError
from gossip.mismatch import SHOWN, describe, difference, explain, listed, task_difference
from gossip.tensors import DTYPES, StateSchema, TensorSpec
from gossip.wire import MAX_MESSAGE, decode, encode


def schema(*entries: tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], str]) -> StateSchema:
    return StateSchema(tuple(TensorSpec(e[0], e[1], e[2] if len(e) > 2 else "float32")
                             for e in entries))


MLP64 = schema(("fc1.weight", (64, 64)), ("fc1.bias", (64,)), ("fc2.weight", (10, 64)),
               ("fc2.bias", (10,)))
MLP128 = schema(("fc1.weight", (128, 64)), ("fc1.bias", (128,)), ("fc2.weight", (10, 128)),
                ("fc2.bias", (10,)))


# --- the diff text --------------------------------------------------------------------


def test_difference_names_the_tensors_whose_shapes_differ() -> None:
    assert difference(MLP64, MLP128) == (
        "3 tensors differ (4 here, 4 there): fc1.weight: (64, 64) here, (128, 64) there; "
        "fc1.bias: (64,) here, (128,) there; fc2.weight: (10, 64) here, (10, 128) there")


def test_difference_names_a_dtype_and_says_only_what_differs() -> None:
    half = schema(("w", (2, 3), "float16"), ("b", (3,)))
    both = schema(("w", (3, 3), "bfloat16"), ("b", (3,)))
    ours = schema(("w", (2, 3)), ("b", (3,)))
    assert difference(ours, half) == ("1 tensor differs (2 here, 2 there): "
                                      "w: float32 here, float16 there")
    assert difference(ours, both) == ("1 tensor differs (2 here, 2 there): "
                                      "w: (2, 3) float32 here, (3, 3) bfloat16 there")


def test_difference_names_tensors_on_one_side_only() -> None:
    ours = schema(("a", (1,)), ("b", (2,)))
    theirs = schema(("a", (1,)), ("c", ()))
    assert difference(ours, theirs) == ("2 tensors differ (2 here, 2 there): "
                                        "c () float32 only there; b (2,) float32 only here")


def test_difference_counts_what_it_does_not_name() -> None:
    ours = schema(*[(f"t{i}", (1,)) for i in range(SHOWN + 3)])
    theirs = schema(*[(f"t{i}", (2,)) for i in range(SHOWN + 3)])
    text = difference(ours, theirs)
    assert text.startswith(f"{SHOWN + 3} tensors differ")
    assert text.count(") there") == SHOWN and text.endswith("; and 3 more")


def test_difference_of_the_same_tensors_in_another_order() -> None:
    assert difference(schema(("a", (1,)), ("b", (1,))), schema(("b", (1,)), ("a", (1,)))) == (
        "the same tensors in another order (2 here, 2 there)")


def test_difference_of_a_list_cut_short() -> None:
    # Their schema has 10 entries and they listed 2: what is past the end is counted, and
    # ours that their list lacks are not called "only here" (they may be past its end).
    ours = schema(("a", (1,)), ("b", (1,)), ("c", (1,)))
    assert difference(ours, schema(("a", (1,)), ("b", (1,))), count=10) == (
        "the 2 tensors they listed agree with ours (3 here, 10 there): 1 of ours are past the "
        "end of their list")
    assert difference(ours, schema(("a", (2,)), ("b", (1,))), count=10) == (
        "at least 1 tensors differ (3 here, 10 there; they listed their first 2): "
        "a: (1,) here, (2,) there")


def test_task_difference_names_the_keys_that_differ() -> None:
    ours = {"entry": "pkg.mod:task", "seed": 0, "options": {"hidden": 64, "lr": 0.01}}
    theirs = {"entry": "pkg.mod:task", "seed": 0, "options": {"hidden": 128, "lr": 0.01,
                                                              "depth": 2}}
    assert task_difference(ours, theirs) == ("options.depth: not given here, 2 there; "
                                             "options.hidden: 64 here, 128 there")
    assert task_difference(ours, ours) == ""
    assert task_difference({"options": {}}, {"options": {"hidden": 128}}) == (
        "options.hidden: not given here, 128 there")
    assert task_difference({"x": 1}, {"x": 1.0}) == "x: 1 here, 1.0 there"  # type differs


def test_a_peers_names_cannot_forge_fields_in_our_log_line() -> None:
    # Printable, so the wire takes them; a log line of key=value fields must not.
    theirs = schema(("a", (1,)), ("x peer=abc result=ok", (2,)))
    text = difference(schema(("a", (1,)), ("b", (2,))), theirs)
    assert "'x peer=abc result=ok' (2,) float32 only there" in text
    assert " peer=abc" not in text.replace("'x peer=abc result=ok'", "")
    assert task_difference({}, {"k=v w": 1}).startswith("'k=v w': ")
    assert task_difference({}, {"options.hidden": 1}).startswith("options.hidden: ")


def test_task_difference_keeps_a_hostile_value_to_one_short_line() -> None:
    text = task_difference({}, {"x\n": "\x1b[2J" + "a" * 1000, "y": list(range(1000))})
    assert "\n" not in text and "\x1b" not in text and len(text) < 200


def test_explain_adds_the_task_metadata() -> None:
    info = describe(MLP128)
    assert explain(MLP64, info).startswith("3 tensors differ")
    text = explain(MLP64, info, {"options": {"hidden": 64}}, {"options": {"hidden": 128}})
    assert text.endswith("; task metadata differs: options.hidden: 64 here, 128 there")
    assert "task metadata" not in explain(MLP64, info, {"a": 1}, {"a": 1})


# --- the description: describe() -------------------------------------------------------


def test_describe_lists_a_small_schema_whole_and_round_trips() -> None:
    meta = encode_meta({}, {"options": {"hidden": 128}})
    info = describe(MLP128, meta)
    assert info.count == 4 and listed(info) == MLP128 and info.meta == meta
    assert decode(encode(info)) == info


def test_describe_lists_the_start_of_a_large_schema_within_one_message() -> None:
    big = schema(*[(f"transformer.h.{i}.attention.query_key_value.weight", (4096, 4096))
                   for i in range(3000)])
    meta = encode_meta({}, {"blob": b"x" * (m.MAX_META - 100)})
    for with_meta in (b"", meta):
        info = describe(big, with_meta)
        assert info.count == 3000 and 0 < len(info.entries) <= m.MAX_SCHEMA_ENTRIES
        assert len(encode(info)) <= MAX_MESSAGE  # encode() would raise otherwise
        assert listed(info).entries == big.entries[:len(info.entries)]
    assert len(describe(big, meta).entries) < len(describe(big).entries)


def test_describe_stops_at_an_entry_no_message_can_hold() -> None:
    odd = schema(("a", (1,)), ("b" * 300, (1,)), ("c", (1,)))
    assert [e[0] for e in describe(odd).entries] == ["a"]
    deep = schema(("a", (1,)), ("b", (1,) * (m.MAX_DIMS + 1)))
    assert describe(deep).count == 2 and len(describe(deep).entries) == 1


def test_the_wire_dtypes_are_the_schema_dtypes() -> None:
    assert m.SCHEMA_DTYPES == DTYPES


# --- the decoder's bounds ------------------------------------------------------------------


ENTRY = ["w", [2, 3], "float32"]


def raw(count: object, entries: object, meta: object = b"") -> bytes:
    return cbor2.dumps([20, count, entries, meta], canonical=True)


def test_a_schema_info_decodes() -> None:
    info = decode(raw(5, [ENTRY, ["b", [], "bfloat16"]]))
    assert info == m.SchemaInfo(5, (("w", (2, 3), "float32"), ("b", (), "bfloat16")), b"")
    assert decode(raw(2**53 - 1, [ENTRY] * 0)) == m.SchemaInfo(2**53 - 1, (), b"")


@pytest.mark.parametrize("data, match", [
    (raw(1, [ENTRY, ["b", [1], "float32"]]), "2 entries, more than 1"),
    (raw(5000, [[f"t{i}", [1], "float32"] for i in range(m.MAX_SCHEMA_ENTRIES + 1)]),
     "more than 1024"),
    (raw(2, "w"), "expected an array"),
    (raw(2, [["w", [2]]]), r"not \[name, shape, dtype\]"),
    (raw(2, [["w", [2], "float32", 0]]), r"not \[name, shape, dtype\]"),
    (raw(2, [["", [2], "float32"]]), "empty"),
    (raw(2, [["w\n", [2], "float32"]]), "not printable"),
    (raw(2, [["\x1b[2J", [2], "float32"]]), "not printable"),
    (raw(2, [ENTRY, ENTRY]), "given twice"),
    (raw(2, [["w" * 257, [2], "float32"]]), "257 characters"),
    (raw(2, [[b"w", [2], "float32"]]), "expected text"),
    (raw(2, [["w", [1] * (m.MAX_DIMS + 1), "float32"]]), "at most 32 dimensions"),
    (raw(2, [["w", 2, "float32"]]), "not an array"),
    (raw(2, [["w", [-1], "float32"]]), "SchemaInfo.entries"),
    (raw(2, [["w", [2**53], "float32"]]), "out of range"),
    (raw(2, [["w", [True], "float32"]]), "unsigned integer, got bool"),
    (raw(2, [["w", [2], "int64"]]), "dtype"),
    (raw(2, [["w", [2], ["float32"]]]), "dtype"),
    (raw(-1, []), "SchemaInfo.count"),
    (raw(2**53, []), "SchemaInfo.count"),
    (raw(1, [ENTRY], b"x" * (m.MAX_META + 1)), "SchemaInfo.meta"),
    (raw(1, [ENTRY], "meta"), "SchemaInfo.meta: expected bytes"),
    (cbor2.dumps([20, 1, [ENTRY]], canonical=True), "expected 3 fields"),
])
def test_the_decoder_refuses(data: bytes, match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode(data)


def test_the_schema_info_of_the_spec_example() -> None:
    # docs/PROTOCOL.md section 6.4: the one-entry schema of section 7.1, as a server sends it.
    spelled = bytes.fromhex("84 14 01 81 83 61 77 82 02 03 67 66 6c 6f 61 74 33 32 40")
    info = describe(schema(("w", (2, 3))))
    assert encode(info) == spelled and decode(spelled) == info
