"""The codec's total decode budget (objects and bytes per frame, nested metadata
included): hostile frames are refused as one ProtocolError while decoding, the
memory the worst allowed frames cost stays under ``worst_case_decode_bytes``, and
legitimate frames still fit the defaults."""

from __future__ import annotations

import gc
import random
import tracemalloc

import msgpack
import pytest

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.msgpack.codec import (
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_ITEMS,
    DEFAULT_MAX_OBJECTS,
    worst_case_decode_bytes,
)
from rd2h.domain.errors import ProtocolError
from rd2h.domain.wire.protocol import LayerMetadata, MfMeta, ReadReadyBatch, ReadRequest

DEFAULT = MsgpackCodec()
ASTRAL = "\U0001f600".encode()  # one character, 4 UTF-8 bytes, decodes to UCS-4
UINT64 = b"\xcf\x80" + bytes(7)  # 2**63: no cached int


def header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 1 << 16 else b"\xdd" + n.to_bytes(4, "big")


def chunks(count: int, item: bytes, per: int) -> list[bytes]:
    """``count`` copies of ``item`` as arrays of at most ``per`` each."""
    full, rest = divmod(count, per)
    return [header(n) + item * n for n in [per] * full + ([rest] if rest else [])]


def chunked(count: int, item: bytes, per: int) -> bytes:
    parts = chunks(count, item, per)
    return header(len(parts)) + b"".join(parts)


def nested(depth: int) -> bytes:
    """An empty array inside ``depth - 1`` arrays: ``depth`` levels, 2*depth units."""
    return b"\x91" * (depth - 1) + b"\x90"


def open_containers(codec: MsgpackCodec, scalar: bytes) -> bytes:
    """The budget spent but for one array, then nested arrays as deep as allowed,
    each full of scalars: all built before the innermost completes and overruns."""
    per = min(codec.max_items, codec.max_objects)
    target = codec.max_objects - per  # a scalar costs 1 unit, its chunk 1 more
    filler = chunks(target - -(-target // (per + 1)), scalar, per)
    chain = header(per) + scalar * per
    for _ in range(codec.max_depth - 2):
        chain = header(per) + scalar * (per - 1) + chain
    return header(len(filler) + 1) + b"".join(filler) + chain


def layers(count: int, tensors: int = 1) -> dict[str, LayerMetadata]:
    meta = LayerMetadata(
        base_addrs=tuple(0x7F00_0000_0000 + (i << 30) for i in range(tensors)),
        block_len=(65536,) * tensors, block_size_scale=(1,) * tensors,
        tensor_group_idx=tuple(range(tensors)), main_tensor_count=tensors,
        has_indexer=False, num_blocks=(4096,) * tensors,
    )
    return {f"model.layers.{i}.self_attn.attn": meta for i in range(count)}


def mf_meta_frame(count: int, tensors: int = 1) -> bytes:
    return MsgpackCodec(1 << 40).encode(MfMeta("session", layers(count, tensors)))


def refusal(codec: MsgpackCodec, frame: bytes) -> str:
    with pytest.raises(ProtocolError) as ei:
        codec.decode(frame)
    return str(ei.value)


# ------------------------------------------------------------- default limits

PER = DEFAULT_MAX_ITEMS


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(lambda: chunked(4_000_000, b"\x90", PER), id="4M-empty-arrays"),
        pytest.param(lambda: chunked(1_000_000, nested(6), PER), id="1M-nested-arrays"),
        pytest.param(lambda: chunked(4_000_000, b"\x80", PER), id="4M-empty-maps"),
        pytest.param(lambda: chunked(5_000_000, b"\xa2ab", PER), id="5M-short-strings"),
        pytest.param(lambda: chunked(5_000_000, b"\xc4\x02ab", PER), id="5M-small-bins"),
        pytest.param(lambda: chunked(5_000_000, UINT64, PER), id="5M-uint64s"),
        pytest.param(lambda: chunked(5_000_000, b"\xe0", PER), id="5M-negative-fixints"),
    ],
)
def test_frames_beyond_the_object_budget_are_refused(frame):
    assert "exceeds the decode budget of" in refusal(DEFAULT, frame())


