"""Shared-secret authentication of control messages: the HMAC framing rule, old-shape
messages without authentication, refusals naming the layer, and the settings."""

from __future__ import annotations

import hashlib
import hmac

import msgpack
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.adapters.msgpack.auth import array_header, read_array_header, split_signed
from rd2h.app.container import build_container
from rd2h.app.settings import Rd2hSettings
from rd2h.domain.errors import AuthenticationError, ProtocolError
from rd2h.domain.protocol import (
    ACK,
    READ_READY_BATCH,
    LayerMetadata,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

SECRET = b"0123456789abcdef-secret"
PLAIN = MsgpackCodec()
SIGNED = AuthenticatedCodec(PLAIN, SECRET)
OTHER = AuthenticatedCodec(PLAIN, b"another-secret-of-16+")
L = "model.layers.2.self_attn"

META = MfMeta("inproc:abc", {L: LayerMetadata((4096, 8192), (64, 8), (1, 1), (0, 1), 1, True,
                                              num_blocks=(8, 8))})
BATCH = ReadReadyBatch(5, L, (ReadRequest("req-1", (1, 2), (3,), 0, 1),), ("req-1",), 1, 2)
MESSAGES = [META, BATCH, ReadDone(5), ReadFailed(5, "boom")]


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def mac(data: bytes, key: bytes = SECRET) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


# ====================================================================== the framing rule


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_signed_frame_is_the_plain_tuple_plus_an_hmac_of_its_encoding(msg):
    plain = PLAIN.encode(msg)
    signed = SIGNED.encode(msg)
    fields = msgpack.unpackb(plain, raw=False)
    # one appended bin field: HMAC-SHA256(secret, plain encoding)
    assert msgpack.unpackb(signed, raw=False) == [*fields, mac(plain)]
    assert signed == array_header(len(fields) + 1) + plain[1:] + b"\xc4\x20" + mac(plain)
    assert SIGNED.decode(signed) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_peer_without_the_secret_reads_signed_frames_as_the_plain_message(msg):
    assert PLAIN.decode(SIGNED.encode(msg)) == msg


@pytest.mark.parametrize("count", [0, 1, 14, 15, 16, 17, 65535, 65536, 70000])
def test_array_headers_are_msgpacks_shortest_form(count):
    packed = pack([None] * count)
    header = array_header(count)
    assert packed.startswith(header)
    assert read_array_header(packed) == (count, len(header))


def test_signing_works_across_the_fixarray_boundary():
    fields = [READ_READY_BATCH, 1, L, [], [], 0, 1, *range(8)]  # 15 fields (newer build)
    plain = pack(fields)
    signed = array_header(16) + plain[1:] + b"\xc4\x20" + mac(plain)
    assert signed[0] == 0xDC  # 16 elements need an array 16 header
    assert split_signed(signed) == (plain, mac(plain))
    assert msgpack.unpackb(signed, raw=False) == [*fields, mac(plain)]


# ====================================================================== without the secret


OLD_SHAPES = [
    pack([READ_READY_BATCH, 4, L, [["req", [1, 2]]]]),  # 4 fields, a 2-field entry
    pack([READ_READY_BATCH, 4, L, [], ["req"]]),  # 5 fields
    pack([b"mf_meta", "s", {L: META.layers[L].to_map()}]),  # inline map
    pack([b"read_done", 4]),
    pack([b"read_failed", 4]),
]


@pytest.mark.parametrize("frame", OLD_SHAPES)
def test_old_shape_messages_decode_without_authentication(frame):
    PLAIN.decode(frame)  # no secret configured: unchanged behaviour


@pytest.mark.parametrize("frame", OLD_SHAPES)
def test_old_shape_messages_are_refused_when_a_secret_is_configured(frame):
    with pytest.raises(AuthenticationError, match=r"not signed.*auth_secret") as ei:
        SIGNED.decode(frame)
    assert ei.value.layer_idx == (4 if b"read_ready" in frame else None)


def test_wrong_secret_is_refused_naming_the_layer_of_a_ready_batch():
    with pytest.raises(AuthenticationError, match="does not match") as ei:
        SIGNED.decode(OTHER.encode(BATCH))
    assert ei.value.layer_idx == BATCH.layer_idx
    with pytest.raises(AuthenticationError, match="does not match") as ei:
        SIGNED.decode(OTHER.encode(META))
    assert ei.value.layer_idx is None


def test_a_refused_malformed_ready_batch_still_names_its_layer():
    with pytest.raises(AuthenticationError) as ei:
        SIGNED.decode(pack([READ_READY_BATCH, 9, L, "not-a-list"]))
    assert ei.value.layer_idx == 9


def test_a_signature_over_other_bytes_is_refused():
    plain = PLAIN.encode(BATCH)
    forged = PLAIN.encode(ReadReadyBatch(5, L, (ReadRequest("req-1", (7,), (7,)),)))
    header = read_array_header(forged)
    assert header is not None
    frame = array_header(header[0] + 1) + forged[header[1]:] + b"\xc4\x20" + mac(plain)
    with pytest.raises(AuthenticationError, match="does not match"):
        SIGNED.decode(frame)


@given(st.integers(0, 10_000), st.integers(1, 255), st.sampled_from(MESSAGES))
@settings(max_examples=300, deadline=None)
def test_any_changed_byte_of_a_signed_frame_is_refused(at, delta, msg):
    frame = bytearray(SIGNED.encode(msg))
    at %= len(frame)
    frame[at] = (frame[at] + delta) % 256
    with pytest.raises(ProtocolError):
        SIGNED.decode(bytes(frame))


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_only_raise_protocol_error(frame):
    with pytest.raises(ProtocolError):
        SIGNED.decode(frame + b"\xc4\x20" + bytes(32))
    try:
        SIGNED.decode(frame)
    except ProtocolError:
        pass
    else:
        raise AssertionError("random bytes carried a valid signature")


def test_oversized_and_non_bytes_frames_are_protocol_errors():
    small = AuthenticatedCodec(MsgpackCodec(max_frame_bytes=1024), SECRET)
    with pytest.raises(ProtocolError, match="exceeds"):
        small.decode(b"\x90" * 5000)
    with pytest.raises(ProtocolError, match="bytes"):
        small.decode("text")  # type: ignore[arg-type]
    assert small.decode(memoryview(small.encode(ReadDone(1)))) == ReadDone(1)


def test_empty_secret_is_a_configuration_error():
    with pytest.raises(ValueError, match="secret"):
        AuthenticatedCodec(PLAIN, b"")


# ====================================================================== the acknowledgement


def test_signed_ack_is_ack_plus_its_hmac():
    assert SIGNED.encode_ack() == ACK + mac(ACK)
    assert SIGNED.is_ack(SIGNED.encode_ack())
    assert not SIGNED.is_ack(SIGNED.encode(ReadDone(1)))
    assert PLAIN.encode_ack() == ACK and PLAIN.is_ack(ACK)
    assert not PLAIN.is_ack(SIGNED.encode_ack())  # a legacy Prefill never takes it for ACK


def test_unsigned_or_wrongly_signed_ack_is_refused_clearly():
    with pytest.raises(AuthenticationError, match=r"not signed.*auth_secret"):
        SIGNED.is_ack(ACK)
    with pytest.raises(AuthenticationError, match="does not match"):
        SIGNED.is_ack(OTHER.encode_ack())


# ====================================================================== settings / container


def test_container_signs_only_when_a_secret_is_configured():
    plain = build_container(Rd2hSettings(role="decode")).codec()
    assert isinstance(plain, MsgpackCodec)
    signed = build_container(
        Rd2hSettings(role="prefill", auth_secret=SECRET.decode(), max_frame_bytes=4096)
    ).codec()
    assert isinstance(signed, AuthenticatedCodec)
    assert SIGNED.decode(signed.encode(BATCH)) == BATCH  # same secret, same tag
    assert signed.is_ack(SIGNED.encode_ack())


def test_short_secret_is_refused_without_echoing_it():
    with pytest.raises(pydantic.ValidationError, match="auth_secret") as ei:
        Rd2hSettings(role="decode", auth_secret="hunter2-short")
    assert "hunter2" not in str(ei.value)


def test_the_secret_never_shows_in_settings_reprs():
    s = Rd2hSettings(role="decode", auth_secret="a-very-secret-value-123")
    assert "a-very-secret" not in repr(s) and "a-very-secret" not in str(s.model_dump())
