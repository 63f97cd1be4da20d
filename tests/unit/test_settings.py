"""The library's settings (gossip.config): every one documented and checked in its one
declaration, the one engine that also declares and checks the daemon's config (arrays, tables,
words), the daemon's config built from the library's declarations, and the NodeConfig presets.
Pure: no trio."""

from __future__ import annotations

import dataclasses
import math

import pytest

from daemon.config import AveragingSection, LimitsSection, TimeoutsSection
from gossip.config import (AveragingConfig, Invalid, Limits, MembershipConfig, NodeConfig,
                           Timeouts, checked, one_of, problem, setting, want)

SETTINGS = (AveragingConfig, MembershipConfig, Timeouts, Limits)
FIELDS = [(cls, f) for cls in SETTINGS for f in dataclasses.fields(cls)]
IDS = [f"{cls.section}.{f.name}" for cls, f in FIELDS]
# A value of another type than each kind of default: what a config file could give by mistake.
WRONG_TYPE = {bool: 1, int: 2.0, float: "1", str: 1}


@pytest.mark.parametrize("cls, f", FIELDS, ids=IDS)
def test_every_setting_has_a_doc_and_a_check(cls: type, f: dataclasses.Field) -> None:
    assert f.metadata["doc"].strip(), f"{cls.section}.{f.name} has no doc"
    # A bool's type is all there is to check; everything else has a range or a set of values.
    assert f.metadata["check"] is not None or type(f.default) is bool, f.name
    assert problem(f, f.default) is None  # the default passes its own check


@pytest.mark.parametrize("cls, f", FIELDS, ids=IDS)
def test_a_value_of_the_wrong_type_is_refused_naming_its_field(cls: type,
                                                               f: dataclasses.Field) -> None:
    kind = f.metadata["kind"] or type(f.default)  # a default that is a word has a kind
    with pytest.raises(ValueError, match=rf"^{cls.section}\.{f.name}: expected "):
        cls(**{f.name: WRONG_TYPE[kind]})


@pytest.mark.parametrize("cls, f", [(c, f) for c, f in FIELDS if type(f.default) is float],
                         ids=[i for (c, f), i in zip(FIELDS, IDS) if type(f.default) is float])
def test_a_float_setting_is_a_number_and_finite_where_its_class_says(
        cls: type, f: dataclasses.Field) -> None:
    for value in (math.nan, math.inf) if cls.finite else (math.nan,):
        with pytest.raises(ValueError, match=rf"^{cls.section}\.{f.name}: expected a finite"):
            cls(**{f.name: value})


def test_an_infinite_time_means_never_where_it_can() -> None:
    assert MembershipConfig(reap_after=math.inf).reap_after == math.inf  # never forget
    assert Timeouts(record=math.inf).record == math.inf  # no deadline
    assert AveragingConfig.finite and Limits.finite  # these have no "never" to mean


@pytest.mark.parametrize("cls, name, value, message", [
    (AveragingConfig, "every", 0, 'expected an integer >= 1 or "auto", got 0'),
    (AveragingConfig, "every", "fast", "expected an integer, \"auto\" or None, got 'fast'"),
    (AveragingConfig, "every", "Auto", "expected an integer, \"auto\" or None, got 'Auto'"),
    (AveragingConfig, "every", 2.5, "expected an integer, \"auto\" or None, got 2.5"),
    (AveragingConfig, "codec", "fp8", "expected fp32, bf16, fp16, int8, mod4, mod4/<F> (F in 2..64) or auto, got 'fp8'"),
    (AveragingConfig, "clip_min_history", 33,
     "expected at most averaging.clip_window (32), got 33"),
    (MembershipConfig, "probe_timeout", 1.0,
     "expected less than membership.probe_interval (1.0), got 1.0"),
    (MembershipConfig, "join_retry_max", 0.5,
     "expected at least membership.join_retry_min (1.0), got 0.5"),
    (MembershipConfig, "indirect_checks", -1, "expected an integer >= 0, got -1"),
    (Timeouts, "connect", 0.0, "expected a number > 0, got 0.0"),
    (Limits, "peer_burst", 0, "expected an integer >= 1, got 0"),
])
def test_a_bad_value_names_its_field(cls: type, name: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        cls(**{name: value})
    assert str(info.value) == f"{cls.section}.{name}: {message}"


def test_every_is_a_count_or_auto() -> None:
    assert AveragingConfig(every="auto").every == "auto"  # gossip.spacing measures it
    assert AveragingConfig(every=7).every == 7
    assert AveragingConfig().every == 1  # the default stays a round every step


def test_none_is_a_value_only_where_it_means_something() -> None:
    assert AveragingConfig(every=None, interval=None).every is None
    with pytest.raises(ValueError, match=r"^averaging\.weight: expected a number, got None"):
        AveragingConfig(weight=None)  # type: ignore[arg-type]


# --- one declaration: the daemon's config takes the library's -------------------------------

def _library_default(section: object, name: str) -> tuple[object, object]:
    """(daemon's default, library's default) of the daemon key ``name``, by what it means."""
    f = {f.name: f for f in dataclasses.fields(section)}[name]  # type: ignore[arg-type]
    if f.metadata["source"] is not None:
        cls, library_name = f.metadata["source"]
        return f.default, getattr(cls(), library_name)
    library = AveragingConfig()
    return {"every": (f.default or None, library.every),
            "interval": (f.default or None, library.interval),
            "mixing": (f.default == "samples", library.by_samples)}[name]


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(AveragingSection)])
def test_the_daemons_averaging_defaults_are_the_librarys(name: str) -> None:
    ours, library = _library_default(AveragingSection, name)
    assert ours == library