def test_mf_meta_with_100000_layers_is_refused():
    frame = mf_meta_frame(100_000)
    assert len(frame) < DEFAULT.max_frame_bytes
    message = refusal(DEFAULT, frame)
    assert message.startswith("MF_META layer metadata exceeds the decode budget of")


@pytest.mark.parametrize("levels", [DEFAULT_MAX_DEPTH + 1, 1025, 100_000])
def test_deep_nesting_of_a_long_frame_is_refused(levels):
    # Long enough for the depth check (shorter frames cannot hide much in open arrays).
    frame = b"\x91" * levels + chunked(DEFAULT_MAX_DEPTH * PER, b"\x01", PER)
    assert f"nested deeper than {DEFAULT_MAX_DEPTH} levels" in refusal(DEFAULT, frame)


def test_deep_nesting_of_a_short_frame_is_refused():
    assert "nested deeper than 1024" in refusal(DEFAULT, b"\x91" * 100_000 + b"\xc0")


def test_a_long_frame_nested_to_the_limit_is_decoded():
    frame = b"\x91" * (DEFAULT_MAX_DEPTH - 2) + chunked(DEFAULT_MAX_DEPTH * PER, b"\x01", PER)
    assert refusal(DEFAULT, frame) == "message tag must be bin, got list"


@pytest.mark.parametrize(
    "frame, reason",
    [
        (header(PER) + b"\x01" * 1000, "truncated"),
        ((b"\xdd" + PER.to_bytes(4, "big")) * 1000, "truncated"),
        (msgpack.packb([b"read_done", 1]) + b"\x00" * 300, "extra data"),
        (header(1000) + b"\xc1" * 1000, "FormatError"),
        (header(4_000_000) + b"\x90" * 4_000_000, "exceeds max_array_len(262144)"),
    ],
)
def test_malformed_frames_are_refused_by_the_check_pass(frame, reason):
    assert reason in refusal(DEFAULT, frame)


# ------------------------------------------------------------- budget sharing


def test_the_nested_layer_map_draws_on_the_frame_budget():
    frame = mf_meta_frame(100)  # 2,800 units of layer map, a frame of ~13 KiB
    roomy = MsgpackCodec(max_objects=1 << 20, max_metadata_objects=1 << 20)
    assert len(roomy.decode(frame).layers) == 100
    # The frame (charged 3 units per byte, too short for hooks) leaves too little.
    shared = MsgpackCodec(max_objects=3 * len(frame) + 2_000, max_metadata_objects=1 << 20)
    assert "MF_META layer metadata exceeds the decode budget" in refusal(shared, frame)
    capped = MsgpackCodec(max_objects=1 << 20, max_metadata_objects=2_000)
    assert "of 2000 objects" in refusal(capped, frame)


def test_the_byte_budget_counts_the_nested_map_again():
    frame = mf_meta_frame(100)
    assert len(MsgpackCodec(max_bytes=2 * len(frame)).decode(frame).layers) == 100
    message = refusal(MsgpackCodec(max_bytes=len(frame) + 100), frame)
    assert "MF_META layer metadata of" in message and "decode budget" in message
    assert "decode budget of 100 bytes" in refusal(MsgpackCodec(max_bytes=100), frame)


def test_limits_are_validated():
    for kwargs in ({"max_objects": 0}, {"max_items": 0}, {"max_depth": 0},
                   {"max_depth": 1024}, {"max_bytes": 8}, {"max_metadata_objects": 0}):
        with pytest.raises(ValueError):
            MsgpackCodec(**kwargs)


# ------------------------------------------------------------- peak memory

SMALL = MsgpackCodec(1 << 20, 4096, max_objects=50_000, max_metadata_objects=20_000)


