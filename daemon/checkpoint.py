"""Atomic, checksummed checkpoints in one directory, keeping the newest N.

Theory of operation
-------------------
A checkpoint is one file, ``checkpoint-<step>.ckpt``, the step written in decimal with zeros
in front to 12 digits at least. The step alone does not name a state: a node ahead of the swarm
pays a debt (its optimizer steps do not count for a while), so it saves different states at one
step, and with one name for them each save would replace the file of the one before. So a save
whose step already has a file in the directory, under the plain name or a repeat's name, set
aside or not, is a repeat: ``checkpoint-<step>.<k>.ckpt``, k one more than the largest that
step has (1 after the plain name), in decimal without zeros in front. Set-aside files
(``<name>.corrupt``, ``<name>.before-jump``) count because they keep their name with a suffix
added: a new file under the old name, set aside in its turn, would replace them. No save takes
a name that a file holds, so a file, once written, holds one state until it is deleted; a step
saved once, the common case, keeps the plain name, the one that older directories hold.

Checkpoints are ordered by step and then k, the plain name being k = 0, everywhere: listing,
pruning, resuming, the jump rule. That is not the order of the names (the name of repeat 1
sorts before the plain name, repeat 10 before repeat 2, and a step past 10^12 - 1 has more
digits), so :func:`checkpoints` orders by the numbers. A name that :func:`save` would not write
(extra zeros in front of the step, a k of 0, zeros in front of k) is not a checkpoint.

A checkpoint's bytes are::

    header   12 bytes   FORMAT: MAGIC b"GOSSIPCK" + VERSION as u32 little-endian
    payload  n bytes    exactly what torch.save(state, ...) writes (a torch zip archive)
    trailer  48 bytes   n as u64 little-endian
                        SHA-256 of header + payload (32 bytes)
                        END_MAGIC b"GOSSIPND"

Every truncation and every flipped byte is caught before a byte of the payload is unpickled:
a cut file is shorter than ``header + n + trailer`` or no longer ends in ``END_MAGIC``, and a
flipped byte breaks the magic, the version, the length or the digest. SHA-256 here detects
damage, not forgery: anyone who can write the directory can write a valid file. That is why
the payload is still read only with ``torch.load(weights_only=True, map_location="cpu")``,
which refuses pickles that name arbitrary classes or functions.

Writing (:func:`save`) streams: ``torch.save`` writes through :class:`_HashingWriter`, which
hashes each chunk on its way to the file, so the payload is never held in memory. The file is a
temp file in the same directory (``.<name>.<random>.tmp``, which :func:`checkpoints`
ignores), flushed, fsynced, renamed to the final name with
``os.replace``, and the directory fsynced (:func:`daemon.files.atomic_write`). Until the rename
the previous checkpoint is untouched, so a crash at any instant leaves the last completed
checkpoint on disk, plus at most a temp file, which the next save removes. After the rename,
all but the newest ``keep`` checkpoints are deleted, never the new one. A save whose step is
more than twice the newest checkpoint's plus :data:`JUMP_SLACK` first sets that one aside as
``<name>.before-jump``, out of the pruning's reach: the order follows the step, so a step taken
from a lying peer would otherwise prune every checkpoint from before it (the newest ``keep`` of
those are kept, and :func:`load_latest` does not read them: resuming from one is the operator's
choice). One process writes a directory at a time (the daemon's trainer): a second writer's
temp file would be taken for a stale one.

Reading (:func:`load`) reads the file once, verifies it, and only then unpickles.
:func:`load_latest` walks back from the newest checkpoint, logging and skipping each that
fails verification. Costs: a save writes the state once and hashes it once (SHA-256 runs at
about 1 GB/s per core); a load holds the file's bytes and the loaded state at the same time.

While the daemon runs, :class:`Checkpointer` is that one writer: it saves a state the training
loop copied between chunks, in a worker thread, one save at a time (the loop skips a periodic
checkpoint while one is still being written), and logs, counts and remembers each.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import logging
import os
import random
import re
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch
import trio

from gossip.lowlevel import MAX_COUNT

from .files import TEMP_SUFFIX, atomic_write
from .logs import RUN

__all__ = [
    "CheckpointError", "Checkpointer", "FORMAT", "MAGIC", "VERSION", "END_MAGIC", "MAX_STEP",
    "save", "load", "load_latest", "checkpoints", "capture_rng", "restore_rng",
    "torch_load_reason",
]

log = logging.getLogger(__name__)
run_log = logging.getLogger(RUN)

MAGIC = b"GOSSIPCK"
VERSION = 1
FORMAT = MAGIC + struct.pack("<I", VERSION)  # the 12 bytes every checkpoint starts with
END_MAGIC = b"GOSSIPND"
_TRAILER = struct.Struct("<Q32s8s")  # payload length, SHA-256(header + payload), END_MAGIC
MAX_STEP = MAX_COUNT  # the protocol's counter range: any step a peer can give us
_NAME = re.compile(r"checkpoint-(\d{12,16})(?:\.(\d{1,16}))?\.ckpt")  # step, then k (repeats)
_TEMP_PREFIX = ".checkpoint-"  # and files.TEMP_SUFFIX: the temp file of a save
# A save more than twice the newest checkpoint's step, plus this, is a jump: more than one
# exchange may move a step (gossip.standing.step_move caps a move up at the step plus the same
# slack, MOVE_SLACK, which is not public API: the daemon keeps its own copy of the number). Honestly a restart far behind the swarm; a peer's lie otherwise: the checkpoint
# before it is kept aside (BEFORE_JUMP), out of the pruning's reach.
JUMP_SLACK = 100_000
BEFORE_JUMP = ".before-jump"
_CORRUPT = ".corrupt"  # an unusable checkpoint set aside by load_latest


class CheckpointError(Exception):
    """A checkpoint file is torn, corrupt or not ours. Nobody's fault in the code: the disk,
    a crash outside our write protocol, or someone else's file. The message names the file
    and why; :attr:`path` and :attr:`reason` hold the two parts."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class _HashingWriter:
    """The file-like object torch.save writes to: hashes each chunk, then passes it on.
    Keeps the first OSError, which torch's zip writer would otherwise bury under a
    RuntimeError of its own."""

    def __init__(self, f: BinaryIO, digest: Any) -> None:
        self._f = f
        self._digest = digest
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        try:
            self._f.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        self._f.flush()


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name} must be an int in [{low}, {high}], got {value!r}")
    return value


