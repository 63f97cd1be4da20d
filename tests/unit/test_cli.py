"""Tests for daemon.cli, in process (``main([...])`` with capsys): each subcommand's files,
output and exit code, and that every operator error is one line on standard error with exit
code 2 (3 for ``status`` with no daemon). Also daemon.logs, which the CLI sets up: the line
format and the live status line on a terminal."""

from __future__ import annotations

import io
import json
import logging
import re
import stat
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import trio

import gossip
from daemon import checkpoint, cli, config as config_module, init as init_module, logs
from daemon.cli import main
from daemon.status import format_status
from daemon.control import serve_control
from daemon.keys import JoinLine, read_swarm_key


@pytest.fixture(autouse=True)
def _no_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(config_module.ENV, raising=False)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The standard error of a failed command: exactly one line, no traceback."""
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"gossipd {command}: "), err
    assert "Traceback" not in err
    return err


def init(capsys: pytest.CaptureFixture[str], directory: Path, *extra: str,
         listen: str = "127.0.0.1:7070") -> str:
    """Run ``gossipd init`` and return the join line it prints."""
    assert main(["init", "--dir", str(directory), "--listen", listen, *extra]) == 0
    out = capsys.readouterr().out
    (line,) = re.findall(r"gossipd init --join '([^']*)'", out)
    return line


# --- --version ---------------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"gossipd \S+\n", out), out
    assert out != "gossipd unknown\n"  # the package is installed in the venv


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


# --- init ---------------------------------------------------------------------------------


def test_init_new_swarm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "node"
    text = init(capsys, d, "--swarm", "lab swarm")
    config_path, identity, swarm_key = d / "gossipd.toml", d / "identity.key", d / "swarm.key"
    for path in (config_path, identity, swarm_key):
        assert path.is_file()
    assert mode(identity) == 0o600
    assert mode(swarm_key) == 0o600
    assert mode(config_path) == 0o600  # written with keys.write_new, like the keys
    gossip.Identity.load(identity)  # a usable key (load refuses group/other-readable ones)

    join = JoinLine.parse(text)
    assert join.name == "lab swarm"
    assert join.key == read_swarm_key(swarm_key)
    assert join.bootstrap == ("127.0.0.1:7070",)  # the advertised address
    assert join.task == cli.NEW_SWARM_TASK
    assert join.seed == 0

    config = config_module.load(config_path)
    assert config.swarm.name == "lab swarm"
    assert config.swarm.bootstrap == ()
    assert config.node.listen == config.node.advertise == "127.0.0.1:7070"
    assert config.task.entry == cli.NEW_SWARM_TASK
    assert config.data_dir() == d.resolve()


def test_init_with_task_and_advertise(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = init(capsys, tmp_path, "--swarm", "s", "--task", "examples/t.py:make",
                "--advertise", "[2001:db8::1]:9000", listen="[::]:9000")
    join = JoinLine.parse(text)
    assert join.bootstrap == ("[2001:db8::1]:9000",)
    assert join.task == "examples/t.py:make"
    config = config_module.load(tmp_path / "gossipd.toml")
    assert config.node.listen == "[::]:9000"
    assert config.node.advertise == "[2001:db8::1]:9000"


def test_init_on_a_wildcard_guesses_advertise(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(init_module, "guess_address", lambda: "192.0.2.7")
    assert main(["init", "--swarm", "s", "--dir", str(tmp_path)]) == 0  # listen 0.0.0.0:7070
    out = capsys.readouterr().out
    assert "node.advertise = 192.0.2.7:7070 (guessed" in out
    assert config_module.load(tmp_path / "gossipd.toml").node.advertise == "192.0.2.7:7070"


def test_guess_address_is_an_ip() -> None:
    host = init_module.guess_address()
    assert re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host)


def test_init_twice_refuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    init(capsys, tmp_path, "--swarm", "s")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert main(["init", "--swarm", "s", "--dir", str(tmp_path)]) == 2
    err = one_line_error(capsys, "init")
    assert "exists" in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_init_join(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = init(capsys, tmp_path / "a", "--swarm", "lab")
    d2 = tmp_path / "b"
    second = init(capsys, d2, "--join", text, listen="127.0.0.1:7071")
    config = config_module.load(d2 / "gossipd.toml")
    join = JoinLine.parse(text)
    assert config.swarm.name == join.name == "lab"
    assert config.swarm.bootstrap == join.bootstrap == ("127.0.0.1:7070",)
    assert config.task.entry == join.task
    assert config.task.seed == join.seed
    assert config.node.advertise == "127.0.0.1:7071"
    assert read_swarm_key(d2 / "swarm.key") == join.key
    assert mode(d2 / "swarm.key") == 0o600
    # the second node's identity is its own
    assert gossip.Identity.load(d2 / "identity.key").peer_id != \
        gossip.Identity.load(tmp_path / "a" / "identity.key").peer_id
    # and the line it prints lets a third node join the same swarm the same way
    assert JoinLine.parse(second) == join
    # each node takes its data shard once it has joined (one shard: shard 0)
    assert (config.task.shard, config.task.shards) == ("auto", 1)


def test_init_shards_travel_in_the_join_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    text = init(capsys, tmp_path / "a", "--swarm", "lab", "--shards", "8")
    assert JoinLine.parse(text).shards == 8
    first = config_module.load(tmp_path / "a" / "gossipd.toml")
    assert (first.task.shard, first.task.shards) == ("auto", 8)
    second = init(capsys, tmp_path / "b", "--join", text, listen="127.0.0.1:7071")
    written = (tmp_path / "b" / "gossipd.toml").read_text()
    assert 'shard = "auto"\n' in written and "shards = 8\n" in written
    assert JoinLine.parse(second).shards == 8


def test_init_cipher_travels_in_the_join_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    default = init(capsys, tmp_path / "x", "--swarm", "x")
    assert JoinLine.parse(default).cipher == "aesgcm" and "cipher" not in default
    assert config_module.load(tmp_path / "x" / "gossipd.toml").swarm.cipher == "aesgcm"
    text = init(capsys, tmp_path / "a", "--swarm", "lab", "--cipher", "chachapoly")
    assert JoinLine.parse(text).cipher == "chachapoly"
    assert config_module.load(tmp_path / "a" / "gossipd.toml").swarm.cipher == "chachapoly"
    second = init(capsys, tmp_path / "b", "--join", text, listen="127.0.0.1:7071")
    assert config_module.load(tmp_path / "b" / "gossipd.toml").swarm.cipher == "chachapoly"
    assert JoinLine.parse(second).cipher == "chachapoly"
    # A joiner cannot pick another cipher than its swarm's: it could never connect.
    assert main(["init", "--join", text, "--dir", str(tmp_path / "c"), "--listen",
                 "127.0.0.1:7072", "--cipher", "aesgcm"]) == 2
    assert "uses cipher chachapoly" in one_line_error(capsys, "init")
    assert not (tmp_path / "c" / "gossipd.toml").exists()


def test_init_refuses_shards_out_of_range(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init", "--swarm", "s", "--dir", str(tmp_path), "--listen", "127.0.0.1:1",
                 "--shards", "0"]) == 2
    assert "task.shards" in one_line_error(capsys, "init")
    assert not (tmp_path / "gossipd.toml").exists()


def test_init_join_keeps_seed_and_can_override_task(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    line = JoinLine("s", bytes(range(32)), ("h1:1", "[::1]:2"), "pkg.mod:fn", seed=9)
    init(capsys, tmp_path, "--join", str(line), "--task", "other.mod:fn")
    config = config_module.load(tmp_path / "gossipd.toml")
    assert config.swarm.bootstrap == ("h1:1", "[::1]:2")
    assert config.task.seed == 9
    assert config.task.entry == "other.mod:fn"


@pytest.mark.parametrize("argv", [
    ["--join", "gossip://nothing-here"],
    ["--join", "http://x@h:1?key=00&task=m:f"],
    ["--swarm", "s", "--listen", "nonsense"],
    ["--swarm", "s", "--listen", "127.0.0.1:70000"],
    ["--swarm", "x" * 65],  # swarm.name is 1..64 characters
    ["--swarm", "s", "--task", "not an entry"],
], ids=["bad-join", "wrong-scheme", "bad-listen", "big-port", "long-name", "bad-task"])
def test_init_operator_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              argv: list[str]) -> None:
    assert main(["init", "--dir", str(tmp_path / "d"), "--listen", "127.0.0.1:7070", *argv]) == 2
    one_line_error(capsys, "init")
    assert not (tmp_path / "d" / "gossipd.toml").exists()


def test_init_join_with_a_seed_below_0_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    line = str(JoinLine("s", bytes(32), ("h:1",), "m:f", seed=-1))
    assert main(["init", "--dir", str(tmp_path), "--listen", "127.0.0.1:1", "--join", line]) == 2
    assert "seed" in one_line_error(capsys, "init")


# --- check-config -------------------------------------------------------------------------


@pytest.fixture
def node_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    d = tmp_path / "n"
    init(capsys, d, "--swarm", "s")
    return d


def test_check_config_ok(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node_dir / "gossipd.toml")
    assert main(["check-config", "-c", cfg]) == 0
    out, err = capsys.readouterr()
    assert out == (node_dir / "gossipd.toml").read_text()  # the rendered config, as written
    assert err.count("\n") == 1 and "ok" in err


def test_check_config_reads_the_env_variable(node_dir: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(config_module.ENV, str(node_dir / "gossipd.toml"))
    assert main(["check-config"]) == 0


@pytest.mark.parametrize("env, says", [
    ({"WORLD_SIZE": "2", "RANK": "x"}, "WORLD_SIZE is set but RANK or LOCAL_RANK is missing"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4"},
     "torchrun spans 2 processes over several machines"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, None),
], ids=["malformed", "several-machines", "torchrun"])
def test_check_config_places_the_process_as_run_does(node_dir: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     env: dict[str, str], says: str | None) -> None:
    # Under torchrun's variables, check-config resolves this process's device from them, as
    # run does (daemon.startup.resolve_device), and refuses what run refuses.
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    code = main(["check-config", "-c", str(node_dir / "gossipd.toml"), "--set",
                 "task.device=cpu"])
    if says is None:
        assert code == 0
        assert "task.device cpu is cpu here" in capsys.readouterr().err
    else:
        assert code == 2
        assert says in one_line_error(capsys, "check-config")


def rewrite(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize("old,new,key", [
    ('device = "auto"', 'device = "tpu"', "task.device"),
    ('keep = 3', 'keep = 0', "checkpoint.keep"),
    ('profile = "lan"', 'profile = "lan"\ncolour = "blue"', "swarm.colour"),
    ('\ninterval = 10.0', '\ninterval = "often"', "averaging.interval"),
    ('name = "s"', 'name = ""', "swarm.name"),
    ('[node]', '[nodes]', "nodes"),
    ('listen = "127.0.0.1:7070"', 'listen = "127.0.0.1:7070', "invalid TOML"),
], ids=["device", "keep", "unknown-key", "type", "empty-name", "unknown-section", "not-toml"])
def test_check_config_bad_value(node_dir: Path, capsys: pytest.CaptureFixture[str],
                                old: str, new: str, key: str) -> None:
    cfg = node_dir / "gossipd.toml"
    rewrite(cfg, old, new)
    assert main(["check-config", "-c", str(cfg)]) == 2
    err = one_line_error(capsys, "check-config")
    assert key in err
    assert str(cfg) in err
    assert capsys.readouterr().out == ""


def test_check_config_renders_every_auto(node_dir: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = node_dir / "gossipd.toml"
    rewrite(cfg, "\nevery = 1\n", '\nevery = "auto"\n')
    assert main(["check-config", "-c", str(cfg)]) == 0
    assert '\nevery = "auto"\n' in capsys.readouterr().out
    rewrite(cfg, '\nevery = "auto"\n', '\nevery = "fast"\n')
    assert main(["check-config", "-c", str(cfg)]) == 2
    assert one_line_error(capsys, "check-config").rstrip().endswith(
        'averaging.every: expected an integer or "auto", got string \'fast\'')


def test_check_config_bad_override(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node_dir / "gossipd.toml")
    assert main(["check-config", "-c", cfg, "--set", "task.device=tpu"]) == 2
    err = one_line_error(capsys, "check-config")
    assert "--set task.device=tpu" in err and "task.device" in err


def test_check_config_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["check-config", "-c", str(missing)]) == 2
    err = one_line_error(capsys, "check-config")
    assert str(missing) in err and "does not exist" in err


def test_check_config_missing_swarm_key(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (node_dir / "swarm.key").unlink()
    assert main(["check-config", "-c", str(node_dir / "gossipd.toml")]) == 2
    assert str(node_dir / "swarm.key") in one_line_error(capsys, "check-config")


def test_check_config_bad_swarm_key(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (node_dir / "swarm.key").write_text("not a key\n")
    assert main(["check-config", "-c", str(node_dir / "gossipd.toml")]) == 2
    assert "64 hex characters" in one_line_error(capsys, "check-config")


def test_check_config_task_that_does_not_load(node_dir: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(node_dir / "gossipd.toml")
    assert main(["check-config", "-c", cfg, "--set", "task.entry=no_such_module_xyz:task"]) == 2
    assert "no_such_module_xyz" in one_line_error(capsys, "check-config")


# --- keygen -------------------------------------------------------------------------------


def test_keygen_swarm_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys" / "swarm.key"
    assert main(["keygen", "--swarm-key", str(path)]) == 0
    assert str(path) in capsys.readouterr().out
    assert mode(path) == 0o600
    key = read_swarm_key(path)
    assert len(key) == 32
    assert main(["keygen", "--swarm-key", str(path)]) == 2
    assert "exists" in one_line_error(capsys, "keygen")
    assert read_swarm_key(path) == key


def test_keygen_identity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "id.key"
    assert main(["keygen", "--identity", str(path)]) == 0
    out = capsys.readouterr().out
    assert mode(path) == 0o600
    identity = gossip.Identity.load(path)
    assert str(identity.peer_id) in out
    before = path.read_bytes()
    assert main(["keygen", "--identity", str(path)]) == 2
    assert "exists" in one_line_error(capsys, "keygen")
    assert path.read_bytes() == before


def test_keygen_needs_one_kind(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for argv in (["keygen"], ["keygen", "--identity", "a", "--swarm-key", "b"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("kind", ["--swarm-key", "--identity"])
def test_keygen_under_a_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         kind: str) -> None:
    (tmp_path / "file").write_text("x")
    assert main(["keygen", kind, str(tmp_path / "file" / "k")]) == 2
    one_line_error(capsys, "keygen")


# --- average ------------------------------------------------------------------------------


def save(path: Path, **tensors: torch.Tensor) -> str:
    torch.save(tensors, path)
    return str(path)


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[str, str]:
    a = save(tmp_path / "a.pt", w=torch.tensor([1.0, 2.0]), b=torch.tensor([4.0]))
    b = save(tmp_path / "b.pt", w=torch.tensor([3.0, 6.0]), b=torch.tensor([0.0]))
    return a, b


def test_average_two_files(tmp_path: Path, two_files: tuple[str, str],
                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.pt"
    assert main(["average", *two_files, "-o", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}: the average of 2 files, 2 tensors\n"
    merged = torch.load(out, weights_only=True)
    assert torch.equal(merged["w"], torch.tensor([2.0, 4.0]))
    assert torch.equal(merged["b"], torch.tensor([2.0]))


def test_average_with_weights(tmp_path: Path, two_files: tuple[str, str]) -> None:
    out = tmp_path / "out.pt"
    assert main(["average", *two_files, "-o", str(out), "--weights", "1,3"]) == 0
    merged = torch.load(out, weights_only=True)
    assert torch.equal(merged["w"], torch.tensor([2.5, 5.0]))  # 0.25 a + 0.75 b
    assert torch.equal(merged["b"], torch.tensor([1.0]))


@pytest.mark.parametrize("weights,fragment", [
    ("1", "1 weights for 2 files"),
    ("1,2,3", "3 weights for 2 files"),
    ("1,x", "not a comma-separated list of numbers"),
])
def test_average_bad_weights(tmp_path: Path, two_files: tuple[str, str],
                             capsys: pytest.CaptureFixture[str], weights: str,
                             fragment: str) -> None:
    out = tmp_path / "out.pt"
    assert main(["average", *two_files, "-o", str(out), "--weights", weights]) == 2
    assert fragment in one_line_error(capsys, "average")
    assert not out.exists()


def test_average_mismatched_files(tmp_path: Path, two_files: tuple[str, str],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    other = save(tmp_path / "c.pt", w=torch.tensor([1.0, 2.0, 3.0]), b=torch.tensor([4.0]))
    out = tmp_path / "out.pt"
    assert main(["average", two_files[0], other, "-o", str(out)]) == 2
    err = one_line_error(capsys, "average")
    assert "w" in err
    assert not out.exists()


def test_average_missing_input(tmp_path: Path, two_files: tuple[str, str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.pt"
    assert main(["average", two_files[0], str(missing), "-o", str(tmp_path / "o.pt")]) == 2
    assert str(missing) in one_line_error(capsys, "average")


def test_average_one_file(tmp_path: Path, two_files: tuple[str, str],
                          capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["average", two_files[0], "-o", str(tmp_path / "o.pt")]) == 2
    assert "gossipd export" in one_line_error(capsys, "average")  # what to use instead


# --- export -------------------------------------------------------------------------------


def small_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))


@pytest.fixture
def daemon_checkpoint(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A checkpoint as the daemon writes one (Trainer.state's entries, checkpoint.save), and
    the model it holds."""
    model = small_model(1)
    model(torch.randn(8, 4))  # BatchNorm's running statistics and batch count move
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "counters": {"step": 1234, "samples": 9872, "weight": 1.0, "own_steps": 1200},
             "rng": checkpoint.capture_rng(), "meta": {"entry": "m:f", "peer": "p"}}
    return checkpoint.save(tmp_path / "checkpoints", state, step=1234, keep=3), model


