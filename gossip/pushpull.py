"""Push-pull paging: a member table cut into PushPull pages, and put back together.

Theory of operation
-------------------
A push-pull (:mod:`gossip.roster`) swaps whole member tables over a secure channel. A table
of :data:`~gossip.membership.MAX_MEMBERS` members with long addresses is far larger than one
message may be, so it travels as a sequence of :class:`~gossip.messages.PushPull` pages:

* :func:`pages` encodes each :class:`~gossip.messages.MemberState` record and fills pages in
  order, each with at most :data:`MAX_PAGE_RECORDS` records and :data:`MAX_PAGE_BYTES` bytes
  of them; the final page (the only one, for a short table) is marked ``last``. Every page
  carries the sender's ``join`` flag. An empty table is one empty last page.
* :class:`TableReader` takes the pages one at a time as they arrive and returns the records
  once the ``last`` page is in. It refuses, with :class:`~gossip.errors.RemoteProtocolError`
  (or :class:`~gossip.errors.WireError` for a record that does not decode), anything that is
  not a PushPull page, a record that is not a MemberState, more than :data:`MAX_RECORDS`
  records, or more than :data:`MAX_PAGES` pages: the whole table is never held past what an
  honest sender could send.

Pages carry no sequence numbers: the channel delivers them in order, authenticated, so the
only sequence to check is "pages, then a last one". Nothing here does I/O; the caller sends
and receives the messages (:mod:`gossip.tables`, the thin loop the roster and the clash watch
use).
"""

from __future__ import annotations

from .errors import RemoteProtocolError
from .membership import MAX_MEMBERS
from .messages import MAX_PARTS, MemberState, Message, PushPull
from .wire import decode, encode

__all__ = [
    "MAX_PAGE_RECORDS",
    "MAX_PAGE_BYTES",
    "MAX_RECORD_BYTES",
    "MAX_RECORDS",
    "MAX_PAGES",
    "TableReader",
    "pages",
]

MAX_PAGE_RECORDS = 4 * MAX_PARTS  # member records per page: 256, all a PushPull may hold
MAX_PAGE_BYTES = 48 * 1024  # bytes of records per page: a page stays under MAX_MESSAGE
MAX_RECORD_BYTES = 1100  # a MemberState with a 256-character address and the largest ints
MAX_RECORDS = MAX_MEMBERS + 1  # a whole table: every member, and the sender itself
# Pages of a whole table, each as full as the sender could make it, and two to spare. Anything
# longer is refused before it is all held in memory.
MAX_PAGES = MAX_RECORDS // (MAX_PAGE_BYTES // MAX_RECORD_BYTES) + 2


def pages(records: list[MemberState], *, join: bool) -> list[PushPull]:
    """``records`` as the pages that carry them, in order, the final one marked ``last``.

    Args:
        records: the table (the sender's own record first, by the roster's convention).
        join: whether the sender is joining (set on every page).

    Returns:
        At least one page; each within :data:`MAX_PAGE_RECORDS` records and
        :data:`MAX_PAGE_BYTES` bytes of them (records are at most :data:`MAX_RECORD_BYTES`).
    """
    cut: list[list[bytes]] = [[]]
    size = 0
    for record in records:
        data = encode(record)
        if len(cut[-1]) == MAX_PAGE_RECORDS or size + len(data) > MAX_PAGE_BYTES:
            cut.append([])
            size = 0
        cut[-1].append(data)
        size += len(data)
    return [PushPull(join, i == len(cut) - 1, tuple(page)) for i, page in enumerate(cut)]


class TableReader:
    """Puts one table back together from its pages, refusing what no honest sender sends.

    Feed each message received with :meth:`add` until it returns the records. One reader
    reads one table.
    """

    def __init__(self) -> None:
        self._records: list[MemberState] = []
        self._pages = 0

    def add(self, page: Message) -> list[MemberState] | None:
        """Take the next message of the table.

        Returns:
            Every record of the table, in order, if ``page`` was the last page; None while
            more pages are to come.

        Raises:
            RemoteProtocolError: not a PushPull, a record that is not a MemberState, more
                than :data:`MAX_RECORDS` records so far, or a table not finished within
                :data:`MAX_PAGES` pages.
            WireError: a record that does not decode.
        """
        if not isinstance(page, PushPull):
            raise RemoteProtocolError(f"expected a PushPull page, got {type(page).__name__}")
        for data in page.records:
            record = decode(data)
            if not isinstance(record, MemberState):
                raise RemoteProtocolError("a PushPull record is not a MemberState")
            self._records.append(record)
        if len(self._records) > MAX_RECORDS:
            raise RemoteProtocolError(f"push-pull of more than {MAX_RECORDS} members")
        self._pages += 1
        if page.last:
            return self._records
        if self._pages >= MAX_PAGES:  # the next page would be one too many
            raise RemoteProtocolError(f"push-pull of more than {MAX_PAGES} pages")
        return None
