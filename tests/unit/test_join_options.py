"""What the join line carries about the task: its options (daemon.keys, bounded and strict)
and never a path on the machine that wrote it (daemon.cli: init, init --join, join-line)."""

from __future__ import annotations

import base64
import datetime
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import cli, config as config_module
from daemon.cli import main
from daemon.keys import MAX_OPTIONS, JoinLine, KeyFileError, decode_options, encode_options

KEY = bytes(range(32))
OPTIONS = {"hidden": 128, "lr": 0.001, "name": "mlp ü", "layers": [64, 32], "aug": True,
           "nested": {"a": {"b": -3}}}


@pytest.fixture(autouse=True)
def _no_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config_module.ENV, raising=False)


def line(**kw: object) -> JoinLine:
    fields: dict = dict(name="lab", key=KEY, bootstrap=("10.0.0.1:7070",), task="pkg.mod:task")
    fields.update(kw)
    return JoinLine(**fields)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --- the options in the line ---------------------------------------------------------------


def test_options_round_trip_and_are_left_out_when_empty() -> None:
    join = line(options=OPTIONS)
    text = str(join)
    assert re.search(r"&options=[A-Za-z0-9_-]+$", text) and " " not in text
    assert JoinLine.parse(text) == join
    assert "options" not in str(line())
    assert JoinLine.parse(str(line())).options == {}


def test_options_are_canonical_json_in_base64url() -> None:
    assert encode_options({"b": 1, "a": [1.5, "x"]}) == b64(b'{"a":[1.5,"x"],"b":1}')
    assert decode_options(b64(b'{"b": 1, "a": [1.5, "x"]}')) == {"a": [1.5, "x"], "b": 1}


_values = st.recursive(
    st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False,
                                                                 allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _values, max_size=4))
def test_options_round_trip_fuzz(options: dict) -> None:
    assert decode_options(encode_options(options)) == options


