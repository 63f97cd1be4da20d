"""A node's settings: one tree of frozen dataclasses, each field declared once.

:class:`NodeConfig` is everything :func:`gossip.open_swarm` needs to know that is not an
object: where to listen, whom to join, whom to trust, and the averaging, membership, timeout
and limit settings. Presets are made with :func:`dataclasses.replace` from the defaults, as
memberlist does: :meth:`NodeConfig.default`, :meth:`NodeConfig.local` (one machine or a
simulated network) and :meth:`NodeConfig.wan` (nodes across the internet).

Theory of operation
-------------------
Each field of :class:`AveragingConfig`, :class:`MembershipConfig`, :class:`Timeouts` and
:class:`Limits` is declared once, with ``setting(default, doc, check)``. That declaration is
the field's documentation (``doc``, with its unit), its type (the type of the default: an int
is accepted where a float is expected; a bool never where a number is; a float must be
finite; ``optional`` adds None and ``words`` strings such as ``"auto"``) and its range
(``check``, which returns the problem as text, or None). Validation runs in
``__post_init__``, so a bad value is a :class:`ValueError` however the object is built, and
the message names the field: ``averaging.every: expected an integer >= 1 or "auto", got 0``.
Relations between fields (``clip_min_history <= clip_window``) are checked after that, in the
class itself.

The same engine declares and validates a program's own settings: the daemon's TOML sections
(``daemon/config.py``) are declared with :func:`setting` too, so there is one set of type
rules and one wording of the errors. A program's setting may also be an array of strings (a
tuple default; ``check`` applies to each item, and the error points at it: ``[1]``) or a
free-form table of plain values (a dict default). :func:`checked` gives a value in the
setting's type (an int where a float is expected becomes a float) or raises :class:`Invalid`;
:func:`problem`, which the classes here use, only says what is wrong, so that a library
setting keeps the value it was given. A program's key that *is* a library setting is declared
with :func:`setting_of`, which takes the default, doc and check of the one declaration here,
and :func:`arguments_for` hands such keys' values back by the library's names, so a default,
a doc or a range lives in one place. This module is pure: it imports nothing that imports
trio, torch or socket, so that every other module can import it.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import re
import reprlib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from .linkrate import MIN_RATE, STALL

__all__ = [
    "NodeConfig", "AveragingConfig", "MembershipConfig", "Timeouts", "Limits", "CODECS",
    "DEFAULT_LEAK", "Check", "setting", "setting_of", "arguments_for", "Invalid", "checked",
    "problem", "want", "one_of", "POSITIVE", "NON_NEGATIVE", "COUNT", "AT_LEAST_1",
]

# Every wire codec of exchanged states: fp32 (exact), bf16 and fp16 element-wise, int8 in
# blocks (gossip.int8). gossip.tensors checks its encoders against this list.
CODECS: tuple[str, ...] = ("fp32", "bf16", "fp16", "int8")
# The mod codecs below 8 bits (gossip.lowbit) as a setting: mod4, 4 bits a value, or
# mod4/<F>, one F-th of the blocks per exchange (the node names the fragment in its offer).
# mod3 and mod2 decode, but are no settings: with periods of 2 x MARGIN (8) times the spread
# last seen, their rounding (a whole spread and more) is as large as the differences it codes,
# and the spread each exchange then measures never shrinks: swarms drifted apart in tests.
MOD_SETTING = re.compile(r"mod(4)(?:/([1-9][0-9]?))?")
# averaging.codec = "auto": the first of these whose exchange fits codec_steps of our steps
# at the peer's measured rate (the last one if none does).
AUTO_CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "mod4", "mod4/2", "mod4/4", "mod4/8",
                                "mod4/16")


def codec_setting(value: object) -> bool:
    """Whether ``value`` is a valid ``averaging.codec``."""
    if value in CODECS or value == "auto":
        return True
    match = MOD_SETTING.fullmatch(value) if isinstance(value, str) else None
    return match is not None and (match[2] is None or 2 <= int(match[2]) <= 64)
# The spacing from which the outer step is taken once a round, with ROUND_PEERS exchanges a
# round, when those settings are "auto" (gossip.plan: the measurements behind them).
LARGE_SPACING = 20
ROUND_PEERS = 3
DEFAULT_LEAK = 0.01  # λ: the fraction of the correction that fades at each committed exchange


# --- checks: each takes a value of the field's type and returns a problem, or None ----------

Check = Callable[[Any], "str | None"]


def want(ok: Callable[[Any], bool], expected: str) -> Check:
    """A check that ``ok(value)`` holds; its problem says what was ``expected``."""
    return lambda value: None if ok(value) else f"expected {expected}, got {reprlib.repr(value)}"


def one_of(*choices: str) -> Check:
    return want(lambda value: value in choices, ", ".join(choices[:-1]) + " or " + choices[-1])


POSITIVE = want(lambda v: v > 0, "a number > 0")
NON_NEGATIVE = want(lambda v: v >= 0, "a number >= 0")
COUNT = want(lambda v: v >= 0, "an integer >= 0")
AT_LEAST_1 = want(lambda v: v >= 1, "an integer >= 1")


# --- declaring a setting ----------------------------------------------------------------------

def setting(default: Any, doc: str, check: Check | None = None, *, optional: bool = False,
            words: tuple[str, ...] = (), kind: type | None = None,
            source: tuple[type, str] | None = None) -> Any:
    """A settings field: ``doc`` (with its unit) is the only description the field has.

    Args:
        default: the value when none is given; its type is the field's type. A tuple is an
            array of strings (``check`` applies to each item); a dict (only ``{}``: each object
            gets its own) is a free-form table of plain values.
        doc: what the field means, with its unit.
        check: the field's range or choices (each takes a value of the field's type).
        optional: None is a value too.
        words: strings it takes besides values of its type, such as ``"auto"``.
        kind: the field's type when the default is one of the ``words``.
        source: the setting this field gives its value to, as (class, field name), where a
            program declares one of the library's settings again (:func:`setting_of`).

    Neither None nor a word goes through ``check``.
    """
    metadata = {"doc": doc, "check": check, "optional": optional, "words": words, "kind": kind,
                "source": source}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def setting_of(cls: type, name: str, *, see: str = "") -> Any:
    """A settings field that is ``cls``'s setting ``name``, with its default, doc and check:
    one declaration for both. ``see`` points at more documentation, after the doc."""
    declared = {f.name: f for f in fields(cls)}[name]
    doc = declared.metadata["doc"] + (f"; see {see}" if see else "")
    meta = declared.metadata
    return setting(declared.default, doc, meta["check"], optional=meta["optional"],
                   words=meta["words"], kind=meta["kind"], source=(cls, name))


def arguments_for(cls: type, settings: Any) -> dict[str, Any]:
    """The values of ``settings``' fields declared :func:`setting_of` ``cls``, by ``cls``'s
    names: keyword arguments of ``cls``."""
    return {f.metadata["source"][1]: getattr(settings, f.name) for f in fields(settings)
            if f.metadata["source"] and f.metadata["source"][0] is cls}


# --- validating a value -----------------------------------------------------------------------

class Invalid(ValueError):
    """What is wrong with a value for a setting. ``where`` locates the problem inside the value:
    ``"[1]"`` (an array's second item), ``".a[2]"`` (in a table), or "" (the value itself)."""

    def __init__(self, problem: str, where: str = "") -> None:
        super().__init__(problem)
        self.where = where


_KINDS = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
          tuple: "an array of strings", dict: "a table"}
