"""When the training loop does what it does: the stop flag and the "is it due" helpers.

Pure but for :class:`Stop`, which bridges the trainer's thread and trio: :func:`due` and
:class:`Cadence` are tested without trio (tests/unit/test_train_cadence.py), and
:class:`daemon.train.Training` reads them between chunks.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import trio

if TYPE_CHECKING:
    from .config import Config

__all__ = ["Cadence", "Stop", "due"]


class Stop:
    """The daemon's one stop flag: a signal, ``task.max_steps`` and a lost process of the node
    set it; the trainer's thread reads it after every step (the chunk in flight ends after its
    step); trio tasks wait on it. Hooks given to :meth:`on_set` run once, when it is set.

    :meth:`set` and :meth:`is_set` may be called from any thread: off trio's thread, the trio
    side (waking :meth:`wait`, running the hooks) is handed to trio's thread.
    """

    def __init__(self) -> None:
        self._flag = threading.Event()  # what the trainer's thread reads
        self._woken = trio.Event()  # the same fact, for trio tasks in wait()
        self._hooks: list[Callable[[], None]] = []
        self._token: trio.lowlevel.TrioToken | None = None  # trio's, once a task used us

    def set(self) -> None:
        self._flag.set()
        if self._token is None or _on_trio_thread():
            self._wake()
        else:
            self._token.run_sync_soon(self._wake)

    def _wake(self) -> None:
        self._woken.set()
        hooks, self._hooks = self._hooks, []
        for hook in hooks:
            hook()

    def is_set(self) -> bool:
        return self._flag.is_set()

    async def wait(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        await self._woken.wait()

    def on_set(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` (on trio's thread) when the flag is set: now, if it already is."""
        if _on_trio_thread():
            self._token = trio.lowlevel.current_trio_token()
        if self._woken.is_set():
            hook()
        else:
            self._hooks.append(hook)


def _on_trio_thread() -> bool:
    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return False
    return True


def due(now: float, last: float, interval: float) -> bool:
    """Whether a thing done every ``interval`` seconds, last at ``last``, is due at ``now``
    (0: every time it is asked; ``math.inf``: never)."""
    return now >= last + interval


@dataclass(frozen=True)
class Cadence:
    """How often the loop does what it does between chunks (all from the config)."""

    chunk: float  # s of steps in one chunk, between two looks at the clock: task.chunk
    progress: float  # s between progress lines: task.progress_interval (0: every chunk)
    checkpoint: float  # s between periodic checkpoints: checkpoint.interval
    evaluate: float  # s between evaluations: task.eval_interval (0 there: inf, never)
    max_steps: int  # steps this run takes, then stops: task.max_steps (0: no limit)

    @classmethod
    def of(cls, config: Config, can_evaluate: bool) -> Cadence:
        """The config's cadence; no evaluation when the task has no ``evaluate()``."""
        t = config.task
        evaluate = t.eval_interval if t.eval_interval and can_evaluate else math.inf
        return cls(t.chunk, t.progress_interval, config.checkpoint.interval, evaluate,
                   t.max_steps)

    def steps_left(self, done: int) -> int:
        """The most steps the next chunk may take, ``done`` taken so far."""
        return self.max_steps - done if self.max_steps else 1 << 62

    def finished(self, done: int) -> bool:
        """Whether ``done`` steps reach ``task.max_steps``."""
        return bool(self.max_steps) and done >= self.max_steps
