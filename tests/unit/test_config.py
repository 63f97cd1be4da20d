"""The daemon's config file: defaults, validation messages, overrides, paths and rendering."""

import dataclasses
import datetime
import math
import re
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gossip
from daemon import config
from daemon.config import (
    AveragingSection,
    CheckpointSection,
    Config,
    ConfigError,
    LimitsSection,
    MetricsSection,
    NodeSection,
    SwarmSection,
    TaskSection,
    TimeoutsSection,
)
from gossip.config import CODECS

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

MINIMAL = """\
[node]
listen = "127.0.0.1:7070"

[swarm]
name = "lab"

[task]
entry = "examples.digits:task"
"""
SECTIONS = [NodeSection, SwarmSection, TaskSection, AveragingSection, TimeoutsSection,
            LimitsSection, CheckpointSection, MetricsSection]
PEER = "abcdefghijklmnopqrstuvwxyz"[:24] + "23"  # 26 characters of the base32 alphabet


def minimal(**sections):
    """The parsed MINIMAL file, with the given keys merged into its sections."""
    data = tomllib.loads(MINIMAL)
    for name, table in sections.items():
        data.setdefault(name, {}).update(table)
    return data


def write(directory, text, name="gossipd.toml"):
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def test_minimal_file_loads_with_defaults(tmp_path):
    loaded = config.load(write(tmp_path, MINIMAL))
    assert loaded == Config(node=NodeSection(listen="127.0.0.1:7070"),
                            swarm=SwarmSection(name="lab"),
                            task=TaskSection(entry="examples.digits:task"), base=tmp_path)
    assert loaded.averaging == AveragingSection()
    assert loaded.task.options == {} and loaded.swarm.bootstrap == ()
    assert loaded.base.is_absolute()


def test_every_field_is_documented():
    assert [f.name for f in dataclasses.fields(Config)][:-1] == [cls.section for cls in SECTIONS]
    for cls in SECTIONS:
        assert cls.__doc__.strip()
        for f in dataclasses.fields(cls):
            assert f.metadata["doc"].strip(), f"{cls.section}.{f.name} has no doc"


def test_render_shows_each_doc_above_its_key():
    lines = config.render(config.from_dict(minimal())).splitlines()
    for cls in SECTIONS:
        for f in dataclasses.fields(cls):
            key = f"[{cls.section}.{f.name}]" if f.name == "options" else f"{f.name} = "
            start = lines.index(f"[{cls.section}]")
            where = next(i for i in range(start, len(lines)) if lines[i].startswith(key))
            assert lines[where - 1] == f"# {f.metadata['doc']}"


def test_int_is_accepted_for_a_float_and_becomes_one():
    loaded = config.from_dict(minimal(averaging={"interval": 3, "min_rate": 2_000_000}))
    assert loaded.averaging.interval == 3.0 and type(loaded.averaging.interval) is float
    assert type(loaded.averaging.min_rate) is float


@pytest.mark.parametrize("sections", [
    {"task": {"device": "cuda"}},
    {"task": {"device": "cuda:3", "entry": "tasks/my_task.py:build_task"}},
    {"task": {"shard": 3, "shards": 4, "max_steps": 10}},
    {"task": {"shard": "auto", "shards": 65535}},
    {"node": {"listen": "0.0.0.0:0", "advertise": "10.0.0.5:7070"}},
    {"node": {"listen": "[::1]:0"}},
    {"swarm": {"bootstrap": ["10.0.0.1:7070", "10.0.0.1:7070", "[fe80::1]:7070"]}},
    {"swarm": {"allow": [PEER], "profile": "wan"}},
    {"limits": {"max_connections": 1, "peer_rate": 0.5, "peer_burst": 1}},
    {"timeouts": {"connect": 1, "handshake": 0.5, "record": 60}},
    {"node": {"dial_from": "127.0.0.2"}},
    {"node": {"dial_from": "::1", "listen": "[::1]:0"}},
    {"averaging": {"interval": 0, "clip": 0, "quarantine": 0, "mixing": "samples",
                   "weight": 1, "codec": "bf16", "start": "download"}},
    {"metrics": {"prometheus": "127.0.0.1:0", "log": ""}},
])
def test_valid_values_load(sections):
    config.from_dict(minimal(**sections))