def test_export_writes_a_state_dict_the_model_loads(
        tmp_path: Path, daemon_checkpoint: tuple[Path, torch.nn.Module],
        capsys: pytest.CaptureFixture[str]) -> None:
    path, model = daemon_checkpoint
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)  # why export exists: a checkpoint is framed
    out = tmp_path / "model.pt"
    assert main(["export", str(path), str(out)]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"wrote {out}: the model of {path} at step 1234, 7 tensors")
    assert mode(out) == 0o600

    state = torch.load(out, weights_only=True)
    assert type(state) is dict and list(state) == list(model.state_dict())  # plain, in order
    fresh = small_model(2)
    fresh.load_state_dict(state)  # strict: every key, no extra
    for key, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_export_overwrites_an_earlier_export(
        tmp_path: Path, daemon_checkpoint: tuple[Path, torch.nn.Module]) -> None:
    path, model = daemon_checkpoint
    out = tmp_path / "model.pt"
    out.write_bytes(b"an older export")
    assert main(["export", str(path), str(out)]) == 0
    assert list(torch.load(out, weights_only=True)) == list(model.state_dict())


@pytest.mark.parametrize("case", ["missing", "not-a-checkpoint", "state-dict", "damaged",
                                  "no-directory", "a-directory", "itself"])
