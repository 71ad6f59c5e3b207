"""Control messages, their legacy shapes and the msgpack wire layout (spec 4)."""

from __future__ import annotations

import contextlib
import dataclasses
import typing

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rd2h.adapters.msgpack.codec import MsgpackCodec
from rd2h.domain.errors import ProtocolError, Rd2hError, UnknownMessageType
from rd2h.domain.wire.compat import compat_of
from rd2h.domain.wire.protocol import (
    ACK,
    LAYER_METADATA_KEYS,
    MF_META,
    READ_DONE,
    READ_FAILED,
    READ_READY_BATCH,
    LayerMetadata,
    Message,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
    fields_of,
    message_from_fields,
)

CODEC = MsgpackCodec()
MESSAGE_TYPES = typing.get_args(Message)  # every kind, the handshake's answers too
PROPS = settings(max_examples=200, deadline=None)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# structured fuzzing draws nested values, which is slow to generate; fewer examples
FUZZ_NESTED = settings(FUZZ, max_examples=200)


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def decode_value(value):
    """Decode a hand-built positional tuple through the real codec."""
    return CODEC.decode(pack(value))


META_MAP = {
    "base_addrs": [4096, 8192, 12288, 16384],
    "block_len": [512, 128, 16384, 128],
    "block_size_scale": [256, 128, 1, 4],
    "tensor_group_idx": [0, 0, 1, 1],
    "main_tensor_count": 2,
    "has_indexer": True,
}
META = LayerMetadata(
    base_addrs=(4096, 8192, 12288, 16384),
    block_len=(512, 128, 16384, 128),
    block_size_scale=(256, 128, 1, 4),
    tensor_group_idx=(0, 0, 1, 1),
    main_tensor_count=2,
    has_indexer=True,
)
L5 = "model.layers.5.self_attn.attn"

# ------------------------------------------------------------------ strategies

u64 = st.integers(0, 2**64 - 1)
block_ids = st.lists(st.integers(0, 2**40), max_size=6)
names = st.text(max_size=16)


@st.composite
def layer_metadata(draw):
    n = draw(st.integers(0, 4))
    ints = st.lists(u64, min_size=n, max_size=n)
    return LayerMetadata(
        base_addrs=tuple(draw(ints)),
        block_len=tuple(draw(ints)),
        block_size_scale=tuple(draw(ints)),
        tensor_group_idx=tuple(draw(ints)),
        main_tensor_count=draw(st.integers(0, 2**32)),
        has_indexer=draw(st.booleans()),
    )


mf_metas = st.builds(
    MfMeta, p_session=names, layers=st.dictionaries(names, layer_metadata(), max_size=3)
)
read_requests = st.builds(
    ReadRequest,
    ext_req_id=names,
    p_main_block_ids=block_ids.map(tuple),
    p_indexer_block_ids=block_ids.map(tuple),
    main_start_block=st.integers(0, 2**32),
    indexer_start_block=st.integers(0, 2**32),
)


@st.composite
def read_ready_batches(draw):
    ratio = draw(st.integers(1, 64))
    return ReadReadyBatch(
        layer_idx=draw(st.integers(0, 2**31)),
        layer_name=draw(names),
        read_reqs=tuple(draw(st.lists(read_requests, max_size=4))),
        done_ext_ids=tuple(draw(st.lists(names, max_size=4))),
        group_member_idx=draw(st.integers(0, ratio - 1)),
        tp_ratio=ratio,
        seq=(seq := draw(st.none() | st.integers(0, 2**63 - 1))),
        hold_until_ms=None if seq is None else draw(st.none() | st.integers(0, 2**63 - 1)),
    )


read_dones = st.builds(ReadDone, layer_idx=st.integers(0, 2**63))
read_faileds = st.builds(ReadFailed, layer_idx=st.integers(0, 2**63), error=st.text(max_size=40))
messages = st.one_of(mf_metas, read_ready_batches(), read_dones, read_faileds)

msgpack_ints = st.integers(-(2**63), 2**64 - 1)
# values the decoder can unpack (map keys are str or bin)
plain_values = st.recursive(
    st.none()
    | st.booleans()
    | msgpack_ints
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from([MF_META, READ_READY_BATCH, READ_DONE, READ_FAILED, b"ACK", "mf_meta"]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=8) | st.binary(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
# anything msgpack can pack: also ext types and int map keys, which the decoder refuses
msgpack_values = st.recursive(
    plain_values
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=8))
    | st.dictionaries(msgpack_ints, plain_values, min_size=1, max_size=2),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=8,
)


