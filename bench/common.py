"""What every benchmark script shares: where results go, the table printer, the plots.

Each script in ``bench/`` prints a table (progress goes to stderr), writes its figures to
``bench/results/<name>.json`` and, where a picture helps, ``bench/results/<name>.png``
(the directory is git-ignored), and prints one JSON object with its headline figures as its
last line. Import it from a script run as ``python bench/<script>.py`` (``bench/`` is then
the first entry of ``sys.path``)::

    from common import progress, pyplot, save_figure, save_json, table
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["RESULTS", "machine", "progress", "pyplot", "results_path", "save_figure",
           "save_json", "table"]

RESULTS = Path(__file__).resolve().parent / "results"


def results_path(name: str) -> Path:
    """``bench/results/<name>``, creating the directory."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    return RESULTS / name


def machine() -> dict[str, Any]:
    """What the figures were measured on, stored with them."""
    return {"cpus": os.cpu_count(), "loadavg": round(os.getloadavg()[0], 2),
            "python": platform.python_version(), "platform": platform.platform(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def save_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``data`` (plus :func:`machine`) to ``bench/results/<name>.json``; NaN and
    infinities become null, so that every JSON reader takes the file."""
    path = results_path(f"{name}.json")
    path.write_text(json.dumps({**_finite(data), "machine": machine()}, indent=2) + "\n")
    return path


def save_figure(figure: Any, name: str) -> Path:
    """Save a matplotlib figure to ``bench/results/<name>.png`` and close it."""
    import matplotlib.pyplot as plt

    path = results_path(f"{name}.png")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(message: str) -> None:
    """A progress line on stderr, so that stdout stays the table and the JSON line."""
    print(message, file=sys.stderr, flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned; floats
    with 3 significant digits unless already formatted as strings."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(str(h).ljust(w) if i == 0 else str(h).rjust(w)
                       for i, (h, w) in enumerate(zip(headers, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))) for row in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
