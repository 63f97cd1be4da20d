"""Member tables over a secure channel: the thin I/O loop around :mod:`gossip.pushpull`.

A push-pull (:mod:`gossip.roster`) and a meeting with our own identity (:mod:`gossip.clash`)
both swap member tables on a channel. Cutting a table into pages and putting it back
together, refusing a table no honest sender sends, is pure and lives in
:mod:`gossip.pushpull`; this module only sends the pages and reads them. Neither function
sets a deadline: the caller's phase deadline covers the whole swap.
"""

from __future__ import annotations

from .channel import SecureChannel
from .messages import MemberState, Message
from . import pushpull

__all__ = ["send_table", "receive_table"]


async def send_table(channel: SecureChannel, records: list[MemberState], *, join: bool) -> None:
    """Send ``records`` on ``channel`` as the pages of one table (``join``: a join request)."""
    for page in pushpull.pages(records, join=join):
        await channel.send_message(page)


async def receive_table(channel: SecureChannel, first: Message) -> list[MemberState]:
    """The records of a table whose first page is ``first``, read to its last page.

    Raises:
        RemoteProtocolError, WireError: a table that :class:`gossip.pushpull.TableReader`
            refuses.
    """
    reader, page = pushpull.TableReader(), first
    while (records := reader.add(page)) is None:
        page = await channel.receive_message()
    return records
