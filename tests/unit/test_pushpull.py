"""Push-pull paging as a pure protocol: tables cut into pages and read back, the page limits,
and the page sequences a reader refuses. No trio, no network: pages are plain messages."""

import pytest

from gossip.errors import RemoteProtocolError, WireError
from gossip.identity import peer_id_from_public_key
from gossip.membership import MAX_MEMBERS
from gossip.messages import Alive, Close, MemberState, PushPull
from gossip.pushpull import (
    MAX_PAGE_BYTES,
    MAX_PAGE_RECORDS,
    MAX_PAGES,
    MAX_RECORD_BYTES,
    MAX_RECORDS,
    TableReader,
    pages,
)
from gossip.wire import MAX_MESSAGE, encode

LONG_HOST = "h" * 250  # the longest addresses a record allows, or near it


PROOF = dict(key=b"k" * 32, signature=b"s" * 64)  # paging checks sizes, gossip.claims proofs


def record(i: int, host: str = "n") -> MemberState:
    peer = peer_id_from_public_key((i + 1).to_bytes(32, "big"))
    return MemberState(peer, i, MemberState.ALIVE, f"{host}:{1000 + i % 60000}", 1, i, i % 2 == 0,
                       **PROOF)


def read(messages) -> list[MemberState]:
    """Feed ``messages`` to one reader; the table once it is whole."""
    reader = TableReader()
    for i, message in enumerate(messages):
        records = reader.add(message)
        if records is not None:
            assert i == len(messages) - 1, "the table ended before its last page"
            return records
    raise AssertionError("no last page")


def test_a_large_table_of_long_addresses_round_trips_through_pages() -> None:
    table = [record(i, LONG_HOST) for i in range(2000)]  # ~550 kB of records
    cut = pages(table, join=True)
    assert len(cut) > 10
    for page in cut:
        assert page.join is True
        assert len(page.records) <= MAX_PAGE_RECORDS
        assert sum(len(data) for data in page.records) <= MAX_PAGE_BYTES
        assert len(encode(page)) <= MAX_MESSAGE
    assert [page.last for page in cut] == [False] * (len(cut) - 1) + [True]
    assert read(cut) == table


def test_short_and_empty_tables_are_one_last_page() -> None:
    table = [record(i) for i in range(3)]
    (page,) = pages(table, join=False)
    assert page.last and not page.join and read([page]) == table
    (empty,) = pages([], join=False)
    assert empty == PushPull(False, True, ())
    assert read([empty]) == []


def test_short_records_fill_pages_up_to_the_record_limit() -> None:
    table = [record(i) for i in range(2 * MAX_PAGE_RECORDS + 1)]
    cut = pages(table, join=False)
    assert [len(page.records) for page in cut] == [MAX_PAGE_RECORDS, MAX_PAGE_RECORDS, 1]
    assert read(cut) == table


def test_a_full_table_of_the_largest_records_fits_max_pages() -> None:
    # The reader's page limit leaves room for the largest table an honest sender has.
    largest = [record(i, LONG_HOST) for i in range(MAX_RECORDS)]
    assert all(len(encode(r)) <= MAX_RECORD_BYTES for r in largest[:10])
    cut = pages(largest, join=False)
    assert len(cut) <= MAX_PAGES
    assert len(read(cut)) == MAX_RECORDS == MAX_MEMBERS + 1


def test_a_table_of_exactly_max_pages_is_read() -> None:
    cut = [PushPull(False, False, (encode(record(i)),)) for i in range(MAX_PAGES - 1)]
    cut.append(PushPull(False, True, ()))
    assert len(read(cut)) == MAX_PAGES - 1


def test_one_page_more_than_max_pages_is_refused_before_it_is_read() -> None:
    reader = TableReader()
    for _ in range(MAX_PAGES - 1):
        assert reader.add(PushPull(False, False, ())) is None
    with pytest.raises(RemoteProtocolError, match=f"^push-pull of more than {MAX_PAGES} pages$"):
        reader.add(PushPull(False, False, ()))


def test_more_records_than_a_table_holds_are_refused() -> None:
    page = PushPull(False, False, tuple(encode(record(i)) for i in range(MAX_PAGE_RECORDS)))
    reader = TableReader()
    full_pages = MAX_RECORDS // MAX_PAGE_RECORDS
    for _ in range(full_pages):
        assert reader.add(page) is None
    last = PushPull(False, True, page.records)
    with pytest.raises(RemoteProtocolError,
                       match=f"^push-pull of more than {MAX_MEMBERS + 1} members$"):
        reader.add(last)  # even on the last page: the count is checked first


@pytest.mark.parametrize("messages, error, message", [
    # Not a page at all, first or in the middle of a table (the pages are out of turn).
    ([Close(Close.NORMAL, "bye")], RemoteProtocolError, "^expected a PushPull page, got Close$"),
    ([PushPull(False, False, ()), Close(Close.NORMAL, "bye")], RemoteProtocolError,
     "^expected a PushPull page, got Close$"),
    # A record that is a message, but not a member's state.
    ([PushPull(False, True, (encode(Alive(record(0).peer, 0, "a:1", 1, 0, False, **PROOF)),))],
     RemoteProtocolError, "^a PushPull record is not a MemberState$"),
    # A record that is not a message.
    ([PushPull(False, True, (b"\xff\x00not cbor",))], WireError, None),
])
def test_malformed_page_sequences_are_refused(messages, error, message) -> None:
    reader = TableReader()
    with pytest.raises(error, match=message):
        for page in messages:
            reader.add(page)
