"""Every exception gossip raises.

All derive from :class:`GossipError`, so ``except gossip.GossipError`` catches everything the
library raises on purpose. Each docstring says whose fault the error is: ours (a bug or a
misuse of the API), the remote peer's (it sent something it must not), or nobody's (the
network or the clock).
"""

from __future__ import annotations

__all__ = [
    "GossipError",
    "IdentityError",
    "WireError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "BadMessage",
    "HandshakeError",
    "PeerTimeout",
    "PeerGone",
    "HandshakeClosed",
    "IdentityClash",
    "ChannelClosed",
    "SchemaMismatch",
    "DownloadFailed",
    "SchemaRefused",
    "ProcessLost",
    "ReplicasDiverged",
    "DeviceError",
]


class GossipError(Exception):
    """Base class of every error raised by gossip."""


class IdentityError(GossipError):
    """A node key file is missing, malformed, or readable by other users.

    The operator's fault: the message says which file and what to do about it.
    """


class WireError(GossipError):
    """Bytes that do not decode to a valid frame or message.

    Raised by the pure codec; whoever handed it the bytes decides who is at fault. Over a
    channel this surfaces as :class:`RemoteProtocolError`.
    """


class LocalProtocolError(GossipError):
    """We tried to do something the protocol does not allow.

    Our fault (a bug, or a misuse of the API): a record larger than
    :data:`~gossip.channel.MAX_RECORD`, two tasks sending (or two receiving) on one channel at
    once, a handshake step out of turn or after the end, a nonce counter run out.

    Using a channel that is no longer usable is not this error: after *we* closed it, or a
    send or receive of ours was cancelled mid-record, it raises :class:`ChannelClosed`; after
    a record of the peer's broke it, the :class:`RemoteProtocolError` again; after the peer
    went away or timed out, :class:`PeerGone` (:meth:`gossip.channel.SecureChannel.send`). A message field out of range, or a message too large
    to encode, is a ``ValueError`` from the message class or the codec.
    """


class RemoteProtocolError(GossipError):
    """The peer broke the protocol: a malformed, oversized, tampered, replayed or truncated
    record, or a message that is not valid at this point.

    The peer's fault. The connection is closed; nothing from the bad record was delivered.
    """


class BadMessage(RemoteProtocolError):
    """An authenticated record that is not a valid protocol message (it does not decode, or a
    field is out of range). Never an honest peer's of the same protocol version: the reference
    stops offering to a peer that answers an offer so (docs/PROTOCOL.md section 9.3).
    """


class HandshakeError(RemoteProtocolError):
    """The secure handshake failed: wrong swarm key, bad identity signature, protocol
    version or swarm mismatch, or a peer not on the allow-list.

    Usually the peer's fault, or a configuration mismatch between the two operators.
    """


class PeerTimeout(GossipError):
    """The peer did not answer within the deadline for this phase.

    Nobody's fault for sure: the peer may be slow, overloaded or gone, or the network lossy.
    The library raises it wherever it sets a deadline, in place of ``trio.TooSlowError``, so a
    caller catches :class:`GossipError` alone.

    Attributes:
        peer: whom we waited for, as the log names it: a peer id's short form, the address
            dialed, or ``"incoming"`` for a connection not yet identified.
        phase: what we waited for: ``"connect"``, ``"handshake"``, ``"offer"``,
            ``"transfer"``, ``"commit"``, ``"record"`` (a record begun and not finished), ...
    """

    def __init__(self, peer: object, phase: str) -> None:
        super().__init__(f"peer {peer} timed out during {phase}")
        self.peer = peer
        self.phase = phase


class PeerGone(GossipError):
    """The peer closed or reset the connection, or cannot be reached.

    The network's or the peer's doing (it crashed, left, or was never there); not a protocol
    violation.
    """


class HandshakeClosed(PeerGone):
    """The peer closed the connection right after our first handshake message.

    What a node holding another swarm key does (it cannot read that message, and answers
    nothing), so usually a configuration mismatch; or the peer crashed at that moment.
    """


class IdentityClash(GossipError):
    """Another node, at another address, runs with this node's identity.

    Two processes started from one identity key (a copied data directory, say). Neither
    can take part in the swarm while both run: give one of them a new identity.
    """

    def __init__(self, address: str) -> None:
        super().__init__(f"the node at {address} runs with this node's identity")
        self.address = address


class ChannelClosed(GossipError):
    """The channel was used after *we* closed it.

    Our fault: compare :class:`PeerGone`, which means the other side went away.
    """


class SchemaMismatch(GossipError):
    """Tensor data does not fit the schema of the local model (names, shapes, dtypes or
    sizes differ), or a payload is incomplete.

    The peer's fault when it comes from the network; ours when the caller passed the wrong
    model.
    """


class DownloadFailed(GossipError):
    """No peer gave us its state: every candidate asked failed or refused (the message says
    how many, and what the last one said). The local model is untouched.

    Nobody's fault for sure. Expected now and then while a swarm starts (no member is ready
    yet): log it, retry later. Within one download, a peer's refusal (``Close``) is this error
    too, logged and followed by the next candidate. A failed *exchange* raises nothing: it is
    logged, counted and skipped inside the node.
    """


class SchemaRefused(DownloadFailed):
    """A peer refused our state request because our model's schema is not its own: another
    model, or other task options. Asking that peer again will not help.

    The operator's to fix (on our side, or on the peer's): the message names the tensors that
    differ, and the task metadata, as far as the peer's answer lists them (gossip.mismatch).
    """


class ProcessLost(GossipError):
    """A collective of a node of several processes failed: another process of the node died
    or closed its end (:mod:`gossip.nodegroup`). Not the network's fault nor a peer's: the
    node must stop, and a restart resumes it from its checkpoint."""


class ReplicasDiverged(GossipError):
    """The processes of one node hold different parameters: a bug, or training code that
    does something different in one process (a step one process takes alone)."""


class DeviceError(GossipError, ValueError):
    """A device name that is malformed or names hardware this machine lacks (CUDA where
    there is none, a GPU index past the last, fewer GPUs than a node's processes): the
    caller's configuration is at fault (:mod:`gossip.devices`)."""