def unpack_nested(raw: bytes):
    """A nested-metadata decoder for calling the domain directly (no codec safety net)."""
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:
        raise ProtocolError(f"bad nested msgpack: {exc}") from exc


def assert_total(frame) -> None:
    """``decode`` returns a typed message or raises ProtocolError, nothing else.

    The domain's ``message_from_fields`` is held to the same rule on its own: the
    codec's catch-all is a safety net, not the place where validation happens.
    """
    try:
        fields = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception:
        fields = None
    if fields is not None:
        with contextlib.suppress(ProtocolError):
            message_from_fields(fields, decode_nested_metadata=unpack_nested)
    try:
        msg = CODEC.decode(frame)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES)
    # anything accepted re-encodes to a frame that decodes to the same message
    assert CODEC.decode(CODEC.encode(msg)) == msg


# ------------------------------------------------------------------ round trips


@given(mf_metas)
@PROPS
def test_mf_meta_round_trip(msg):
    assert CODEC.decode(CODEC.encode(msg)) == msg


@given(read_ready_batches())
@PROPS
def test_read_ready_batch_round_trip(msg):
    assert CODEC.decode(CODEC.encode(msg)) == msg


@given(read_dones)
@PROPS
def test_read_done_round_trip(msg):
    assert CODEC.decode(CODEC.encode(msg)) == msg


@given(read_faileds)
@PROPS
def test_read_failed_round_trip(msg):
    assert CODEC.decode(CODEC.encode(msg)) == msg


@given(messages)
@PROPS
def test_domain_round_trip_without_codec(msg):
    fields = fields_of(msg)
    assert fields[0] in (MF_META, READ_READY_BATCH, READ_DONE, READ_FAILED)
    assert message_from_fields(fields) == msg


def test_fields_of_rejects_non_messages():
    with pytest.raises(TypeError):
        fields_of(("read_done", 1))


# ------------------------------------------------------------------ exact wire layout


def test_tag_constants_and_ack():
    assert MF_META == b"mf_meta"
    assert READ_READY_BATCH == b"read_ready_batch"
    assert READ_DONE == b"read_done"
    assert READ_FAILED == b"read_failed"
    assert ACK == b"ACK"
    assert isinstance(ACK, bytes)


def test_encoded_read_done_and_failed_bytes():
    assert CODEC.encode(ReadDone(7)) == pack([b"read_done", 7])
    assert CODEC.encode(ReadFailed(7, "boom")) == pack([b"read_failed", 7, "boom"])
    # tag is msgpack bin8 (0xc4), never a str (0xa0..0xbf / 0xd9)
    frame = CODEC.encode(ReadDone(7))
    assert frame[0] == 0x92  # fixarray of 2
    assert frame[1] == 0xC4
    assert frame[2] == len(b"read_done")


def test_encoded_read_ready_batch_layout():
    msg = ReadReadyBatch(3, L5, (ReadRequest("req-1", (4, 5), (6,), 2, 1),), ("req-0",), 1, 4)
    frame = CODEC.encode(msg)
    assert frame == pack(
        [b"read_ready_batch", 3, L5, [["req-1", [4, 5], [6], 2, 1]], ["req-0"], 1, 4]
    )
    fields = msgpack.unpackb(frame, raw=False)
    assert isinstance(fields[0], bytes)
    assert isinstance(fields[2], str)


def test_encoded_mf_meta_nests_a_msgpack_map_in_bin():
    frame = CODEC.encode(MfMeta("sess-1", {L5: META}))
    fields = msgpack.unpackb(frame, raw=False)
    assert fields[0] == b"mf_meta" and isinstance(fields[0], bytes)
    assert fields[1] == "sess-1"
    assert isinstance(fields[2], bytes)
    nested = msgpack.unpackb(fields[2], raw=False)
    assert nested == {L5: META_MAP}
    assert set(nested[L5]) == set(LAYER_METADATA_KEYS)


