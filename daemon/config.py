"""The daemon's configuration: one TOML file read into a tree of frozen dataclasses.

Theory of operation
-------------------
Each table of the file is a frozen dataclass below, and each of its fields is declared once, with
the library's settings engine (:mod:`gossip.config`): ``setting(default, doc, check)``. That one
declaration is the field's documentation (the ``doc`` metadata, which :func:`render` writes as a
comment above the key), its type (the type of the default) and its validation (``check``); the
engine's :func:`gossip.config.checked` converts and checks each value, and :class:`_Section` only
turns its problem into a :class:`ConfigError` that names the key. A key that is a library setting
is declared with ``setting_of(gossip_class, name)`` instead, which takes the default, doc and check
of the setting's one declaration in :mod:`gossip.config`.

The tables mirror :class:`gossip.NodeConfig`: ``[averaging]``, ``[timeouts]`` and ``[limits]`` hold
:class:`gossip.AveragingConfig`'s, :class:`gossip.Timeouts`' and :class:`gossip.Limits`' settings
under the library's names; ``[node]`` and ``[swarm]`` hold its addresses and peers, ``[task]``,
``[checkpoint]`` and ``[metrics]`` the daemon's own keys. Two rules of spelling hold in every
table: a key ending in ``_every`` (``averaging.every``, ``task.check_every``) counts steps, and one
ending in ``_interval`` (``task.progress_interval``, ``metrics.interval``) counts seconds. TOML has
no None, so the file spells the library's None otherwise, and :meth:`Config.node_config` is the one
place that maps it back (see its docstring). Keys that were renamed are listed in ``_RENAMED``: an
old key is refused (exit 2) with a one-line hint naming the new one, never silently read.

Validation runs in ``__post_init__``, so a bad config is an error however it is built, from a
file or in code, in two stages:

1. each section checks the *form* of its own values: the type (an int is accepted where a float
   is expected; a bool or a float never where an int is), the range, the enumeration, the
   address syntax, and relations inside the section (``task.shard < task.shards``);
2. :class:`Config` checks that required values are *present* (``swarm.name``, ``task.entry``,
   and ``node.advertise`` behind a wildcard ``node.listen``). Keeping presence out of stage 1
   lets every section's defaults be a valid section on their own.

:func:`load` reads the file, applies ``--set section.key=value`` overrides to the parsed table
(so an override is validated exactly like a value in the file), and hands it to
:func:`from_dict`, which rejects unknown sections and keys before building the tree. Every
error is a one-line :class:`ConfigError` that starts with where the value came from (the file,
or the ``--set`` argument) and names the key. Writing a config back as TOML is
:mod:`daemon.toml`'s (:func:`render`, re-exported here).

Relative paths start from ``node.data_dir``, which itself starts from the directory of the
config file (``Config.base``), never from the current directory of whoever started the daemon.
"""

from __future__ import annotations

import difflib
import ipaddress
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

import gossip
import gossip.lowlevel
from gossip import MAX_SHARDS
from gossip.lowlevel import parse_address
from gossip.config import (AT_LEAST_1, COUNT, NON_NEGATIVE, POSITIVE, Check, Invalid,
                           arguments_for, checked, one_of, setting, setting_of, want)
from gossip.devices import NAMES, valid_name

from .entry import parse_entry
from .toml import BARE_KEY, describe, render

__all__ = [
    "ENV", "DEFAULT_PATH", "ConfigError", "NodeSection", "SwarmSection", "TaskSection",
    "AveragingSection", "TimeoutsSection", "LimitsSection", "CheckpointSection", "MetricsSection",
    "Config", "load", "from_dict", "parse_override", "apply_override", "render",
]

ENV = "GOSSIPD_CONFIG"  # names the config file when no path is given
DEFAULT_PATH = "gossipd.toml"  # in the current directory, when neither a path nor ENV is given

WILDCARDS = ("0.0.0.0", "::")  # listen hosts that peers cannot dial
_PEER_ID = re.compile(r"[a-z2-7]{26}")