def test_export_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    daemon_checkpoint: tuple[Path, torch.nn.Module],
                                    case: str) -> None:
    path, _ = daemon_checkpoint
    out = tmp_path / "model.pt"
    if case == "missing":
        path = tmp_path / "checkpoints" / "checkpoint-000000000099.ckpt"
    elif case == "not-a-checkpoint":
        path = tmp_path / "notes.txt"
        path.write_text("not a checkpoint\n")
    elif case == "state-dict":  # already what export writes: torch.load takes it as it is
        path = Path(save(tmp_path / "sd.pt", w=torch.zeros(2)))
    elif case == "damaged":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif case == "no-directory":
        out = tmp_path / "no" / "such" / "model.pt"
    elif case == "a-directory":
        out = tmp_path
    else:
        out = path
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert main(["export", str(path), str(out)]) == 2
    err = one_line_error(capsys, "export")
    assert str(path if case in ("missing", "not-a-checkpoint", "state-dict", "damaged")
               else out) in err
    expected = {"missing": "No such file", "not-a-checkpoint": "not a gossipd checkpoint",
                "state-dict": "not a gossipd checkpoint", "damaged": "damaged",
                "no-directory": "does not exist", "a-directory": "is a directory",
                "itself": "refusing to overwrite"}[case]
    assert expected in err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def test_export_needs_two_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["export", "only-one.ckpt"])
    assert info.value.code == 2
    capsys.readouterr()


