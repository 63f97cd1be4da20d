"""The library's settings (gossip.config): every one documented and checked in its one
declaration, the daemon's config built from them, and the NodeConfig presets. Pure: no trio."""

from __future__ import annotations

import dataclasses
import math

import pytest

from daemon.config import AveragingSection, SwarmSection
from gossip.config import (AveragingConfig, Limits, MembershipConfig, NodeConfig, Timeouts,
                           problem)

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
    with pytest.raises(ValueError, match=rf"^{cls.section}\.{f.name}: expected "):
        cls(**{f.name: WRONG_TYPE[type(f.default)]})


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
    (AveragingConfig, "codec", "fp8", "expected fp32, bf16, fp16 or int8, got 'fp8'"),
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


@pytest.mark.parametrize("name", ["max_connections", "max_handshakes_per_host", "peer_rate",
                                  "peer_burst"])
def test_the_daemons_limits_are_the_librarys(name: str) -> None:
    f = {f.name: f for f in dataclasses.fields(SwarmSection)}[name]
    assert f.metadata["source"] == (Limits, name)
    ours, library = _library_default(SwarmSection, name)
    assert ours == library


def test_a_shared_key_has_the_librarys_doc_and_check() -> None:
    for section in (AveragingSection, SwarmSection):
        for f in dataclasses.fields(section):
            if f.metadata["source"] is not None:
                cls, name = f.metadata["source"]
                setting = {s.name: s for s in dataclasses.fields(cls)}[name]
                assert f.metadata["doc"].startswith(setting.metadata["doc"]), f.name
                assert f.metadata["check"] is setting.metadata["check"], f.name


def test_only_the_toml_spellings_are_declared_in_the_daemon() -> None:
    own = {f.name for f in dataclasses.fields(AveragingSection) if f.metadata["source"] is None}
    assert own == {"every", "interval", "mixing"}


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