def save(directory: Path, state: Mapping[str, Any], *, step: int, keep: int) -> Path:
    """Write ``state`` as the checkpoint for ``step``, atomically, then prune old ones.

    Creates ``directory`` (mode 0700) if missing and removes temp files left by a crash.
    The file is ``checkpoint-<step>.ckpt``, or, when that step already has a name in the
    directory, ``checkpoint-<step>.<k>.ckpt`` with k one more than its largest (see the module
    docstring): no file is ever replaced. After the rename, all but the newest ``keep``
    checkpoints (by step, then k) are deleted, never the one just written.

    Args:
        directory: where checkpoints live.
        state: anything ``torch.load(weights_only=True)`` can read back: tensors, dicts,
            lists, tuples, str, int, float, bool, None.
        step: the training step, 0 to :data:`MAX_STEP`; it names the file, with k.
        keep: how many checkpoints to keep, at least 1.

    Returns:
        The path of the new checkpoint.

    Raises:
        ValueError: ``step`` or ``keep`` is out of range.
        OSError: the disk refused; the previous checkpoints are untouched.
        Exception: whatever torch.save raises for an unpicklable state; nothing is written.
    """
    _check_int("step", step, 0, MAX_STEP)
    _check_int("keep", keep, 1, MAX_STEP)
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    repeats: list[int] = []  # the k of each name this step has, set-aside ones included
    for name in os.listdir(directory):
        stale = directory / name
        if name.startswith(_TEMP_PREFIX) and name.endswith(TEMP_SUFFIX) and stale.is_file():
            log.warning("checkpoint stale temp removed path=%s", stale)
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
            continue
        for suffix in (BEFORE_JUMP, _CORRUPT):  # a set-aside file keeps its name too
            if name.endswith(suffix):
                name = name[:-len(suffix)]
                break
        key = _key(name)
        if key is not None and key[0] == step:
            repeats.append(key[1])

    path = directory / _name(step, max(repeats) + 1 if repeats else 0)
    started = time.monotonic()
    size = 0

    def write(f: BinaryIO) -> None:
        nonlocal size
        digest = hashlib.sha256(FORMAT)
        f.write(FORMAT)
        payload = _HashingWriter(f, digest)
        try:
            torch.save(dict(state), payload)
        except Exception:
            if payload.error is not None:  # the disk failed: say so, not torch's echo of it
                raise payload.error from None
            raise
        f.write(_TRAILER.pack(payload.size, digest.digest(), END_MAGIC))
        size = len(FORMAT) + payload.size + _TRAILER.size

    before = checkpoints(directory)
    atomic_write(path, write)
    log.debug("checkpoint saved path=%s step=%d bytes=%d seconds=%.3f",
              path, step, size, time.monotonic() - started)
    if before and before[-1] != path and step > jump_bound(_key_of(before[-1])[0]):
        _keep_before_jump(before[-1], step, keep)

    for old in checkpoints(directory)[:-keep]:
        if old != path:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
            log.info("checkpoint pruned path=%s", old)
    return path