# --- status -------------------------------------------------------------------------------


def test_status_with_no_daemon(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "-c", str(node_dir / "gossipd.toml")]) == 3
    err = one_line_error(capsys, "status")
    assert "no daemon is running" in err
    assert capsys.readouterr().out == ""


def test_status_with_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "-c", str(tmp_path / "nope.toml")]) == 2
    one_line_error(capsys, "status")


def status_reply(**changes: Any) -> dict[str, Any]:
    """A reply shaped like daemon.status.status_reply's (after a JSON round trip)."""
    reply: dict[str, Any] = {
        "peer": "aaaabbbbccccddddeeeeffffgg", "address": "10.0.0.1:7070", "swarm": "lab",
        "task": "daemon.tasks.digits:task", "schema": "6b258ea925054d0b695d3dba4bc4c382",
        "device": "cpu", "version": "0.1.0", "uptime_s": 61.4, "data_dir": "/srv/gossipd",
        # Metrics.sample
        "step": 1200, "samples": 76800, "loss": 0.123456, "samples_per_s": 2048.4,
        "ready": True, "peers": {"alive": 2, "suspect": 1, "dead": 0, "left": 0},
        "exchanges": {"committed": 30, "busy": 2, "rejected": 1, "invalid": 0, "failed": 3,
                      "no_peer": 4, "newcomers": 2, "newcomers_limited": 0},
        "bytes": {"sent": 12_300_000, "received": 4_560_000}, "mean_exchange_s": 0.0421,
        "last_distance": 0.5, "pending": 1, "quarantined": 0, "downloads_served": 0,
        "own_steps": 400, "own_steps_total": 1150, "step_held": 0,
        "evaluation": {"metrics": {"accuracy": 0.97221, "loss": 0.09123}, "step": 1100,
                       "age_s": 12.4},
        "eval_every": 60.0,
        "members": [
            {"peer": "zzzzyyyyxxxx2222333344445", "address": "10.0.0.9:7070", "state": "suspect",
             "step": 1100, "step_age_s": 41.0, "ready": True},
            {"peer": "mmmmnnnnoooo2222333344445", "address": "10.0.0.3:7070", "state": "alive",
             "step": 1199, "step_age_s": 3.2, "ready": False},
            {"peer": "bbbbcccc2222333344445555a", "address": "[2001:db8::5]:7070",
             "state": "alive", "step": 1201, "step_age_s": 0.0, "ready": True},
        ],
        "downloaded_from": None, "join_trouble": None, "clash": None,
        "last_checkpoint": {"path": "/srv/gossipd/checkpoints/step-1000.pt", "step": 1000,
                            "time": 1.7e9},
    }
    reply.update(changes)
    return reply