def test_hand_built_mf_meta_decodes():
    frame = pack([b"mf_meta", "sess-9", pack({L5: META_MAP, "model.layers.6.x": META_MAP})])
    assert CODEC.decode(frame) == MfMeta("sess-9", {L5: META, "model.layers.6.x": META})


def test_mf_meta_with_empty_layer_map():
    assert decode_value([b"mf_meta", "s", pack({})]) == MfMeta("s", {})


def test_hand_built_read_ready_batch_decodes():
    frame = pack(
        [
            b"read_ready_batch",
            12,
            L5,
            [["a", [1, 2, 3], [7, 8], 0, 5], ["b", [], [9], 3, 0]],
            ["z"],
            2,
            3,
        ]
    )
    assert CODEC.decode(frame) == ReadReadyBatch(
        12,
        L5,
        (ReadRequest("a", (1, 2, 3), (7, 8), 0, 5), ReadRequest("b", (), (9,), 3, 0)),
        ("z",),
        2,
        3,
    )


def test_hand_built_replies_decode():
    assert decode_value([b"read_done", 0]) == ReadDone(0)
    assert decode_value([b"read_failed", 4, "no such request"]) == ReadFailed(4, "no such request")


def test_decoded_frames_accept_bytearray_and_memoryview():
    frame = pack([b"read_done", 9])
    assert CODEC.decode(bytearray(frame)) == ReadDone(9)
    assert CODEC.decode(memoryview(frame)) == ReadDone(9)


# ------------------------------------------------------------------ legacy shapes


def test_two_field_read_entry_shares_ids_and_starts_at_zero():
    msg = decode_value([b"read_ready_batch", 2, L5, [["r1", [3, 4, 5]]], [], 0, 1])
    assert msg.read_reqs == (ReadRequest("r1", (3, 4, 5), (3, 4, 5), 0, 0),)
    req = msg.read_reqs[0]
    assert req.p_main_block_ids == req.p_indexer_block_ids
    assert (req.main_start_block, req.indexer_start_block) == (0, 0)


def test_four_field_message_has_no_done_ids_member_0_ratio_1():
    msg = decode_value([b"read_ready_batch", 2, L5, [["r1", [3]]]])
    assert msg == ReadReadyBatch(2, L5, (ReadRequest("r1", (3,), (3,)),), (), 0, 1)
    assert (msg.done_ext_ids, msg.group_member_idx, msg.tp_ratio) == ((), 0, 1)


def test_five_field_message_has_done_ids_member_0_ratio_1():
    msg = decode_value([b"read_ready_batch", 2, L5, [], ["d1", "d2"]])
    assert msg == ReadReadyBatch(2, L5, (), ("d1", "d2"), 0, 1)


@pytest.mark.parametrize("ratio", [0, -1, -5, -(2**40)])
def test_ratio_below_one_counts_as_one(ratio):
    msg = decode_value([b"read_ready_batch", 2, L5, [], [], 0, ratio])
    assert msg.tp_ratio == 1
    assert msg.group_member_idx == 0


@pytest.mark.parametrize("ratio", [0, -3])
def test_member_1_with_ratio_below_one_is_rejected(ratio):
    with pytest.raises(ProtocolError) as ei:
        decode_value([b"read_ready_batch", 2, L5, [], [], 1, ratio])
    assert ei.value.layer_idx == 2


def test_appended_fields_from_newer_builds_are_ignored():
    msg = decode_value([b"read_ready_batch", 2, L5, [["r", [1], [2], 0, 0, "x"]], [], 1, 2, 99,
                        "future"])
    assert msg == ReadReadyBatch(2, L5, (ReadRequest("r", (1,), (2,)),), (), 1, 2, 99)
    assert decode_value([b"read_done", 1, "extra"]) == ReadDone(1)
    assert decode_value([b"read_failed", 1, "e", 5]) == ReadFailed(1, "e", 5)  # the id
    assert decode_value([b"read_failed", 1, "e", 5, "x"]) == ReadFailed(1, "e", 5)
    with pytest.raises(ProtocolError):
        decode_value([b"read_done", 1, -1])  # an id is never negative


