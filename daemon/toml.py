"""The config file's TOML: writing a config back as text, and naming TOML's types in errors.

Theory of operation
-------------------
Python reads TOML (``tomllib``) but does not write it, and the daemon writes it: ``gossipd
init`` (the new node's file), ``gossipd check-config`` (every key with its value), and the
demo, test and bench harnesses (a file per node). :func:`render` writes every section
of a :class:`daemon.config.Config` as a table, each key preceded by its documentation as a
comment, so the text is also the reference of every setting. The writer is small because the
values are few in kind: booleans, numbers, strings, arrays of strings, and one free-form
table (``[task.options]``), which is written after its section's plain keys (TOML's rule) with
its nested tables inline. Loading the text back gives an equal config; the tests round-trip
arbitrary names and options to hold that.

:func:`describe` names a value by its TOML type (``string 'fast'``, ``float 2.5``), so that
an error about a file speaks the file's language.
"""

from __future__ import annotations

import datetime
import re
import reprlib
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config

__all__ = ["BARE_KEY", "describe", "render"]

BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a key TOML takes without quotes
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
            "\r": "\\r"}
_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
          tuple: "array", dict: "table"}


def describe(value: Any) -> str:
    """``value`` as an error shows it: its TOML type, then a short repr (``float 2.5``)."""
    return f"{_TYPES.get(type(value), type(value).__name__)} {reprlib.repr(value)}"


def render(config: Config) -> str:
    """The whole config as TOML, every field preceded by its documentation. Loading the text
    back (from a file in ``config.base``) gives an equal config."""
    lines = ["# gossipd configuration. Every key is listed with its value; absent keys take the",
             "# default. Relative paths start from node.data_dir, which starts from this file's",
             "# directory. Override a key when starting: gossipd run --set section.key=value"]
    for section in (getattr(config, f.name) for f in fields(config)):
        if is_dataclass(section):  # not base, which is no key
            lines += _table(section)
    return "\n".join(lines) + "\n"


def _table(section: Any) -> list[str]:
    """The lines of one section: its doc, its plain keys, then its free-form tables."""
    name = section.section
    lines = ["", f"# {type(section).__doc__}", f"[{name}]"]
    tables = []
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, dict):  # must follow the section's plain keys
            tables.append((f, value))
            continue
        lines += [f"# {f.metadata['doc']}", f"{f.name} = {_toml(value)}"]
    for f, table in tables:
        lines += ["", f"# {f.metadata['doc']}", f"[{name}.{f.name}]"]
        lines += [f"{_toml_key(key)} = {_toml(value)}" for key, value in table.items()]
    return lines


def _toml(value: Any) -> str:
    """One TOML value on one line; nested tables are written inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # float reprs (1e+16, inf, nan, 1e-05) are TOML floats too
    if isinstance(value, str):
        return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f"
                                                 else c) for c in value) + '"'
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_key(key: str) -> str:
    return key if BARE_KEY.fullmatch(key) else _toml(key)