def test_format_status() -> None:
    text = format_status(status_reply())
    lines = text.splitlines()
    assert lines[0] == "peer      aaaabbbbccccddddeeeeffffgg  10.0.0.1:7070  swarm lab"
    assert lines[1] == "task      daemon.tasks.digits:task on cpu, up 61 s"
    # the steps this node trained (this run, and all its runs), apart from the swarm's step
    assert lines[2] == ("training  400 own steps since start (1150 in all), 76800 samples, "
                        "loss 0.1235, 2048 samples/s")
    assert lines[3] == "step      1200 (the swarm's: the step the task's schedule follows)"
    assert lines[4] == "eval      accuracy 0.9722  loss 0.0912  at step 1100, 12 s ago"
    assert lines[5] == ("averaging 30 committed, 2 busy, 3 failed, 0 invalid, 1 rejected; "
                        "1 pending")
    assert lines[6] == "traffic   12.3 MB out, 4.6 MB in"
    assert lines[7] == "checkpoint step 1000 /srv/gossipd/checkpoints/step-1000.pt"
    assert lines[8] == "peers     3"
    # members sorted by state, then peer id; ids cut to 8 characters; each step's age
    members = lines[9:]
    assert [m.split()[0] for m in members] == ["bbbbcccc", "mmmmnnnn", "zzzzyyyy"]
    assert members[0].split()[1:3] == ["[2001:db8::5]:7070", "alive"]
    assert members[0].endswith("step 1201 (0 s ago)")
    assert members[1].endswith("step 1199 (3 s ago)  not ready")
    assert members[2].split()[2] == "suspect"
    assert members[2].endswith("step 1100 (41 s ago)")


