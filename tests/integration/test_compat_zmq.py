"""MF_META's compatibility map over real ZeroMQ sockets: a Prefill and a Decode that
disagree on a field both state meet at the handshake (Decode refuses, naming the field;
Prefill fails at once, well before ``meta_ack_s``), signed or not; peers that agree,
or a Prefill that sends no map, transfer as before."""

from __future__ import annotations

import time

import pytest
from fakes.logs import RecordingLogger
from fakes.net import wait_until
from fakes.rig import (
    PLAIN,
    WAIT,
    Transfer,
    assert_transfer_landed,
    internal,
    run_transfer,
    targets,
)

from rd2h.adapters.msgpack import AuthenticatedCodec
from rd2h.domain.errors import LayerSendError
from rd2h.domain.wire.compat import compat_of
from rd2h.domain.wire.protocol import ReadRequest

pytestmark = pytest.mark.integration

SECRET = b"0123456789abcdef-secret"
META_ACK_S = 60.0  # a refusal must never wait for this
FAST_S = 5.0
T1 = Transfer("req-c1", (1, 3), (1, 3), (4, 9), (2, 7))


def test_a_block_size_mismatch_is_refused_at_the_handshake(rig) -> None:
    d = rig.decode([0, 1], compat=compat_of(block_size=32, kv_dtype="bfloat16"))
    p = rig.prefill_memory([0, 1])
    log = RecordingLogger(role="prefill")
    sender = rig.start_sender(p, log=log, compat=compat_of(block_size=16, kv_dtype="bfloat16"),
                              meta_ack_timeout_s=META_ACK_S)
    d.receiver.admit(internal("r1"), [0], [0])
    t0 = time.monotonic()
    for layer in (0, 1):
        sender.submit(layer, None, targets(d.endpoint, [ReadRequest("r1", (0,), (0,))]))
    for layer in (0, 1):
        with pytest.raises(LayerSendError, match="block_size: prefill 16, decode 32"):
            sender.wait_for_layer_send(layer, WAIT)
    assert time.monotonic() - t0 < FAST_S
    assert ("decode refused the handshake" in log.events("error"))
    assert any("block_size: prefill 16, decode 32" in line for line in log.lines("error"))
    wait_until(lambda: "refusing MF_META from an incompatible prefill build"
               in d.log.events("error"), "decode to log the refusal")
    assert d.receiver.counters()["peers"] == 0  # nothing stored
    assert d.receiver.stats.layers_done == 0 and d.receiver.stats.bytes_read == 0


def test_a_signed_refusal_names_the_dtype_and_leaves_no_signing_state(rig) -> None:
    d_codec = AuthenticatedCodec(PLAIN, SECRET)
    d = rig.decode([0], d_codec, compat=compat_of(block_size=16, kv_dtype="bfloat16"))
    p = rig.prefill_memory([0])
    sender = rig.start_sender(p, AuthenticatedCodec(PLAIN, SECRET),
                              compat=compat_of(block_size=16, kv_dtype="float16"),
                              meta_ack_timeout_s=META_ACK_S)
    t0 = time.monotonic()
    failed = sender.prepare([d.endpoint], WAIT)
    assert time.monotonic() - t0 < FAST_S
    assert "kv_dtype: prefill float16, decode bfloat16" in failed[d.endpoint], failed
    wait_until(lambda: d_codec.connections == 0, "decode to forget the refused connection")
    assert d.receiver.counters()["peers"] == 0


def test_a_signing_prefill_and_a_plain_decode_meet_at_once(rig) -> None:
    d = rig.decode([0], compat=compat_of(block_size=16))
    p = rig.prefill_memory([0])
    sender = rig.start_sender(p, AuthenticatedCodec(PLAIN, SECRET),
                              compat=compat_of(block_size=16), meta_ack_timeout_s=META_ACK_S)
    t0 = time.monotonic()
    error = sender.prepare([d.endpoint], WAIT)[d.endpoint]
    assert time.monotonic() - t0 < FAST_S
    assert "not signed" in error and "auth: prefill rd2h-auth-2, decode none" in error, error


@pytest.mark.parametrize("signed", [False, True])
def test_agreeing_maps_transfer_as_before(rig, signed: bool) -> None:
    codec = (lambda: AuthenticatedCodec(PLAIN, SECRET)) if signed else (lambda: PLAIN)
    facts = {"block_size": 16, "kv_dtype": "bfloat16", "mla": True}
    d = rig.decode([0, 1], codec(), compat=compat_of(**facts, main_sharing="rank_local"))
    p = rig.prefill_memory([0, 1])
    sender = rig.start_sender(p, codec(), compat=compat_of(**facts))
    outcome = run_transfer(p, d, sender, T1, [(0, 2)])
    assert internal(T1.ext) not in outcome.failed
    assert_transfer_landed(p, d, T1)


def test_a_prefill_without_a_map_is_served_as_before(rig) -> None:
    d = rig.decode([0, 1], compat=compat_of(block_size=32))
    p = rig.prefill_memory([0, 1])
    sender = rig.start_sender(p)  # the original MF_META: three fields
    outcome = run_transfer(p, d, sender, T1, [(0, 1), (1, 2)])
    assert internal(T1.ext) not in outcome.failed
    assert_transfer_landed(p, d, T1)