def test_the_hold_follows_the_announcement_id():
    """Field 8: until when Prefill keeps the blocks (ms of the Unix epoch); only after an
    id, only an int (a signature envelope there is not a hold), never negative."""
    head = [b"read_ready_batch", 2, L5, [["r", [1], [2], 0, 0]], [], 0, 1]
    hold = 1_796_300_000_123
    msg = ReadReadyBatch(2, L5, (ReadRequest("r", (1,), (2,)),), (), 0, 1, 7, hold)
    assert decode_value([*head, 7, hold]) == msg
    assert fields_of(msg)[7:] == [7, hold]
    assert decode_value([*head, 7]).hold_until_ms is None  # older builds
    assert decode_value([*head, 7, b"\x00" * 56]).hold_until_ms is None  # an envelope
    assert fields_of(ReadReadyBatch(2, L5, (), seq=None, hold_until_ms=hold))[7:] == []
    with pytest.raises(ProtocolError, match="announcement hold"):
        decode_value([*head, 7, -1])


def test_read_entries_may_state_kv_digests_as_a_sixth_field():
    """``verify_kv``: per tensor, a digest per block (ints below 2**63); an entry without
    them keeps the plain 5-field form older peers send, and they ignore the sixth."""
    req = ReadRequest("r", (1, 2), (3,), 0, 0, ((5, 6), (7, 8), (9,)))
    batch = ReadReadyBatch(2, L5, (req,), (), 0, 1, 3)
    fields = fields_of(batch)
    assert fields[3] == [["r", [1, 2], [3], 0, 0, [[5, 6], [7, 8], [9]]]]
    assert decode_value(fields) == batch
    plain = dataclasses.replace(req, digests=None)
    assert fields_of(dataclasses.replace(batch, read_reqs=(plain,)))[3][0] == [
        "r", [1, 2], [3], 0, 0]
    with pytest.raises(ProtocolError, match="KV digests"):
        decode_value([*fields[:3], [["r", [1], [1], 0, 0, [[-1]]]], *fields[4:]])


def test_mf_meta_states_its_generation_after_its_compat_map():
    """Field 4, only after the compat map (rd2h builds always state one); older frames
    and a value of another type there state none."""
    compat = compat_of(block_size=16)
    meta = MfMeta("s", {}, compat, 2**63 - 1)
    fields = fields_of(meta)
    assert fields[3:] == [compat.to_wire(), 2**63 - 1]
    assert decode_value(fields) == meta
    assert decode_value(fields[:4]).generation is None
    assert decode_value([*fields[:4], "x"]).generation is None
    assert fields_of(MfMeta("s", {}, None, 5))[3:] == []  # no map, no generation


def test_read_failed_without_error_and_with_bin_error():
    assert decode_value([b"read_failed", 3]) == ReadFailed(3, "")
    assert decode_value([b"read_failed", 3, b"bad \xff"]) == ReadFailed(3, "bad \ufffd")


def test_mf_meta_with_inline_map_decodes():
    assert decode_value([b"mf_meta", "s", {L5: META_MAP}]) == MfMeta("s", {L5: META})


def test_named_ext_ids_keeps_order_without_repeats():
    msg = ReadReadyBatch(
        0,
        L5,
        (ReadRequest("b", (), ()), ReadRequest("a", (), ()), ReadRequest("b", (), ())),
        ("c", "a", "d"),
    )
    assert msg.named_ext_ids == ("b", "a", "c", "d")


# ------------------------------------------------------------------ rejections


def test_str_tag_is_rejected():
    with pytest.raises(ProtocolError) as ei:
        decode_value(["read_done", 1])
    assert not isinstance(ei.value, UnknownMessageType)


@pytest.mark.parametrize("tag", [b"read_ready", b"", b"READ_DONE", b"ACK", b"mf_meta2"])
def test_unknown_tag_is_unknown_message_type(tag):
    with pytest.raises(UnknownMessageType) as ei:
        decode_value([tag, 1, 2])
    assert isinstance(ei.value, ProtocolError)
    assert isinstance(ei.value, Rd2hError)
    assert ei.value.tag == tag


@pytest.mark.parametrize(
    "value", [[], {}, 5, "read_done", b"read_done", None, [None], [1, 2], [[b"read_done", 1]]]
)
def test_non_message_values_are_rejected(value):
    with pytest.raises(ProtocolError):
        decode_value(value)