def test_format_status_before_anything_happened() -> None:
    text = format_status(status_reply(loss=None, last_checkpoint=None, members=[], ready=False,
                                      own_steps=0, own_steps_total=0, evaluation=None))
    lines = text.splitlines()
    assert lines[2] == "NOT READY fetching the swarm's state"
    del lines[2]
    assert lines[2].startswith("training  0 own steps since start, 76800 samples, loss -,")
    assert lines[4] == "eval      none yet (every 60 s)"
    assert lines[7] == "checkpoint none yet"
    assert lines[-1] == "peers     0"


@pytest.mark.parametrize("changes, line", [
    # a node ahead of the swarm: its step stands while its own steps go on
    ({"step_held": 35}, "step      1200 (the swarm's: the step the task's schedule follows); "
                        "held for 35 own steps: ahead of the swarm, which catches up"),
    ({"own_steps_total": None}, "training  400 own steps since start, 76800 samples"),
    ({"own_steps_total": 400}, "training  400 own steps since start, 76800 samples"),
    ({"evaluation": None, "eval_every": 0.0},
     "eval      none yet (task.eval_interval is 0: once, when stopping)"),
])
def test_format_status_says_only_what_it_knows(changes: dict[str, Any], line: str) -> None:
    assert any(x.startswith(line) for x in format_status(status_reply(**changes)).splitlines())


@pytest.mark.parametrize("reachability, says", [
    ({"reachable": True, "mode": "auto", "checked": True, "detail": "dialed back by kq3f2x7a"},
     "reach     reachable: dialed back by kq3f2x7a"),
    ({"reachable": False, "mode": "auto", "checked": False, "detail": "not checked yet"},
     "reach     outbound only until a member dials us back (not checked yet)"),
    ({"reachable": False, "mode": "auto", "checked": True,
      "detail": "kq3f2x7a could not dial us: no connection"},
     "reach     outbound only: kq3f2x7a could not dial us: no connection; this node starts"),
    ({"reachable": False, "mode": "set", "checked": False, "detail": "configured"},
     "reach     outbound only (node.reachable = false): peers never dial this node"),
])
def test_format_status_says_whether_others_can_dial_us(reachability, says) -> None:
    members = [{"peer": "mmmmnnnnoooo2222333344445", "address": "10.0.0.3:7070",
                "state": "alive", "step": 1199, "step_age_s": 3.2, "ready": True,
                "reachable": False}]
    lines = format_status(status_reply(reachability=reachability, members=members)).splitlines()
    assert lines[1].startswith(says)
    assert lines[-1].endswith("step 1199 (3 s ago)  outbound only")