BAD = [
    # (sections merged into the minimal file, the key named, a fragment of the message)
    ({"node": {"listen": 7070}}, "node.listen", "expected a string, got integer 7070"),
    ({"node": {"listen": "localhost"}}, "node.listen", "bad address 'localhost'"),
    ({"node": {"listen": "127.0.0.1:70000"}}, "node.listen", "port out of range"),
    ({"node": {"advertise": "10.0.0.5:0"}}, "node.advertise", "port 0 cannot be dialed"),
    ({"node": {"advertise": "0.0.0.0:7070"}}, "node.advertise", "0.0.0.0 cannot be dialed"),
    ({"node": {"listen": "0.0.0.0:7070"}}, "node.advertise", "listen's host is a wildcard"),
    ({"node": {"listen": "[::]:7070"}}, "node.advertise", "listen's host is a wildcard"),
    ({"node": {"data_dir": ""}}, "node.data_dir", "expected a non-empty string"),
    ({"swarm": {"name": ""}}, "swarm.name", "required"),
    ({"swarm": {"name": "x" * 65}}, "swarm.name", "at most 64 characters"),
    ({"swarm": {"bootstrap": "10.0.0.1:7070"}}, "swarm.bootstrap", "expected an array"),
    ({"swarm": {"bootstrap": ["a:1", 7]}}, "swarm.bootstrap[1]", "expected a string"),
    ({"swarm": {"bootstrap": ["a:1", "b:0"]}}, "swarm.bootstrap[1]", "port 0 cannot be dialed"),
    ({"swarm": {"allow": [PEER.upper()]}}, "swarm.allow[0]", "expected a peer id"),
    ({"swarm": {"allow": [PEER, PEER[:-1]]}}, "swarm.allow[1]", "expected a peer id"),
    ({"swarm": {"profile": "lan2"}}, "swarm.profile", "expected lan or wan, got 'lan2'"),
    ({"limits": {"max_connections": 0}}, "limits.max_connections", "expected an integer >= 1"),
    ({"limits": {"peer_rate": 0}}, "limits.peer_rate", "expected a number > 0"),
    ({"limits": {"max_handshakes_per_host": 0}}, "limits.max_handshakes_per_host",
     "expected an integer >= 1"),
    ({"limits": {"peer_burst": 0.5}}, "limits.peer_burst", "expected an integer, got float"),
    ({"node": {"dial_from": "eth0"}}, "node.dial_from", "expected an IP address"),
    ({"task": {"entry": ""}}, "task.entry", "required"),
    ({"task": {"entry": "module_only"}}, "task.entry", "'module:function'"),
    ({"task": {"entry": "m:not-a-name"}}, "task.entry", "'module:function'"),
    ({"task": {"device": "gpu"}}, "task.device",
     "expected auto, cpu, cuda or cuda:N, got 'gpu'"),
    ({"task": {"device": "cuda:x"}}, "task.device", "expected auto, cpu, cuda or cuda:N"),
    ({"task": {"seed": True}}, "task.seed", "expected an integer, got boolean True"),
    ({"task": {"max_steps": 10.0}}, "task.max_steps", "expected an integer, got float 10.0"),
    ({"task": {"max_steps": -1}}, "task.max_steps", "expected an integer >= 0, got -1"),
    ({"task": {"shard": 2, "shards": 2}}, "task.shard", "[0, 2), got 2"),
    ({"task": {"shards": 0}}, "task.shards", "expected an integer in 1..65535, got 0"),
    ({"task": {"shards": 2**16}}, "task.shards", "expected an integer in 1..65535, got 65536"),
    ({"task": {"shard": "any"}}, "task.shard", 'expected an integer or "auto", got string'),
    ({"task": {"shard": "Auto"}}, "task.shard", 'expected an integer or "auto"'),
    ({"task": {"shard": 1.0}}, "task.shard", 'expected an integer or "auto", got float'),
    ({"task": {"chunk": 0}}, "task.chunk", "expected a number > 0, got 0.0"),
    ({"task": {"progress_interval": -1}}, "task.progress_interval", "expected a number >= 0"),
    ({"task": {"options": [1, 2]}}, "task.options", "expected a table"),
    ({"averaging": {"every": "fast"}}, "averaging.every",
     'expected an integer or "auto", got string \'fast\''),
    ({"averaging": {"every": -1}}, "averaging.every", 'expected an integer >= 0 or "auto", got -1'),
    ({"averaging": {"every": 2.5}}, "averaging.every", 'expected an integer or "auto", got float'),
    ({"averaging": {"interval": -1}}, "averaging.interval", "expected a number >= 0"),
    ({"averaging": {"interval": math.inf}}, "averaging.interval", "expected a finite number"),
    ({"averaging": {"interval": "5s"}}, "averaging.interval", "expected a number, got string"),
    ({"averaging": {"weight": 0}}, "averaging.weight", "expected a number in (0, 1], got 0.0"),
    ({"averaging": {"weight": 1.5}}, "averaging.weight", "expected a number in (0, 1]"),
    ({"averaging": {"weight": True}}, "averaging.weight", "expected a number, got boolean"),
    ({"averaging": {"mixing": "mean"}}, "averaging.mixing", "expected fixed or samples"),
    ({"averaging": {"codec": "int4"}}, "averaging.codec", "expected fp32, bf16, fp16, int8, mod4, mod4/<F> (F in 2..64) or auto"),
    ({"averaging": {"start": "never"}}, "averaging.start", "expected auto, own or download"),
    ({"averaging": {"clip": -0.1}}, "averaging.clip", "expected a number >= 0"),
    ({"averaging": {"max_norm_ratio": 0}}, "averaging.max_norm_ratio", "expected a number > 0"),
    ({"averaging": {"strikes": 0}}, "averaging.strikes", "expected an integer >= 1"),
    ({"timeouts": {"record": 0}}, "timeouts.record", "expected a number > 0"),
    ({"timeouts": {"connect": math.inf}}, "timeouts.connect", "expected a finite number"),
    ({"averaging": {"min_rate": -1e6}}, "averaging.min_rate", "expected a number > 0"),
    ({"checkpoint": {"keep": 0}}, "checkpoint.keep", "expected an integer >= 1"),
    ({"checkpoint": {"interval": 0}}, "checkpoint.interval", "expected a number > 0"),
    ({"metrics": {"prometheus": "9100"}}, "metrics.prometheus", "bad address '9100'"),
    ({"metrics": {"interval": 0}}, "metrics.interval", "expected a number > 0"),
    ({"task": {"eval_interval": -1}}, "task.eval_interval", "expected a number >= 0"),
]