def test_raw_ack_is_the_acknowledgement_and_nothing_else_is():
    """``b"ACK"`` is a message of its own (``MetaAck``, in the union since #44; before,
    it was read apart and ``decode`` refused it); anything longer that is not the
    generation extension (with or without its flag byte) is malformed."""
    assert CODEC.decode(ACK) == MetaAck()
    assert CODEC.decode(ACK + (7).to_bytes(8, "big")) == MetaAck(7)
    assert CODEC.decode(ACK + (7).to_bytes(8, "big") + b"\x01") == MetaAck(7, layer_runs=True)
    assert CODEC.decode(ACK + bytes(9)) == MetaAck(0)  # flags without layer runs
    for frame in (ACK + b"x", ACK + bytes(10)):
        with pytest.raises(ProtocolError) as info:
            CODEC.decode(frame)
        assert not info.value.handshake


@pytest.mark.parametrize(
    "value",
    [
        [b"read_ready_batch"],
        [b"read_ready_batch", 1],
        [b"read_ready_batch", 1, L5],
        [b"mf_meta"],
        [b"mf_meta", "s"],
        [b"read_done"],
        [b"read_failed"],
    ],
)
def test_truncated_tuples_are_rejected(value):
    with pytest.raises(ProtocolError):
        decode_value(value)
    with pytest.raises(ProtocolError):  # the domain itself, without the codec's safety net
        message_from_fields(value, decode_nested_metadata=unpack_nested)


# (message, expected layer_idx on the error: None when the layer index was unreadable)
RRB_REJECTS = [
    # layer index itself
    ([b"read_ready_batch", "1", L5, []], None),
    ([b"read_ready_batch", -1, L5, []], None),
    ([b"read_ready_batch", True, L5, []], None),
    ([b"read_ready_batch", 1.0, L5, []], None),
    ([b"read_ready_batch", None, L5, []], None),
    # everything after it carries the layer index
    ([b"read_ready_batch", 4, b"name", []], 4),
    ([b"read_ready_batch", 4, 17, []], 4),
    ([b"read_ready_batch", 4, L5, {}], 4),
    ([b"read_ready_batch", 4, L5, "reqs"], 4),
    ([b"read_ready_batch", 4, L5, [5]], 4),
    ([b"read_ready_batch", 4, L5, [[]]], 4),
    ([b"read_ready_batch", 4, L5, [["r"]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2]]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2], 0]]], 4),
    ([b"read_ready_batch", 4, L5, [[b"r", [1]]]], 4),
    ([b"read_ready_batch", 4, L5, [[7, [1], [2], 0, 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", 1]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [-1]]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", ["1"]]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [True]]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1.0]]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [-3], [2], 0, 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [-2], 0, 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], None, 0, 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2], -1, 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2], 0, -1]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2], "0", 0]]], 4),
    ([b"read_ready_batch", 4, L5, [["r", [1], [2], 0, False]]], 4),
    ([b"read_ready_batch", 4, L5, [], "done"], 4),
    ([b"read_ready_batch", 4, L5, [], [b"d"]], 4),
    ([b"read_ready_batch", 4, L5, [], [1]], 4),
    ([b"read_ready_batch", 4, L5, [], [], 0], 4),  # member without ratio
    ([b"read_ready_batch", 4, L5, [], [], -1, 2], 4),
    ([b"read_ready_batch", 4, L5, [], [], 2, 2], 4),  # member >= ratio
    ([b"read_ready_batch", 4, L5, [], [], 5, 4], 4),
    ([b"read_ready_batch", 4, L5, [], [], "0", 2], 4),
    ([b"read_ready_batch", 4, L5, [], [], 0, "2"], 4),
    ([b"read_ready_batch", 4, L5, [], [], 0, 2.0], 4),
    ([b"read_ready_batch", 4, L5, [], [], True, 2], 4),
]


@pytest.mark.parametrize(("value", "layer_idx"), RRB_REJECTS)
def test_malformed_read_ready_batch_is_rejected(value, layer_idx):
    with pytest.raises(ProtocolError) as ei:
        decode_value(value)
    assert ei.value.layer_idx == layer_idx
    assert not isinstance(ei.value, UnknownMessageType)
    with pytest.raises(ProtocolError) as ei:
        message_from_fields(value)
    assert ei.value.layer_idx == layer_idx


