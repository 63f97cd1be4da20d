"""A server of named fault proxies with a small HTTP/1.1 JSON control API, and its CLI.

Theory of operation
-------------------
:func:`open_proxy_server` serves the control API on one TCP address and keeps a table of
named :class:`~gossip.testing.proxy.FaultProxy` instances, each serving in the server's
nursery until it is deleted. Tests that run real daemons as subprocesses start it with
``python -m gossip.testing.proxy`` (or :meth:`ProxyClient.spawn`) and drive it with the
synchronous :class:`~gossip.testing.proxyclient.ProxyClient`.

The HTTP handling is deliberately tiny: one request per connection (``Connection: close``),
a Content-Length body (no chunked encoding), the request head and body together at most
MAX_REQUEST_BYTES, and the whole request read within REQUEST_DEADLINE. Every answer is JSON;
errors are ``{"error": "one line"}`` with 400 (malformed request, bad JSON, unknown field,
bad value), 404 (no such proxy or endpoint), 405, 408, 409 (name or address taken) or 413.
A request the server cannot parse costs that connection only.

=======  ========================  ===========================================================
method   path                      does
=======  ========================  ===========================================================
GET      /proxies                  ``{"proxies": [proxy, ...]}``
POST     /proxies                  ``{"name", "listen", "upstream"}`` -> 201, proxy (bound listen)
GET      /proxies/NAME             proxy: name, listen, upstream, faults, statistics
POST     /proxies/NAME/faults      partial update of the faults -> proxy
DELETE   /proxies/NAME/faults      clear every fault -> proxy
POST     /proxies/NAME/reset       reset every open connection -> ``{"reset": count}``
DELETE   /proxies/NAME             stop the proxy -> ``{"removed": NAME}``
=======  ========================  ===========================================================
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import json
import logging
import re
import signal
import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from ..address import parse_address
from ..groups import one_error
from ..network import TcpNetwork
from .proxy import FaultProxy
from .proxyfaults import FAULT_FIELDS

__all__ = ["ProxyServer", "open_proxy_server", "main"]

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 64 * 1024  # request line, headers and body together
REQUEST_DEADLINE = 10.0  # s to receive a whole request (and to send the answer)
LINGER_BYTES = 1024 * 1024  # request bytes drained after answering, so the answer arrives
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_REASONS = {200: "OK", 201: "Created", 400: "Bad Request", 404: "Not Found",
            405: "Method Not Allowed", 408: "Request Timeout", 409: "Conflict",
            413: "Content Too Large", 500: "Internal Server Error"}


class _HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class _Request:
    method: str
    path: str
    body: bytes


class ProxyServer:
    """The named proxies of one control server. Made by :func:`open_proxy_server`."""

    def __init__(self, nursery: trio.Nursery, seed: int) -> None:
        self._nursery = nursery
        self._seed = seed
        self._proxies: dict[str, FaultProxy] = {}
        self.address: str | None = None  # the control API's "host:port"

    @property
    def proxies(self) -> dict[str, FaultProxy]:
        """A copy of the table: name -> proxy."""
        return dict(self._proxies)

    async def create(self, name: str, listen: str, upstream: str) -> FaultProxy:
        """Start a proxy named ``name``; its seed derives from the server's seed and the name.

        Raises:
            ValueError: a bad name or address.
            KeyError: the name is taken.
            OSError: ``listen`` cannot be bound.
        """
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ValueError(f"name must match {NAME.pattern}, not {name!r}")
        if name in self._proxies:
            raise KeyError(name)
        proxy = FaultProxy(listen, upstream, seed=_derive_seed(self._seed, name))
        self._proxies[name] = proxy  # reserved while binding: a concurrent create gets 409
        try:
            await self._nursery.start(proxy.serve)
        except BaseException:
            del self._proxies[name]
            raise
        log.info("proxy created name=%s listen=%s upstream=%s", name, proxy.address, upstream)
        return proxy

    def remove(self, name: str) -> None:
        """Stop the proxy named ``name`` and close its connections.

        Raises:
            KeyError: no such proxy.
        """
        self._proxies.pop(name).close()
        log.info("proxy removed name=%s", name)

    async def _serve(self, control: str, *, task_status: trio.TaskStatus[str]) -> None:
        await TcpNetwork().serve(control, self._handle, task_status=task_status)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        try:
            with trio.fail_after(REQUEST_DEADLINE):
                request = await _read_request(stream)
        except _HttpError as exc:
            status, body = exc.status, {"error": str(exc)}
        except trio.TooSlowError:
            status, body = 408, {"error": f"request not received within {REQUEST_DEADLINE:g} s"}
        else:
            try:
                status, body = await self._dispatch(request)
            except _HttpError as exc:
                status, body = exc.status, {"error": str(exc)}
            except Exception as exc:  # a bug: answer 500 and keep serving, loudly
                log.exception("control request failed method=%s path=%s", request.method, request.path)
                status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        payload = (json.dumps(body) + "\n").encode()
        head = (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
        with trio.move_on_after(REQUEST_DEADLINE):
            await stream.send_all(head + payload)
            # Drain what the client still sends (an oversized body) before closing: closing
            # with unread bytes resets the connection, and the client might lose the answer.
            await stream.send_eof()
            drained = 0
            while drained < LINGER_BYTES and (data := await stream.receive_some(64 * 1024)):
                drained += len(data)

    async def _dispatch(self, request: _Request) -> tuple[int, Any]:
        parts = request.path.split("/")
        if len(parts) < 2 or parts[0] != "" or parts[1] != "proxies" or len(parts) > 4:
            raise _HttpError(404, f"no such endpoint {request.path}")
        if len(parts) == 2:
            _allow(request, "GET", "POST")
            if request.method == "GET":
                return 200, {"proxies": [self._describe(n) for n in sorted(self._proxies)]}
            return await self._create(_json_object(request.body))
        name = parts[2]
        if name not in self._proxies:
            raise _HttpError(404, f"no proxy named {name!r}")
        proxy = self._proxies[name]
        if len(parts) == 3:
            _allow(request, "GET", "DELETE")
            if request.method == "GET":
                return 200, self._describe(name)
            self.remove(name)
            return 200, {"removed": name}
        if parts[3] == "faults":
            _allow(request, "POST", "DELETE")
            if request.method == "DELETE":
                proxy.clear()
                return 200, self._describe(name)
            changes = _json_object(request.body)
            unknown = sorted(set(changes) - set(FAULT_FIELDS))
            if unknown:
                raise _HttpError(400, f"unknown fault {unknown[0]!r}; known: {', '.join(FAULT_FIELDS)}")
            try:
                proxy.configure(**changes)
            except ValueError as exc:
                raise _HttpError(400, str(exc)) from None
            return 200, self._describe(name)
        if parts[3] == "reset":
            _allow(request, "POST")
            return 200, {"reset": proxy.reset()}
        raise _HttpError(404, f"no such endpoint {request.path}")

    async def _create(self, fields: dict[str, Any]) -> tuple[int, Any]:
        expected = {"name", "listen", "upstream"}
        if set(fields) != expected:
            extra = sorted(set(fields) - expected)
            raise _HttpError(400, f"unknown field {extra[0]!r}" if extra
                             else f"missing field {sorted(expected - set(fields))[0]!r}")
        for key in sorted(expected):
            if not isinstance(fields[key], str):
                raise _HttpError(400, f"{key} must be a string")
        name = fields["name"]
        try:
            await self.create(name, fields["listen"], fields["upstream"])
        except KeyError:
            raise _HttpError(409, f"a proxy named {name!r} exists") from None
        except ValueError as exc:
            raise _HttpError(400, str(exc)) from None
        except OSError as exc:
            status = 409 if exc.errno == errno.EADDRINUSE else 400
            raise _HttpError(status, f"cannot listen on {fields['listen']} or resolve "
                                     f"{fields['upstream']}: {exc.strerror or exc}") from None
        return 201, self._describe(name)

    def _describe(self, name: str) -> dict[str, Any]:
        proxy = self._proxies[name]
        return {"name": name, "listen": proxy.address, "upstream": proxy.upstream,
                "faults": proxy.faults.as_dict(),
                "statistics": dataclasses.asdict(proxy.statistics())}


def _derive_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "big")


def _allow(request: _Request, *methods: str) -> None:
    if request.method not in methods:
        raise _HttpError(405, f"{request.method} not allowed on {request.path}; use {' or '.join(methods)}")


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise _HttpError(400, f"bad JSON: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if not isinstance(value, dict):
        raise _HttpError(400, "the body must be a JSON object")
    return value


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


async def _read_request(stream: trio.abc.Stream) -> _Request:
    buffer = bytearray()
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) >= MAX_REQUEST_BYTES:
            raise _HttpError(413, f"request head larger than {MAX_REQUEST_BYTES} bytes")
        data = await stream.receive_some(MAX_REQUEST_BYTES - len(buffer))
        if not data:
            raise _HttpError(400, "connection closed before the end of the request head")
        buffer += data
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    request_line = lines[0].split(" ")
    if (len(request_line) != 3 or not request_line[0].isalpha() or not request_line[0].isupper()
            or not request_line[1].startswith("/") or not request_line[2].startswith("HTTP/1.")):
        raise _HttpError(400, "not an HTTP/1.1 request line")
    method, target, _ = request_line
    headers: dict[str, str] = {}
    for line in lines[1:]:
        key, sep, value = line.partition(":")
        if not sep or not key or key != key.strip():
            raise _HttpError(400, "malformed header line")
        key, value = key.lower(), value.strip()
        if key in headers and key == "content-length" and headers[key] != value:
            raise _HttpError(400, "conflicting Content-Length headers")
        headers[key] = value
    if "transfer-encoding" in headers:
        raise _HttpError(400, "Transfer-Encoding is not supported; send Content-Length")
    length_text = headers.get("content-length", "0")
    if not (length_text.isascii() and length_text.isdigit()):
        raise _HttpError(400, "bad Content-Length")
    length = int(length_text)
    if end + 4 + length > MAX_REQUEST_BYTES:
        raise _HttpError(413, f"request larger than {MAX_REQUEST_BYTES} bytes")
    body = bytearray(buffer[end + 4:])
    while len(body) < length:
        data = await stream.receive_some(length - len(body))
        if not data:
            raise _HttpError(400, "connection closed before the end of the body")
        body += data
    return _Request(method, target.partition("?")[0], bytes(body[:length]))


@asynccontextmanager
async def open_proxy_server(control: str = "127.0.0.1:0", *, seed: int = 0) -> AsyncIterator[ProxyServer]:
    """Serve the control API on ``control``; every proxy it made stops on exit.

    Args:
        control: ``"host:port"`` of the control API (port 0 picks one: ``server.address``).
        seed: each proxy's seed derives from it and the proxy's name.

    Raises:
        OSError: ``control`` cannot be bound.
    """
    with one_error():
        async with trio.open_nursery() as nursery:
            server = ProxyServer(nursery, seed)
            server.address = await nursery.start(server._serve, control)
            try:
                yield server
            finally:
                nursery.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    """``python -m gossip.testing.proxy``: run a control server until SIGTERM or SIGINT.

    Prints ``control=HOST:PORT`` on stdout once listening. Returns the exit status.
    """
    parser = argparse.ArgumentParser(prog="python -m gossip.testing.proxy",
                                     description="Fault-injection proxies behind an HTTP API.")
    parser.add_argument("--control", default="127.0.0.1:0", help="host:port of the control API")
    parser.add_argument("--seed", type=int, default=0, help="seeds every proxy's randomness")
    parser.add_argument("--log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="stderr log level")
    args = parser.parse_args(argv)
    try:
        parse_address(args.control)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        trio.run(_serve_until_signal, args.control, args.seed)
    except OSError as exc:
        print(f"proxy: cannot listen on {args.control}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


async def _serve_until_signal(control: str, seed: int) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with open_proxy_server(control, seed=seed) as server:
            print(f"control={server.address}", flush=True)
            async for signum in signals:
                log.info("proxy server stopping signal=%s", signal.Signals(signum).name)
                break
