"""The local control socket: how ``gossipd status`` asks a running daemon what it is doing.

A Unix stream socket in the data directory, mode 0600, so only the daemon's own user can
connect. One request per connection: a JSON object on one line (``{"command": "status"}``),
answered by one JSON line. Requests are bounded (``MAX_REQUEST`` bytes, ``TIMEOUT``
seconds); a bad one gets ``{"error": ...}`` and the connection is closed.

At start-up a socket file left by a crashed daemon is removed, and one that still answers
means another daemon is running with this data directory (an error, not a takeover).

The server's functions import trio where they run, not at the top: the client,
:func:`query`, is all ``gossipd status`` needs, and importing trio would be most of its time
(0.1 s on a quiet machine, several times that on a busy one).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import trio

__all__ = ["ControlError", "bind_control", "serve_control", "query", "claim"]

log = logging.getLogger(__name__)

MAX_REQUEST = 4096  # bytes
MAX_REPLY = 1 << 22  # bytes a client reads at most
TIMEOUT = 5.0  # s for one request and its reply
MAX_CLIENTS = 8  # connections served at once; more wait in the listen backlog
ACCEPT_BACKOFF = 0.1  # s to wait after accept() fails (out of file descriptors)


class ControlError(Exception):
    """The control socket cannot be used: no daemon is running, or one already is."""


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def claim(path: Path) -> None:
    """Make ``path`` free for a new control socket: remove a stale one.

    Raises:
        ControlError: a daemon is answering on it, or something other than a socket is there
            (never deleted: the path may be mistyped, say ``node.control = "swarm.key"``).
    """
    if len(os.fsencode(path)) > 100:  # sun_path is 108 bytes on Linux, 104 on macOS
        raise ControlError(f"control socket path {path} is too long for a Unix socket; "
                           "set node.control to a shorter path")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlError(f"node.control {path} exists and is not a socket; not removing it")
    if _answers(path):
        raise ControlError(f"a daemon is already running with control socket {path}")
    path.unlink()


def bind_control(path: Path) -> socket.socket:
    """Claim ``path`` and listen on it, mode 0600 (call before any other thread starts: the
    umask that makes the file 0600 from its creation is process-wide).

    Raises:
        ControlError: as :func:`claim`, or the path cannot be bound (a missing directory, no
            permission, or another daemon that bound it first).
    """
    claim(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ControlError(f"cannot bind control socket {path}: {exc.strerror}") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(16)
    return sock


async def serve_control(path: Path, handlers: dict[str, Callable[[], Any]], *,
                        sock: socket.socket | None = None,
                        task_status: Any = None) -> None:
    """Answer requests on ``path`` until cancelled; removes the socket file on the way out.

    Args:
        handlers: command name -> function returning a JSON-able reply.
        sock: the socket :func:`bind_control` made; bound here if not given.
        task_status: from ``nursery.start``, told ``path`` once the socket listens.
    """
    import trio

    if task_status is None:  # started with start_soon: nobody waits to be told
        task_status = trio.TASK_STATUS_IGNORED
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock or bind_control(path)))
    limiter = trio.Semaphore(MAX_CLIENTS)
    try:
        async with listener:
            task_status.started(path)
            async with trio.open_nursery() as nursery:
                while True:
                    await limiter.acquire()
                    try:
                        stream = await listener.accept()
                    except OSError as exc:  # out of file descriptors: wait, don't die
                        limiter.release()
                        log.warning("control socket accept failed error=%s", exc)
                        await trio.sleep(ACCEPT_BACKOFF)
                        continue
                    nursery.start_soon(_serve_one, stream, handlers, limiter)
    finally:
        with trio.CancelScope(shield=True):
            path.unlink(missing_ok=True)


async def _serve_one(stream: trio.abc.Stream, handlers: dict[str, Callable[[], Any]],
                     limiter: trio.Semaphore) -> None:
    """Answer one request. Whatever the client does (garbage, hanging up, silence), only this
    connection ends; the server and the daemon go on."""
    import trio

    try:
        async with stream:
            with trio.move_on_after(TIMEOUT):
                try:
                    try:
                        reply = _answer(await _read_line(stream, MAX_REQUEST), handlers)
                    except ValueError as exc:  # too long
                        reply = {"error": f"bad request: {exc}"}
                    await stream.send_all(json.dumps(reply, default=str).encode() + b"\n")
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the client hung up
    finally:
        limiter.release()


def _answer(line: bytes, handlers: dict[str, Callable[[], Any]]) -> Any:
    try:
        request = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        return {"error": f"bad request: {exc}"}
    command = request.get("command") if isinstance(request, dict) else None
    handler = handlers.get(command) if isinstance(command, str) else None
    if handler is None:
        return {"error": f"unknown command {command!r}; try one of {sorted(handlers)}"}
    try:
        return handler()
    except Exception as exc:  # a bug in a handler: reported to the client, the daemon goes on
        log.exception("control command failed command=%s", command)
        return {"error": f"{command} failed: {exc!r}"}


async def _read_line(stream: trio.abc.ReceiveStream, limit: int) -> bytes:
    data = bytearray()
    while b"\n" not in data:
        chunk = await stream.receive_some(limit + 1 - len(data))
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError(f"longer than {limit} bytes")
    return bytes(data.split(b"\n", 1)[0])


def query(path: Path, command: str = "status") -> dict[str, Any]:
    """Ask the daemon at ``path`` (synchronous; for the CLI).

    Raises:
        ControlError: no daemon answers there, or the reply is not a JSON object.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(TIMEOUT)
        try:
            s.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            raise ControlError(f"no daemon is running (nothing answers on {path})") from None
        except OSError as exc:
            raise ControlError(f"cannot reach the daemon at {path}: {exc.strerror}") from None
        try:
            s.sendall(json.dumps({"command": command}).encode() + b"\n")
            data = bytearray()
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
                if len(data) > MAX_REPLY:
                    raise ControlError("the daemon's reply is too long")
        except socket.timeout:
            raise ControlError(f"the daemon at {path} did not answer within {TIMEOUT:g} s") from None
    try:
        reply = json.loads(data)
    except ValueError:
        raise ControlError("the daemon's reply is not JSON") from None
    if not isinstance(reply, dict):
        raise ControlError("the daemon's reply is not a JSON object")
    if "error" in reply:
        raise ControlError(f"the daemon says: {reply['error']}")
    return reply