@pytest.mark.parametrize("section, cls", [(TimeoutsSection, Timeouts), (LimitsSection, Limits)])
def test_the_daemons_timeouts_and_limits_tables_are_the_librarys(section: type,
                                                                 cls: type) -> None:
    # The same names, in the same order, each key the library's setting with its default.
    names = [f.name for f in dataclasses.fields(cls)]
    assert [f.name for f in dataclasses.fields(section)] == names
    assert section.section == cls.section
    for name in names:
        f = {f.name: f for f in dataclasses.fields(section)}[name]
        assert f.metadata["source"] == (cls, name)
        ours, library = _library_default(section, name)
        assert ours == library


def test_a_shared_key_has_the_librarys_doc_and_check() -> None:
    for section in (AveragingSection, TimeoutsSection, LimitsSection):
        for f in dataclasses.fields(section):
            if f.metadata["source"] is not None:
                cls, name = f.metadata["source"]
                setting = {s.name: s for s in dataclasses.fields(cls)}[name]
                assert f.metadata["doc"].startswith(setting.metadata["doc"]), f.name
                assert f.metadata["check"] is setting.metadata["check"], f.name


def test_only_the_toml_spellings_are_declared_in_the_daemon() -> None:
    own = {f.name for f in dataclasses.fields(AveragingSection) if f.metadata["source"] is None}
    assert own == {"every", "interval", "mixing"}


# --- the engine's kinds beyond the library's: words, arrays and tables ----------------------

@dataclasses.dataclass
class _Program:
    """A program's own settings, declared with the library's engine."""

    interval: float = setting(1.0, "s", want(lambda v: v > 0, "a number > 0"))
    hosts: tuple = setting((), "names", one_of("a", "b"))
    options: dict = setting({}, "free-form")
    mode: object = setting("auto", "on, off or auto", words=("auto",), kind=bool)


def _field(name: str) -> dataclasses.Field:
    return {f.name: f for f in dataclasses.fields(_Program)}[name]


def test_checked_converts_to_the_settings_type() -> None:
    assert type(checked(_field("interval"), 3)) is float
    assert checked(_field("hosts"), ["a", "b"]) == ("a", "b")
    options = {"x": (1, 2), "y": {"z": "w"}}
    copy = checked(_field("options"), options)
    assert copy == {"x": [1, 2], "y": {"z": "w"}} and copy["y"] is not options["y"]
    assert checked(_field("mode"), "auto") == "auto" and checked(_field("mode"), False) is False
    assert _Program().options == {} and _Program().options is not _Program().options


@pytest.mark.parametrize("name, value, where, message", [
    ("interval", 0, "", "expected a number > 0, got 0.0"),  # checked after the conversion
    ("interval", "1", "", "expected a number, got '1'"),
    ("hosts", "a", "", "expected an array of strings, got 'a'"),
    ("hosts", ["a", 2], "[1]", "expected a string, got 2"),
    ("hosts", ["a", "c"], "[1]", "expected a or b, got 'c'"),
    ("options", [1], "", "expected a table, got [1]"),
    ("options", {"a": [1, object()]}, ".a[1]", "expected a TOML value, got <object"),
    ("options", {1: 2}, "", "expected string keys, got 1"),
    ("mode", "Auto", "", "expected a boolean or \"auto\", got 'Auto'"),
])
def test_checked_says_what_is_wrong_and_where(name: str, value: object, where: str,
                                              message: str) -> None:
    with pytest.raises(Invalid) as info:
        checked(_field(name), value)
    assert info.value.where == where and str(info.value).startswith(message)


def test_problem_checks_the_value_as_given() -> None:
    # The library's classes keep what they are given, and say so in its own terms.
    assert problem(_field("interval"), 0) == "expected a number > 0, got 0"
    kept = AveragingConfig(interval=3).interval
    assert kept == 3 and type(kept) is int
    assert problem(_field("hosts"), ["a", "c"]) == "[1]: expected a or b, got 'c'"


def test_checked_writes_a_wrong_value_as_told() -> None:
    with pytest.raises(Invalid, match="^expected a number, got string '1'$"):
        checked(_field("interval"), "1", describe=lambda v: f"string {v!r}")


# --- presets --------------------------------------------------------------------------------

def test_local_differs_from_default_only_in_the_averaging_interval_and_start() -> None:
    default, local = NodeConfig.default(), NodeConfig.local()
    assert dataclasses.replace(local, averaging=default.averaging) == default
    assert dataclasses.replace(local.averaging, interval=default.averaging.interval,
                               start=default.averaging.start) == default.averaging
    assert (local.averaging.interval, local.averaging.start) == (1.0, "own")


def test_wan_uses_memberlists_wan_membership() -> None:
    default, wan = NodeConfig.default(), NodeConfig.wan()
    assert wan.membership == MembershipConfig.wan() != MembershipConfig.lan()
    assert dataclasses.replace(wan, membership=default.membership) == default
    assert MembershipConfig.lan() == MembershipConfig() == default.membership
