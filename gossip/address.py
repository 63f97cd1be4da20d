"""Network addresses as text: ``host:port``, or ``[v6]:port`` for IPv6. Pure."""

from __future__ import annotations

import re

__all__ = ["parse_address", "format_address"]

_HOST = re.compile(r"[A-Za-z0-9._-]+")  # a host name or an IPv4 address
_IPV6 = re.compile(r"[0-9A-Fa-f:.]+(%[A-Za-z0-9._-]+)?")  # inside the brackets, with a zone


def parse_address(address: str) -> tuple[str, int]:
    """Split ``"host:port"`` (or ``"[v6]:port"``) into ``(host, port)``.

    Raises:
        ValueError: the string is not of that form or the port is out of range.
    """
    if not isinstance(address, str):
        raise ValueError(f"address must be a 'host:port' string, not {type(address).__name__}")
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not (port_text.isascii() and port_text.isdigit()):
        raise ValueError(f"bad address {address!r}: expected 'host:port'")
    if host.startswith("["):
        if not host.endswith("]") or not _IPV6.fullmatch(host[1:-1]):
            raise ValueError(f"bad address {address!r}: expected '[IPv6 address]:port'")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"bad address {address!r}: write IPv6 hosts as '[addr]:port'")
    elif not _HOST.fullmatch(host):
        # Addresses travel in peers' announcements and end up in logs and on terminals: no
        # spaces, control characters or escapes, only what a host name or an IP holds.
        raise ValueError(f"bad address {address!r}: a host is letters, digits, '.', '-' "
                         "and '_'")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError(f"bad address {address!r}: port out of range")
    return host, port


def format_address(host: str, port: int) -> str:
    """The inverse of :func:`parse_address`."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