@pytest.mark.parametrize(("sections", "key", "fragment"), BAD,
                         ids=[f"{key}:{fragment[:24]}" for _, key, fragment in BAD])
def test_bad_value_names_file_and_key(sections, key, fragment):
    with pytest.raises(ConfigError) as info:
        config.from_dict(minimal(**sections), source="lab.toml")
    message = str(info.value)
    assert message.startswith(f"lab.toml: {key}: "), message
    assert fragment in message
    assert "\n" not in message
    assert info.value.key == key.partition("[")[0]


def test_missing_required_values_are_named():
    with pytest.raises(ConfigError, match=r"^<config>: swarm\.name: required"):
        config.from_dict({"task": {"entry": "m:f"}, "node": {"listen": "127.0.0.1:0"}})
    with pytest.raises(ConfigError, match=r"^<config>: task\.entry: required"):
        config.from_dict({"swarm": {"name": "lab"}, "node": {"listen": "127.0.0.1:0"}})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match=r"^x\.toml: nodes: unknown section \(did you mean node"):
        config.from_dict(minimal(nodes={}), source="x.toml")
    with pytest.raises(ConfigError, match=r"^x\.toml: zzz: unknown section \(expected one of node"):
        config.from_dict(minimal(zzz={}), source="x.toml")


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"^x\.toml: node\.lisen: unknown key \(did you mean "
                                          r"listen\?\)$"):
        config.from_dict(minimal(node={"lisen": "1.2.3.4:5"}), source="x.toml")
    with pytest.raises(ConfigError, match=r"^<config>: checkpoint\.section: unknown key"):
        config.from_dict(minimal(checkpoint={"section": "x"}))


def test_a_renamed_key_says_what_to_write_instead(tmp_path):
    # task.progress_every counted steps; read as seconds it would silently change meaning.
    expected = (r"task\.progress_every: no longer a key; did you mean task\.progress_interval "
                r"\(seconds between progress lines, default 10; progress_every counted steps\)\?$")
    path = write(tmp_path, MINIMAL + "progress_every = 100\n")
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: {expected}"):
        config.load(path)
    with pytest.raises(ConfigError, match=f"^--set task.progress_every=5: {expected}"):
        config.load(write(tmp_path, MINIMAL, "other.toml"), ["task.progress_every=5"])


