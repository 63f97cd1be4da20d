"""A synchronous client of the fault-proxy control API, for tests that are not trio.

Tests of real daemons are synchronous (subprocesses and polling), so this client uses only
``urllib`` and blocking calls. :meth:`ProxyClient.spawn` starts the control server as a
subprocess (``python -m gossip.testing.proxy``'s entry point), reads its ``control=`` line
within SPAWN_TIMEOUT, and stops it (SIGTERM, then SIGKILL) on exit. Wall-clock time
(``time.monotonic``) is used here on purpose: this runs outside trio, beside real processes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..address import format_address, parse_address
from ..errors import GossipError

__all__ = ["ProxyClient", "ProxyError"]

REQUEST_TIMEOUT = 10.0  # s for one control request
SPAWN_TIMEOUT = 30.0  # s for a spawned server to print its control address
STOP_TIMEOUT = 10.0  # s for a spawned server to exit after SIGTERM, before SIGKILL
_CLI = "import sys; from gossip.testing.proxyctl import main; sys.exit(main())"


class ProxyError(GossipError):
    """The proxy server refused a request (``status`` 4xx: the caller's fault, the message
    says what) or failed (5xx), or could not be reached or started (``status`` None)."""

    def __init__(self, status: int | None, message: str) -> None:
        super().__init__(f"{status} {message}" if status is not None else message)
        self.status = status
        self.message = message


class ProxyClient:
    """Drives a proxy server's control API at ``control`` (``"host:port"``).

    Every method blocks for at most REQUEST_TIMEOUT and raises :class:`ProxyError` when the
    server answers 4xx/5xx (with the server's message) or cannot be reached.

    Raises:
        ValueError: ``control`` is not ``host:port``.
    """

    def __init__(self, control: str) -> None:
        host, port = parse_address(control)
        self.control = format_address(host, port)
        self.process: subprocess.Popen[bytes] | None = None  # set by spawn()
        # No proxy from the environment (HTTP_PROXY) may sit between a test and its server.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def list(self) -> list[dict[str, Any]]:
        """Every proxy: name, listen, upstream, faults, statistics."""
        return self._call("GET", "/proxies")["proxies"]

    def create(self, name: str, listen: str, upstream: str) -> str:
        """Start a proxy; returns the address it listens on (port 0 picks one)."""
        body = {"name": name, "listen": listen, "upstream": upstream}
        return self._call("POST", "/proxies", body)["listen"]

    def get(self, name: str) -> dict[str, Any]:
        """One proxy: name, listen, upstream, faults, statistics."""
        return self._call("GET", self._path(name))

    def faults(self, name: str, **faults: Any) -> dict[str, Any]:
        """Change some faults (``delay``, ``jitter``, ``throttle``, ``cut_after``,
        ``corrupt``, ``reset_probability``, ``loss``, ``block``), keep the others."""
        if "block" in faults:  # one address, or any iterable of them
            block = faults["block"]
            faults["block"] = [block] if isinstance(block, str) else list(block)
        return self._call("POST", self._path(name, "faults"), faults)

    def clear(self, name: str) -> dict[str, Any]:
        """Remove every fault of a proxy."""
        return self._call("DELETE", self._path(name, "faults"))

    def reset(self, name: str) -> int:
        """Reset every open connection of a proxy; returns how many."""
        return self._call("POST", self._path(name, "reset"))["reset"]

    def remove(self, name: str) -> None:
        """Stop a proxy and close its connections."""
        self._call("DELETE", self._path(name))

    @classmethod
    @contextmanager
    def spawn(cls, seed: int = 0, *, control: str = "127.0.0.1:0") -> Iterator[ProxyClient]:
        """Run a proxy server in a subprocess for the duration of a ``with`` block.

        ``client.process`` is the subprocess; it is stopped (SIGTERM, then SIGKILL) on exit
        and its ``returncode`` is 0 after a clean stop.

        Raises:
            ProxyError: the server did not print its address within SPAWN_TIMEOUT or exited.
        """
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # the directory holding gossip/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        process = subprocess.Popen(
            [sys.executable, "-c", _CLI, "--control", control, "--seed", str(seed)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env)
        try:
            line = _read_line(process, SPAWN_TIMEOUT)
            if not line.startswith("control="):
                raise ProxyError(None, f"proxy server printed {line!r}, not control=HOST:PORT")
            client = cls(line[len("control="):])
            client.process = process
            yield client
        finally:
            _stop(process)

    def _path(self, name: str, *rest: str) -> str:
        return "/".join(["/proxies", urllib.parse.quote(name, safe=""), *rest])

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.control}{path}", data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with self._opener.open(request, timeout=REQUEST_TIMEOUT) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
            try:
                message = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode("utf-8", "replace").strip() or exc.reason
            raise ProxyError(exc.code, str(message)) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ProxyError(None, f"proxy server {self.control} unreachable: {reason}") from None


def _read_line(process: subprocess.Popen[bytes], timeout: float) -> str:
    """The first line ``process`` prints, read with a deadline and no thread."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    buffer = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buffer:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProxyError(None, f"proxy server printed no control address within {timeout:g} s")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                status = process.wait(STOP_TIMEOUT)
                raise ProxyError(None, f"proxy server exited with status {status} before listening")
            buffer += chunk
    return buffer.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()