# What a table may hold, besides tables and arrays: TOML's values (a bool is an int, a datetime
# a date).
_PLAIN = (str, int, float, datetime.date, datetime.time)


def checked(f: dataclasses.Field, value: Any, *, finite: bool = True,
            describe: Callable[[Any], str] = reprlib.repr) -> Any:
    """``value`` for the setting ``f``, in the setting's type: an int becomes a float where
    the default is one, an array a tuple of plain strings, a table a copy made of plain dicts
    and lists. ``finite``: an infinite float is wrong too (NaN always is). ``describe`` writes
    a wrong value in the problem.

    Raises:
        Invalid: the value is not of the setting's type, or fails its check.
    """
    return _examine(f, value, finite, describe, convert=True)


def problem(f: dataclasses.Field, value: Any, *, finite: bool = True) -> str | None:
    """What is wrong with ``value``, as given, for the setting ``f``, or None (as
    :func:`checked`, which also converts it)."""
    try:
        _examine(f, value, finite, reprlib.repr, convert=False)
    except Invalid as exc:
        return f"{exc.where}: {exc}" if exc.where else str(exc)
    return None


def _examine(f: dataclasses.Field, value: Any, finite: bool, describe: Callable[[Any], str], *,
             convert: bool) -> Any:
    optional, words = f.metadata["optional"], f.metadata["words"]
    if value is None and optional:
        return None
    if isinstance(value, str) and value in words:
        return str(value)
    kind = f.metadata.get("kind") or (dict if f.default is MISSING else type(f.default))
    if not _is_a(kind, value):
        *others, last = [_KINDS[kind], *(f'"{word}"' for word in words),
                         *(["None"] if optional else [])]
        expected = f"{', '.join(others)} or {last}" if others else last
        raise Invalid(f"expected {expected}, got {describe(value)}")
    if kind is float and (math.isnan(value) or finite and math.isinf(value)):
        raise Invalid(f"expected a finite number, got {value!r}")
    if kind is tuple:
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise Invalid(f"expected a string, got {describe(item)}", f"[{i}]")
    if convert:  # str(): a plain str for a subclass such as PeerId
        value = (tuple(str(item) for item in value) if kind is tuple
                 else _plain(value, "", describe) if kind is dict else kind(value))
    check = f.metadata["check"] or (lambda item: None)
    # An array's check applies to each item, and the problem points at the item.
    for where, item in ([(f"[{i}]", item) for i, item in enumerate(value)] if kind is tuple
                        else [("", value)]):
        wrong = check(item)
        if wrong:
            raise Invalid(wrong, where)
    return value


