"""The one device resolver (gossip.devices), on a CPU machine that emulates CUDA.

``torch.cuda.is_available`` and ``device_count`` are patched to say "N GPUs", and
``torch._C._cuda_setDevice`` to record the index it is given: ``torch.cuda.set_device`` itself
runs, with its own check that the device has an index (the check that stopped every daemon
with the default ``auto`` on a GPU machine). The daemon's three users of the resolver
(``check-config``, ``run``'s start-up and a follower process) must agree on every name, GPU
count and process count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio

from daemon import cli, processes
from daemon.config import ConfigError, from_dict, load, render
from daemon.keys import write_swarm_key
from daemon.processes import Placement
from daemon.service import open_prepared
from daemon.startup import StartupError, resolve_device
from gossip.devices import DeviceError, resolve, valid_name

NAMES = ["auto", "cpu", "cuda", "cuda:0", "cuda:1", "cuda:3"]


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Emulate a machine with CUDA; returns the indices ``set_device`` was given. Set the
    number of GPUs with :func:`have`."""
    chosen: list[int] = []
    monkeypatch.setattr(torch._C, "_cuda_setDevice", chosen.append, raising=False)
    have(monkeypatch, 2)
    return chosen


def have(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)


# --- the rules ------------------------------------------------------------------------------

# (name, GPUs, local rank, processes) -> the device, or a fragment of the error
RULES = [
    ("auto", 0, 0, 1, "cpu"),
    ("auto", 2, 0, 1, "cuda:0"),
    ("auto", 2, 1, 2, "cuda:1"),
    ("auto", 0, 1, 2, "cpu"),
    ("auto", 1, 0, 2, "1 CUDA device(s): use at most 1 processes"),
    ("cpu", 2, 0, 1, "cpu"),
    ("cpu", 2, 1, 2, "cpu"),
    ("cuda", 2, 0, 1, "cuda:0"),
    ("cuda", 2, 1, 2, "cuda:1"),
    ("cuda", 0, 0, 1, "asks for CUDA, which is not available here"),
    ("cuda", 3, 0, 4, "3 CUDA device(s): use at most 3 processes"),
    ("cuda:1", 2, 0, 1, "cuda:1"),
    ("cuda:0", 2, 0, 2, "names one GPU, but this node has 2 processes"),
    ("cuda:0", 0, 0, 1, "asks for CUDA, which is not available here"),
    ("cuda:3", 2, 0, 1, "this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
    ("tpu", 2, 0, 1, "is not auto, cpu, cuda or cuda:N"),
    ("cuda:", 2, 0, 1, "is not auto, cpu, cuda or cuda:N"),
    ("CUDA", 2, 0, 1, "is not auto, cpu, cuda or cuda:N"),
    ("auto", 2, 2, 2, "local rank 2 is not in 0..1"),
]


@pytest.mark.parametrize("name,count,rank,size,expected", RULES)
def test_the_rules(monkeypatch: pytest.MonkeyPatch, gpus: list[int], name: str, count: int,
                   rank: int, size: int, expected: str) -> None:
    have(monkeypatch, count)
    if expected == "cpu" or expected.startswith("cuda:") and " " not in expected:
        device = resolve(name, local_rank=rank, processes=size)
        assert str(device) == expected
        if device.type == "cuda":
            assert device.index is not None
            torch.cuda.set_device(device)  # torch's own check: an explicit index
            assert gpus == [device.index]
    else:
        with pytest.raises(DeviceError, match=expected.replace("(", r"\(").replace(")", r"\)")):
            resolve(name, local_rank=rank, processes=size)


def test_an_index_less_cuda_device_is_what_set_device_refuses(gpus: list[int]) -> None:
    # The crash this resolver exists to prevent, so that the test above means something.
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))
    assert gpus == []


def test_errors_name_the_setting_they_come_from(monkeypatch: pytest.MonkeyPatch) -> None:
    have(monkeypatch, 0)
    with pytest.raises(DeviceError, match=r"^task.device 'cuda' asks for CUDA"):
        resolve("cuda", what="task.device")
    assert issubclass(DeviceError, ValueError)


def test_torchrun_variables_give_the_rank_and_the_processes(monkeypatch: pytest.MonkeyPatch,
                                                           gpus: list[int]) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve("auto") == torch.device("cuda", 1)
    assert resolve("cuda", local_rank=0) == torch.device("cuda", 0)  # an argument wins
    with pytest.raises(DeviceError, match="names one GPU"):
        resolve("cuda:0")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(DeviceError, match="LOCAL_RANK='x'"):
        resolve("auto")


