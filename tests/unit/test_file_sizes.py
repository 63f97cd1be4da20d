"""No module of the library or the program passes 600 lines (docs/STYLE.md, rule 1): past that
a file is two concepts, and it is split where they meet rather than left to grow."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST = 600


def test_no_module_passes_600_lines() -> None:
    sizes = {str(path.relative_to(ROOT)): len(path.read_text().splitlines())
             for package in ("gossip", "daemon") for path in (ROOT / package).rglob("*.py")}
    assert sizes, "no modules found"
    over = {name: lines for name, lines in sorted(sizes.items()) if lines > MOST}
    assert not over, f"over {MOST} lines: {over}"