def _spend(item: bytes, units: int) -> bytes:
    return chunked(SMALL.max_objects // units + 1, item, SMALL.max_items)


WORST = {
    "empty arrays": lambda: _spend(b"\x90", 2),
    "nested arrays": lambda: _spend(nested(DEFAULT_MAX_DEPTH - 2), 2 * (DEFAULT_MAX_DEPTH - 2)),
    "empty maps": lambda: _spend(b"\x80", 3),
    "maps of maps": lambda: _spend(b"\x81\xa2ab\x80", 7),
    "2-char strings": lambda: _spend(b"\xa2ab", 1),
    "astral strings": lambda: _spend(b"\xa4" + ASTRAL, 1),
    "2-byte bins": lambda: _spend(b"\xc4\x02ab", 1),
    "negative fixints": lambda: _spend(b"\xe0", 1),
    "uint64s": lambda: _spend(UINT64, 1),
    "float64s": lambda: _spend(b"\xcb\x40\x09" + bytes(6), 1),
    "open containers": lambda: open_containers(SMALL, b"\xa4" + ASTRAL),
    "long UCS-4 strings": lambda: header(7) + msgpack.packb(
        "a" * (1 << 17) + ASTRAL.decode()) * 7,
    "MF_META at the metadata cap": lambda: mf_meta_frame(SMALL.max_metadata_objects // 28 + 1),
}


def peak_of(codec: MsgpackCodec, frame: bytes) -> tuple[int, str]:
    gc.collect()
    tracemalloc.start()
    try:
        codec.decode(frame)
        outcome = "decoded"
    except ProtocolError as exc:
        outcome = str(exc)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak, outcome


@pytest.mark.parametrize("shape", sorted(WORST))
def test_peak_memory_of_the_worst_frames_stays_under_the_bound(shape):
    frame = WORST[shape]()
    assert len(frame) <= SMALL.max_frame_bytes
    bound = SMALL.worst_case_decode_bytes()
    peak, outcome = peak_of(SMALL, frame)
    print(f"\n{shape}: {len(frame)}-byte frame, peak {peak} bytes, bound {bound} ({outcome})")
    assert outcome != "decoded"  # none of them is a valid message
    assert peak < bound
    # The object term alone, with the payload bytes this frame really carries.
    per = min(SMALL.max_items, SMALL.max_objects)
    tight = worst_case_decode_bytes(
        len(frame), SMALL.max_objects, max_items=per, max_bytes=2 * len(frame)
    )
    assert peak < tight


def test_the_bound_grows_with_every_limit():
    base = worst_case_decode_bytes()
    assert base == DEFAULT.worst_case_decode_bytes()
    assert worst_case_decode_bytes(max_objects=2 * DEFAULT_MAX_OBJECTS) > base
    assert worst_case_decode_bytes(max_items=2 * DEFAULT_MAX_ITEMS) > base
    assert worst_case_decode_bytes(max_depth=2 * DEFAULT_MAX_DEPTH) > base
    assert worst_case_decode_bytes(2 * DEFAULT.max_frame_bytes) > base
    print(f"\ndefault bound: {base / 2**20:.0f} MiB")
    assert base < 1 << 30


# ------------------------------------------------------------- legitimate frames


def test_a_big_read_ready_batch_round_trips_at_the_default_limits():
    ids = list(range(1 << 16, 1 << 20))
    random.Random(3).shuffle(ids)  # 5-byte ints, none cached
    reqs = tuple(
        ReadRequest(f"cmpl-{i:06d}-0", tuple(ids[i * 4096:(i + 1) * 4096]),
                    tuple(ids[(i + 256) * 4096:(i + 257) * 4096]), 0, 0)
        for i in range(256)
    )
    batch = ReadReadyBatch(7, "model.layers.7.self_attn.attn", reqs, ("done-1",), 0, 1)
    frame = DEFAULT.encode(batch)
    assert DEFAULT.decode(frame) == batch


def test_an_mf_meta_of_61_layers_round_trips_at_the_default_limits():
    meta = MfMeta("session-1", layers(61, tensors=4))
    assert DEFAULT.decode(DEFAULT.encode(meta)) == meta


def test_the_deployment_defaults_bound_is_the_one_the_readme_states():
    """What a deployment gets without tuning (``Rd2hOptions``' defaults, built by the
    composition root)."""
    from rd2h.app.settings import Rd2hSettings
    from rd2h.bootstrap.container import bootstrap

    codec = bootstrap(Rd2hSettings(role="decode")).codec()
    assert isinstance(codec, MsgpackCodec)
    assert (codec.max_frame_bytes, codec.max_objects) == (16 * 2**20, 2**20)
    bound = codec.worst_case_decode_bytes()
    print(f"\ndeployment defaults (16 MiB frames, 1,048,576 units): bound "
          f"{bound / 2**20:.0f} MiB")
    assert round(bound / 2**20) == 369  # docs/security.md "Decode cost of a frame"