# Every key renamed since: *_every counts steps and *_interval seconds everywhere, and the
# library's timeouts and limits have tables of their own, as in NodeConfig. Old keys are
# refused with the hint (exit 2 from the CLI), as task.progress_every is.
_SAME = "the same seconds: a key ending in _interval counts seconds, one in _every steps"
_TIMEOUTS = "the same value, in the [timeouts] table, as in the library's NodeConfig.timeouts"
_LIMITS = "the same value, in the [limits] table, as in the library's NodeConfig.limits"
RENAMED = [
    ("task.eval_every", "task.eval_interval", _SAME),
    ("metrics.every", "metrics.interval", _SAME),
    ("averaging.connect_timeout", "timeouts.connect", _TIMEOUTS),
    ("averaging.handshake_timeout", "timeouts.handshake", _TIMEOUTS),
    ("averaging.record_timeout", "timeouts.record", _TIMEOUTS),
    ("swarm.max_connections", "limits.max_connections", _LIMITS),
    ("swarm.max_handshakes_per_host", "limits.max_handshakes_per_host", _LIMITS),
    ("swarm.peer_rate", "limits.peer_rate", _LIMITS),
    ("swarm.peer_burst", "limits.peer_burst", _LIMITS),
]


@pytest.mark.parametrize("old, new, note", RENAMED, ids=[old for old, _, _ in RENAMED])
def test_each_renamed_key_names_its_new_one(tmp_path, old, new, note):
    section, key = old.split(".")
    expected = f"{old}: no longer a key; did you mean {new} ({note})?"
    with pytest.raises(ConfigError) as info:
        config.from_dict(minimal(**{section: {key: 5}}), source="old.toml")
    assert str(info.value) == f"old.toml: {expected}" and info.value.key == old
    with pytest.raises(ConfigError) as info:
        config.load(write(tmp_path, MINIMAL), [f"{old}=5"])
    assert str(info.value) == f"--set {old}=5: {expected}"
    new_section, new_key = new.split(".")
    loaded = config.from_dict(minimal(**{new_section: {new_key: 5}}))
    assert getattr(getattr(loaded, new_section), new_key) == 5  # the new key takes the value


def test_a_file_of_old_keys_names_every_rename_in_one_line():
    # A file written by `gossipd init` before the renames holds all of them: one error per
    # run would take as many runs to fix.
    old = {}
    for key, _, _ in RENAMED:
        section, name = key.split(".")
        old.setdefault(section, {})[name] = 5
    with pytest.raises(ConfigError) as info:
        config.from_dict(minimal(**old), source="old.toml")
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"old.toml: {len(RENAMED)} keys were renamed")
    assert all(f"{key} -> {new}" in text for key, new, _ in RENAMED)


def test_section_that_is_not_a_table_is_an_error():
    data = minimal()
    data["averaging"] = 5
    with pytest.raises(ConfigError, match=r"^<config>: averaging: expected a table \[averaging\], "
                                          r"got integer 5$"):
        config.from_dict(data)


def test_options_must_hold_toml_values():
    with pytest.raises(ConfigError, match=r"task\.options\.a\[1\]: expected a TOML value"):
        config.from_dict(minimal(task={"options": {"a": [1, object()]}}))


def test_building_a_bad_config_in_code_raises_config_error():
    with pytest.raises(ConfigError, match=r"^task\.device: expected auto"):
        TaskSection(entry="m:f", device="gpu")
    with pytest.raises(ValueError, match=r"^node\.advertise: required"):
        Config(swarm=SwarmSection(name="lab"), task=TaskSection(entry="m:f"))
    with pytest.raises(ConfigError, match=r"^swarm: expected a SwarmSection"):
        Config(swarm={"name": "lab"}, task=TaskSection(entry="m:f"))
    # Each section's defaults are valid on their own; presence is checked by Config.
    for cls in SECTIONS:
        cls()


def test_sections_copy_and_normalize_what_they_are_given():
    options = {"layers": (1, 2)}
    swarm = SwarmSection(name="lab", bootstrap=["a:1"], allow=[gossip.PeerId(PEER)])
    task = TaskSection(entry="m:f", options=options)
    options["layers"] = ()
    assert swarm.bootstrap == ("a:1",) and type(swarm.allow[0]) is str
    assert task.options == {"layers": [1, 2]}


