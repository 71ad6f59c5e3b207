"""The compatibility map in the sessions, sans IO: Decode refuses an MF_META whose map
differs from its own (nothing stored, a refusal naming the field), Prefill fails what
waits on that endpoint at once with that reason; peers without a map work as before."""

from __future__ import annotations

from rd2h.domain.decode.decode_session import (
    DecodeSession,
    Forget,
    LayerFailed,
    MetaStored,
    Rejected,
    Reply,
    SendAck,
    SendRefusal,
)
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.prefill.announce import LayerTarget, group_batches
from rd2h.domain.prefill.prefill_events import Disconnect, HandshakeDone, LayerAnswered, SendMeta
from rd2h.domain.prefill.prefill_session import PrefillSession, PrefillTimeouts
from rd2h.domain.wire.compat import (
    INCOMPATIBLE,
    Compat,
    MetaRefused,
    Mismatch,
    compat_of,
    decode_compat,
)
from rd2h.domain.wire.protocol import MfMeta, ReadFailed, ReadReadyBatch, ReadRequest

NAME = "model.layers.0.attn"
BPB, NB = 64, 8
SRC = SourceLayout(NAME, (TensorComponent(0x10000, BPB, num_blocks=NB),))
DST = DestinationLayout(NAME, (DestTensor(0x90000, BPB, NB),))
DECODE = compat_of(block_size=16, kv_dtype="bfloat16", mla=True, main_sharing="rank_local")
P = b"peer-1"
T = PrefillTimeouts(meta_ack_s=10.0, layer_ack_s=5.0, device_event_s=3.0, reconnect_after_s=4.0)


def decode(compat: Compat | None = DECODE) -> DecodeSession:
    return DecodeSession(destinations={NAME: DST}, d_rank=0, d_tp=1, main_shared=False,
                         compat=compat)


def meta(compat: Compat | None, layout: SourceLayout = SRC) -> MfMeta:
    return MfMeta("p-session", {NAME: layout.to_metadata()}, compat)


def batch() -> ReadReadyBatch:
    return ReadReadyBatch(0, NAME, (ReadRequest("r1", (0,), (0,)),), (), seq=3)


# ====================================================================== Decode


def test_a_differing_block_size_is_refused_naming_both_values_and_nothing_is_kept() -> None:
    s = decode()
    outs = s.receive(P, meta(compat_of(block_size=128, kv_dtype="bfloat16")), 0.0)
    refusal = MetaRefused(INCOMPATIBLE, (Mismatch("block_size", "128", "16"),))
    assert outs == [Rejected("incompatible", f"prefill p-session: {refusal.describe()}"),
                    SendRefusal(P, refusal), Forget(P)]
    assert s.counters()["peers"] == 0
    # Nothing was stored: an announcement on that connection still fails per layer.
    outs = s.receive(P, batch(), 1.0)
    assert isinstance(outs[0], Reply) and isinstance(outs[0].message, ReadFailed)
    assert "before MF_META" in outs[0].message.error


def test_every_differing_field_and_the_protocol_version_are_named() -> None:
    theirs = compat_of(block_size=16, kv_dtype="float16", mla=False, protocol=2)
    outs = decode().receive(P, meta(theirs), 0.0)
    refusal = next(o.refusal for o in outs if isinstance(o, SendRefusal))
    assert [m.key for m in refusal.mismatches] == ["protocol", "kv_dtype", "mla"]


def test_an_earlier_compatible_peer_state_goes_when_its_map_no_longer_matches() -> None:
    s = decode()
    assert s.receive(P, meta(DECODE), 0.0) == [SendAck(P), MetaStored(P, "p-session", 1)]
    assert s.counters()["peers"] == 1
    assert any(isinstance(o, SendRefusal)
               for o in s.receive(P, meta(compat_of(block_size=32)), 1.0))
    assert s.counters()["peers"] == 0


def test_a_matching_map_is_acknowledged() -> None:
    s = decode()
    assert s.receive(P, meta(DECODE), 0.0) == [SendAck(P), MetaStored(P, "p-session", 1)]


def test_keys_only_one_side_states_and_unknown_keys_are_not_compared() -> None:
    # Prefill states no main_sharing (not configured) but a head size Decode does not.
    theirs = Compat({**compat_of(block_size=16, head_size=576).values})
    assert decode().receive(P, meta(theirs), 0.0)[0] == SendAck(P)
    # A newer Prefill's keys unknown here were dropped by the decoder: only known compared.
    newer = decode_compat({"protocol": 1, "block_size": 16, "page_layout": "v9", "x": [1]})
    assert decode().receive(P, meta(newer), 0.0)[0] == SendAck(P)


def test_a_peer_without_a_map_works_as_before_and_layouts_are_still_checked() -> None:
    s = decode()
    assert s.receive(P, meta(None), 0.0) == [SendAck(P), MetaStored(P, "p-session", 1)]
    # Per-request layout checks still apply: a source whose block is another size fails.
    wrong = SourceLayout(NAME, (TensorComponent(0x10000, BPB * 2, num_blocks=NB),))
    s.receive(P, meta(None, wrong), 0.5)
    s.admit("r1-abcdefgh", [0], [0], 0.0)
    outs = s.receive(P, batch(), 1.0)
    assert any(isinstance(o, LayerFailed) and "mismatch" in o.reason for o in outs), outs


def test_a_decode_without_a_map_acknowledges_any_map() -> None:
    outs = decode(None).receive(P, meta(compat_of(block_size=999)), 0.0)
    assert outs == [SendAck(P), MetaStored(P, "p-session", 1)]


# ====================================================================== Prefill


def prefill() -> PrefillSession:
    return PrefillSession({0: SRC, 1: SourceLayout("model.layers.1.attn", SRC.main)}, T)


def announce(s: PrefillSession, layer: int, ep: str, now: float) -> int:
    targets = [LayerTarget(ep, ReadRequest("r1", (0,), (0,)), False, 0, 1, "r1")]
    return s.announce(layer, group_batches(layer, s.layer_name(layer), targets), now,
                      {ep: [(f"r{layer}", "r1")]})


def test_prefill_fails_what_waits_on_a_refusing_endpoint_at_once_with_its_reason() -> None:
    s = prefill()
    a0, a1 = announce(s, 0, "A", 0.0), announce(s, 1, "A", 0.0)
    assert SendMeta("A") in s.event_done(a0, 0.1)
    s.event_done(a1, 0.1)
    reason = MetaRefused(INCOMPATIBLE, (Mismatch("block_size", "16", "128"),)).describe()
    outs = s.ack_refused("A", reason, 0.2)  # long before meta_ack_s (10 s)
    assert Disconnect("A") in outs
    done = [o for o in outs if isinstance(o, HandshakeDone)]
    assert done and "block_size: prefill 16, decode 128" in (done[0].error or "")
    failed = [o for o in outs if isinstance(o, LayerAnswered)]
    assert sorted(o.layer_idx for o in failed) == [0, 1]
    assert all("block_size: prefill 16, decode 128" in (o.error or "") for o in failed)
    assert s.gate(0).open and s.gate(1).open and s.idle
    assert s.book.open_tickets(["r0", "r1"]) == {}
    assert s.book.errors(["r0", "r1"]).keys() == {"r0", "r1"}
    # Within reconnect_after_s a new announcement to it fails at once, same reason.
    again = announce(s, 0, "A", 1.0)
    outs = s.event_done(again, 1.1)
    assert [o.error for o in outs if isinstance(o, LayerAnswered)] == [done[0].error]
