"""MF_META's compatibility map (field 3) and Decode's refusal (``b"NAK"``): the values
each side states, the comparison, and both on the wire, plain and signed."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest

from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.app.settings import Rd2hOptions
from rd2h.domain.errors import AuthenticationError, ProtocolError
from rd2h.domain.wire.compat import (
    INCOMPATIBLE,
    MAX_KEYS,
    NAK,
    PROTOCOL_VERSION,
    Compat,
    MetaRefused,
    Mismatch,
    compare,
    compat_of,
    decode_compat,
)
from rd2h.domain.wire.protocol import (
    ACK,
    MF_META,
    LayerMetadata,
    MetaAck,
    MfMeta,
    ReadDone,
    fields_of,
)
from rd2h.entry import translate

SECRET = b"0123456789abcdef-secret"
PLAIN = MsgpackCodec()
L = "model.layers.0.self_attn"
LAYERS = {L: LayerMetadata((4096,), (64,), (1,), (0,), 1, False)}
MINE = compat_of(block_size=16, kv_dtype="bfloat16", num_layers=61, head_size=576,
                 kv_heads=1, mla=True, main_sharing="shared_pool", auth="none")
META = MfMeta("inproc:p", LAYERS, MINE)


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def meta_frame(compat: object) -> bytes:
    return pack([MF_META, "inproc:p", pack({L: LAYERS[L].to_map()}), compat])


# ====================================================================== the values


def test_compat_of_states_the_protocol_and_only_the_given_values() -> None:
    assert compat_of().values == {"protocol": PROTOCOL_VERSION}
    assert compat_of(block_size=16, mla=False).values == {
        "protocol": PROTOCOL_VERSION, "block_size": 16, "mla": False}
    assert compat_of(block_size=16).with_values(auth="rd2h-auth-2", kv_dtype=None).values == {
        "protocol": PROTOCOL_VERSION, "block_size": 16, "auth": "rd2h-auth-2"}
    with pytest.raises(ValueError, match="'block_size' must be an int"):
        compat_of(block_size=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'kv_dtype' must be a str"):
        compat_of(kv_dtype="x" * 200)


def test_compare_names_every_differing_key_with_both_values() -> None:
    theirs = compat_of(block_size=128, kv_dtype="float16", num_layers=61, head_size=576,
                       kv_heads=1, mla=False, main_sharing="shared_pool", auth="none")
    refused = compare(theirs, MINE)
    assert refused == MetaRefused(INCOMPATIBLE, (
        Mismatch("block_size", "128", "16"), Mismatch("kv_dtype", "float16", "bfloat16"),
        Mismatch("mla", "false", "true")))
    assert refused.describe() == (f"{INCOMPATIBLE}: block_size: prefill 128, decode 16; "
                                  "kv_dtype: prefill float16, decode bfloat16; "
                                  "mla: prefill false, decode true")
    assert compare(MINE, MINE) is None


def test_only_keys_both_state_are_compared_and_always_the_protocol() -> None:
    assert compare(compat_of(block_size=16), MINE) is None  # Prefill states less
    assert compare(MINE, compat_of(kv_dtype="bfloat16")) is None  # Decode states less
    newer = compat_of(block_size=16, protocol=PROTOCOL_VERSION + 1)
    refused = compare(newer, compat_of())
    assert refused is not None
    assert refused.mismatches == (Mismatch("protocol", str(PROTOCOL_VERSION + 1),
                                           str(PROTOCOL_VERSION)),)


# ====================================================================== MF_META field 3


@pytest.mark.parametrize("codec", [PLAIN, AuthenticatedCodec(PLAIN, SECRET)])
def test_mf_meta_with_compat_round_trips(codec) -> None:
    got = codec.decode(codec.encode(META, "ep"), b"id")
    assert got == META and got.compat == MINE


def test_mf_meta_without_compat_is_the_legacy_frame() -> None:
    legacy = MfMeta("inproc:p", LAYERS)
    assert len(fields_of(legacy)) == 3  # nothing appended
    assert PLAIN.decode(PLAIN.encode(legacy)).compat is None
    assert PLAIN.decode(pack([MF_META, "inproc:p", pack({L: LAYERS[L].to_map()})])) == legacy


def test_a_plain_reader_sees_past_the_signature_envelope() -> None:
    signing = AuthenticatedCodec(PLAIN, SECRET)
    # No map: field 3 is the 56-byte envelope, which is not a compat map.
    assert PLAIN.decode(signing.encode(MfMeta("inproc:p", LAYERS), "a")).compat is None
    assert PLAIN.decode(signing.encode(META, "b")).compat == MINE


def test_unknown_keys_are_dropped_unread() -> None:
    wire = {"protocol": 1, "block_size": 16, "future": [1, {"x": b"y"}], "later": None}
    assert decode_compat(wire) == Compat({"protocol": 1, "block_size": 16})
    assert PLAIN.decode(meta_frame(wire)).compat == Compat({"protocol": 1, "block_size": 16})


@pytest.mark.parametrize(("compat", "message"), [
    ([1, 2], "compat must be a map, got list"),
    (7, "compat must be a map, got int"),
    ("protocol", "compat must be a map, got str"),
    ({"block_size": 16}, "compat lacks 'protocol'"),
    ({"protocol": "1"}, "'protocol' must be an int"),
    ({"protocol": 1, "block_size": -1}, "'block_size' must be an int in"),
    ({"protocol": 1, "block_size": True}, "'block_size' must be an int in"),
    ({"protocol": 1, "block_size": 1 << 63}, "'block_size' must be an int in"),
    ({"protocol": 1, "mla": 1}, "'mla' must be a bool"),
    ({"protocol": 1, "kv_dtype": "f" * 129}, "'kv_dtype' must be a str of at most 128"),
    ({"protocol": 1, 5: "x"}, "keys must be str"),
    ({"protocol": 1, "k" * 65: 1}, "keys must be str of at most 64"),
    ({"protocol": 1, **{f"k{i}": i for i in range(MAX_KEYS)}}, f"at most {MAX_KEYS}"),
])
def test_a_malformed_compat_map_is_a_protocol_error(compat, message) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_compat(compat)


def test_the_codec_refuses_a_malformed_compat_map_as_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="compat must be a map, got list"):
        PLAIN.decode(meta_frame([1, 2]))
    with pytest.raises(ProtocolError, match="'block_size' must be an int"):
        PLAIN.decode(meta_frame({"protocol": 1, "block_size": "16"}))


def test_an_oversized_compat_map_is_refused_by_the_budget_or_the_entry_cap() -> None:
    huge = {"protocol": 1, **{f"key-{i}": i for i in range(5000)}}
    with pytest.raises(ProtocolError, match="compat has 5001 entries"):
        PLAIN.decode(meta_frame(huge))
    with pytest.raises(ProtocolError, match=r"budget|max_map_len"):
        MsgpackCodec(max_objects=1000).decode(meta_frame(huge))
    with pytest.raises(ProtocolError, match="budget"):
        MsgpackCodec(max_objects=1000).decode(
            meta_frame({"protocol": 1, "future": [[0] * 400] * 3}))


# ====================================================================== the refusal


REFUSAL = MetaRefused(INCOMPATIBLE, (Mismatch("block_size", "16", "128"),))


def test_the_refusal_round_trips_and_is_never_taken_for_something_else() -> None:
    frame = PLAIN.encode(REFUSAL)
    assert frame.startswith(NAK)
    assert PLAIN.decode(frame) == REFUSAL  # never an acknowledgement
    assert PLAIN.decode(ACK) == MetaAck()
    assert PLAIN.decode(PLAIN.encode(ReadDone(1, 2))) == ReadDone(1, 2)
    assert PLAIN.decode(NAK + pack([INCOMPATIBLE, [], "later field"])) == MetaRefused(
        INCOMPATIBLE)


@pytest.mark.parametrize("body", [
    b"", b"\xc1", pack("just a str"), pack([1, []]), pack(["r", [["k", "p"]]]),
    pack(["r", [["k", "p", 3]]]), pack(["r", [["k", "p", "d"]] * 40]),
    pack(["r", []]) + b"trailing",
])
def test_a_malformed_refusal_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        PLAIN.decode(NAK + body)
    assert info.value.handshake  # the handshake it answers fails


def test_long_refusal_texts_are_clipped() -> None:
    got = PLAIN.decode(NAK + pack(["r" * 5000, [["k" * 500, "p" * 500, "d"]]]))
    assert isinstance(got, MetaRefused) and len(got.reason) == 1024
    assert len(got.mismatches[0].key) == 64 and len(got.mismatches[0].prefill) == 128


def signed_pair() -> tuple[AuthenticatedCodec, AuthenticatedCodec]:
    p, d = AuthenticatedCodec(PLAIN, SECRET), AuthenticatedCodec(PLAIN, SECRET)
    assert d.decode(p.encode(META, "ep"), b"id") == META
    return p, d


def test_a_signed_refusal_is_verified_on_its_connection_once() -> None:
    p, d = signed_pair()
    frame = d.encode(REFUSAL, b"id")
    assert frame.startswith(NAK)
    assert p.decode(frame, "ep") == REFUSAL  # never an acknowledgement
    with pytest.raises(AuthenticationError, match="replayed"):
        p.decode(frame, "ep")
    assert p.decode(d.encode(ReadDone(0), b"id"), "ep") == ReadDone(0)


def test_an_unsigned_refusal_to_a_signing_prefill_quotes_its_claim() -> None:
    p, _ = signed_pair()
    with pytest.raises(AuthenticationError, match=r"not signed .*it said: .*block_size"):
        p.decode(PLAIN.encode(REFUSAL), "ep")


def test_a_tampered_or_foreign_refusal_is_refused() -> None:
    p, d = signed_pair()
    frame = bytearray(d.encode(REFUSAL, b"id"))
    frame[10] ^= 1
    with pytest.raises(AuthenticationError, match="not verified"):
        p.decode(bytes(frame), "ep")
    other = AuthenticatedCodec(PLAIN, b"another-secret-of-some-length")
    with pytest.raises(AuthenticationError):
        p.decode(other.encode(REFUSAL, b"id"), "ep")
    with pytest.raises(AuthenticationError, match="not signed") as info:
        p.decode(NAK + b"\x00" * 20, "ep")
    assert info.value.handshake


def test_each_codec_states_its_signing_envelope() -> None:
    assert PLAIN.signing == "none"
    assert AuthenticatedCodec(PLAIN, SECRET).signing == "rd2h-auth-2"


# ====================================================================== the connector's values


def test_the_connector_states_what_both_engines_know() -> None:
    model = SimpleNamespace(get_head_size=lambda: 128, use_mla=False,
                            get_total_num_hidden_layers=lambda: 32,
                            get_total_num_kv_heads=lambda: 8)
    vllm = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="fp8"))
    spec = SimpleNamespace(head_size=128, dtype="torch.uint8")
    plain = Rd2hOptions.parse({})
    assert translate.compat(vllm, spec, plain, "decode", 16).values == {
        "protocol": PROTOCOL_VERSION, "block_size": 16, "kv_dtype": "fp8_e4m3",
        "num_layers": 32, "head_size": 128, "kv_heads": 8, "mla": False,
        "main_sharing": "rank_local"}
    # Prefill states main_sharing only when configured (it does not depend on it).
    assert "main_sharing" not in translate.compat(vllm, spec, plain, "prefill", 16).values
    pool = Rd2hOptions.parse({"destinations": "sparse_kv_pool", "main_sharing": "shared_pool"})
    assert translate.compat(vllm, spec, pool, "prefill", 16).values["main_sharing"] == (
        "shared_pool")
    # No model config (e.g. a bare VllmConfig): the cache spec's facts only.
    bare = SimpleNamespace(model_config=None, cache_config=SimpleNamespace(cache_dtype="auto"))
    mla_spec = type("MLAAttentionSpec", (), {"head_size": 576, "dtype": "torch.bfloat16"})()
    assert translate.compat(bare, mla_spec, plain, "prefill", 64).values == {
        "protocol": PROTOCOL_VERSION, "block_size": 64, "kv_dtype": "bfloat16",
        "head_size": 576, "mla": True}