# --- overrides --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("task.seed=7", ("task", "seed", 7)),
    ("averaging.weight=0.25", ("averaging", "weight", 0.25)),
    ("averaging.min_rate=1e6", ("averaging", "min_rate", 1e6)),
    ("task.device=cpu", ("task", "device", "cpu")),
    ('task.device="cuda:1"', ("task", "device", "cuda:1")),
    ("node.listen=127.0.0.1:9000", ("node", "listen", "127.0.0.1:9000")),
    ("metrics.log=", ("metrics", "log", "")),
    ('swarm.bootstrap=["a:1", "b:2"]', ("swarm", "bootstrap", ["a:1", "b:2"])),
    ("task.options.lr=0.01", ("task", "options.lr", 0.01)),
    ("task.options.fast=true", ("task", "options.fast", True)),
    (" task.seed = 3 ", ("task", "seed", 3)),
    ("swarm.name=a=b", ("swarm", "name", "a=b")),
    ("swarm.name=1\nx = 2", ("swarm", "name", "1\nx = 2")),  # one value only, never two keys
])
def test_parse_override(text, expected):
    assert config.parse_override(text) == expected


@pytest.mark.parametrize("text", ["task.seed", "seed=1", "=1", "task..seed=1", ".seed=1",
                                  "task.se ed=1", "task.seed.=1", ""])
def test_malformed_override_is_an_error(text):
    with pytest.raises(ConfigError, match=r"^--set .*: expected section\.key=value"):
        config.parse_override(text)


def test_overrides_apply_before_validation(tmp_path):
    path = write(tmp_path, MINIMAL.replace('name = "lab"\n', ""))  # swarm.name comes from --set
    loaded = config.load(path, [
        "swarm.name=lab", "task.seed=1", "task.seed=2", "task.device=cpu",
        "task.options.lr=0.01", "task.options.model.width=64", "averaging.interval=0",
        "swarm.bootstrap=['10.0.0.1:7070']",
    ])
    assert loaded.swarm.name == "lab"
    assert loaded.task.seed == 2  # the last one wins
    assert loaded.task.device == "cpu"
    assert loaded.task.options == {"lr": 0.01, "model": {"width": 64}}
    assert loaded.averaging.interval == 0.0
    assert loaded.swarm.bootstrap == ("10.0.0.1:7070",)


def test_shard_auto_from_a_file_or_an_override(tmp_path):
    path = write(tmp_path, MINIMAL)
    assert config.load(path).task.shard == 0  # the default
    loaded = config.load(path, ["task.shard=auto", "task.shards=8"])  # no quotes needed
    assert (loaded.task.shard, loaded.task.shards) == ("auto", 8)
    assert 'shard = "auto"' in config.render(loaded)
    assert config.load(path, ["task.shard=auto", "task.shard=5", "task.shards=8"]).task.shard == 5


def test_every_auto_from_a_file_or_an_override_reaches_the_library(tmp_path):
    path = write(tmp_path, MINIMAL + '[averaging]\nevery = "auto"\n')
    loaded = config.load(path)
    assert loaded.averaging.every == "auto"
    assert loaded.node_config().averaging.every == "auto"
    assert 'every = "auto"' in config.render(loaded)  # what check-config prints
    assert round_trip(tmp_path, loaded) == loaded
    assert config.load(path, ["averaging.every=4"]).node_config().averaging.every == 4
    assert config.load(write(tmp_path, MINIMAL, "other.toml"),
                       ["averaging.every=auto"]).averaging.every == "auto"  # no quotes needed


def test_bad_override_is_reported_like_a_bad_file_value(tmp_path):
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as info:
        config.load(path, ["task.device=gpu"])
    assert str(info.value) == ("--set task.device=gpu: task.device: expected auto, cpu, cuda or "
                               "cuda:N, got 'gpu'")
    with pytest.raises(ConfigError, match=r"^--set task\.seed=1\.5: task\.seed: expected an "
                                          r"integer, got float 1\.5$"):
        config.load(path, ["task.seed=1.5"])
    with pytest.raises(ConfigError, match=r"^--set task\.sed=1: task\.sed: unknown key"):
        config.load(path, ["task.sed=1"])
    with pytest.raises(ConfigError, match=r"^--set tsak\.seed=1: tsak: unknown section"):
        config.load(path, ["tsak.seed=1"])
    with pytest.raises(ConfigError, match=r"^--set node\.listen\.port=1: node\.listen: expected a "
                                          r"table"):
        config.load(path, ["node.listen.port=1"])