@pytest.mark.parametrize("changes, ending", [
    ({"spacing": 1280, "every": "auto"}, "; 1 pending; a round every 1280 steps (auto)"),
    ({"spacing": 4, "every": 4}, "; 1 pending; a round every 4 steps"),
    ({"spacing": 510, "every": "auto", "round_peers": 3},
     "; 1 pending; a round of 3 exchanges every 510 steps (auto)"),
    ({"spacing": None, "every": 0}, "; 1 pending; no rounds by steps (averaging.every = 0)"),
])
def test_format_status_says_how_far_apart_our_rounds_are(changes: dict[str, Any],
                                                        ending: str) -> None:
    lines = format_status(status_reply(**changes)).splitlines()
    assert lines[5].startswith("averaging 30 committed") and lines[5].endswith(ending)


def test_format_status_of_a_daemon_of_an_older_version() -> None:
    """A reply without the newer keys (an older daemon still running after an upgrade) is
    printed without them: nothing is made up."""
    reply = status_reply()
    for key in ("own_steps", "own_steps_total", "evaluation", "eval_every"):
        del reply[key]
    for m in reply["members"]:
        del m["step_age_s"]
    lines = format_status(reply).splitlines()
    assert lines[2] == "training  76800 samples, loss 0.1235, 2048 samples/s"
    assert not any(x.startswith("eval") for x in lines)
    assert lines[-3].endswith("step 1201")


