"""What the join line carries about the task: its options (daemon.keys, bounded and strict)
and never a path on the machine that wrote it (daemon.init: init, init --join, join-line)."""

from __future__ import annotations

import base64
import datetime
import json
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import config as config_module, init as init_module
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
    # Brackets inside text are not nesting, an escaped quote does not end the text.
    text = '[[[[[[[[[["{{{{{{{{{{\\'
    assert decode_options(encode_options({"a": text})) == {"a": text}


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
    # Refused before parsing: how deep a parser recurses depends on the Python build.
    (b64(b"[" * 2000 + b"]" * 2000), "nested more than 8"),
    (b64(b'{"a":' + b"[" * 2000 + b"]" * 2000 + b"}"), "nested more than 8"),
    (b64(b"[" * 2000), "nested more than 8"),
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
    assert err == ""  # the operator asked for loopback (init said what it means)
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


def test_a_module_entry_travels_as_it_is() -> None:
    assert init_module.shareable_entry("pkg.mod:task") == ("pkg.mod:task", "")


@pytest.mark.parametrize("entry", ["tasks/mine.py:task", "mine.py:task", "../mine.py:task"])
def test_a_relative_task_file_travels_as_it_is_with_a_warning(entry: str) -> None:
    shared, warning = init_module.shareable_entry(entry)
    target = entry.rpartition(":")[0]
    assert shared == entry
    assert warning == (f"warning: task.entry {entry} is a file of this node's; a volunteer's "
                       f"node looks for {target} in its own data directory: send it with the "
                       "line, or make the task a module volunteers install "
                       "(package.module:task)")


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


# --- the swarm's settings, and nothing of the machine that wrote the line ---------------------


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("gossipd init: "), err
    return err


WAN_BF16 = ["--set", "swarm.profile=wan", "--set", "averaging.codec=bf16", "--set",
            "averaging.correction=false"]


def test_init_set_swarm_settings_travel_and_init_join_writes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    out, _ = run(capsys, "init", "--swarm", "lab", "--dir", str(a), "--listen",
                 "127.0.0.1:7070", *WAN_BF16)
    text = printed_line(out)
    assert text.endswith("&seed=0&profile=wan&codec=bf16&correction=false")
    first = config_module.load(a / "gossipd.toml")
    assert (first.swarm.profile, first.averaging.codec, first.averaging.correction) == (
        "wan", "bf16", False)

    out, _ = run(capsys, "init", "--join", text, "--dir", str(b), "--listen", "127.0.0.1:7071")
    assert ('swarm settings from the join line: swarm.profile = "wan", averaging.codec = '
            '"bf16", averaging.correction = false') in out
    joined = config_module.load(b / "gossipd.toml")
    assert (joined.swarm.profile, joined.averaging.codec, joined.averaging.correction) == (
        "wan", "bf16", False)
    assert joined.averaging.mixing == "fixed" and joined.averaging.weight == 0.5
    assert JoinLine.parse(printed_line(out)) == JoinLine.parse(text)  # passed on as it came


def test_join_line_carries_settings_edited_after_init(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "init", "--swarm", "lab", "--dir", str(tmp_path), "--listen", "127.0.0.1:7070")
    path = tmp_path / "gossipd.toml"
    text = path.read_text()
    for old, new in [('mixing = "fixed"', 'mixing = "samples"'), ("weight = 0.5", "weight = 1"),
                     ('codec = "fp32"', 'codec = "int8"')]:
        assert text.count(old) == 1
        text = text.replace(old, new)
    path.write_text(text)
    out, _ = run(capsys, "join-line", "-c", str(path))
    join = JoinLine.parse(out.strip())
    assert (join.mixing, join.weight, join.codec, join.profile) == ("samples", 1.0, "int8", "lan")
    assert out.strip().endswith("&seed=0&codec=int8&mixing=samples&weight=1.0")


def test_a_joiner_cannot_set_another_value_of_what_its_line_carries(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = str(line(profile="wan", codec="bf16"))
    for setting in ("averaging.codec=fp32", "swarm.profile=lan"):
        assert main(["init", "--join", text, "--dir", str(tmp_path / "x"), "--listen",
                     "127.0.0.1:7071", "--set", setting]) == 2
        err = one_line_error(capsys)
        key = setting.partition("=")[0]
        assert f"the join line's swarm has {key} = " in err and f"--set {key}" in err
        assert not (tmp_path / "x").exists()
    # What the line does not carry is the joiner's own to set.
    run(capsys, "init", "--join", text, "--dir", str(tmp_path / "y"), "--listen",
        "127.0.0.1:7071", "--set", "task.device=cpu", "--set", "averaging.codec=bf16")
    config = config_module.load(tmp_path / "y" / "gossipd.toml")
    assert (config.task.device, config.averaging.codec) == ("cpu", "bf16")


@pytest.mark.parametrize("field", ["codec=fp8", "profile=WAN", "weight=2", "correction=no",
                                   "relay=on"])
def test_init_join_refuses_a_line_with_a_bad_setting(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str) -> None:
    assert main(["init", "--join", f"{line()}&{field}", "--dir", str(tmp_path / "x"),
                 "--listen", "127.0.0.1:7071"]) == 2
    assert one_line_error(capsys).startswith("gossipd init: bad join line: ")
    assert not (tmp_path / "x").exists()


def test_init_set_is_checked_like_the_config(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "--swarm", "lab", "--dir", str(tmp_path / "x"), "--listen",
                 "127.0.0.1:7070", "--set", "averaging.codec=fp8"]) == 2
    assert "averaging.codec: expected fp32, bf16, fp16, int8, mod4, mod4/<F> (F in 2..64) or auto" in one_line_error(capsys)
    assert not (tmp_path / "x").exists()