class ConfigError(ValueError):
    """The configuration is invalid: the operator's to fix. The message is one line that starts
    with the file (or ``--set`` argument) and the key; the CLI prints it and exits with 2.

    Attributes:
        key: the dotted key at fault (``"task.device"``), or None when no key is.
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key

    def within(self, source: str) -> ConfigError:
        """The same error, its message prefixed with ``source``."""
        return ConfigError(f"{source}: {self}", self.key)


# --- checks: each takes a value of the field's type and returns a problem, or None ----------
# (the common ones, and want/one_of, are the library's: gossip.config)

def _address(*, dialable: bool, optional: bool = False) -> Check:
    """A ``host:port``. A dialable one (what peers connect to) needs a real host and port."""

    def check(value: str) -> str | None:
        if optional and value == "":
            return None
        try:
            host, port = parse_address(value)
        except ValueError as exc:
            return str(exc)
        if dialable and port == 0:
            return f"port 0 cannot be dialed: expected a port in 1..65535, got {value!r}"
        if dialable and host in WILDCARDS:
            return f"{host} cannot be dialed: expected the host peers reach, got {value!r}"
        return None

    return check


def _entry(value: str) -> str | None:
    try:
        if value:  # "" is caught as missing, in stage 2
            parse_entry(value)
    except ValueError as exc:
        return str(exc)
    return None


def _ip_or_empty(value: str) -> str | None:
    try:
        if value:
            ipaddress.ip_address(value)
    except ValueError:
        return f"expected an IP address or \"\", got {value!r}"
    return None


NOT_EMPTY = want(bool, "a non-empty string")


class _Section:
    """Validation shared by the sections: the library's engine converts and checks each value
    (:func:`gossip.config.checked`), and its problem becomes a :class:`ConfigError` that names
    the key, and the item at fault inside it (``swarm.bootstrap[1]``). ``section`` is the TOML
    table's name: a plain class attribute (it has no annotation), not a field."""

    section = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            try:
                value = checked(f, getattr(self, f.name), describe=describe)
            except Invalid as exc:
                key = f"{self.section}.{f.name}"
                raise ConfigError(f"{key}{exc.where}: {exc}", key) from None
            object.__setattr__(self, f.name, value)


@dataclass(frozen=True)
class NodeSection(_Section):
    """Where this node listens, and where it keeps its files."""

    section = "node"
    listen: str = setting("0.0.0.0:7070", "host:port for UDP datagrams and TCP channels; port 0 "
                          "picks any free port", _address(dialable=False))
    advertise: str = setting("", "host:port peers dial to reach us; \"\" means listen (required "
                             "when listen's host is 0.0.0.0 or ::)",
                             _address(dialable=True, optional=True))
    data_dir: str = setting(".", "directory of this node's files, relative to this file's "
                            "directory", NOT_EMPTY)
    identity: str = setting("identity.key", "node key file, relative to data_dir; created at "
                            "first run", NOT_EMPTY)
    control: str = setting("control.sock", "Unix control socket for `gossipd status`, relative "
                           "to data_dir", NOT_EMPTY)
    dial_from: str = setting("", "local IP our outgoing connections come from; \"\" lets the "
                             "system choose (set it on multi-homed hosts)", _ip_or_empty)
    reachable: bool | str = setting("auto", "whether other members can dial advertise (or "
                                    "listen): true; false behind a NAT or firewall that lets "
                                    "nothing in (we then start every exchange ourselves); "
                                    "\"auto\": a member dials us back after we join",
                                    words=("auto",), kind=bool)