def test_codec_turns_any_decoding_bug_into_a_protocol_error(monkeypatch):
    import rd2h.adapters.msgpack.codec as codec_module

    def broken(fields, decode_nested_metadata=None, read_requests=None):
        raise KeyError("bug")

    monkeypatch.setattr(codec_module, "message_from_fields", broken)
    with pytest.raises(ProtocolError) as ei:
        MsgpackCodec().decode(pack([READ_DONE, 1]))
    assert isinstance(ei.value.__cause__, KeyError)


def _meta_with(**changes):
    m = dict(META_MAP)
    for key, val in changes.items():
        if val is KeyError:
            del m[key]
        else:
            m[key] = val
    return m


@pytest.mark.parametrize(
    "payload",
    [
        pack({L5: _meta_with(base_addrs=KeyError)}),
        pack({L5: _meta_with(has_indexer=KeyError)}),
        pack({L5: _meta_with(main_tensor_count=KeyError)}),
        pack({L5: _meta_with(block_len=[1, 2, 3])}),  # lists differ in length
        pack({L5: _meta_with(base_addrs=[-1, 2, 3, 4])}),
        pack({L5: _meta_with(block_size_scale=[1, 1, 1, "1"])}),
        pack({L5: _meta_with(tensor_group_idx=5)}),
        pack({L5: _meta_with(main_tensor_count=-1)}),
        pack({L5: _meta_with(main_tensor_count="2")}),
        pack({L5: _meta_with(has_indexer=1)}),
        pack({L5: _meta_with(has_indexer="true")}),
        pack({L5: [1, 2]}),
        pack({b"bin-layer-name": META_MAP}),
        pack({1: META_MAP}),  # non-str map key (strict_map_key)
        pack([META_MAP]),
        pack(5),
        b"\xc1",  # never-used msgpack byte
        b"",
        pack({L5: META_MAP}) + b"\x00",  # trailing data
        pack({L5: META_MAP})[:-3],  # truncated nested map
        7,
        None,
        [META_MAP],
    ],
)
def test_malformed_mf_meta_is_rejected(payload):
    with pytest.raises(ProtocolError) as ei:
        decode_value([b"mf_meta", "s", payload])
    assert ei.value.layer_idx is None


@pytest.mark.parametrize("session", [b"s", 1, None, ["s"]])
def test_mf_meta_session_must_be_str(session):
    with pytest.raises(ProtocolError):
        decode_value([b"mf_meta", session, pack({L5: META_MAP})])


def test_mf_meta_bytes_without_nested_decoder_is_rejected_by_the_domain():
    with pytest.raises(ProtocolError):
        message_from_fields([MF_META, "s", pack({})])


@pytest.mark.parametrize(
    ("value", "layer_idx"),
    [
        ([b"read_done", -1], None),
        ([b"read_done", "1"], None),
        ([b"read_done", True], None),
        ([b"read_done", None], None),
        ([b"read_failed", -1, "e"], None),
        ([b"read_failed", 1.5, "e"], None),
        ([b"read_failed", 3, 7], 3),
        ([b"read_failed", 3, ["e"]], 3),
        ([b"read_failed", 3, None], 3),
    ],
)
def test_malformed_replies_are_rejected(value, layer_idx):
    with pytest.raises(ProtocolError) as ei:
        decode_value(value)
    assert ei.value.layer_idx == layer_idx


# ------------------------------------------------------------------ bounds


def test_oversized_frame_is_rejected():
    codec = MsgpackCodec(max_frame_bytes=64)
    small = codec.encode(ReadDone(1))
    assert codec.decode(small) == ReadDone(1)
    big = codec.encode(ReadFailed(1, "x" * 100))
    assert len(big) > 64
    with pytest.raises(ProtocolError, match="limit"):
        codec.decode(big)


def test_frame_exactly_at_the_limit_is_accepted():
    frame = CODEC.encode(ReadFailed(1, "y" * 40))
    codec = MsgpackCodec(max_frame_bytes=len(frame))
    assert codec.decode(frame) == ReadFailed(1, "y" * 40)
    with pytest.raises(ProtocolError):
        MsgpackCodec(max_frame_bytes=len(frame) - 1).decode(frame)


def test_too_many_items_is_rejected():
    codec = MsgpackCodec(max_items=16)
    ok = ReadReadyBatch(1, L5, (ReadRequest("r", tuple(range(16)), ()),))
    assert codec.decode(codec.encode(ok)) == ok
    too_many = ReadReadyBatch(1, L5, (ReadRequest("r", tuple(range(17)), ()),))
    with pytest.raises(ProtocolError):
        codec.decode(codec.encode(too_many))