def _is_a(kind: type, value: Any) -> bool:
    """Whether ``value`` is of the setting type ``kind``: an int is a number, a bool is not;
    a list is an array, any mapping a table."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {bool: isinstance(value, bool), int: number and isinstance(value, int),
            float: number, tuple: isinstance(value, (list, tuple)),
            dict: isinstance(value, Mapping)}.get(kind, isinstance(value, kind))


def _plain(value: Any, where: str, describe: Callable[[Any], str]) -> Any:
    """A copy of a free-form table made of plain dicts and lists: only what TOML can hold."""
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise Invalid(f"expected string keys, got {describe(key)}", where)
        return {key: _plain(item, f"{where}.{key}", describe) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]", describe) for i, item in enumerate(value)]
    if isinstance(value, _PLAIN):
        return value
    raise Invalid(f"expected a TOML value, got {describe(value)}", where)


class _Settings:
    """Validation shared by the settings classes. ``section`` names them in errors, and
    ``finite`` says whether an infinite time is refused: plain class attributes (they have no
    annotation), not fields."""

    section = ""
    finite = True

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            wrong = problem(f, getattr(self, f.name), finite=self.finite)
            if wrong:
                raise self.refuse(f.name, wrong)

    def refuse(self, name: str, wrong: str) -> ValueError:
        return ValueError(f"{self.section}.{name}: {wrong}")


@dataclass(frozen=True)
class AveragingConfig(_Settings):
    """How a node averages (:mod:`gossip.averaging`)."""

    section = "averaging"
    every: int | str | None = setting(1, "local steps between the rounds we start (x U(0.75, "
                                      "1.25)); a round on a slow link is followed at once by the "
                                      "next; \"auto\": ceil(2 x exchange time / step time), "
                                      "measured, 1 until it is; None: by interval only",
                                      want(lambda v: v >= 1, 'an integer >= 1 or "auto"'),
                                      optional=True, words=("auto",))
    interval: float | None = setting(10.0, "s after our last round ends (x U(0.75, 1.25)) before "
                                     "we start another anyway, for a node that steps slower "
                                     "than every or not at all; None: by steps only (both None: "
                                     "only average_now())", POSITIVE, optional=True)
    weight: float = setting(0.5, "fixed mixing's weight, in (0, 1]; 0.5 keeps the swarm's mean",
                            want(lambda v: 0 < v <= 1, "a number in (0, 1]"))
    by_samples: bool = setting(False, "push-sum: weigh both sides by the samples they trained "
                               "on; False: fixed mixing, own += weight * (peer - own)")
    codec: str = setting("fp32", "wire format of the states we offer: fp32 (exact, 4 bytes a "
                         "parameter), bf16 or fp16 (2), int8 (~1.06: blocks of 64 values "
                         "against one scale), mod4 (4.25 bits: "
                         "coded against the receiver's own state), mod4/<F> (one F-th of "
                         "the blocks per exchange, F in 2..64: mod4/8 is 1/60 of fp32), or "
                         "\"auto\": per peer, the first of fp32, bf16, int8, mod4, mod4/2, "
                         "/4, /8, /16 whose exchange fits codec_steps of our training steps at "
                         "the link's measured rate. We take offers in any of them",
                         want(codec_setting, "fp32, bf16, fp16, int8, mod4, "
                              "mod4/<F> (F in 2..64) or auto"))
    wide_codec: str = setting("int8", "the codec of our offers at wide spacing (from "
                              f"{LARGE_SPACING} steps between rounds) where codec is fp32: int8 "
                              "(1/3.8 of the bytes, so that a round's exchanges fit the link "
                              "one fp32 exchange did), or fp32, bf16, fp16 (gossip.plan)",
                              one_of("int8", "fp32", "bf16", "fp16"))
    codec_steps: float = setting(20.0, "with codec = \"auto\": the training steps an exchange "
                                 "may take, at the link's measured rate (> 0)", POSITIVE)
    correction: bool = setting(True, "keep a drift correction (added to the gradients; its "
                               "estimate travels with the weights): what keeps nodes on skewed "
                               "data from drifting apart. Costs two model-sized buffers on the "
                               "device, doubles the host's exchange buffers and the bytes of "
                               f"an exchange. From {LARGE_SPACING} steps between rounds the "
                               "estimates stay home (gossip.plan): measured there, the "
                               "correction cost more than it corrected")
    leak: float = setting(DEFAULT_LEAK, "fraction of the drift correction that fades at each "
                          "exchange, so that departures leave no lasting bias; in [0, 1)",
                          want(lambda v: 0 <= v < 1, "a number in [0, 1)"))
    outer: bool = setting(True, "apply each committed exchange through an outer optimizer "
                          "with Nesterov momentum (the progress since the last exchange and the "
                          "move towards the peer are one pseudo-gradient, as in DiLoCo and "
                          "NoLoCo) and measure the drift correction per exchange; False: plain "
                          "averaging, own += weight * (peer - own). Costs two model-sized "
                          "buffers on the host")
    outer_lr: float = setting(0.7, "the outer step's learning rate, in (0, 2]; 1 with momentum "
                              "0 is plain averaging",
                              want(lambda v: 0 < v <= 2, "a number in (0, 2]"))
    outer_momentum: float | str = setting("auto", "the outer step's Nesterov momentum, in "
                                          "[0, 1); \"auto\": 0.5 taken at every exchange, "
                                          "0.9 taken once a round (gossip.plan)",
                                          want(lambda v: 0 <= v < 1, 'a number in [0, 1) or '
                                               '"auto"'), words=("auto",), kind=float)
    outer_cadence: str = setting("auto", "when the outer step is taken: exchange (at each "
                                 "committed exchange, either side), round (once a round of "
                                 "ours, on all that moved us since the last: DiLoCo's "
                                 "cadence), or auto: by exchange below "
                                 f"{LARGE_SPACING} steps between rounds, by round from there",
                                 one_of("auto", "exchange", "round"))
    peers: int | str = setting("auto", "exchanges a round of ours makes, each with another "
                               "peer (>= 1); \"auto\": 1 below "
                               f"{LARGE_SPACING} steps between rounds, {ROUND_PEERS} from "
                               "there", AT_LEAST_1, words=("auto",), kind=int)
    attempts: int = setting(3, "peers tried per round when they are busy or fail (>= 1)",
                            AT_LEAST_1)
    backoff: float = setting(0.2, "s; mean pause before trying the next peer (x U(0.5, 1.5)) "
                             "(> 0)", POSITIVE)
    clip: float = setting(5.0, "clip a step to clip x the median distance of our recent rounds "
                          "(>= 0); 0: off", NON_NEGATIVE)
    clip_window: int = setting(32, "exchanges we initiated that the clip's median looks back on "
                               "(>= 1)", AT_LEAST_1)
    clip_min_history: int = setting(8, "no clipping until this many are known (>= 1, at most "
                                    "clip_window)", AT_LEAST_1)
    max_norm_ratio: float = setting(100.0, "refuse a state farther from ours than this x our "
                                    "norm (> 0)", POSITIVE)
    strikes: int = setting(3, "refused payloads in a row that quarantine a peer (>= 1)",
                           AT_LEAST_1)
    quarantine: float = setting(600.0, "s a quarantined peer is left alone (>= 0)",
                                NON_NEGATIVE)
    trust_after: float = setting(10.0, "s a peer must have been an alive member, proved to us "
                                 "on a channel, before its offers move our model (unless we "
                                 "picked it before); until then they commit but move it by "
                                 "nothing. A peer that joined after us moves us by a share of "
                                 "the weight that grows to all of it over this time. 0 trusts "
                                 "every key holder at once, and lifts the budget of members' "
                                 "offers per address (>= 0)", NON_NEGATIVE)
    offer_timeout: float = setting(5.0, "s from sending an offer to its answer (> 0)", POSITIVE)
    transfer_timeout: float = setting(10.0, "s for both payloads, plus encoded bytes at the "
                                      "peer link's measured rate / 4, or at min_rate if that "
                                      "is slower or unknown (> 0)", POSITIVE)
    min_rate: float = setting(MIN_RATE, "bytes/s of the slowest link every payload is given "
                              "time for (> 0): exchanges and downloads (50 kB/s = 400 kbit/s: "
                              "100 MB in 2,000 s)", POSITIVE)
    commit_timeout: float = setting(5.0, "s for the peer's commit, past the transfer deadline "
                                    "(> 0)", POSITIVE)
    stall_timeout: float = setting(STALL, "s a payload (exchange or download) may go without a "
                                   "byte before its peer is dropped (> 0)", POSITIVE)
    start: str = setting("auto", "first weights: auto (download if a ready peer exists, else "
                         "own), own or download", one_of("auto", "own", "download"))
    download_wait: float = setting(5.0, "s; with start = auto, how long to look for a ready "
                                   "peer after joining (>= 0)", NON_NEGATIVE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_min_history > self.clip_window:
            raise self.refuse("clip_min_history", f"expected at most averaging.clip_window "
                              f"({self.clip_window}), got {self.clip_min_history}")

    @property
    def outer_setting(self) -> tuple[float, float | None] | None:
        """The outer step's (lr, momentum) for :class:`~gossip.replica.Replica` (momentum None:
        "auto", by the spacing: :mod:`gossip.plan`); None: off."""
        if not self.outer:
            return None
        return self.outer_lr, None if self.outer_momentum == "auto" else self.outer_momentum

    def transfer_deadline(self, nbytes: int) -> float:
        """The deadline for both payloads of ``nbytes`` each over a link never measured (at
        ``min_rate``): the longest any transfer is given (as
        :meth:`gossip.exchange.Deadlines.transfer_for`)."""
        return self.transfer_timeout + nbytes / self.min_rate


@dataclass(frozen=True)
class MembershipConfig(_Settings):
    """Membership timing. The defaults are memberlist's LAN profile; :meth:`wan` is its WAN
    profile. N below is the number of members believed alive, this node included."""

    section = "membership"
    finite = False  # an infinite time means never (reap_after: never forget a member)
    probe_interval: float = setting(1.0, "s; one probe per period, times (local health score "
                                    "+ 1)", POSITIVE)
    probe_timeout: float = setting(0.5, "s; wait for a direct Ack before asking helpers; same "
                                   "scaling (shorter than probe_interval)", POSITIVE)
    indirect_checks: int = setting(3, "helpers asked to probe a silent member for us", COUNT)
    suspicion_mult: float = setting(4.0, "min suspicion timeout = mult * max(1, log10 N) * "
                                    "probe_interval", POSITIVE)
    suspicion_max_mult: float = setting(6.0, "max suspicion timeout = this * min (Lifeguard)",
                                        want(lambda v: v >= 1, "a number >= 1"))
    retransmit_mult: int = setting(4, "each update is sent mult * ceil(log10(N + 1)) times",
                                   COUNT)
    awareness_max: int = setting(8, "local health score cap: timeouts stretch at most (max + 1) "
                                 "times", COUNT)
    gossip_interval: float = setting(0.2, "s between gossip rounds while updates are queued",
                                     POSITIVE)
    gossip_nodes: int = setting(3, "members each gossip round sends to", COUNT)
    gossip_to_the_dead: float = setting(30.0, "s after its death a member still receives "
                                        "gossip", NON_NEGATIVE)
    push_pull_interval: float = setting(30.0, "s; times ceil(log2(N / 32)) + 1 above 32 "
                                        "members", POSITIVE)
    reconnect_interval: float = setting(10.0, "s between push-pulls with a random dead member",
                                        POSITIVE)
    reap_after: float = setting(3600.0, "s a dead or departed member is remembered, then "
                                "forgotten", POSITIVE)
    meta_interval: float = setting(30.0, "s; a changed training step is re-announced at most "
                                   "this often", POSITIVE)
    join_retry_min: float = setting(1.0, "s; first wait after no bootstrap address answered",
                                    POSITIVE)
    join_retry_max: float = setting(30.0, "s; the wait doubles up to this (>= join_retry_min)",
                                    POSITIVE)
    push_pull_timeout: float = setting(10.0, "s; a whole push-pull exchange, dial to last page",
                                       POSITIVE)
    leave_timeout: float = setting(2.0, "s a leaving node keeps gossiping its departure",
                                   NON_NEGATIVE)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.probe_timeout >= self.probe_interval:
            raise self.refuse("probe_timeout", f"expected less than membership.probe_interval "
                              f"({self.probe_interval}), got {self.probe_timeout}")
        if self.join_retry_max < self.join_retry_min:
            raise self.refuse("join_retry_max", f"expected at least membership.join_retry_min "
                              f"({self.join_retry_min}), got {self.join_retry_max}")

    @classmethod
    def lan(cls) -> MembershipConfig:
        """memberlist's LAN profile (the default): fast detection on a low-latency network."""
        return cls()

    @classmethod
    def wan(cls) -> MembershipConfig:
        """memberlist's WAN profile: slower, more patient, for nodes across the internet."""
        return cls(
            probe_interval=5.0, probe_timeout=3.0, suspicion_mult=6.0, gossip_interval=0.5,
            gossip_nodes=4, gossip_to_the_dead=60.0, push_pull_interval=60.0,
            reconnect_interval=30.0, push_pull_timeout=30.0, leave_timeout=5.0,
        )