@dataclass(frozen=True)
class SwarmSection(_Section):
    """Which swarm to join, and whom to exchange with."""

    section = "swarm"
    name: str = setting("", "the swarm's name, 1..64 characters, the same on every node "
                        "(required)", want(lambda v: len(v) <= 64, "at most 64 characters"))
    key_file: str = setting("swarm.key", "swarm key file, relative to data_dir: 32 random bytes "
                            "as 64 hex characters", NOT_EMPTY)
    previous_key_file: str = setting("", "only while rotating the swarm key: the key being "
                                     "replaced, a key file like key_file, relative to data_dir; "
                                     "the node accepts both and speaks key_file's; \"\": none "
                                     "(gossipd rotate-key sets it, gossipd retire-key "
                                     "clears it)")
    cipher: str = setting("aesgcm", "channel cipher, the same on every node (a node of the other "
                          "cipher cannot connect): aesgcm (fastest on machines with AES "
                          "instructions) or chachapoly (for swarms of machines without them)",
                          one_of(*gossip.lowlevel.CIPHERS))
    bootstrap: tuple[str, ...] = setting((), "host:port of some members to join through; empty: "
                                         "this node starts the swarm", _address(dialable=True))
    allow: tuple[str, ...] = setting((), "peer ids allowed to exchange with us; empty: anyone "
                                     "holding the swarm key", want(
                                         _PEER_ID.fullmatch, "a peer id (26 of a-z, 2-7)"))
    profile: str = setting("lan", "membership timing: lan (fast failure detection) or wan "
                           "(patient, for nodes across the internet)", one_of("lan", "wan"))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.previous_key_file and self.previous_key_file == self.key_file:
            raise ConfigError(f"swarm.previous_key_file: expected another file than "
                              f"swarm.key_file, got {self.previous_key_file!r} for both: the "
                              "previous key is the one being replaced", "swarm.previous_key_file")


@dataclass(frozen=True)
class TaskSection(_Section):
    """What to train, on which device, and which share of the data."""

    section = "task"
    entry: str = setting("", "what to train: \"package.module:function\" or "
                         "\"path/to/file.py:function\", a relative path from data_dir (required)",
                         _entry)
    device: str = setting("auto", "auto, cpu, cuda or cuda:N; auto and cuda take GPU 0 (GPU r "
                          "for process r of a node of several), auto the CPU when there is no "
                          "GPU", want(valid_name, NAMES))
    seed: int = setting(0, "seeds the model's initialization: the same on every node (>= 0)",
                        COUNT)
    shard: int | str = setting(0, "this node's shard of the data, in [0, shards), or \"auto\": "
                               "once joined, the shard the fewest members announce, kept in "
                               "data_dir/shard", COUNT, words=("auto",))
    shards: int = setting(1, f"how many shards the data is split into, 1..{MAX_SHARDS}: "
                          "the same on every node", want(lambda v: 1 <= v <= MAX_SHARDS,
                                                          f"an integer in 1..{MAX_SHARDS}"))
    options: Mapping[str, Any] = setting({}, "free-form table passed to the task as given")
    chunk: float = setting(0.25, "s; the trainer thread returns to the event loop at least this "
                           "often (> 0)", POSITIVE)
    progress_interval: float = setting(10.0, "s between progress log lines (>= 0); 0: one after "
                                       "every chunk", NON_NEGATIVE)
    eval_interval: float = setting(0.0, "s between evaluations while training (the task's "
                                   "evaluate, between chunks); 0: only when stopping",
                                   NON_NEGATIVE)
    max_steps: int = setting(0, "stop after this process has taken this many steps; 0: run "
                             "until stopped", COUNT)
    processes: int = setting(1, "training processes of this node, 1..64: one per GPU on a "
                             "machine with several (process r takes cuda:r); they train one "
                             "model synchronously and the swarm sees one node. Under torchrun, "
                             "leave it at 1", want(lambda v: 1 <= v <= 64, "an integer in 1..64"))
    pipeline: int = setting(1, "pipeline stages of this node, 1..64: the task's model (which "
                            "declares Task.pipeline) cut into this many stages, one process "
                            "each (stage k on cuda:k), micro-batches flowing through them; the "
                            "swarm sees one ordinary model. Not with processes > 1",
                            want(lambda v: 1 <= v <= 64, "an integer in 1..64"))
    check_every: int = setting(0, "steps between checks that a node's processes hold "
                               "bit-identical parameters (a broadcast of the model); 0: never",
                               COUNT)
    threads: int = setting(0, "CPU threads torch may use; 0: torch's default (one per core). "
                           "Small models train faster on 1", COUNT)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.pipeline > 1 and self.processes > 1:
            raise ConfigError("task.pipeline and task.processes cannot both be above 1: a "
                              "node is either data parallel or pipelined, not both (a data x "
                              "pipeline mesh is not supported)", "task.pipeline")
        if self.shard != "auto" and self.shard >= self.shards:
            raise ConfigError(f"task.shard: expected an integer in [0, task.shards) = "
                              f"[0, {self.shards}), got {self.shard}", "task.shard")