def test_a_plain_script_takes_gpu_0_or_the_cpu(monkeypatch: pytest.MonkeyPatch,
                                               gpus: list[int]) -> None:
    assert resolve() == torch.device("cuda", 0)
    have(monkeypatch, 0)
    assert resolve() == torch.device("cpu")


def test_spelling_alone_is_checked_without_torch() -> None:
    assert all(valid_name(n) for n in NAMES)
    assert not any(valid_name(n) for n in ("", "gpu", "cuda:-1", "cuda:1:2", " cpu", None, 0))


# --- the daemon: check-config, run and a follower agree -------------------------------------


def node_dir(tmp_path: Path, device: str, nprocs: int) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    write_swarm_key(tmp_path / "swarm.key", bytes(32))
    (tmp_path / "tiny.py").write_text(
        "import torch\nfrom daemon.task import Task\n\ndef task(ctx):\n"
        "    raise SystemExit('the task is built after the device is chosen')\n")
    cfg = tmp_path / "gossipd.toml"
    config = from_dict({"node": {"listen": "127.0.0.1:0"}, "swarm": {"name": "s"},
                        "task": {"entry": "tiny.py:task", "device": device,
                                 "processes": nprocs}, "metrics": {"log": ""}},
                       tmp_path, str(cfg))
    cfg.write_text(render(config))
    return tmp_path


def check_config(directory: Path, capsys: pytest.CaptureFixture[str]) -> str | None:
    """None if check-config accepts, else its one-line error."""
    code = cli.main(["check-config", "-c", str(directory / "gossipd.toml")])
    err = capsys.readouterr().err
    assert code in (0, 2)
    return None if code == 0 else err


def start_device(directory: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """What ``run``'s start-up resolves for the speaker (rank 0), or its one-line error. The
    start stops where the device is first used (torch's threads), before the task is built;
    the followers it would start are counted, not started."""
    seen: list[str] = []
    spawned: list[int] = []

    def record(threads: int, where: Placement, device: torch.device) -> None:
        seen.append(str(device))
        raise StartupError("stop here")

    def spawn(argv: object, size: int, port: int) -> list[object]:
        spawned.append(size)
        return []

    async def start() -> None:
        async with open_prepared(config, argv=("run",)):
            pass  # pragma: no cover

    with monkeypatch.context() as patch:
        patch.setattr(processes, "set_threads", record)
        patch.setattr(processes, "spawn_followers", spawn)
        config = load(directory / "gossipd.toml", [])
        with pytest.raises(StartupError) as caught:
            trio.run(start)
    if str(caught.value) != "stop here":
        assert not spawned  # a device this machine lacks is refused before any follower
        return str(caught.value)
    return seen[0]


@pytest.mark.parametrize("count", [0, 1, 2])
@pytest.mark.parametrize("nprocs", [1, 2])
@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:1"])
def test_check_config_run_and_followers_resolve_alike(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      gpus: list[int], count: int, nprocs: int,
                                                      device: str) -> None:
    have(monkeypatch, count)
    directory = node_dir(tmp_path, device, nprocs)
    refused = check_config(directory, capsys)
    started = start_device(directory, monkeypatch)
    if refused is None:
        assert not started.startswith("task.device"), started
        expected = [resolve(device, local_rank=r, processes=nprocs) for r in range(nprocs)]
        assert started == str(expected[0])
        # each follower resolves its own GPU the same way
        for rank in range(1, nprocs):
            where = Placement(rank, nprocs, rank, "gossipd")
            assert resolve_device(device, where) == expected[rank]
        assert all(d.type == "cpu" or d.index is not None for d in expected)
    else:
        assert "task.device" in refused and refused.count("\n") == 1
        assert started.startswith("task.device") and started in refused
        for rank in range(1, nprocs):
            with pytest.raises(StartupError, match=r"^task.device"):
                resolve_device(device, Placement(rank, nprocs, rank, "gossipd"))


def test_check_config_says_which_device(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch,
                                        gpus: list[int]) -> None:
    assert check_config(node_dir(tmp_path / "one", "auto", 1), capsys) is None
    cli.main(["check-config", "-c", str(tmp_path / "one" / "gossipd.toml")])
    assert "task.device auto is cuda:0 here" in capsys.readouterr().err
    cli.main(["check-config", "-c", str(node_dir(tmp_path / "two", "auto", 2) / "gossipd.toml")])
    assert "cuda:0 to cuda:1, one per process" in capsys.readouterr().err


def test_a_misspelt_device_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="task.device"):
        from_dict({"swarm": {"name": "s"}, "task": {"entry": "m:f", "device": "gpu"}},
                  Path("."))
