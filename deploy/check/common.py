"""What the steps of ``make deploy-check`` share: running commands with a log, waiting on a
condition, and the two ways a step ends other than passing."""

from __future__ import annotations

import os
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


class Skip(Exception):
    """The step cannot run on this machine; the message says why."""


class Failed(Exception):
    """The step ran and something it checks does not hold; the message says what."""


@dataclass
class Context:
    """Where the check keeps its files, and how it runs podman here."""

    cache: Path  # kept between runs: the base system, the podman-compose venv
    work: Path  # this run's files, removed at the end unless --keep
    log: Path  # every command and its output
    podman_env: dict[str, str] = field(default_factory=dict)  # CONTAINERS_CONF, when needed
    image: str = "localhost/gossipd:cpu"
    base_image: str = "localhost/gossipd-base:bookworm"
    replaced: str | None = None  # the image ID that was tagged ``image`` before the build
    wheels: Path | None = None  # a folder holding a CPU torch wheel for CPython 3.11
    torch: str = "torch"  # the requirement that picks that wheel, e.g. torch==2.13.0+cpu

    def say(self, line: str) -> None:
        print(f"deploy-check: {line}", flush=True)
        with self.log.open("a") as f:
            f.write(f"## {line}\n")

    def sh(self, argv: list[str], *, check: bool = True, timeout: float = 600,
           input: str | None = None, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """Runs ``argv``, its output into the log; raises Failed on a non-zero exit when
        ``check``, with the output's last lines."""
        full_env = {**os.environ, **self.podman_env, **(env or {})}
        started = time.monotonic()
        try:
            result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                    input=input, env=full_env, cwd=cwd or ROOT)
        except subprocess.TimeoutExpired as e:
            self._record(argv, None, time.monotonic() - started, str(e.stdout or ""),
                         str(e.stderr or ""))
            raise Failed(f"{shlex.join(argv)} did not finish in {timeout:.0f} s") from None
        self._record(argv, result.returncode, time.monotonic() - started, result.stdout,
                     result.stderr)
        if check and result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-8:])
            raise Failed(f"{shlex.join(argv)} exited {result.returncode}:\n{tail}")
        return result

    def _record(self, argv: list[str], rc: int | None, seconds: float, out: str,
                err: str) -> None:
        with self.log.open("a") as f:
            f.write(f"$ {shlex.join(argv)}  # exit {rc}, {seconds:.1f} s\n{out}{err}\n")

    def podman(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        return self.sh(["podman", *args], **kwargs)  # type: ignore[arg-type]


def trust_host_cas(rootfs: Path) -> None:
    """Makes a Debian tree trust the certificate authorities this machine added
    (/usr/local/share/ca-certificates: a proxy that inspects TLS, say), and has its pip use
    the system's bundle, as this machine's pip does. Nothing to do on a machine without."""
    added = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
    if not added:
        return
    target = rootfs / "usr/local/share/ca-certificates"
    target.mkdir(parents=True, exist_ok=True)
    for crt in added:
        (target / crt.name).write_bytes(crt.read_bytes())
    result = subprocess.run(["chroot", str(rootfs), "update-ca-certificates"],
                            capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise Failed(f"update-ca-certificates in {rootfs} exited {result.returncode}: "
                     + result.stderr.strip()[-300:])
    (rootfs / "etc/pip.conf").write_text("[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             interval: float = 2.0) -> T:
    """Polls ``probe`` until it returns something other than None or False; raises Failed
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise Failed(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)
