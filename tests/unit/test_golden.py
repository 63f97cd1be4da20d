"""What a user sees stays as it was unless a change means it to: every command's ``--help``,
the rendered default config (every key, its default and its documentation) and the library's
``NodeConfig`` defaults, compared with the files under ``tests/golden/``.

A change that means to alter one of them rewrites the files
(``python -m tests.unit.test_golden``) and says why in its commit message; the diff of the
files is then the list of what a user sees differently.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
COMMANDS = ["init", "join-line", "run", "status", "check-config", "keygen", "rotate-key",
            "retire-key", "average", "export", "demo"]


def _help(args: list[str]) -> str:
    from daemon import cli

    out = io.StringIO()
    with redirect_stdout(out):
        try:
            cli.main([*args, "--help"])
        except SystemExit:  # argparse's end of --help
            pass
    return out.getvalue()


def snapshot() -> dict[str, str]:
    """Each golden file's name and what it should hold now."""
    from daemon.config import from_dict, render
    from gossip.config import NodeConfig

    minimal = {"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "golden"},
               "task": {"entry": "daemon.tasks.digits:task"}}
    texts = {"help.txt": "".join(f"==== gossipd {' '.join(args)} --help\n{_help(args)}\n"
                                 for args in [[]] + [[c] for c in COMMANDS]),
             "config.toml": render(from_dict(minimal, Path("/golden"), "/golden/gossipd.toml")),
             "nodeconfig.txt": repr(NodeConfig()) + "\n"}
    return texts


@pytest.mark.parametrize("name", ["help.txt", "config.toml", "nodeconfig.txt"])
def test_what_a_user_sees_is_as_recorded(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    expected = (GOLDEN / name).read_text()
    assert snapshot()[name] == expected, (
        f"tests/golden/{name} differs: if the change means it, rewrite the files with "
        "`python -m tests.unit.test_golden` and say why in the commit")


if __name__ == "__main__":
    import os

    os.environ["COLUMNS"] = "100"
    for name, text in snapshot().items():
        (GOLDEN / name).write_text(text)
        print(f"wrote tests/golden/{name} ({len(text)} characters)")