@pytest.mark.parametrize("options, match", [
    ({"when": datetime.date(2020, 1, 1)}, "task.options.when is a date"),
    ({"at": [datetime.time(1, 2)]}, r"task.options.at\[0\] is a time"),
    ({"x": float("inf")}, "not a finite number"),
    ({"x": 2**63}, "64-bit"),
    ({"x": None}, "is a null"),
    ({"x": "y" * MAX_OPTIONS}, f"more than a join line carries \\({MAX_OPTIONS}\\)"),
    ({"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {}}}}}}}}}, "nested more than 8"),
])
def test_options_a_line_cannot_carry_are_refused_with_the_option_named(
        options: dict, match: str) -> None:
    with pytest.raises(KeyFileError, match=match):
        line(options=options)


@pytest.mark.parametrize("field, match", [
    ("!!!", "not the base64url"),
    ("e30=", "not the base64url"),  # padding is left out
    ("A" * (MAX_OPTIONS * 2), "not the base64url"),  # bounded before decoding
    ("e", "does not decode"),  # not a whole number of bytes
    (b64(b"\xff\xfe"), "does not decode"),  # not UTF-8
    (b64(b"{"), "does not decode"),
    (b64(b"[1]"), "not a table"),
    (b64(b'"x"'), "not a table"),
    (b64(b'{"a":1,"a":2}'), "given twice"),
    (b64(b'{"a":NaN}'), "not a number"),
    (b64(b'{"a":1e999}'), "not a finite number"),
    (b64(b'{"a":null}'), "is a null"),
    (b64(b'{"a":99999999999999999999}'), "64-bit"),
    (b64(b"[" * 2000 + b"]" * 2000), "does not decode"),  # a RecursionError, caught
    (b64(b'{"a":' + b"[" * 2000 + b"]" * 2000 + b"}"), "does not decode|nested"),
    (b64(b'{"a":' + b"[" * 8 + b"]" * 8 + b"}"), "nested more than 8"),
])
def test_a_line_with_malformed_options_is_refused(field: str, match: str) -> None:
    with pytest.raises(KeyFileError, match=match) as info:
        JoinLine.parse(f"gossip://lab@h:1?key={KEY.hex()}&task=m:f&options={field}")
    assert "\n" not in str(info.value) and KEY.hex() not in str(info.value)


# --- init, init --join and join-line ------------------------------------------------------------


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    assert main(list(argv)) == 0
    return capsys.readouterr()


def printed_line(out: str) -> str:
    (text,) = re.findall(r"gossipd init --join '([^']*)'", out)
    return text


def set_options(config: Path, toml: str) -> None:
    text = config.read_text()
    assert "[task.options]\n" in text
    config.write_text(text.replace("[task.options]\n", f"[task.options]\n{toml}\n", 1))


def test_join_line_prints_the_options_edited_after_init_and_init_join_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    out, _ = run(capsys, "init", "--swarm", "lab", "--dir", str(a), "--listen", "127.0.0.1:7070")
    assert "gossipd join-line -c" in out  # says how to print it again
    set_options(a / "gossipd.toml", 'hidden = 128\nlr = 0.001\nkind = "mlp"')
    out, err = run(capsys, "join-line", "-c", str(a / "gossipd.toml"))
    assert err == ""
    join = JoinLine.parse(out.strip())
    assert join.options == {"hidden": 128, "lr": 0.001, "kind": "mlp"}
    assert join.bootstrap == ("127.0.0.1:7070",) and join.name == "lab"

    out, _ = run(capsys, "init", "--join", out.strip(), "--dir", str(b), "--listen",
                 "127.0.0.1:7071")
    assert 'task.options from the join line: {"hidden": 128, "kind": "mlp", "lr": 0.001}' in out
    config = config_module.load(b / "gossipd.toml")
    assert dict(config.task.options) == {"hidden": 128, "lr": 0.001, "kind": "mlp"}
    assert JoinLine.parse(printed_line(out)).options == config.task.options
    # The joined node's own line: its address first, then the swarm's it joined through.
    out, _ = run(capsys, "join-line", "-c", str(b / "gossipd.toml"))
    assert JoinLine.parse(out.strip()).bootstrap == ("127.0.0.1:7071", "127.0.0.1:7070")


def test_join_line_refuses_options_it_cannot_carry(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "init", "--swarm", "lab", "--dir", str(tmp_path), "--listen", "127.0.0.1:7070")
    set_options(tmp_path / "gossipd.toml", "start = 2024-01-01")
    assert main(["join-line", "-c", str(tmp_path / "gossipd.toml")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("gossipd join-line: task.options.start is a date")


def test_an_absolute_task_path_travels_as_the_file_name_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    entry = "/home/alice/tasks/mine.py:task"
    out, err = run(capsys, "init", "--swarm", "lab", "--dir", str(tmp_path), "--listen",
                   "127.0.0.1:7070", "--task", entry)
    assert config_module.load(tmp_path / "gossipd.toml").task.entry == entry  # ours runs it
    assert JoinLine.parse(printed_line(out)).task == "mine.py:task"
    assert "/home/alice" not in printed_line(out)
    assert err.startswith(f"warning: task.entry {entry} is a path on this machine")
    assert "send mine.py with the line" in err and "package.module:task" in err
    out, err = run(capsys, "join-line", "-c", str(tmp_path / "gossipd.toml"))
    assert JoinLine.parse(out.strip()).task == "mine.py:task" and "send mine.py" in err


@pytest.mark.parametrize("entry", ["pkg.mod:task", "tasks/mine.py:task", "mine.py:task",
                                   "../mine.py:task"])
def test_other_entries_travel_as_they_are(entry: str) -> None:
    assert cli.shareable_entry(entry) == (entry, "")


def test_init_join_warns_of_an_absolute_path_in_an_older_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = line(task="/home/alice/tasks/mine.py:task")
    out, err = run(capsys, "init", "--join", str(old), "--dir", str(tmp_path), "--listen",
                   "127.0.0.1:7071")
    config = config_module.load(tmp_path / "gossipd.toml")
    assert config.task.entry == "/home/alice/tasks/mine.py:task"  # kept, with a warning
    assert err.startswith("warning: the join line names its task file by a path on the "
                          "machine that wrote it")
    assert f"put the file in {tmp_path.resolve()}" in err and '"mine.py:task"' in err


def test_init_join_writes_no_options_for_a_line_without_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = run(capsys, "init", "--join", str(line()), "--dir", str(tmp_path), "--listen",
                 "127.0.0.1:7071")
    assert "task.options from" not in out
    assert dict(config_module.load(tmp_path / "gossipd.toml").task.options) == {}
    assert json.loads(json.dumps(OPTIONS)) == OPTIONS  # the fixture is JSON as it is