@dataclass(frozen=True)
class AveragingSection(_Section):
    """How, and how often, this node averages its model with a random peer."""

    section = "averaging"
    # every and interval: 0 here is the library's None (Config.node_config).
    every: int | str = setting(gossip.AveragingConfig.every or 0, "local steps between the "
                               "rounds we start (x U(0.75, 1.25)); a round on a slow link is "
                               "followed at once by the next; \"auto\": ceil(2 x exchange time / "
                               "step time), measured, 1 until it is; 0: by interval only (see "
                               "docs/DAEMON.md, Choosing averaging.every)",
                               want(lambda v: v >= 0, 'an integer >= 0 or "auto"'),
                               words=("auto",))
    interval: float = setting(gossip.AveragingConfig.interval or 0.0, "s after our last round "
                              "ends before we start another anyway, for a node that steps "
                              "slower than every (or not at all); 0: by steps only (every and "
                              "interval both 0: never start one; still answers peers)",
                              NON_NEGATIVE)
    correction: bool = setting_of(gossip.AveragingConfig, "correction")
    leak: float = setting_of(gossip.AveragingConfig, "leak")
    outer: bool = setting_of(gossip.AveragingConfig, "outer")
    outer_lr: float = setting_of(gossip.AveragingConfig, "outer_lr")
    outer_momentum: float | str = setting_of(gossip.AveragingConfig, "outer_momentum")
    outer_cadence: str = setting_of(gossip.AveragingConfig, "outer_cadence")
    peers: int | str = setting_of(gossip.AveragingConfig, "peers")
    mixing: str = setting("samples" if gossip.AveragingConfig.by_samples else "fixed",
                          "fixed: own += weight * (peer - own); samples: weigh both sides by "
                          "samples trained (push-sum)", one_of("fixed", "samples"))
    weight: float = setting_of(gossip.AveragingConfig, "weight")
    codec: str = setting_of(gossip.AveragingConfig, "codec")
    wide_codec: str = setting_of(gossip.AveragingConfig, "wide_codec")
    clip: float = setting_of(gossip.AveragingConfig, "clip")
    max_norm_ratio: float = setting_of(gossip.AveragingConfig, "max_norm_ratio")
    strikes: int = setting_of(gossip.AveragingConfig, "strikes")
    quarantine: float = setting_of(gossip.AveragingConfig, "quarantine")
    trust_after: float = setting_of(gossip.AveragingConfig, "trust_after")
    start: str = setting_of(gossip.AveragingConfig, "start")
    download_wait: float = setting_of(gossip.AveragingConfig, "download_wait")
    offer_timeout: float = setting_of(gossip.AveragingConfig, "offer_timeout")
    transfer_timeout: float = setting_of(gossip.AveragingConfig, "transfer_timeout",
                                         see="docs/OPERATIONS.md, Thin and slow links")
    commit_timeout: float = setting_of(gossip.AveragingConfig, "commit_timeout")
    min_rate: float = setting_of(gossip.AveragingConfig, "min_rate")
    stall_timeout: float = setting_of(gossip.AveragingConfig, "stall_timeout")

    def to_averaging(self) -> gossip.AveragingConfig:
        """The library's averaging settings: the fields declared from them, and every,
        interval and mixing mapped as :meth:`Config.node_config` says."""
        return gossip.AveragingConfig(**arguments_for(gossip.AveragingConfig, self),
                                      every=self.every or None, interval=self.interval or None,
                                      by_samples=self.mixing == "samples")