@dataclass(frozen=True)
class Timeouts(_Settings):
    """Deadlines, in seconds, one per phase of a channel (:mod:`gossip.channel`).

    These are the only timeouts the library takes as arguments (everywhere else the caller
    wraps its awaits in :func:`~gossip.groups.phase_deadline`): ``connect`` and ``serve``
    compose two phases, and the record deadline is a property of the connection that guards
    every read, whoever the caller is. A 1 MiB record must cross the link within ``record``
    seconds: the default gives it 35 kB/s, below the slowest link a transfer is given time for
    (:data:`gossip.linkrate.MIN_RATE`, 50 kB/s), so on a thin link a payload's own deadline,
    which follows the link, decides first. Below about 35 kB/s (280 kbit/s) raise both.
    A peer that stops sending mid-payload is dropped by the stall deadline
    (:meth:`gossip.channel.SecureChannel.stall_guard`), long before this one.
    """

    section = "timeouts"
    finite = False  # an infinite deadline is no deadline
    connect: float = setting(5.0, "s to open a TCP connection (> 0)", POSITIVE)
    handshake: float = setting(5.0, "s for the whole handshake (> 0)", POSITIVE)
    record: float = setting(30.0, "s from a record's first byte to its last (> 0); 30 lets a "
                            "1 MiB record cross at 35 kB/s: keep it above 1 MiB / min_rate",
                            POSITIVE)