async def test_status_asks_the_running_daemon(node_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = config_module.load(node_dir / "gossipd.toml")
    cfg = str(node_dir / "gossipd.toml")
    reply = status_reply()
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, config.path(config.node.control),
                            {"status": lambda: reply})
        assert await trio.to_thread.run_sync(main, ["status", "-c", cfg]) == 0
        assert capsys.readouterr().out == format_status(reply) + "\n"
        assert await trio.to_thread.run_sync(main, ["status", "-c", cfg, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == reply
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("changes, code, said", [
    ({}, 0, "ready: step 1200, 3 peers\n"),
    ({"joined": False, "ready": False}, 4, "not ready: joining the swarm"),
    ({"joined": False, "ready": True}, 4, "not ready: joining the swarm"),  # resumed, alone
    ({"ready": False}, 4, "not ready: fetching the swarm's state"),
    ({"joined": False, "ready": False, "join_trouble": {
        "seconds": 95.0, "attempts": 6, "reasons": {"10.0.0.5:7070": "connection closed during "
                                                    "the handshake: another swarm key?"}}},
     4, "not ready: cannot join the swarm: 6 attempt(s) in 95 s failed; 10.0.0.5:7070: "
        "connection closed during the handshake: another swarm key?"),
    ({"clash": "10.0.0.9:7070"}, 4,
     "not ready: identity clash: the node at 10.0.0.9:7070 runs with this node's identity"),
])
async def test_status_ready(node_dir: Path, capsys: pytest.CaptureFixture[str],
                            changes: dict[str, Any], code: int, said: str) -> None:
    """``status --ready`` (a readiness probe): 0 once joined and training, else 4 and one
    line on standard error saying what the node waits for."""
    config = config_module.load(node_dir / "gossipd.toml")
    reply = status_reply(**{"joined": True, **changes})
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, config.path(config.node.control),
                            {"status": lambda: reply})
        argv = ["status", "--ready", "-c", str(node_dir / "gossipd.toml")]
        assert await trio.to_thread.run_sync(main, argv) == code
        nursery.cancel_scope.cancel()
    if code == 0:
        assert capsys.readouterr().out == said
    else:
        assert said in one_line_error(capsys, "status")


async def test_status_needs_no_advertise(node_dir: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    # Containers set node.advertise at start (`run --set node.advertise=$POD_IP:7070`); their
    # probes run `gossipd status` with the file alone, which must still find the socket.
    path = node_dir / "gossipd.toml"
    text = path.read_text()
    path.write_text(re.sub(r'(?m)^listen = .*$', 'listen = "0.0.0.0:7070"',
                           re.sub(r'(?m)^advertise = .*$', 'advertise = ""', text)))
    assert main(["check-config", "-c", str(path)]) == 2
    assert "node.advertise" in one_line_error(capsys, "check-config")
    config = config_module.load(path, complete=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, config.path(config.node.control),
                            {"status": lambda: status_reply(joined=True)})
        assert await trio.to_thread.run_sync(main, ["status", "--ready", "-c", str(path)]) == 0
        nursery.cancel_scope.cancel()


def test_status_ready_with_no_daemon(node_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--ready", "-c", str(node_dir / "gossipd.toml")]) == 3
    one_line_error(capsys, "status")


def test_format_status_names_the_data_shard() -> None:
    assert "data shard" not in format_status(status_reply())
    line = format_status(status_reply(shard=2, shards=4)).splitlines()[1]
    assert line.endswith("up 61 s, data shard 2 of 4")
    line = format_status(status_reply(shard=None, shards=4)).splitlines()[1]
    assert line.endswith("data shard of 4 not chosen yet")


def test_format_status_while_joining() -> None:
    lines = format_status(status_reply(joined=False, ready=False)).splitlines()
    assert lines[2] == "NOT READY joining the swarm: no bootstrap address has answered yet"
    trouble = {"seconds": 40.0, "attempts": 3, "reasons": {"a:1": "no answer within 10 s"}}
    lines = format_status(status_reply(joined=False, ready=False,
                                       join_trouble=trouble)).splitlines()
    assert lines[2] == ("NOT READY cannot join the swarm: 3 attempt(s) in 40 s failed; "
                        "a:1: no answer within 10 s")
    assert not any(line.startswith("NOT READY") for line in
                   format_status(status_reply(joined=True)).splitlines())


# --- logs ---------------------------------------------------------------------------------


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, given back as it was: setup() replaces its handlers. pytest's own
    capture handlers come and go with each test phase, so only the others are put back."""
    root = logging.getLogger()
    kept = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]
    level = root.level
    yield root
    for h in list(root.handlers):
        if isinstance(h, logs._Handler):
            root.removeHandler(h)
    for h in kept:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)


class FakeTty(io.StringIO):
    def isatty(self) -> bool:
        return True


LINE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3} (\S+) (\S+) (.*)")


def test_setup_to_a_file_writes_whole_lines(root_logger: logging.Logger) -> None:
    stream = io.StringIO()
    assert logs.setup("INFO", stream) is None
    logging.getLogger("daemon.service").info("started peer=%s step=%d", "ab12", 7)
    logging.getLogger("daemon.x").debug("hidden")
    logging.getLogger("gossip.node").warning("averaging round failed peer=%s", "cd34")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (LINE.fullmatch(line) for line in lines)
    assert first and first.groups() == ("INFO", "daemon.service", "started peer=ab12 step=7")
    assert second and second.groups() == ("WARNING", "gossip.node",
                                          "averaging round failed peer=cd34")
    assert "\x1b" not in stream.getvalue() and "\r" not in stream.getvalue()


def test_setup_replaces_existing_handlers(root_logger: logging.Logger) -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.setup("INFO", first)
    logs.setup("DEBUG", second)
    assert len(root_logger.handlers) == 1
    assert root_logger.level == logging.DEBUG
    logging.getLogger("t").debug("once")
    assert first.getvalue() == ""
    assert second.getvalue().count("\n") == 1


def test_live_line_on_a_terminal(root_logger: logging.Logger) -> None:
    tty = FakeTty()
    live = logs.setup("INFO", tty)
    assert isinstance(live, logs.LiveLine)
    logging.getLogger("t").info("before any status")
    assert tty.getvalue().endswith("before any status\n")  # no status yet: nothing to redraw
    assert "\x1b" not in tty.getvalue()
    tty.seek(0)
    tty.truncate()

    live.show("step 10 loss 1.0")
    assert tty.getvalue() == "\r\x1b[Kstep 10 loss 1.0"
    live.show("step 20 loss 0.9")
    assert tty.getvalue().endswith("\r\x1b[Kstep 20 loss 0.9")
    tty.seek(0)
    tty.truncate()

    logging.getLogger("t").info("event k=v")
    out = tty.getvalue()
    # cleared, the record as a whole line, then the status drawn again below it
    assert out.startswith("\r\x1b[K")
    assert out.endswith("\nstep 20 loss 0.9")
    record = out[len("\r\x1b[K"):-len("step 20 loss 0.9")]
    match = LINE.fullmatch(record.rstrip("\n"))
    assert match and match.groups() == ("INFO", "t", "event k=v")

    tty.seek(0)
    tty.truncate()
    live.clear()
    assert tty.getvalue() == "\r\x1b[K"


def test_live_line_draws_nothing_without_text() -> None:
    tty = FakeTty()
    live = logs.LiveLine(tty)
    live.clear()
    live.redraw()
    assert tty.getvalue() == ""
