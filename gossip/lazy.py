"""Public namespaces whose names load on first use (PEP 562 ``__getattr__``).

``gossip`` and ``gossip.lowlevel`` each list their names in a table, module to names, and
import a module only when one of its names is first asked for: most of the API needs torch,
whose import takes seconds, and ``gossipd status`` must answer in milliseconds. A name that
moved from one namespace to another still loads from the old one, with a
``DeprecationWarning`` naming the new place.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["namespace"]


def namespace(package: str, api: Mapping[str, tuple[str, ...]], *,
              moved: Mapping[str, str] | None = None,
              ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """The ``__getattr__``, ``__dir__`` and ``__all__`` of a lazy namespace.

    Args:
        package: the namespace's module name (its ``__name__``).
        api: module of the ``gossip`` package (``"node"``) -> the public names it gives.
        moved: old public name -> the namespace that now has it (``"gossip.lowlevel"``).

    Returns:
        ``(__getattr__, __dir__, __all__)`` to assign in the namespace's module. A loaded
        name is stored in the module, so the next lookup does not come back here.
    """
    home = {name: module for module, names in api.items() for name in names}
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        module = home.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"gossip.{module}"), name)
            setattr(importlib.import_module(package), name, value)
            return value
        if name in moved:
            warnings.warn(f"{package}.{name} has moved to {moved[name]}.{name}",
                          DeprecationWarning, stacklevel=2)
            return getattr(importlib.import_module(moved[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *home})

    return __getattr__, __dir__, sorted(home)