def load(path: Path) -> dict[str, Any]:
    """Read one checkpoint, verify it, and only then unpickle it (weights only, onto the CPU).

    Args:
        path: a checkpoint file.

    Returns:
        The state as saved (a dict with str keys).

    Raises:
        CheckpointError: unreadable, truncated, wrong magic or version, bad length or digest,
            or a payload that ``torch.load(weights_only=True)`` refuses or that is not a dict.
    """
    path = Path(path)
    least = len(FORMAT) + _TRAILER.size
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < least:
                raise CheckpointError(path, f"truncated: {size} bytes, a checkpoint has at "
                                            f"least {least}")
            header = f.read(len(FORMAT))
            payload = f.read(size - least)
            trailer = f.read()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from exc

    if header[:len(MAGIC)] != MAGIC:
        raise CheckpointError(path, "not a gossipd checkpoint (bad magic)")
    if header != FORMAT:
        version = struct.unpack("<I", header[len(MAGIC):])[0]
        raise CheckpointError(path, f"format version {version}, this build reads {VERSION}")
    if len(trailer) != _TRAILER.size:
        raise CheckpointError(path, "file changed while being read")
    length, digest, end = _TRAILER.unpack(trailer)
    if end != END_MAGIC:
        raise CheckpointError(path, "truncated or damaged (bad end magic)")
    if length != len(payload):
        raise CheckpointError(path, f"truncated or damaged: trailer says {length} payload "
                                    f"bytes, file holds {len(payload)}")
    actual = hashlib.sha256(header)
    actual.update(payload)  # not header + payload: that would copy the payload
    if not hmac.compare_digest(digest, actual.digest()):
        raise CheckpointError(path, "damaged: SHA-256 mismatch")

    try:
        # BytesIO over a bytes object shares it: no copy of the payload.
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch.load raises many types on hostile bytes; all mean "refused"
        raise CheckpointError(path, f"payload refused by torch.load(weights_only=True): "
                                    f"{torch_load_reason(exc)}") from exc
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(path, f"payload is a {type(state).__name__}, not a dict with "
                                    "str keys")
    return state


