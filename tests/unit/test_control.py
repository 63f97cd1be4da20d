"""Tests for daemon.control over real Unix sockets: replies from handlers, the socket file's
mode and lifetime, bad requests answered without stopping the server, and claim() telling a
stale socket file from a live daemon's."""

from __future__ import annotations

import json
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from daemon.control import MAX_REQUEST, ControlError, claim, query, serve_control


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    path = tmp_path / "c.sock"
    assert len(str(path)) < 100, "tmp_path too long for a Unix socket"
    return path


def raw_request(path: Path, data: bytes) -> dict[str, Any]:
    """Send ``data`` as is, end the request, and read the one-line JSON reply (blocking; run
    it in a thread). Reads up to the newline, not to EOF: a server that closes with part of
    an oversized request unread makes the kernel reset the connection after the reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(path))
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = bytearray()
        while not reply.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, f"connection closed without a reply line: {bytes(reply)!r}"
            reply += chunk
    assert reply.count(b"\n") == 1, reply
    return json.loads(reply)


async def test_query_gets_the_handlers_reply(sock_path: Path) -> None:
    handlers = {"status": lambda: {"step": 12, "peers": ["a", "b"]},
                "ping": lambda: {"pong": True}}
    async with trio.open_nursery() as nursery:
        started = await nursery.start(serve_control, sock_path, handlers)
        assert started == sock_path
        assert await trio.to_thread.run_sync(query, sock_path) == {"step": 12, "peers": ["a", "b"]}
        assert await trio.to_thread.run_sync(query, sock_path, "ping") == {"pong": True}
        nursery.cancel_scope.cancel()


async def test_reply_is_made_json_with_str_for_other_values(sock_path: Path) -> None:
    handlers = {"status": lambda: {"path": Path("/x/y")}}
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, handlers)
        assert await trio.to_thread.run_sync(query, sock_path) == {"path": "/x/y"}
        nursery.cancel_scope.cancel()


async def test_socket_file_is_0600(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {})
        st = sock_path.lstat()
        assert stat.S_ISSOCK(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        nursery.cancel_scope.cancel()


async def test_socket_file_is_removed_when_cancelled(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {})
        assert sock_path.exists()
        nursery.cancel_scope.cancel()
    assert not sock_path.exists()
    assert not sock_path.is_symlink()


async def test_unknown_command(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": dict})
        with pytest.raises(ControlError, match="unknown command 'frobnicate'") as info:
            await trio.to_thread.run_sync(query, sock_path, "frobnicate")
        assert "status" in str(info.value)  # it says what the choices are
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("data", [
    b"this is not json\n",
    b"\xff\xfe\n",  # not UTF-8
    b'["status"]\n',  # JSON, not an object
    b'{"command": 5}\n',  # command not a string
    b"",  # nothing at all
], ids=["not-json", "not-utf8", "array", "int-command", "empty"])
async def test_bad_request_gets_an_error_and_the_server_keeps_serving(
        sock_path: Path, data: bytes) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"ok": 1}})
        reply = await trio.to_thread.run_sync(raw_request, sock_path, data)
        assert set(reply) == {"error"}
        assert await trio.to_thread.run_sync(query, sock_path) == {"ok": 1}
        nursery.cancel_scope.cancel()


async def test_request_without_newline_is_read_to_eof(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"ok": 1}})
        reply = await trio.to_thread.run_sync(raw_request, sock_path, b'{"command": "status"}')
        assert reply == {"ok": 1}
        nursery.cancel_scope.cancel()


async def test_oversized_request_gets_an_error_and_the_server_keeps_serving(
        sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"ok": 1}})
        big = json.dumps({"command": "x" * MAX_REQUEST}).encode() + b"\n"
        reply = await trio.to_thread.run_sync(raw_request, sock_path, big)
        assert f"longer than {MAX_REQUEST} bytes" in reply["error"]
        # through query() too (its command is the payload), which turns it into ControlError
        with pytest.raises(ControlError, match="longer than"):
            await trio.to_thread.run_sync(query, sock_path, "y" * (2 * MAX_REQUEST))
        assert await trio.to_thread.run_sync(query, sock_path) == {"ok": 1}
        nursery.cancel_scope.cancel()


async def test_request_of_exactly_max_request_bytes_is_served(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"ok": 1}})
        body = b'{"command": "status"}'
        padded = body + b" " * (MAX_REQUEST - len(body) - 1) + b"\n"
        assert len(padded) == MAX_REQUEST
        assert await trio.to_thread.run_sync(raw_request, sock_path, padded) == {"ok": 1}
        nursery.cancel_scope.cancel()


async def test_several_clients_at_once(sock_path: Path) -> None:
    calls = []

    def status() -> dict[str, int]:
        calls.append(1)
        return {"n": len(calls)}

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": status})
        replies: list[dict[str, Any]] = []

        async def one() -> None:
            replies.append(await trio.to_thread.run_sync(query, sock_path))

        async with trio.open_nursery() as clients:
            for _ in range(8):
                clients.start_soon(one)
        assert sorted(r["n"] for r in replies) == list(range(1, 9))
        nursery.cancel_scope.cancel()


# --- claim and query without a server -------------------------------------------------------


def test_query_with_nothing_there(sock_path: Path) -> None:
    with pytest.raises(ControlError, match="no daemon is running") as info:
        query(sock_path)
    assert str(sock_path) in str(info.value)


def test_query_on_a_stale_socket(sock_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))  # bound, never listening, then closed: a crashed daemon's file
    with pytest.raises(ControlError, match="no daemon is running"):
        query(sock_path)


def test_claim_with_nothing_there(sock_path: Path) -> None:
    claim(sock_path)
    assert not sock_path.exists()


def test_claim_never_removes_a_file_that_is_not_a_socket(sock_path: Path) -> None:
    sock_path.write_text("perhaps the swarm key, named by mistake")
    with pytest.raises(ControlError, match="not a socket"):
        claim(sock_path)
    assert sock_path.read_text().startswith("perhaps")


def test_claim_removes_a_dead_socket(sock_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))
        s.listen(1)
    assert stat.S_ISSOCK(sock_path.lstat().st_mode)
    claim(sock_path)
    assert not sock_path.exists()


def test_claim_never_removes_a_symlink(sock_path: Path) -> None:
    sock_path.symlink_to(sock_path.parent / "gone")
    with pytest.raises(ControlError, match="not a socket"):
        claim(sock_path)
    assert sock_path.is_symlink()


def test_claim_refuses_a_live_socket(sock_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))
        s.listen(1)
        with pytest.raises(ControlError, match="already running"):
            claim(sock_path)
        assert sock_path.exists()


# A client that connects and hangs up without reading (claim()'s own probe, a ^C'd
# `gossipd status`) must end that connection only, never the server or the daemon.


async def test_client_hanging_up_unread_does_not_stop_the_server(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"ok": 1}})
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(sock_path))  # the listen backlog takes it at once: no thread needed
        await trio.testing.wait_all_tasks_blocked()  # the server has handled the hang-up
        assert await trio.to_thread.run_sync(query, sock_path) == {"ok": 1}
        nursery.cancel_scope.cancel()


async def test_second_server_on_the_same_path_is_refused(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"first": True}})
        with pytest.raises(ControlError, match="already running"):
            await nursery.start(serve_control, sock_path, {})
        assert sock_path.exists()  # the refused server did not remove the live socket
        nursery.cancel_scope.cancel()


async def test_first_server_survives_a_refused_second_one(sock_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"first": True}})
        with pytest.raises(ControlError, match="already running"):
            await nursery.start(serve_control, sock_path, {})
        await trio.testing.wait_all_tasks_blocked()  # the server has handled claim()'s probe
        assert await trio.to_thread.run_sync(query, sock_path) == {"first": True}
        nursery.cancel_scope.cancel()


async def test_new_server_replaces_a_stale_socket(sock_path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock_path))
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_control, sock_path, {"status": lambda: {"new": True}})
        assert await trio.to_thread.run_sync(query, sock_path) == {"new": True}
        nursery.cancel_scope.cancel()


def test_claim_refuses_a_path_too_long(tmp_path: Path) -> None:
    path = tmp_path / ("d" * 60) / ("s" * 60 + ".sock")
    assert len(str(path)) > 100
    with pytest.raises(ControlError, match="too long") as info:
        claim(path)
    assert "node.control" in str(info.value)


async def test_serve_refuses_a_path_too_long(tmp_path: Path) -> None:
    path = tmp_path / ("s" * 101)
    async with trio.open_nursery() as nursery:
        with pytest.raises(ControlError, match="too long"):
            await nursery.start(serve_control, path, {})
    assert not path.exists()