def test_no_guessable_address_is_refused_rather_than_loopback_in_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_module, "guess_address", lambda: "127.0.0.1")  # no route off the machine
    assert main(["init", "--swarm", "lab", "--dir", str(tmp_path / "x")]) == 2  # 0.0.0.0:7070
    err = one_line_error(capsys)
    assert "cannot tell this machine's address" in err and "--advertise HOST:PORT" in err
    assert main(["init", "--join", str(line()), "--dir", str(tmp_path / "x")]) == 2
    one_line_error(capsys)
    assert not (tmp_path / "x").exists()
    # A swarm on this machine alone: loopback is the right answer, and said to be.
    run(capsys, "init", "--join", str(line(bootstrap=("127.0.0.1:7070",))), "--dir",
        str(tmp_path / "y"), "--listen", "0.0.0.0:7071")
    assert config_module.load(tmp_path / "y" / "gossipd.toml").node.advertise == \
        "127.0.0.1:7071"
    out, err = run(capsys, "init", "--swarm", "lab", "--dir", str(tmp_path / "z"),
                   "--advertise", "192.0.2.5:7070")
    assert JoinLine.parse(printed_line(out)).bootstrap == ("192.0.2.5:7070",) and err == ""


def test_init_on_loopback_says_the_line_works_on_this_machine_only(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "init", "--swarm", "lab", "--dir", str(tmp_path), "--listen",
                 "127.0.0.1:7070")
    assert err == ("note: the join line's 127.0.0.1:7070 is loopback: only nodes on this "
                   "machine can join through it (node.advertise names the address others "
                   "reach)\n")


def test_nothing_machine_local_travels(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    local = ["--set", f"node.data_dir={tmp_path / 'alice'}", "--set", "node.identity=alice.key",
             "--set", "node.control=/run/alice.sock", "--set", "node.dial_from=10.1.2.3",
             "--set", "node.reachable=true", "--set", "task.device=cuda:1",
             "--set", "task.threads=3", "--set", "checkpoint.dir=/mnt/ckpt",
             "--set", "metrics.prometheus=10.1.2.3:9100", "--set", "limits.max_connections=9"]
    monkeypatch.setattr(init_module, "guess_address", lambda: "192.0.2.7")
    out, _ = run(capsys, "init", "--swarm", "lab", "--dir", str(a), "--listen", "0.0.0.0:7070",
                 *local)
    assert (tmp_path / "alice" / "alice.key").is_file()
    text = printed_line(out)
    for word in ("alice", "10.1.2.3", "cuda", "ckpt", "threads", "9100", "0.0.0.0"):
        assert word not in text, word
    assert JoinLine.parse(text).bootstrap == ("192.0.2.7:7070",)

    monkeypatch.setattr(init_module, "guess_address", lambda: "198.51.100.4")
    run(capsys, "init", "--join", text, "--dir", str(b), "--listen", "0.0.0.0:7171")
    joined = config_module.load(b / "gossipd.toml")
    defaults = config_module.Config(complete=False)
    assert joined.node == config_module.NodeSection(listen="0.0.0.0:7171",
                                                    advertise="198.51.100.4:7171")
    assert joined.swarm.bootstrap == ("192.0.2.7:7070",)
    for section in ("checkpoint", "metrics"):
        assert getattr(joined, section) == getattr(defaults, section)
    assert (joined.task.device, joined.task.threads, joined.limits.max_connections) == (
        "auto", 0, 256)


def test_join_line_leaves_out_the_address_of_a_node_nobody_can_dial(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "init", "--join", str(line()), "--dir", str(tmp_path), "--listen",
        "127.0.0.1:7071", "--set", "node.reachable=false")
    out, _ = run(capsys, "join-line", "-c", str(tmp_path / "gossipd.toml"))
    assert JoinLine.parse(out.strip()).bootstrap == ("10.0.0.1:7070",)


def test_init_join_warns_when_the_task_module_is_not_installed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, err = run(capsys, "init", "--join", str(line(task="no_such_pkg_x.mod:task")), "--dir",
                 str(tmp_path / "a"), "--listen", "127.0.0.1:7071")
    assert err.startswith("warning: task module no_such_pkg_x.mod is not installed here")
    _, err = run(capsys, "init", "--join", str(line(task="daemon.tasks.digits:task")), "--dir",
                 str(tmp_path / "b"), "--listen", "127.0.0.1:7071")
    assert "not installed" not in err