def torch_load_reason(exc: BaseException) -> str:
    """One line saying why torch.load refused a file: torch's weights_only message is a page
    whose first line is boilerplate (advising ``weights_only=False``, which we never do) and
    whose cause is in the middle."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines
              if not line.startswith(("Weights only load failed", "Check the documentation"))]
    text = (useful or lines or [""])[0]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_latest(directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint in ``directory`` that verifies, skipping (and logging) newer
    ones that do not.

    Args:
        directory: where checkpoints live; it may be missing.

    Returns:
        ``(path, state)``, or None if the directory is missing or holds no valid checkpoint.
    """
    for path in reversed(checkpoints(directory)):
        log.info("loading checkpoint path=%s", path)  # a large one takes a while: say so
        try:
            return path, load(path)
        except CheckpointError as exc:
            log.warning("checkpoint unusable path=%s reason=%s; trying the previous one",
                        path, exc.reason)
            _set_aside(path)
    return None


def _set_aside(path: Path) -> None:
    """Rename an unusable checkpoint to ``<name>.corrupt``: kept for a post-mortem, out of
    :func:`checkpoints`, so that it is not tried again and, being newer than the checkpoints
    written after resuming, does not make pruning delete those."""
    target = path.with_name(path.name + _CORRUPT)
    try:
        os.replace(path, target)
    except OSError as exc:
        log.warning("cannot set aside checkpoint path=%s error=%s", path, exc.strerror)
    else:
        log.info("checkpoint set aside path=%s", target)


def checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory`` by step and then k (the plain name first), oldest
    first, without verifying them.

    Temp files and anything not named as :func:`save` names a checkpoint (the step to 12
    digits at least, no extra zeros in front; a k of 1 or more, no zeros in front) are
    ignored; a missing directory has none.
    """
    directory = Path(directory)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    keys: dict[str, tuple[int, int]] = {}
    for name in names:
        key = _key(name)
        if key is not None and (directory / name).is_file():
            keys[name] = key
    return [directory / n for n in sorted(keys, key=keys.__getitem__)]


def _name(step: int, k: int = 0) -> str:
    """The name :func:`save` gives the checkpoint of ``step`` written after k others of it."""
    return f"checkpoint-{step:012d}.ckpt" if k == 0 else f"checkpoint-{step:012d}.{k}.ckpt"


def _key(name: str) -> tuple[int, int] | None:
    """``(step, k)`` of a checkpoint's name (k 0 for the plain name), or None for a name
    :func:`save` does not write."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    key = int(match[1]), int(match[2] or 0)
    return key if _name(*key) == name else None


def _key_of(path: Path) -> tuple[int, int]:
    key = _key(path.name)
    assert key is not None  # checkpoints() lists only such names
    return key


def jump_bound(step: int) -> int:
    """The largest step a save may follow a checkpoint of ``step`` with before it counts as
    a jump: twice the step, plus :data:`JUMP_SLACK`."""
    return 2 * step + JUMP_SLACK


def _keep_before_jump(newest: Path, step: int, keep: int) -> None:
    """The step jumped past :func:`jump_bound` of the newest checkpoint before it: set that
    one aside as ``<name>.before-jump``, out of the pruning's reach (and of
    :func:`load_latest`'s), so that a step taken from a lying peer cannot prune away every
    checkpoint from before it. At most ``keep`` are kept, the newest."""
    kept = newest.with_name(newest.name + BEFORE_JUMP)
    with contextlib.suppress(FileNotFoundError):
        os.replace(newest, kept)  # no file holds that name: save gave newest's name a new one
        log.warning("checkpoint step jumped from %d to %d: the one before it is kept at %s "
                    "(to resume from it, rename it to %s and move the newer ones away)",
                    _key_of(newest)[0], step, kept, newest.name)
    olds: dict[Path, tuple[int, int]] = {}
    for old in kept.parent.glob(f"checkpoint-*{BEFORE_JUMP}"):
        key = _key(old.name[:-len(BEFORE_JUMP)])
        if key is not None:
            olds[old] = key
    for old in sorted(olds, key=olds.__getitem__)[:-keep]:
        with contextlib.suppress(FileNotFoundError):
            old.unlink()