@dataclass(frozen=True)
class TimeoutsSection(_Section):
    """Deadlines of a channel's phases, on every connection this node opens or accepts."""

    section = "timeouts"
    connect: float = setting_of(gossip.Timeouts, "connect")
    handshake: float = setting_of(gossip.Timeouts, "handshake")
    record: float = setting_of(gossip.Timeouts, "record")


@dataclass(frozen=True)
class LimitsSection(_Section):
    """How much inbound work this node takes on: connections, and how often a peer opens one."""

    section = "limits"
    max_connections: int = setting_of(gossip.Limits, "max_connections")
    max_handshakes_per_host: int = setting_of(gossip.Limits, "max_handshakes_per_host")
    host_rate: float = setting_of(gossip.Limits, "host_rate")
    host_burst: int = setting_of(gossip.Limits, "host_burst")
    peer_rate: float = setting_of(gossip.Limits, "peer_rate")
    peer_burst: int = setting_of(gossip.Limits, "peer_burst")


@dataclass(frozen=True)
class CheckpointSection(_Section):
    """When, and where, the model is saved."""

    section = "checkpoint"
    interval: float = setting(300.0, "s between checkpoints (> 0); one is also written at exit",
                              POSITIVE)
    keep: int = setting(3, "newest checkpoints kept (>= 1)", AT_LEAST_1)
    dir: str = setting("checkpoints", "checkpoint directory, relative to data_dir", NOT_EMPTY)


@dataclass(frozen=True)
class MetricsSection(_Section):
    """What this node reports about itself, and where."""

    section = "metrics"
    prometheus: str = setting("", "host:port of the Prometheus endpoint; \"\": off",
                              _address(dialable=False, optional=True))
    log: str = setting("metrics.jsonl", "JSON-lines metrics log, relative to data_dir; \"\": off")
    interval: float = setting(10.0, "s between JSON lines (> 0)", POSITIVE)


_SECTIONS = {cls.section: cls for cls in (
    NodeSection, SwarmSection, TaskSection, AveragingSection, TimeoutsSection, LimitsSection,
    CheckpointSection, MetricsSection)}

# Keys that were renamed, with what to write instead. An old key is refused (exit 2) with this
# hint, never read: one clear error away from running, not silently read with another meaning.
_SAME = "the same seconds: a key ending in _interval counts seconds, one in _every steps"
_RENAMED = {
    "task.progress_every": ("task.progress_interval", "seconds between progress lines, default "
                            "10; progress_every counted steps"),
    "task.eval_every": ("task.eval_interval", _SAME),
    "metrics.every": ("metrics.interval", _SAME),
    **{f"averaging.{name}_timeout": (f"timeouts.{name}", "the same value, in the [timeouts] "
                                     "table, as in the library's NodeConfig.timeouts")
       for name in ("connect", "handshake", "record")},
    **{f"swarm.{name}": (f"limits.{name}", "the same value, in the [limits] table, as in the "
                         "library's NodeConfig.limits")
       for name in ("max_connections", "max_handshakes_per_host", "peer_rate", "peer_burst")},
}


