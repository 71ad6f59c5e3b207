"""The codec's per-connection memo of READ_READY_BATCH read entries and the protocol's
column-wise check of plain entries: both accept exactly what the entry-by-entry path
accepts, with equal values, and refuse the rest the same way."""

from __future__ import annotations

import msgpack
import pytest

import rd2h.adapters.msgpack.codec as codec_module
import rd2h.adapters.msgpack.entries as entry_memo
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.domain.errors import ProtocolError
from rd2h.domain.wire.protocol import (
    READ_READY_BATCH,
    ReadReadyBatch,
    ReadRequest,
    decode_read_request,
    message_from_fields,
)

REQS = (ReadRequest("a", (3, 4, 5), (3, 4, 5), 0, 0), ReadRequest("b", (9,), (7, 8), 2, 1))


def batch(layer: int, reqs: tuple[ReadRequest, ...] = REQS, seq: int = 0) -> ReadReadyBatch:
    return ReadReadyBatch(layer, f"layer.{layer}", reqs, (), 0, 1, seq)


def frame(*fields: object) -> bytes:
    return msgpack.packb(list(fields), use_bin_type=True)


def test_same_entries_on_a_connection_reuse_the_checked_ones() -> None:
    codec = MsgpackCodec()
    first = codec.decode(codec.encode(batch(0)), b"peer")
    second = codec.decode(codec.encode(batch(1, seq=1)), b"peer")
    assert isinstance(second, ReadReadyBatch)
    assert second == batch(1, seq=1)  # every other field decoded from this frame
    assert second.read_reqs is first.read_reqs  # the same checked entries
    other = codec.decode(codec.encode(batch(1)), b"other")  # not another connection's
    assert other.read_reqs == REQS and other.read_reqs is not first.read_reqs


def test_different_entries_are_decoded_and_checked_again() -> None:
    codec = MsgpackCodec()
    codec.decode(codec.encode(batch(0)), b"peer")
    moved = (ReadRequest("a", (3, 4, 6), (3, 4, 6), 0, 0),)
    assert codec.decode(codec.encode(batch(1, moved)), b"peer").read_reqs == moved
    # equal values, other bytes (a bool and a float where ints were): refused as before
    for bad in (True, 4.0):
        entries = [["a", [3, bad, 5], [3, 4, 5], 0, 0]]
        with pytest.raises(ProtocolError, match="block ids must hold ints"):
            codec.decode(frame(READ_READY_BATCH, 2, "layer.2", entries, [], 0, 1, 2), b"peer")
    codec.decode(codec.encode(batch(0)), b"peer")
    with pytest.raises(ProtocolError, match="group member index"):  # other fields: checked
        codec.decode(codec.encode(ReadReadyBatch(1, "layer.1", REQS, (), 3, 2, 1)), b"peer")


def test_forget_drops_a_connection_and_the_memo_is_bounded(monkeypatch) -> None:
    codec = MsgpackCodec()
    first = codec.decode(codec.encode(batch(0)), b"peer")
    codec.forget(b"peer")
    assert codec.decode(codec.encode(batch(1)), b"peer").read_reqs is not first.read_reqs
    monkeypatch.setattr(codec_module, "MEMO_MAX_CONNECTIONS", 3)
    for i in range(5):
        codec.decode(codec.encode(batch(0)), f"c{i}")
    assert list(codec._entries) == ["c2", "c3", "c4"]  # the oldest went first
    monkeypatch.setattr(codec_module, "MEMO_MAX_BYTES", 8)
    codec.decode(codec.encode(batch(0)), "big")
    assert "big" not in codec._entries  # entries longer than the bound are not kept
    assert codec.decode(codec.encode(batch(0))).read_reqs == REQS  # no connection: no memo


def test_a_large_frame_is_not_scanned_again_for_the_memo(monkeypatch) -> None:
    def scan(frame, index):
        raise AssertionError("a frame over MEMO_MAX_FRAME_BYTES was scanned again")

    codec = MsgpackCodec()
    monkeypatch.setattr(codec_module, "element_bytes", scan)
    monkeypatch.setattr(codec_module, "MEMO_MAX_FRAME_BYTES", 16)
    first = codec.decode(codec.encode(batch(0)), b"peer")
    again = codec.decode(codec.encode(batch(1)), b"peer")
    assert again.read_reqs == REQS and again.read_reqs is not first.read_reqs
    assert b"peer" not in codec._entries