def test_file_errors_are_blamed_on_the_file_despite_overrides(tmp_path):
    path = write(tmp_path, MINIMAL + "seed = -1.5\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: task\.seed: "):
        config.load(path, ["task.device=cpu"])
    # ...unless an override set the same key:
    with pytest.raises(ConfigError, match=r"^--set task\.seed=x: task\.seed: "):
        config.load(path, ["task.seed=x"])


# --- files and paths ------------------------------------------------------------------------

def test_env_var_selects_the_file(tmp_path, monkeypatch):
    path = write(tmp_path, MINIMAL.replace('"lab"', '"from-env"'), "elsewhere.toml")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setenv(config.ENV, str(path))
    assert config.load().swarm.name == "from-env"
    assert config.load(write(tmp_path, MINIMAL)).swarm.name == "lab"  # an explicit path wins


def test_default_path_is_in_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(config.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    write(tmp_path, MINIMAL, config.DEFAULT_PATH)
    loaded = config.load()
    assert loaded.swarm.name == "lab" and loaded.base == tmp_path


def test_missing_file_names_it(tmp_path, monkeypatch):
    monkeypatch.delenv(config.ENV, raising=False)
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        config.load(missing)
    assert str(info.value) == (f"config file {missing} does not exist "
                               f"(run `gossipd init` to write one)")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^config file gossipd\.toml does not exist"):
        config.load()


def test_bad_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, MINIMAL + "seed = = 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: invalid TOML: .*line 9"):
        config.load(path)
    path.write_bytes(b"[swarm]\nname = \"\xff\"\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: invalid TOML"):
        config.load(path)


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}: cannot read"):
        config.load(tmp_path)


def test_relative_paths_start_from_the_config_files_directory(tmp_path, monkeypatch):
    (tmp_path / "etc").mkdir()
    write(tmp_path / "etc", MINIMAL.replace("[node]\n", '[node]\ndata_dir = "../var"\n'))
    monkeypatch.chdir(tmp_path / "etc")
    loaded = config.load(Path("gossipd.toml"))  # relative, from another current directory...
    monkeypatch.chdir("/")
    assert loaded.base == tmp_path / "etc"  # ...still anchored where the file is
    assert loaded.data_dir() == (tmp_path / "var").resolve()
    assert loaded.path(loaded.node.identity) == (tmp_path / "var" / "identity.key").resolve()
    assert loaded.path(loaded.checkpoint.dir) == (tmp_path / "var" / "checkpoints").resolve()
    assert loaded.path("/srv/ckpt") == Path("/srv/ckpt")


def test_absolute_data_dir_ignores_base(tmp_path):
    loaded = config.from_dict(minimal(node={"data_dir": str(tmp_path)}), base=Path("/nowhere"))
    assert loaded.data_dir() == tmp_path.resolve()


# --- rendering ------------------------------------------------------------------------------

def round_trip(directory, cfg):
    return config.load(write(directory, config.render(cfg)))


def test_render_round_trips_the_defaults(tmp_path):
    cfg = config.load(write(tmp_path, MINIMAL))
    assert round_trip(tmp_path, cfg) == cfg


def test_render_round_trips_every_kind_of_value(tmp_path):
    cfg = config.from_dict(minimal(
        node={"listen": "[::]:0", "advertise": "[2001:db8::1]:7070", "data_dir": "d i r"},
        swarm={"name": 'q"uo\\te\n\ttab\x7f\x00 é ✓', "bootstrap": ["a:1", "[::1]:2", "a:1"],
               "allow": [PEER, PEER[::-1]], "profile": "wan"},
        task={"options": {
            "lr": 3e-4, "big": 1e300, "neg": -0.0, "inf": math.inf, "n": 2**62, "on": False,
            "name": "a\"b'c\\d", "list": [1, "two", [3.5], {"k": "v"}], "empty": [],
            "nested": {"deeper": {"x": 1}, "with space": "ok", "": "empty key"},
            "when": datetime.datetime(2024, 5, 1, 12, 30, tzinfo=datetime.timezone.utc),
            "day": datetime.date(2024, 5, 1), "time": datetime.time(8, 15, 0, 250000),
            "ключ": "значение", "table": {},
        }, "max_steps": 10**12, "device": "cuda:0", "shard": "auto", "shards": 8},
        averaging={"min_rate": 1e6, "interval": 0, "weight": 1},
        metrics={"prometheus": "127.0.0.1:9100", "log": ""},
    ), base=tmp_path)
    assert round_trip(tmp_path, cfg) == cfg