@dataclass(frozen=True)
class Config:
    """The whole configuration: one field per TOML table, plus where relative paths start."""

    node: NodeSection = field(default_factory=NodeSection)
    swarm: SwarmSection = field(default_factory=SwarmSection)
    task: TaskSection = field(default_factory=TaskSection)
    averaging: AveragingSection = field(default_factory=AveragingSection)
    timeouts: TimeoutsSection = field(default_factory=TimeoutsSection)
    limits: LimitsSection = field(default_factory=LimitsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    base: Path = Path(".")  # the config file's directory; node.data_dir starts here. Not a key
    # False skips stage 2 (the required values): for commands that only look for the node's
    # files, such as `gossipd status`, which must not need node.advertise to find a socket.
    complete: InitVar[bool] = True

    def __post_init__(self, complete: bool) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name}: expected a {cls.__name__}, got "
                                  f"{describe(getattr(self, name))}", name)
        object.__setattr__(self, "base", Path(self.base))
        if not complete:
            return
        if not self.swarm.name:
            raise ConfigError("swarm.name: required: the swarm's name, 1..64 characters, the "
                              "same on every node", "swarm.name")
        if not self.task.entry:
            raise ConfigError("task.entry: required: what to train, as 'module:function' or "
                              "'path/to/file.py:function'", "task.entry")
        host, _ = parse_address(self.node.listen)
        if host in WILDCARDS and not self.node.advertise:
            raise ConfigError(f"node.advertise: required because node.listen's host is a "
                              f"wildcard ({self.node.listen}): set the host:port peers dial to "
                              f"reach this node", "node.advertise")

    def data_dir(self) -> Path:
        """The absolute directory of this node's files."""
        return (self.base / self.node.data_dir).resolve()

    def path(self, relative: str) -> Path:
        """``relative`` under :meth:`data_dir`; an absolute path stays as it is."""
        return self.data_dir() / relative

    def node_config(self) -> gossip.NodeConfig:
        """The library's settings of this node: what :func:`gossip.open_swarm` takes.

        ``[averaging]``, ``[timeouts]`` and ``[limits]`` keep the library's names. TOML has no
        None, so where the library takes None the file says it otherwise, and this is the one
        place that reads it back:

        - ``averaging.every = 0``: None, no rounds by steps; ``averaging.interval = 0``: None,
          no rounds by time (``"auto"`` stays ``"auto"``);
        - ``node.advertise = ""``: None, peers dial ``listen``; ``swarm.allow = []``: None,
          any holder of the swarm key; ``node.reachable = "auto"``: None, find out by a
          dial-back once joined.

        Two keys are spelled as choices: ``averaging.mixing = "samples"`` is ``by_samples``,
        and ``swarm.profile`` picks :meth:`gossip.MembershipConfig.lan` or ``wan``.
        A node resuming a checkpoint takes ``averaging.start`` as a fresh one does: the
        library then takes a ready peer's state only if it is newer than the checkpoint
        (:mod:`gossip.node`, "Resuming"), and ``"own"`` keeps the checkpoint's weights.
        """
        averaging = self.averaging.to_averaging()
        return gossip.NodeConfig(
            listen=self.node.listen, advertise=self.node.advertise or None,
            bootstrap=self.swarm.bootstrap, allow=frozenset(self.swarm.allow) or None,
            reachable=None if self.node.reachable == "auto" else bool(self.node.reachable),
            averaging=averaging,
            membership=(gossip.MembershipConfig.wan() if self.swarm.profile == "wan"
                        else gossip.MembershipConfig.lan()),
            timeouts=gossip.Timeouts(**arguments_for(gossip.Timeouts, self.timeouts)),
            limits=gossip.Limits(**arguments_for(gossip.Limits, self.limits)))


# --- reading ---------------------------------------------------------------------------------

def load(path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *,
         complete: bool = True) -> Config:
    """Read the config file and apply ``--set`` overrides.

    Args:
        path: the TOML file; None means ``$GOSSIPD_CONFIG``, or else ``gossipd.toml``.
        overrides: ``section.key=value`` strings, applied in order (see :func:`parse_override`).
        complete: False accepts a config that lacks a required value (``swarm.name``,
            ``task.entry``, ``node.advertise`` behind a wildcard): enough to find the node's
            files, not to run it.

    Raises:
        ConfigError: the file is missing or unreadable, is not TOML, or holds a bad value.
    """
    path = Path(path if path is not None else os.environ.get(ENV) or DEFAULT_PATH)
    source = str(path)
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {source} does not exist (run `gossipd init` to write "
                          f"one)") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    applied = [(text, apply_override(data, text)) for text in overrides]
    try:
        return _build(data, Path(os.path.abspath(path)).parent, complete)
    except ConfigError as exc:
        # Blame the last override that set the key at fault (or a table above or below it).
        blamed = [text for text, key in applied if exc.key and _overlap(key, exc.key)]
        raise exc.within(f"--set {blamed[-1]}" if blamed else source) from None


