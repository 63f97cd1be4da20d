"""Where a model trains: the one resolver of the device names a user writes.

A device name is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``. Everything that turns one into a
:class:`torch.device` calls :func:`resolve` (the daemon's ``check-config`` and ``run``, the
followers of a node of several processes, and a library user's script), so that a name
``check-config`` accepts is one that ``run`` starts with, and a CUDA device always comes back
with an explicit index: ``torch.cuda.set_device`` (which a trainer thread needs, since new
threads start on device 0) refuses ``torch.device("cuda")``, and two parts of one process that
resolve ``cuda`` at different moments could otherwise disagree on which GPU it means.

The rules, for process ``local_rank`` of a node of ``processes`` (1 for a plain daemon or
script):

==========  ===========================  ================================================
name        CUDA present                 no CUDA
==========  ===========================  ================================================
``auto``    ``cuda:local_rank``          ``cpu``
``cuda``    ``cuda:local_rank``          error
``cuda:N``  ``cuda:N`` (one process)     error
``cpu``     ``cpu``                      ``cpu``
==========  ===========================  ================================================

A node of several processes takes one GPU per process, so it needs at least as many GPUs as
processes, and ``cuda:N`` (one GPU) is refused for it. Under ``torchrun``, ``local_rank``
defaults to ``LOCAL_RANK`` from the environment.

Only :func:`resolve` imports torch, on its first call: the daemon's configuration checks a
name's spelling with :func:`valid_name` in commands that must answer in milliseconds.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from .errors import DeviceError

if TYPE_CHECKING:
    import torch

__all__ = ["NAMES", "DeviceError", "resolve", "valid_name"]

NAMES = "auto, cpu, cuda or cuda:N"  # what an error says a name may be
_NAME = re.compile(r"auto|cpu|cuda(?::([0-9]+))?")


def valid_name(name: object) -> bool:
    """Whether ``name`` is spelled as a device name (it may still not exist here)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def resolve(name: str = "auto", *, local_rank: int | None = None,
            processes: int | None = None, what: str = "device") -> torch.device:
    """The device of process ``local_rank`` of a node of ``processes``, by the rules above.

    Args:
        name: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.
        local_rank: this process's GPU among the node's; None: ``LOCAL_RANK`` from the
            environment (``torchrun`` sets it), else 0.
        processes: how many training processes the node has, one GPU each; None:
            ``LOCAL_WORLD_SIZE`` from the environment (``torchrun``), else 1.
        what: how an error names the setting (the daemon's says ``task.device``).

    Returns:
        ``torch.device("cpu")`` or ``torch.device("cuda", index)``, never an index-less CUDA
        device.

    Raises:
        DeviceError: a malformed name, CUDA asked for where there is none, no such GPU, fewer
            GPUs than processes, or one GPU named for several processes.
    """
    import torch

    match = _NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise DeviceError(f"{what} {name!r} is not {NAMES}")
    if local_rank is None:
        local_rank = _environ("LOCAL_RANK", 0)
    if processes is None:
        processes = _environ("LOCAL_WORLD_SIZE", 1)
    if not 0 <= local_rank < processes:
        raise DeviceError(f"local rank {local_rank} is not in 0..{processes - 1}")
    if name == "cpu" or name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    index = match.group(1)
    if index is not None and processes > 1:
        raise DeviceError(f"{what} {name!r} names one GPU, but this node has {processes} "
                          f"processes, one GPU each: use auto or cuda (process r takes "
                          f"cuda:r), or cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"{what} {name!r} asks for CUDA, which is not available here")
    count = torch.cuda.device_count()
    if index is not None:
        if int(index) >= count:
            raise DeviceError(f"{what} {name!r}: this machine has {count} CUDA device(s), "
                              f"cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", int(index))
    if processes > count:
        raise DeviceError(f"{what} {name!r}: this node has {processes} processes, one GPU "
                          f"each, but this machine has {count} CUDA device(s): use at most "
                          f"{count} processes, or cpu")
    return torch.device("cuda", local_rank)


def _environ(variable: str, default: int) -> int:
    """An integer variable of the environment (torchrun's), ``default`` when it is unset.

    Raises:
        DeviceError: it is set but not a non-negative integer.
    """
    value = os.environ.get(variable)
    if value is None:
        return default
    if not value.isdigit():
        raise DeviceError(f"{variable}={value!r} is not a non-negative integer")
    return int(value)