def test_plain_entries_are_checked_column_wise_like_entry_by_entry() -> None:
    plain = [["a", [1, 2], [3], 4, 5], ["b", [], [6], 0, 0]]
    msg = message_from_fields([READ_READY_BATCH, 1, "l", plain, [], 0, 1])
    assert msg.read_reqs == tuple(decode_read_request(e, 1) for e in plain)
    assert all(type(i) is int for r in msg.read_reqs for i in r.p_main_block_ids)
    # anything else goes the entry-by-entry way, which names the fault
    cases = [
        ([["a", [1, True], [3], 4, 5]], "main block ids must hold ints"),
        ([["a", [1, 2], [3, 2**63], 4, 5]], "indexer block ids must hold ints"),
        ([["a", [1, -1], [3], 4, 5]], "main block ids must hold ints"),
        ([["a", [1], [3], -4, 5]], "main start block must be >= 0"),
        ([["a", [1], [3], 4, True]], "indexer start block must be an int"),
        ([[7, [1], [3], 4, 5]], "read request id must be a str"),
        ([["a", [1], [3], 4]], "must have 2 or 5 fields"),
        ([["a", 1, [3], 4, 5]], "main block ids must be an array"),
    ]
    for entries, why in cases:
        with pytest.raises(ProtocolError, match=why):
            message_from_fields([READ_READY_BATCH, 1, "l", entries, [], 0, 1])
    # shapes the column-wise check leaves to the entry-by-entry path, still accepted
    legacy = message_from_fields([READ_READY_BATCH, 1, "l", [["a", [1, 2]]], [], 0, 1])
    assert legacy.read_reqs == (ReadRequest("a", (1, 2), (1, 2), 0, 0),)
    longer = message_from_fields([READ_READY_BATCH, 1, "l", [["a", [1], [2], 0, 0, "x"]]])
    assert longer.read_reqs == (ReadRequest("a", (1,), (2,), 0, 0),)


def test_memo_finds_the_entries_only_at_their_own_place_in_the_frame() -> None:
    """The fast look-up (canonical head, then the remembered entries right after it)
    matches only element 3 itself: a non-canonical head falls back to the parse, and the
    remembered entries' bytes elsewhere in the frame (a later element) are not taken for
    element 3."""
    codec = MsgpackCodec()
    first = codec.decode(codec.encode(batch(0)), b"peer")
    wire = entry_memo.element_bytes(codec.encode(batch(0)), 3)
    assert wire is not None
    plain = codec.encode(batch(1, seq=1))  # what an rd2h Prefill sends: found at once
    assert entry_memo.entries_at(plain, msgpack.unpackb(plain), wire)
    # layer index 1 as a uint64 (non-canonical): still decoded, still memoised by the parse
    odd = (b"\x98" + msgpack.packb(READ_READY_BATCH, use_bin_type=True) + b"\xcf"
           + (1).to_bytes(8, "big") + msgpack.packb("layer.1") + wire
           + msgpack.packb([]) + b"\x00\x01\x01")
    got = codec.decode(odd, b"peer")
    assert got == batch(1, seq=1) and got.read_reqs is first.read_reqs
    assert not entry_memo.entries_at(odd, msgpack.unpackb(odd), wire)
    # the remembered entries' bytes in a later element (an extension field old builds
    # ignore), other entries at element 3
    moved = (ReadRequest("a", (3, 4, 6), (3, 4, 6), 0, 0),)
    tricky = frame(READ_READY_BATCH, 2, "layer.2", [["a", [3, 4, 6], [3, 4, 6], 0, 0]], [],
                   0, 1, 2, 10**12, wire)
    assert wire in tricky
    assert not entry_memo.entries_at(tricky, msgpack.unpackb(tricky), wire)
    got = codec.decode(tricky, b"peer")
    assert got.read_reqs == moved and got.read_reqs is not first.read_reqs