def from_dict(data: Mapping, base: Path = Path("."), source: str = "<config>") -> Config:
    """Build a :class:`Config` from a parsed TOML table; errors are prefixed with ``source``.

    Raises:
        ConfigError: an unknown section or key, or a bad or missing value.
    """
    try:
        return _build(data, base)
    except ConfigError as exc:
        raise exc.within(source) from None


def _build(data: Mapping, base: Path, complete: bool = True) -> Config:
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a table of sections, got {describe(data)}")
    _refuse_renamed(data)
    sections = {}
    for name, table in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"{name}: unknown section{_suggest(name, _SECTIONS)}", name)
        if not isinstance(table, Mapping):
            raise ConfigError(f"{name}: expected a table [{name}], got {describe(table)}", name)
        known = [f.name for f in fields(_SECTIONS[name])]
        for key in table:
            if f"{name}.{key}" in _RENAMED:
                new, note = _RENAMED[f"{name}.{key}"]
                raise ConfigError(f"{name}.{key}: no longer a key; did you mean {new} "
                                  f"({note})?", f"{name}.{key}")
            if key not in known:
                raise ConfigError(f"{name}.{key}: unknown key{_suggest(key, known)}",
                                  f"{name}.{key}")
        sections[name] = _SECTIONS[name](**table)
    return Config(**sections, base=base, complete=complete)


def _refuse_renamed(data: Mapping) -> None:
    """Refuse every renamed key of ``data`` in one line: a file written by ``gossipd init``
    before a rename holds them all, and one error per run would take as many runs to fix."""
    old = [f"{name}.{key}" for name, table in data.items() if isinstance(table, Mapping)
           for key in table if f"{name}.{key}" in _RENAMED]
    if len(old) > 1:
        renames = ", ".join(f"{key} -> {_RENAMED[key][0]}" for key in old)
        raise ConfigError(f"{len(old)} keys were renamed (docs/DAEMON.md, Renamed keys): "
                          f"{renames}", old[0])


def _suggest(word: object, known: Sequence[str] | Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(str(word), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else f" (expected one of {', '.join(known)})"


def _overlap(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def parse_override(text: str) -> tuple[str, str, Any]:
    """Split ``section.key=value`` into ``(section, key, value)``.

    The value is read as a TOML value (``3``, ``0.5``, ``true``, ``["a:1", "b:2"]``), and is
    the bare string when it is not one, so that ``task.device=cpu`` needs no quotes. ``key``
    may be dotted to reach into a table: ``task.options.lr=0.01`` gives ``("task",
    "options.lr", 0.01)``.

    Raises:
        ConfigError: ``text`` is not of that form.
    """
    dotted, sep, raw = text.partition("=")
    parts = dotted.strip().split(".")
    if not sep or len(parts) < 2 or not all(BARE_KEY.fullmatch(part) for part in parts):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. task.device=cpu")
    try:
        parsed = tomllib.loads("v = " + raw)
        value = parsed["v"] if parsed.keys() == {"v"} else raw.strip()
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts[0], ".".join(parts[1:]), value


def apply_override(data: dict, text: str) -> str:
    """Set the override's value in the parsed file ``data``; returns its dotted key."""
    section, key, value = parse_override(text)
    *tables, last = [section, *key.split(".")]
    table = data
    for depth, name in enumerate(tables, 1):
        table = table.setdefault(name, {})
        if not isinstance(table, dict):
            dotted = ".".join(tables[:depth])
            raise ConfigError(f"--set {text}: {dotted}: expected a table, got {describe(table)}",
                              dotted)
    table[last] = value
    return f"{section}.{key}"
