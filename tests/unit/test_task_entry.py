"""``task.entry``: every form a user writes, resolved as DAEMON.md documents (a relative file
path from ``node.data_dir``, never from the current directory; a module from the Python
path), and errors that name the path tried."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from daemon.cli import main
from daemon.config import ConfigError, TaskSection, from_dict, render
from daemon.keys import write_swarm_key
from daemon.task import TaskError, entry_file, load_entry, parse_entry


def task_file(path: Path, value: str) -> Path:
    """A task file whose ``task()`` returns ``value``: tells which file was loaded."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"def task(ctx=None):\n    return {value!r}\n")
    return path


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``tmp_path/node`` is the data directory; the current directory is elsewhere and holds
    decoys of the same names, so that a lookup from it would load the wrong file."""
    data_dir = tmp_path / "node"
    elsewhere = tmp_path / "cwd"
    for name in ("x.py", "sub/x.py"):
        task_file(data_dir / name, f"node/{name}")
        task_file(elsewhere / name, "cwd")
    task_file(tmp_path / "x.py", "parent")
    monkeypatch.chdir(elsewhere)
    return data_dir


@pytest.mark.parametrize("entry, loaded", [
    ("x.py:task", "node/x.py"),
    ("./x.py:task", "node/x.py"),
    ("sub/x.py:task", "node/sub/x.py"),
    ("./sub/x.py:task", "node/sub/x.py"),
    ("../x.py:task", "parent"),
])
def test_a_relative_task_file_starts_from_the_data_dir(layout: Path, entry: str,
                                                       loaded: str) -> None:
    assert load_entry(entry, layout)() == loaded


def test_an_absolute_task_file_ignores_the_data_dir(layout: Path, tmp_path: Path) -> None:
    path = task_file(tmp_path / "abs" / "mine.py", "absolute")
    assert load_entry(f"{path}:task", layout)() == "absolute"
    assert entry_file(f"{path}:task", layout) == path


def test_a_module_comes_from_the_python_path(layout: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "lib" / "entry_test_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    task_file(package / "tasks.py", "module")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    monkeypatch.delitem(sys.modules, "entry_test_pkg", raising=False)
    assert load_entry("entry_test_pkg.tasks:task", layout)() == "module"
    assert entry_file("entry_test_pkg.tasks:task", layout) is None


def test_a_missing_task_file_names_the_path_tried(layout: Path) -> None:
    with pytest.raises(TaskError) as caught:
        load_entry("tasks/nope.py:task", layout)
    message = str(caught.value)
    assert f"task file {layout / 'tasks' / 'nope.py'} does not exist" in message
    assert f"node.data_dir, {layout}" in message


def test_a_missing_parent_relative_file_names_the_normalized_path(layout: Path) -> None:
    with pytest.raises(TaskError, match=f"task file {layout.parent / 'nope.py'} does not"):
        load_entry("../nope.py:task", layout)


def test_a_directory_is_not_a_task_file(layout: Path) -> None:
    (layout / "dir.py").mkdir()
    with pytest.raises(TaskError, match=f"task file {layout / 'dir.py'} is not a file"):
        load_entry("dir.py:task", layout)


def test_a_missing_function_names_the_file(layout: Path) -> None:
    with pytest.raises(TaskError, match=f"task file {layout / 'x.py'} has no function 'other'"):
        load_entry("x.py:other", layout)


def test_a_module_that_is_not_there_hints_at_the_file_form(layout: Path) -> None:
    with pytest.raises(TaskError, match=r"no_such_module_xyz.*a file\? write it as "):
        load_entry("no_such_module_xyz:task", layout)


@pytest.mark.parametrize("entry", ["x.py:task", "./x.py:task", "../x.py:task", "sub/x.py:task",
                                   "/srv/x.py:task", "package.module:task", "module:task"])
def test_every_form_is_a_valid_entry(entry: str) -> None:
    assert TaskSection(entry=entry).entry == entry
    assert parse_entry(entry)[1] == "task"


@pytest.mark.parametrize("entry, fragment", [
    (".module:task", "'module:function'"),
    ("package..module:task", "'module:function'"),
    ("sub/x:task", "a task file ends in .py"),
    ("x.py:", "'module:function'"),
    ("x.py:not-a-name", "'module:function'"),
    ("x.py", "'module:function'"),
])
def test_malformed_entries_are_config_errors(entry: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match=f"^task.entry: .*{fragment}"):
        TaskSection(entry=entry)
    with pytest.raises(TaskError, match=fragment):
        load_entry(entry)


def test_check_config_resolves_a_task_file_from_the_data_dir(layout: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]
                                                             ) -> None:
    # The config lives in one directory, its data_dir in another, and the daemon is started
    # from a third (the decoy's): the file found is the data_dir's.
    etc = tmp_path / "etc"
    etc.mkdir()
    path = etc / "gossipd.toml"
    data = {"node": {"listen": "127.0.0.1:0", "data_dir": "../node"}, "swarm": {"name": "s"},
            "task": {"entry": "./sub/x.py:task"}}
    path.write_text(render(from_dict(data, etc, str(path))))
    write_swarm_key(layout / "swarm.key", bytes(32))
    assert main(["check-config", "-c", str(path)]) == 0
    assert main(["check-config", "-c", str(path), "--set", "task.entry=./gone.py:task"]) == 2
    assert f"task file {layout / 'gone.py'} does not exist" in capsys.readouterr().err
