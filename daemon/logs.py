"""Log output: one line per event, ``key=value`` text, and a live status line on a terminal.

Every module logs through ``logging.getLogger(__name__)`` with messages already in the form
``event key=value ...``; this module only decides where they go and how a line starts
(``2026-11-23T10:00:00.123 INFO daemon.service event key=value``). When standard error is
a terminal, :class:`LiveLine` keeps one status line at the bottom that log records scroll
above; otherwise (a file, journald, a pipe) only whole lines are written.

One exception to ``__name__``: the lines of a node's run (progress, checkpoint, evaluation,
stopped) log as :data:`RUN`, whichever module writes them (train, checkpoint, processes), so
that one name finds them all: the name operators filter on and the docs show.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import IO

__all__ = ["setup", "LiveLine", "RUN"]

RUN = "daemon.service"  # the logger of a node's run lines (see the module docstring)


class _Formatter(logging.Formatter):
    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        t = time.localtime(record.created)
        return time.strftime("%Y-%m-%dT%H:%M:%S", t) + f".{int(record.msecs):03d}"


class LiveLine:
    """A status line redrawn in place at the bottom of a terminal."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._text = ""
        self._lock = threading.Lock()

    def show(self, text: str) -> None:
        with self._lock:
            self._text = text
            self._stream.write("\r\x1b[K" + text)
            self._stream.flush()

    def clear(self) -> None:
        with self._lock:
            if self._text:
                self._stream.write("\r\x1b[K")
                self._stream.flush()

    def close(self) -> None:
        """Clear the line for good: later records are plain lines."""
        self.clear()
        with self._lock:
            self._text = ""

    def redraw(self) -> None:
        with self._lock:
            if self._text:
                self._stream.write(self._text)
                self._stream.flush()


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes records above the live line, if there is one."""

    def __init__(self, stream: IO[str], live: LiveLine | None) -> None:
        super().__init__(stream)
        self.live = live

    def emit(self, record: logging.LogRecord) -> None:
        if self.live is None:
            super().emit(record)
            return
        self.live.clear()
        super().emit(record)
        self.live.redraw()


def setup(level: str = "INFO", stream: IO[str] | None = None,
          process: int | None = None) -> LiveLine | None:
    """Send log records to ``stream`` (standard error by default).

    Args:
        process: this process's rank in a node of several: each line names it, and only
            process 0 draws a live line.

    Returns:
        The live status line when the stream is a terminal, else None.
    """
    stream = stream or sys.stderr
    live = LiveLine(stream) if stream.isatty() and not process else None
    handler = _Handler(stream, live)
    where = "" if process is None else f"[process {process}] "
    handler.setFormatter(_Formatter(f"%(asctime)s %(levelname)s {where}%(name)s %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    return live
