"""Tests for daemon.keys: swarm key files (0600, never overwritten, bounded and validated
reads) and the join line (round trips through its text form, refuses malformed lines, and
never shows the key in its repr)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.keys import MAX_KEY_FILE, JoinLine, KeyFileError, read_swarm_key, write_new, \
    write_swarm_key

KEY = bytes(range(32))
HEX = KEY.hex()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- swarm key files ----------------------------------------------------------------------


def test_swarm_key_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    write_swarm_key(path, KEY)
    assert path.read_bytes() == HEX.encode() + b"\n"
    assert read_swarm_key(path) == KEY


def test_swarm_key_file_is_0600(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    write_swarm_key(path, KEY)
    assert mode(path) == 0o600


def test_write_creates_missing_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "swarm.key"
    write_swarm_key(path, KEY)
    assert read_swarm_key(path) == KEY


def test_write_refuses_to_overwrite(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    write_swarm_key(path, KEY)
    with pytest.raises(KeyFileError, match="exists") as info:
        write_swarm_key(path, bytes(32))
    assert str(path) in str(info.value)
    assert read_swarm_key(path) == KEY  # unchanged


def test_write_new_refuses_to_overwrite_any_file(tmp_path: Path) -> None:
    path = tmp_path / "x"
    path.write_text("precious")
    with pytest.raises(KeyFileError, match="not overwriting"):
        write_new(path, b"new")
    assert path.read_text() == "precious"


@pytest.mark.parametrize("key", [b"", bytes(31), bytes(33)])
def test_write_refuses_a_key_of_the_wrong_length(tmp_path: Path, key: bytes) -> None:
    with pytest.raises(ValueError):
        write_swarm_key(tmp_path / "k", key)
    assert not (tmp_path / "k").exists()


def test_write_under_a_file_is_a_key_file_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(KeyFileError):
        write_swarm_key(tmp_path / "file" / "swarm.key", KEY)


def test_read_accepts_uppercase_and_surrounding_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "k"
    path.write_text(f"  {HEX.upper()}\r\n\n")
    assert read_swarm_key(path) == KEY


def test_read_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.key"
    with pytest.raises(KeyFileError, match="does not exist") as info:
        read_swarm_key(path)
    assert str(path) in str(info.value)


def test_read_unreadable_path(tmp_path: Path) -> None:
    # a directory cannot be read as a file (works as root too, unlike chmod 000)
    with pytest.raises(KeyFileError, match="cannot read") as info:
        read_swarm_key(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("content", [
    b"",
    b"\n",
    HEX[:-2].encode(),  # 31 bytes
    (HEX + "00").encode(),  # 33 bytes
    ("zz" + HEX[2:]).encode(),  # 64 characters, not hex
    HEX.encode() + b" trailing",
    b"\xff" * 64,  # not ASCII
], ids=["empty", "newline", "short", "long", "not-hex", "junk", "binary"])
def test_read_malformed_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match="64 hex characters") as info:
        read_swarm_key(path)
    assert str(path) in str(info.value)


def test_read_oversized_file(tmp_path: Path) -> None:
    # a valid key padded past MAX_KEY_FILE: refused, though the stripped text is 64 hex digits
    path = tmp_path / "big.key"
    path.write_bytes(HEX.encode() + b" " * MAX_KEY_FILE + b"\n")
    with pytest.raises(KeyFileError) as info:
        read_swarm_key(path)
    assert str(path) in str(info.value)


def test_read_refuses_hex_with_inner_whitespace(tmp_path: Path) -> None:
    path = tmp_path / "spaced.key"
    path.write_text("00 " * 20 + "0000\n")
    with pytest.raises(KeyFileError):
        read_swarm_key(path)


# --- join lines -----------------------------------------------------------------------------


def line(**kw: object) -> JoinLine:
    fields: dict[str, object] = dict(name="lab", key=KEY, bootstrap=("10.0.0.1:7070",),
                                     task="daemon.tasks.digits:task", seed=0)
    fields.update(kw)
    return JoinLine(**fields)  # type: ignore[arg-type]


def test_join_line_text_form() -> None:
    text = str(line(seed=7))
    assert text == (f"gossip://lab@10.0.0.1:7070?key={HEX}&task=daemon.tasks.digits:task"
                    f"&seed=7")
    assert JoinLine.parse(text) == line(seed=7)


@pytest.mark.parametrize("join", [
    line(),
    line(name="my swarm/with?odd&chars=@%:#+"),
    line(name="ünïcödé ☃"),
    line(bootstrap=("[::1]:7070",)),
    line(bootstrap=("[::1]:7070", "example.org:1", "192.168.1.2:65535")),
    line(task="examples/tasks/my task.py:make_task"),
    line(task="/abs/path:with/colons.py:fn"),
    line(task="pkg.mod:fn&x=1?y#z+w"),
    line(seed=2**40),
    line(shards=8),
    line(shards=65535, seed=3),
    line(cipher="chachapoly", shards=4),
], ids=["plain", "escaped-name", "unicode-name", "ipv6", "several", "path-task",
        "colons-task", "escaped-task", "big-seed", "shards", "most-shards", "chachapoly"])
def test_join_line_round_trip(join: JoinLine) -> None:
    text = str(join)
    assert text.startswith("gossip://")
    assert " " not in text  # pastes as one shell word inside quotes, and one URL
    assert JoinLine.parse(text) == join


def test_join_line_parse_strips_whitespace() -> None:
    assert JoinLine.parse(f"  {line()}\n") == line()


def test_join_line_parse_defaults_seed_to_0() -> None:
    text = f"gossip://lab@h:1?key={HEX}&task=m:f"
    assert JoinLine.parse(text).seed == 0


def test_join_line_carries_shards_unless_1() -> None:
    assert str(line(shards=8)).endswith("&seed=0&shards=8")
    assert "shards" not in str(line())  # the lines of a swarm with one shard stay as they were
    assert JoinLine.parse(f"gossip://lab@h:1?key={HEX}&task=m:f").shards == 1


def test_join_line_carries_the_cipher_unless_the_default() -> None:
    # Never negotiated on a connection: a joiner of the wrong cipher could not connect at all.
    assert str(line(cipher="chachapoly")).endswith("&seed=0&cipher=chachapoly")
    assert "cipher" not in str(line())
    assert JoinLine.parse(f"gossip://lab@h:1?key={HEX}&task=m:f").cipher == "aesgcm"
    with pytest.raises(KeyFileError, match="cipher= .swarm.cipher: expected aesgcm or "
                       "chachapoly, got 'rot13'"):
        line(cipher="rot13")


# The swarm-wide settings: each as the line writes it when it is not the config's default.
SETTINGS = [("profile", "wan", "wan"), ("codec", "bf16", "bf16"), ("codec", "int8", "int8"),
            ("mixing", "samples", "samples"), ("weight", 0.25, "0.25"),
            ("correction", False, "false")]


@pytest.mark.parametrize("name, value, text", SETTINGS)
def test_join_line_carries_each_swarm_setting_unless_the_default(name: str, value: object,
                                                                 text: str) -> None:
    join = line(**{name: value})
    assert str(join).endswith(f"&seed=0&{name}={text}")
    assert JoinLine.parse(str(join)) == join
    assert f"&{name}=" not in str(line())
    assert JoinLine.parse(f"gossip://lab@h:1?key={HEX}&task=m:f") == JoinLine(
        "lab", KEY, ("h:1",), "m:f")  # an older line: every setting its default


def test_join_line_settings_by_config_key() -> None:
    from daemon.config import AveragingSection, SwarmSection
    assert line().settings() == {
        "swarm.cipher": SwarmSection().cipher, "swarm.profile": SwarmSection().profile,
        "averaging.codec": AveragingSection().codec, "averaging.mixing": "fixed",
        "averaging.weight": 0.5, "averaging.correction": True}
    assert line().settings(changed=True) == {}
    assert line(profile="wan", weight=1).settings(changed=True) == {
        "swarm.profile": "wan", "averaging.weight": 1}


def test_join_line_with_every_setting_round_trips_in_a_fixed_order() -> None:
    join = line(cipher="chachapoly", profile="wan", codec="fp16", mixing="samples",
                weight=1e-05, correction=False, shards=3, options={"a": 1})
    text = str(join)
    assert text.endswith("&seed=0&shards=3&cipher=chachapoly&profile=wan&codec=fp16"
                         "&mixing=samples&weight=1e-05&correction=false&options=eyJhIjoxfQ")
    assert JoinLine.parse(text) == join


@pytest.mark.parametrize("field, match", [
    ("profile=WAN", r"profile= \(swarm.profile: expected lan or wan, got 'WAN'\)"),
    ("codec=fp8", r"codec= \(averaging.codec: expected fp32, bf16, fp16, int8"),
    ("codec=", "codec= "),
    ("mixing=push-sum", r"mixing= \(averaging.mixing: expected fixed or samples"),
    ("weight=0", r"weight= \(averaging.weight: expected a number in \(0, 1\]"),
    ("weight=1.5", "weight= "),
    ("weight=1e999", "finite"),
    ("weight=nan", "weight= must be a number, not 'nan'"),
    ("weight=-0.5", "weight= must be a number"),
    ("weight=0_5", "weight= must be a number"),
    ("weight=%200.5", "weight= must be a number"),
    ("correction=yes", "correction= must be true or false, not 'yes'"),
    ("correction=True", "correction= must be true or false"),
    ("codec=bf16&codec=fp16", "codec= is given twice"),
    ("seed=1&seed=2", "seed= is given twice"),
    ("relay=on", "unknown field 'relay': a line from a newer gossipd"),
    ("weight=0.5%0A", "weight= must be a number"),
])
def test_join_line_with_a_bad_setting_is_refused_in_one_line(field: str, match: str) -> None:
    with pytest.raises(KeyFileError, match=match) as info:
        JoinLine.parse(f"gossip://lab@h:1?key={HEX}&task=m:f&{field}")
    assert str(info.value).startswith("bad join line: ")
    assert "\n" not in str(info.value) and HEX not in str(info.value)


@pytest.mark.parametrize("bootstrap, match", [
    ("0.0.0.0:7070", "0.0.0.0 means every address"),
    ("[::]:7070", ":: means every address"),
    ("h:0", "port 0"),
    ("h:1,0.0.0.0:2", "0.0.0.0"),
])
def test_join_line_refuses_a_bootstrap_address_nobody_can_dial(bootstrap: str,
                                                               match: str) -> None:
    with pytest.raises(KeyFileError, match=match):
        JoinLine.parse(f"gossip://lab@{bootstrap}?key={HEX}&task=m:f")
    with pytest.raises(KeyFileError, match=match):
        line(bootstrap=tuple(bootstrap.split(",")))
    with pytest.raises(KeyFileError, match="needs a bootstrap address"):
        line(bootstrap=())


def test_join_line_repr_hides_the_key() -> None:
    join = line(name="lab")
    for text in (repr(join), repr([join]), f"{join!r}"):
        assert HEX not in text
        assert HEX.upper() not in text
        assert "lab" in text


@pytest.mark.parametrize("text", [
    f"lab@h:1?key={HEX}&task=m:f",  # no scheme
    f"http://lab@h:1?key={HEX}&task=m:f",  # wrong scheme
    "gossip://lab@h:1?task=m:f",  # no key
    "gossip://lab@h:1?key=&task=m:f",  # empty key
    f"gossip://lab@h:1?key={HEX[:-2]}&task=m:f",  # short key
    f"gossip://lab@h:1?key={HEX}00&task=m:f",  # long key
    f"gossip://lab@h:1?key={'g' * 64}&task=m:f",  # not hex
    f"gossip://lab@h:1?key={HEX}",  # no task
    f"gossip://lab@h:1?key={HEX}&task=",  # empty task
    f"gossip://lab@?key={HEX}&task=m:f",  # no bootstrap
    f"gossip://lab@,?key={HEX}&task=m:f",  # empty bootstrap list
    f"gossip://lab@h?key={HEX}&task=m:f",  # no port
    f"gossip://lab@h:99999?key={HEX}&task=m:f",  # port out of range
    f"gossip://lab@::1:7070?key={HEX}&task=m:f",  # IPv6 without brackets
    f"gossip://lab@h:1,bad?key={HEX}&task=m:f",  # one bad of several
    f"gossip://lab@h:1?key={HEX}&task=m:f&seed=x",  # bad seed
    f"gossip://lab@h:1?key={HEX}&task=m:f&seed=1.5",  # bad seed
    f"gossip://lab@h:1?key={HEX}&task=m:f&shards=0",  # no shard at all
    f"gossip://lab@h:1?key={HEX}&task=m:f&shards=65536",  # more than MAX_SHARDS
    f"gossip://lab@h:1?key={HEX}&task=m:f&shards=-2",
    f"gossip://lab@h:1?key={HEX}&task=m:f&cipher=AESGCM",  # names are lower case
    f"gossip://@h:1?key={HEX}&task=m:f",  # no name
    "gossip://lab@h:1",  # no query at all
    f"gossip://labh:1?key={HEX}&task=m:f",  # no @
    "",
], ids=["no-scheme", "wrong-scheme", "no-key", "empty-key", "short-key", "long-key",
        "not-hex-key", "no-task", "empty-task", "no-bootstrap", "empty-bootstrap", "no-port",
        "big-port", "bare-ipv6", "one-bad-peer", "seed-x", "seed-float", "shards-0", "shards-big",
        "shards-negative", "cipher-upper", "no-name", "no-query", "no-at", "empty"])
def test_join_line_malformed(text: str) -> None:
    with pytest.raises(KeyFileError) as info:
        JoinLine.parse(text)
    assert "\n" not in str(info.value)
    assert HEX not in str(info.value)  # an error message never echoes the key either


def test_join_line_task_with_percent_round_trips() -> None:
    join = line(task="dir/100%41.py:task")
    assert JoinLine.parse(str(join)) == join


_names = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20)
_hosts = st.one_of(
    st.from_regex(r"[a-z][a-z0-9.-]{0,15}", fullmatch=True),
    st.ip_addresses(v=4).filter(lambda a: not a.is_unspecified).map(str),
    st.ip_addresses(v=6).filter(lambda a: not a.is_unspecified).map(lambda a: f"[{a}]"),
)
_peers = st.builds(lambda h, p: f"{h}:{p}", _hosts, st.integers(1, 65535))
_tasks = st.builds(lambda m, f: f"{m}:{f}",
                   st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                           max_size=20),
                   st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True))


@settings(max_examples=150, deadline=None)
@given(name=_names, key=st.binary(min_size=32, max_size=32),
       bootstrap=st.lists(_peers, min_size=1, max_size=4).map(tuple), task=_tasks,
       seed=st.integers(0, 2**63), shards=st.integers(1, 2**16 - 1),
       settings=st.fixed_dictionaries({}, optional={
           "cipher": st.sampled_from(["aesgcm", "chachapoly"]),
           "profile": st.sampled_from(["lan", "wan"]),
           "codec": st.sampled_from(["fp32", "bf16", "fp16", "int8"]),
           "mixing": st.sampled_from(["fixed", "samples"]),
           "weight": st.floats(0, 1, exclude_min=True), "correction": st.booleans()}))
def test_join_line_round_trip_fuzz(name: str, key: bytes, bootstrap: tuple[str, ...],
                                   task: str, seed: int, shards: int,
                                   settings: dict[str, object]) -> None:
    join = JoinLine(name, key, bootstrap, task, seed, shards, **settings)  # type: ignore[arg-type]
    assert JoinLine.parse(str(join)) == join
    assert key.hex() not in repr(join)