def capture_rng() -> dict[str, Any]:
    """The random generators' states, in a form ``torch.load(weights_only=True)`` reads.

    Returns:
        ``{"python": [version, [ints...], gauss_next], "torch": uint8 tensor}``, plus
        ``"cuda": [uint8 tensor per device]`` when CUDA has been initialized (when it has
        not, no CUDA generator has been used, so there is nothing to save).
    """
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss_next],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        state["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the generators' states from :func:`capture_rng`.

    A missing ``"cuda"`` entry is fine; a CUDA state for a different number of devices (or
    for a machine without CUDA) is logged and skipped, since the draws cannot match anyway.

    Raises:
        ValueError: the python or torch state is missing or malformed; nothing is changed.
    """
    try:
        version, internal, gauss_next = state["python"]
        python = (int(version), tuple(int(x) for x in internal),
                  None if gauss_next is None else float(gauss_next))
        cpu = state["torch"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"rng state malformed: {type(exc).__name__}: {exc}") from exc
    expected = torch.get_rng_state()
    if (not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8
            or cpu.shape != expected.shape):
        raise ValueError(f"rng state malformed: torch state is not a uint8 tensor of shape "
                         f"{tuple(expected.shape)}")
    random.setstate(python)
    torch.set_rng_state(cpu.cpu())

    cuda = state.get("cuda")
    if cuda is None:
        return
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda) != available:
        log.warning("rng cuda state skipped saved_devices=%d devices=%d", len(cuda), available)
        return
    torch.cuda.set_rng_state_all(cuda)


class Checkpointer:
    """The running daemon's checkpoints in ``directory``, the newest ``keep`` kept: one save
    at a time, in a worker thread; each logged, counted in ``metrics`` and told to ``event``
    (the metrics log).

    Args:
        metrics: has ``checkpointed(seconds)`` and ``checkpoint_failures`` (a counter).
        event: ``event(name, **fields)``, the metrics log's.
    """

    def __init__(self, directory: Path, keep: int, metrics: Any,
                 event: Callable[..., None]) -> None:
        self.directory = directory
        self.keep = keep
        self.metrics = metrics
        self.event = event
        self.last: dict[str, Any] | None = None  # the newest written: path, step, time
        self._writing = trio.Lock()  # one save at a time

    @property
    def busy(self) -> bool:
        """Whether a save is under way."""
        return self._writing.locked()

    async def write(self, state: Mapping[str, Any]) -> None:
        """Save ``state`` (a :meth:`daemon.train.Trainer.state`) as the checkpoint of its step.

        Raises:
            OSError: the disk refused; the previous checkpoint is still there.
        """
        async with self._writing:
            started = time.monotonic()
            step = state["counters"]["step"]
            path = await trio.to_thread.run_sync(
                lambda: save(self.directory, state, step=step, keep=self.keep))
            seconds = time.monotonic() - started
            self.metrics.checkpointed(seconds)
            self.last = {"path": str(path), "step": step, "time": time.time()}
            run_log.info("checkpoint path=%s step=%d seconds=%.2f", path, step, seconds)
            self.event("checkpoint", path=str(path), step=step, seconds=round(seconds, 3))

    async def write_periodic(self, state: Mapping[str, Any]) -> None:
        """:meth:`write` while training: a failure (disk full) is logged and training goes
        on; the previous checkpoint is still there."""
        try:
            await self.write(state)
        except OSError as exc:
            self.metrics.checkpoint_failures.inc()
            run_log.error("checkpoint failed dir=%s error=%s; training goes on",
                          self.directory, exc)