_option_values = st.recursive(
    st.booleans() | st.text()
    | st.integers(min_value=-2**63, max_value=2**63 - 1) | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=3),
    max_leaves=10,
)


@settings(max_examples=150, deadline=None)
@given(name=st.text(min_size=1, max_size=64),
       options=st.dictionaries(st.text(max_size=8), _option_values, max_size=4))
def test_render_round_trips_any_name_and_options(name, options):
    cfg = config.from_dict(minimal(swarm={"name": name}, task={"options": options}))
    assert config.from_dict(tomllib.loads(config.render(cfg))) == cfg


# --- mapping onto the library's settings ------------------------------------------------------

def test_to_averaging_maps_every_shared_field():
    section = AveragingSection(every=7, interval=2, weight=0.25, codec="fp16", clip=0,
                               max_norm_ratio=10, strikes=5, quarantine=60, start="own",
                               download_wait=1, offer_timeout=1, transfer_timeout=2,
                               commit_timeout=3, min_rate=5e5, correction=False, leak=0.5)
    averaging = section.to_averaging()
    assert averaging.interval == 2.0 and averaging.by_samples is False
    shared = {f.name for f in dataclasses.fields(gossip.AveragingConfig)}
    for f in dataclasses.fields(section):
        if f.name in shared:
            assert getattr(averaging, f.name) == getattr(section, f.name), f.name


def test_to_averaging_interval_0_is_none_and_samples_is_push_sum():
    averaging = AveragingSection(interval=0, mixing="samples").to_averaging()
    assert averaging.interval is None and averaging.by_samples is True
    assert averaging.every == 1  # by steps only


def test_to_averaging_every_0_is_by_time_only_and_both_0_never_start_a_round():
    averaging = AveragingSection(every=0).to_averaging()
    assert averaging.every is None and averaging.interval == 10.0
    averaging = AveragingSection(every=0, interval=0).to_averaging()
    assert averaging.every is None and averaging.interval is None


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_is_one_the_library_knows(codec):
    assert AveragingSection(codec=codec).to_averaging().codec == codec


def test_node_config_takes_the_timeouts_by_their_library_names():
    cfg = config.from_dict(minimal(timeouts={"connect": 1, "handshake": 2, "record": 3}))
    assert cfg.node_config().timeouts == gossip.Timeouts(connect=1.0, handshake=2.0, record=3.0)


def test_node_config_takes_the_limits():
    cfg = config.from_dict(minimal(limits={"max_connections": 3, "max_handshakes_per_host": 2,
                                           "peer_rate": 0.5, "peer_burst": 4}))
    assert cfg.node_config().limits == gossip.Limits(max_connections=3, max_handshakes_per_host=2,
                                                     peer_rate=0.5, peer_burst=4)


def test_membership_profile():
    lan = config.from_dict(minimal())
    wan = config.from_dict(minimal(swarm={"profile": "wan"}))
    assert lan.node_config().membership == gossip.MembershipConfig()
    assert wan.node_config().membership == gossip.MembershipConfig.wan()


def test_node_config_of_the_defaults_is_the_librarys():
    """Where the daemon keeps the library's defaults, its node config is the library's own
    (the TOML-only spellings included: every, interval and mixing)."""
    node = config.from_dict(minimal()).node_config()
    assert node == gossip.NodeConfig(listen="127.0.0.1:7070", reachable=None)


def test_node_config_maps_the_node_and_swarm_keys():
    cfg = config.from_dict(minimal(
        node={"listen": "0.0.0.0:7070", "advertise": "10.0.0.5:7070", "reachable": False},
        swarm={"bootstrap": ["10.0.0.1:7070"], "allow": [PEER]},
        averaging={"every": 0, "mixing": "samples", "start": "download"}))
    node = cfg.node_config()
    assert (node.listen, node.advertise, node.bootstrap) == ("0.0.0.0:7070", "10.0.0.5:7070",
                                                             ("10.0.0.1:7070",))
    assert node.allow == frozenset({PEER}) and node.reachable is False
    assert node.averaging == gossip.AveragingConfig(every=None, by_samples=True,
                                                    start="download")
    assert config.from_dict(minimal(node={"reachable": True})).node_config().reachable is True
