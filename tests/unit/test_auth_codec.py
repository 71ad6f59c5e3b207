"""Shared-secret authentication of control messages: the HMAC framing rule, old-shape
messages without authentication, refusals naming the layer, and the settings."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac

import msgpack
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.adapters.msgpack.auth import array_header, read_array_header, split_signed
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import AuthenticationError, ProtocolError
from rd2h.domain.wire.compat import compat_of
from rd2h.domain.wire.protocol import (
    ACK,
    READ_READY_BATCH,
    LayerMetadata,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

SECRET = b"0123456789abcdef-secret"
PLAIN = MsgpackCodec()
L = "model.layers.2.self_attn"

META = MfMeta("inproc:abc", {L: LayerMetadata((4096, 8192), (64, 8), (1, 1), (0, 1), 1, True,
                                              num_blocks=(8, 8))})
BATCH = ReadReadyBatch(5, L, (ReadRequest("req-1", (1, 2), (3,), 0, 1),), ("req-1",), 1, 2, 7)
MESSAGES = [META, BATCH, ReadDone(5, 7), ReadFailed(5, "boom", 7)]


def signed(secret: bytes = SECRET) -> AuthenticatedCodec:
    return AuthenticatedCodec(PLAIN, secret)


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def mac(receiver: bytes, sender: bytes, seq: int, plain: bytes, key: bytes = SECRET) -> bytes:
    data = b"rd2h-auth-2" + receiver + sender + seq.to_bytes(8, "big") + plain
    return hmac.new(key, data, hashlib.sha256).digest()


def pair(secret_p: bytes = SECRET, secret_d: bytes = SECRET):
    """A Prefill codec and a Decode codec after a handshake on one connection."""
    p, d = signed(secret_p), signed(secret_d)
    assert d.decode(p.encode(META, "ep"), b"id") == META
    assert p.decode(d.encode(MetaAck(), b"id"), "ep") == MetaAck()
    return p, d


# ====================================================================== the framing rule


def test_signed_frame_is_the_plain_tuple_plus_an_envelope_bound_to_both_nonces():
    p, d = signed(), signed()
    meta = p.encode(META, "ep")
    plain = PLAIN.encode(META)
    env = msgpack.unpackb(meta, raw=False)[-1]
    p_nonce, seq = env[:16], int.from_bytes(env[16:24], "big")
    assert seq == 1 and env[24:] == mac(bytes(16), p_nonce, 1, plain)  # no Decode nonce yet
    assert meta == array_header(4) + plain[1:] + b"\xc4\x38" + env
    assert d.decode(meta, b"id") == META
    ack = d.encode(MetaAck(), b"id")
    d_nonce = ack[3:19]
    assert ack == ACK + d_nonce + (1).to_bytes(8, "big") + mac(p_nonce, d_nonce, 1, ACK)
    assert p.decode(ack, "ep") == MetaAck()
    frame = p.encode(BATCH, "ep")
    env = msgpack.unpackb(frame, raw=False)[-1]
    assert env[:16] == p_nonce and env[24:] == mac(d_nonce, p_nonce, 2, PLAIN.encode(BATCH))
    assert d.decode(frame, b"id") == BATCH
    reply = d.encode(ReadDone(5, 7), b"id")
    assert p.decode(reply, "ep") == ReadDone(5, 7)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_a_peer_without_the_secret_reads_signed_frames_as_the_plain_message(msg):
    p, _ = pair()
    assert PLAIN.decode(p.encode(msg, "ep")) == msg


@pytest.mark.parametrize("count", [0, 1, 14, 15, 16, 17, 65535, 65536, 70000])
def test_array_headers_are_msgpacks_shortest_form(count):
    packed = pack([None] * count)
    header = array_header(count)
    assert packed.startswith(header)
    assert read_array_header(packed) == (count, len(header))


def test_signing_works_across_the_fixarray_boundary():
    fields = [READ_READY_BATCH, 1, L, [], [], 0, 1, *range(8)]  # 15 fields (newer build)
    plain = pack(fields)
    env = bytes(range(56))
    frame = array_header(16) + plain[1:] + b"\xc4\x38" + env
    assert frame[0] == 0xDC  # 16 elements need an array 16 header
    assert split_signed(frame) == (plain, env)
    assert msgpack.unpackb(frame, raw=False) == [*fields, env]


# ====================================================================== replays


def test_a_frame_sent_again_on_its_connection_is_refused():
    p, d = pair()
    frame = p.encode(BATCH, "ep")
    assert d.decode(frame, b"id") == BATCH
    with pytest.raises(AuthenticationError, match="replayed") as ei:
        d.decode(frame, b"id")
    assert ei.value.layer_idx == 5
    reply = d.encode(ReadDone(5, 7), b"id")
    assert p.decode(reply, "ep") == ReadDone(5, 7)
    with pytest.raises(AuthenticationError, match="replayed"):
        p.decode(reply, "ep")
    assert d.decode(p.encode(BATCH, "ep"), b"id") == BATCH  # the next one is fine


def test_a_frame_captured_on_one_connection_is_refused_on_another():
    p, d = pair()
    captured = p.encode(BATCH, "ep")
    # The attacker replays the captured MF_META on its own connection: Decode answers
    # it (harmless: metadata under the attacker's connection) with a new nonce ...
    p2 = signed()
    meta = p2.encode(META, "ep")
    assert d.decode(meta, b"attacker") == META
    d.encode(MetaAck(), b"attacker")
    # ... so the captured batch, bound to the first connection's nonces, is refused.
    with pytest.raises(AuthenticationError, match="does not match") as ei:
        d.decode(captured, b"attacker")
    assert ei.value.layer_idx == 5
    assert d.decode(captured, b"id") == BATCH  # on its own connection, once
    with pytest.raises(AuthenticationError, match="another connection"):
        d.decode(captured, b"nobody")  # no MF_META on that connection at all


def test_an_ack_from_another_connection_is_refused():
    p, d = signed(), signed()
    d.decode(p.encode(META, "ep"), b"id")
    other = signed()
    d.decode(other.encode(META, "x"), b"other")
    with pytest.raises(AuthenticationError, match="acknowledgement refused"):
        p.decode(d.encode(MetaAck(), b"other"), "ep")
    assert p.decode(d.encode(MetaAck(), b"id"), "ep") == MetaAck()


def test_a_restarted_peer_starts_a_new_count():
    """Prefill re-handshakes over the same endpoint with a Decode that restarted: the
    new Decode nonce restarts the count, so its sequence 1 is not a replay."""
    p, d = pair()
    for _ in range(3):
        assert p.decode(d.encode(ReadDone(1, 1), b"id"), "ep") == ReadDone(1, 1)
    d2 = signed()
    assert d2.decode(p.encode(META, "ep"), b"new") == META
    assert p.decode(d2.encode(MetaAck(), b"new"), "ep") == MetaAck()
    assert d2.decode(p.encode(BATCH, "ep"), b"new") == BATCH
    assert p.decode(d2.encode(ReadDone(5, 7), b"new"), "ep") == ReadDone(5, 7)


def test_state_is_per_connection_bounded_and_forgotten():
    d = AuthenticatedCodec(PLAIN, SECRET, max_connections=3)
    for n in range(10):
        d.decode(signed().encode(META, "ep"), n)
    assert d.connections == 3
    d.forget(9)
    assert d.connections == 2
    # A refusal to a connection Decode knows nothing of keeps no state either.
    d.encode(ReadFailed(1, "no", 1), b"unknown")
    assert d.connections == 2
    with pytest.raises(ValueError):
        AuthenticatedCodec(PLAIN, SECRET, max_connections=0)


def test_replayed_mf_meta_never_displaces_a_proven_connection():
    """A captured MF_META replayed on more connections than the cap: each gets unproven
    state, evicting only older unproven state; the valid connection proved itself with
    a frame after the ACK and keeps working."""
    p, d = signed(), AuthenticatedCodec(PLAIN, SECRET, max_connections=4)
    captured = p.encode(META, "ep")
    assert d.decode(captured, b"id") == META
    assert p.decode(d.encode(MetaAck(), b"id"), "ep") == MetaAck()
    assert p.proven("ep") and not d.proven(b"id")  # Prefill: the ACK bound its nonce
    assert d.decode(p.encode(BATCH, "ep"), b"id") == BATCH
    assert d.proven(b"id")
    for n in range(10):
        assert d.decode(captured, n) == META
        d.encode(MetaAck(), n)
        assert not d.proven(n)
    assert d.connections == 1 + 4  # the proven one and the 4 newest unproven ones
    assert d.decode(p.encode(BATCH, "ep"), b"id") == BATCH
    assert p.decode(d.encode(ReadDone(5, 7), b"id"), "ep") == ReadDone(5, 7)
    with pytest.raises(AuthenticationError, match="does not match"):
        d.decode(p.encode(BATCH, "ep"), 9)  # bound to the valid connection's nonces
    with pytest.raises(AuthenticationError, match="another connection"):
        d.decode(p.encode(BATCH, "ep"), 0)  # its unproven state was evicted


def test_proven_state_is_bounded_by_refusing_rather_than_evicting():
    d = AuthenticatedCodec(PLAIN, SECRET, max_connections=2)
    peers = {n: signed() for n in range(3)}
    for n, p in peers.items():
        d.decode(p.encode(META, "ep"), n)
        assert p.decode(d.encode(MetaAck(), n), "ep") == MetaAck()
        if n < 2:
            assert d.decode(p.encode(BATCH, "ep"), n) == BATCH and d.proven(n)
    with pytest.raises(AuthenticationError, match="too many authenticated") as ei:
        d.decode(peers[2].encode(BATCH, "ep"), 2)
    assert ei.value.layer_idx == 5 and not d.proven(2)
    assert d.decode(peers[0].encode(BATCH, "ep"), 0) == BATCH  # untouched
    d.forget(1)  # a proven connection closed: room for one more
    assert d.decode(peers[2].encode(BATCH, "ep"), 2) == BATCH and d.proven(2)


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
        signed().decode(frame)
    assert ei.value.layer_idx == (4 if b"read_ready" in frame else None)


def test_wrong_secret_is_refused_naming_the_layer_of_a_ready_batch():
    d, other = signed(), signed(b"another-secret-of-16+")
    with pytest.raises(AuthenticationError, match="does not match") as ei:
        d.decode(other.encode(META, "ep"), b"id")
    assert ei.value.layer_idx is None
    with pytest.raises(AuthenticationError) as ei:
        d.decode(other.encode(BATCH, "ep"), b"id")
    assert ei.value.layer_idx == BATCH.layer_idx


def test_a_refused_malformed_ready_batch_still_names_its_layer():
    with pytest.raises(AuthenticationError) as ei:
        signed().decode(pack([READ_READY_BATCH, 9, L, "not-a-list"]))
    assert ei.value.layer_idx == 9


def test_a_signature_over_other_bytes_is_refused():
    p, d = pair()
    good = p.encode(BATCH, "ep")
    forged = PLAIN.encode(ReadReadyBatch(5, L, (ReadRequest("req-1", (7,), (7,)),)))
    header = read_array_header(forged)
    assert header is not None
    frame = array_header(header[0] + 1) + forged[header[1]:] + good[-58:]
    with pytest.raises(AuthenticationError, match="does not match"):
        d.decode(frame, b"id")
    assert d.decode(good, b"id") == BATCH


@given(st.integers(0, 10_000), st.integers(1, 255), st.sampled_from(MESSAGES))
@settings(max_examples=300, deadline=None)
def test_any_changed_byte_of_a_signed_frame_is_refused(at, delta, msg):
    p, d = pair()
    frame = bytearray(p.encode(msg, "ep"))
    at %= len(frame)
    frame[at] = (frame[at] + delta) % 256
    with pytest.raises(ProtocolError):
        d.decode(bytes(frame), b"id")


@given(st.binary(max_size=200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_only_raise_protocol_error(frame):
    _, d = pair()
    with pytest.raises(ProtocolError):
        d.decode(frame + b"\xc4\x38" + bytes(56), b"id")
    try:
        d.decode(frame, b"id")
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
    p = AuthenticatedCodec(MsgpackCodec(max_frame_bytes=1024), SECRET)
    small.decode(p.encode(META, "ep"), "c")
    p.decode(small.encode(MetaAck(), "c"), "ep")
    assert small.decode(memoryview(p.encode(ReadDone(1), "ep")), "c") == ReadDone(1)


def test_empty_secret_is_a_configuration_error():
    with pytest.raises(ValueError, match="secret"):
        AuthenticatedCodec(PLAIN, b"")


# ====================================================================== the acknowledgement


def test_signed_ack_is_recognised_and_only_once():
    p, d = signed(), signed()
    d.decode(p.encode(META, "ep"), b"id")
    ack = d.encode(MetaAck(), b"id")
    assert p.decode(ack, "ep") == MetaAck()
    with pytest.raises(AuthenticationError, match="replayed"):
        p.decode(ack, "ep")
    assert p.decode(d.encode(ReadDone(1), b"id"), "ep") == ReadDone(1)  # not an ACK
    assert PLAIN.encode(MetaAck()) == ACK and PLAIN.decode(ACK) == MetaAck()
    with pytest.raises(ProtocolError) as info:  # a legacy Prefill never takes it for ACK
        PLAIN.decode(ack)
    assert not info.value.handshake  # a malformed reply to it


def test_unsigned_or_wrongly_signed_ack_is_refused_clearly():
    p, other = signed(), signed(b"another-secret-of-16+")
    other.decode(signed(b"another-secret-of-16+").encode(META, "x"), b"id")
    p.encode(META, "ep")
    with pytest.raises(AuthenticationError, match=r"not signed.*auth_secret"):
        p.decode(ACK, "ep")
    with pytest.raises(AuthenticationError, match="does not match"):
        p.decode(other.encode(MetaAck(), b"id"), "ep")


# ====================================================================== settings / container


def test_container_signs_only_when_a_secret_is_configured():
    plain = bootstrap(Rd2hSettings(role="decode")).codec()
    assert isinstance(plain, MsgpackCodec)
    signed = bootstrap(
        Rd2hSettings(role="prefill", auth_secret=SECRET.decode(), max_frame_bytes=4096)
    ).codec()
    assert isinstance(signed, AuthenticatedCodec)
    d = AuthenticatedCodec(PLAIN, SECRET)
    assert d.decode(signed.encode(META, "ep"), b"id") == META  # same secret: verified
    assert signed.decode(d.encode(MetaAck(), b"id"), "ep") == MetaAck()


def test_short_secret_is_refused_without_echoing_it():
    with pytest.raises(pydantic.ValidationError, match="auth_secret") as ei:
        Rd2hSettings(role="decode", auth_secret="hunter2-short")
    assert "hunter2" not in str(ei.value)


def test_the_secret_never_shows_in_settings_reprs():
    s = Rd2hSettings(role="decode", auth_secret="a-very-secret-value-123")
    assert "a-very-secret" not in repr(s) and "a-very-secret" not in str(s.model_dump())


def test_an_ack_stating_decodes_generation_is_signed_over_it():
    """The generation (8 bytes after ``b"ACK"``) is inside the signed plain bytes: it
    cannot be changed in flight, and an unsigned one is refused like an unsigned ACK."""
    p, d = signed(), signed()
    meta = dataclasses.replace(META, compat=compat_of(auth=p.signing), generation=9)
    assert d.decode(p.encode(meta, "ep"), b"id") == meta
    ack = d.encode(MetaAck(2**62 + 5), b"id")
    assert ack.startswith(ACK + (2**62 + 5).to_bytes(8, "big"))
    tampered = ack[:3] + (6).to_bytes(8, "big") + ack[11:]
    with pytest.raises(AuthenticationError):
        p.decode(tampered, "ep")
    assert p.decode(ack, "ep") == MetaAck(2**62 + 5)
    with pytest.raises(AuthenticationError, match="not signed"):
        p.decode(PLAIN.encode(MetaAck(5)), "ep")
    assert PLAIN.decode(PLAIN.encode(MetaAck(5))) == MetaAck(5)
    assert PLAIN.decode(ACK).generation is None  # type: ignore[union-attr]
    with pytest.raises(ProtocolError):
        PLAIN.decode(ACK + b"x")  # not an acknowledgement