def test_max_frame_bytes_below_16_is_a_configuration_error():
    with pytest.raises(ValueError):
        MsgpackCodec(max_frame_bytes=15)


def test_deeply_nested_input_is_a_protocol_error():
    with pytest.raises(ProtocolError):
        CODEC.decode(b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(ProtocolError):
        decode_value([b"mf_meta", "s", b"\x91" * 100_000 + b"\xc0"])


@pytest.mark.parametrize("frame", ["text", 5, None, [b"read_done", 1]])
def test_non_bytes_frame_is_a_protocol_error(frame):
    with pytest.raises(ProtocolError):
        CODEC.decode(frame)


@pytest.mark.parametrize(
    "value", [msgpack.ExtType(1, b"abc"), msgpack.Timestamp(1, 0), [b"read_done", 1.0]]
)
def test_ext_types_and_floats_are_rejected(value):
    with pytest.raises(ProtocolError):
        decode_value(value)


# ------------------------------------------------------------------ totality (fuzz)


@given(st.binary(max_size=300))
@FUZZ
def test_random_bytes_only_raise_protocol_error(frame):
    assert_total(frame)


@given(messages, st.data())
@FUZZ
def test_truncated_valid_frames_only_raise_protocol_error(msg, data):
    frame = CODEC.encode(msg)
    cut = data.draw(st.integers(0, max(0, len(frame) - 1)))
    with pytest.raises(ProtocolError):
        CODEC.decode(frame[:cut])


@given(
    messages,
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "set", "insert", "delete"]),
            st.integers(0, 10**6),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=8,
    ),
)
@FUZZ
def test_mutated_valid_frames_only_raise_protocol_error(msg, edits):
    frame = bytearray(CODEC.encode(msg))
    for op, pos, byte in edits:
        if op == "insert":
            frame.insert(pos % (len(frame) + 1), byte)
        elif frame:
            i = pos % len(frame)
            if op == "flip":
                frame[i] ^= 1 << (byte % 8)
            elif op == "set":
                frame[i] = byte
            else:
                del frame[i]
    assert_total(bytes(frame))


@given(msgpack_values)
@FUZZ_NESTED
def test_random_msgpack_values_only_raise_protocol_error(value):
    assert_total(pack(value))


@given(
    st.sampled_from([MF_META, READ_READY_BATCH, READ_DONE, READ_FAILED]),
    st.lists(plain_values, max_size=7),
)
@FUZZ_NESTED
def test_random_fields_after_a_valid_tag_only_raise_protocol_error(tag, rest):
    assert_total(pack([tag, *rest]))


@given(
    st.lists(plain_values, max_size=2),
    st.dictionaries(st.sampled_from(LAYER_METADATA_KEYS), plain_values),
)
@FUZZ_NESTED
def test_random_nested_metadata_only_raise_protocol_error(extra, layer):
    assert_total(pack([MF_META, "s", pack({L5: {**META_MAP, **layer}}), *extra]))
    assert_total(pack([MF_META, "s", pack({L5: layer})]))


entry_fields = (
    st.none()
    | st.booleans()
    | st.integers(-5, 2**33)
    | st.floats(allow_nan=False)
    | st.text(max_size=4)
    | st.binary(max_size=4)
    | st.lists(st.integers(-3, 50) | st.booleans() | st.text(max_size=2), max_size=4)
)


@given(
    st.integers(0, 2**31),
    st.lists(st.lists(entry_fields, max_size=6), max_size=3),
    entry_fields | st.lists(st.text(max_size=3) | st.integers(0, 3), max_size=3),
    entry_fields,
    entry_fields,
)
@FUZZ_NESTED
def test_random_read_entries_only_raise_protocol_error(layer_idx, entries, done, member, ratio):
    frame = pack([READ_READY_BATCH, layer_idx, L5, entries, done, member, ratio])
    try:
        msg = CODEC.decode(frame)
    except ProtocolError as exc:
        assert exc.layer_idx == layer_idx  # the index was readable, so it is reported
    else:
        assert isinstance(msg, ReadReadyBatch)
        assert msg.layer_idx == layer_idx
        assert 0 <= msg.group_member_idx < msg.tp_ratio