@dataclass(frozen=True)
class Limits(_Settings):
    """A node's limits on inbound work (:mod:`gossip.limits`, whose docstring says why)."""

    section = "limits"
    max_connections: int = setting(256, "inbound connections open at once, handshakes included "
                                   "(>= 1); more are closed unread", AT_LEAST_1)
    max_handshakes_per_host: int = setting(8, "connections from one IP address that have not "
                                           "proved the swarm key yet, at once (>= 1); one more "
                                           "closes the oldest", AT_LEAST_1)
    host_rate: float = setting(50.0, "inbound connections per second one IP address may open "
                               "on average (> 0), counted at accept: more are closed unread, "
                               "before any cryptography", POSITIVE)
    host_burst: int = setting(100, "inbound connections one IP address may open at once (>= 1)",
                              AT_LEAST_1)
    peer_rate: float = setting(10.0, "inbound channels per second one peer may open on average "
                               "(> 0); more are closed unread", POSITIVE)
    peer_burst: int = setting(20, "inbound channels one peer may open at once (>= 1)",
                              AT_LEAST_1)


@dataclass(frozen=True)
class NodeConfig:
    """How one node joins a swarm and behaves in it.

    Attributes:
        listen: ``host:port`` for datagrams and channels (port 0 picks one).
        advertise: the address others should dial, when not ``listen`` (say, behind NAT).
        bootstrap: some members' addresses; empty starts a new swarm.
        allow: the peer ids this node exchanges weights with (offers, downloads, both ways);
            None: any holder of the swarm key. Membership itself is open to every key holder.
        reachable: whether other members can dial ``advertise`` (or ``listen``). False, behind
            a NAT or a firewall: the node initiates every exchange and download itself and is
            never chosen by others. None: find out after joining, with a dial-back check
            (:mod:`gossip.reachability`).
        averaging: how and how often the node averages (:class:`AveragingConfig`).
        membership: failure detection and gossip timing (:class:`MembershipConfig`).
        timeouts: the channel's per-phase deadlines (:class:`Timeouts`).
        limits: inbound connections open at once, and how often one peer may open one
            (:class:`Limits`).
    """

    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    bootstrap: tuple[str, ...] = ()
    allow: frozenset[str] | None = None
    reachable: bool | None = True
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        if isinstance(self.bootstrap, str):
            raise ValueError(f"bootstrap must be a sequence of addresses, not the string "
                             f"{self.bootstrap!r}")
        object.__setattr__(self, "bootstrap", tuple(self.bootstrap))
        if self.allow is not None:
            object.__setattr__(self, "allow", frozenset(self.allow))
        if self.reachable not in (True, False, None):
            raise ValueError(f"reachable must be True, False or None, not {self.reachable!r}")
        for name, cls in (("averaging", AveragingConfig), ("membership", MembershipConfig),
                          ("timeouts", Timeouts), ("limits", Limits)):
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"{name} must be a {cls.__name__}, not "
                                 f"{getattr(self, name)!r}")

    @classmethod
    def default(cls) -> NodeConfig:
        """The defaults: a LAN's membership timing, a round every step or every 10 s idle."""
        return cls()

    @classmethod
    def local(cls) -> NodeConfig:
        """For nodes on one machine or a simulated network (:mod:`gossip.testing`): every
        node starts from its own model, and an idle node averages every second."""
        base = cls.default()
        return dataclasses.replace(
            base, averaging=dataclasses.replace(base.averaging, interval=1.0, start="own"))

    @classmethod
    def wan(cls) -> NodeConfig:
        """For nodes across the internet: memberlist's patient WAN membership timing."""
        return dataclasses.replace(cls.default(), membership=MembershipConfig.wan())
