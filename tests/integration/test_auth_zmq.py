"""Shared-secret authentication end to end over real ZeroMQ sockets.

Matching secrets: transfers work. A missing or different secret on either side: the
peer is refused with a message that says so, on both sides, and no byte moves.
Every wait has a short deadline; a refusal never waits out more than one of them.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Any

import pytest
from fakes.logs import RecordingLogger
from fakes.rig import (
    WAIT,
    DSide,
    PSide,
    Rig,
    Transfer,
    assert_guarded,
    assert_transfer_landed,
    internal,
    layer_name,
    recv_frames,
    run_transfer,
    step,
    targets,
)

from rd2h.adapters.msgpack import AuthenticatedCodec, MsgpackCodec
from rd2h.app.prefill import PrefillSender
from rd2h.domain.errors import LayerSendError
from rd2h.domain.wire.protocol import (
    Message,
    MetaAck,
    MfMeta,
    ReadDone,
    ReadFailed,
    ReadReadyBatch,
    ReadRequest,
)

pytestmark = pytest.mark.integration

SECRET = "shared-secret-for-the-auth-tests"
OTHER_SECRET = "some-other-secret-of-length"
# What each side is configured with (its codec comes from these settings).
SIGNED = {"auth_secret": SECRET}
OTHER = {"auth_secret": OTHER_SECRET}
UNSIGNED: dict[str, Any] = {}
# The codecs of the tests' own hand-driven peers (raw sockets).
PLAIN = MsgpackCodec()
OTHER_PEER = AuthenticatedCodec(PLAIN, OTHER_SECRET.encode())
SHORT = 0.5  # deadline where a test expects the wait to run out
LAYERS = (0, 1)
NOTHING = {"main": (), "indexer": ()}


def prefill(rig: Rig) -> PSide:
    return rig.prefill_memory(LAYERS, seed=3, advertise=True)


def decode(rig: Rig, settings: dict[str, Any]) -> DSide:
    return rig.decode(LAYERS, settings=settings)


def sender_of(rig: Rig, p: PSide, settings: dict[str, Any],
              log: RecordingLogger | None = None, **timeouts: float) -> PrefillSender:
    return rig.start_sender(p, settings=settings, log=log, **timeouts)


REQ = Transfer("req-auth", (5, 1, 6), (2, 7, 0), (9, 3, 4), (0, 7, 2))


def announce_all(sender: PrefillSender, d: DSide, t: Transfer) -> list[LayerSendError]:
    """Announce every layer of ``t`` in one chunk; the errors the layers ended with."""
    errors = []
    for layer in LAYERS:
        done = [t.ext] if layer == LAYERS[-1] else []
        sender.submit(layer, None, targets(d.endpoint, [t.read(0, len(t.p_main))], done))
    for layer in LAYERS:
        try:
            sender.wait_for_layer_send(layer, WAIT)
        except LayerSendError as exc:
            errors.append(exc)
    return errors


# ====================================================================== matching secrets


def test_matching_secrets_transfer_and_verify(rig: Rig) -> None:
    # Both codecs come from the settings, as in production.
    p = prefill(rig)
    d = decode(rig, SIGNED)
    sender = sender_of(rig, p, SIGNED)
    out = run_transfer(p, d, sender, REQ, [(0, 2), (2, 3)])
    assert out.finished == {internal(REQ.ext)} and out.failed == frozenset()
    assert_transfer_landed(p, d, REQ)
    assert_guarded(d, {"main": REQ.d_main, "indexer": REQ.d_idx})
    assert d.receiver.stats.auth_refused == 0
    assert d.receiver.stats.layers_done == 4


# ====================================================================== Decode holds a secret


def test_decode_with_secret_refuses_prefill_without_one(rig: Rig) -> None:
    p = prefill(rig)
    d = decode(rig, SIGNED)
    sender = sender_of(rig, p, UNSIGNED, meta_ack_timeout_s=SHORT)
    d.receiver.admit(internal(REQ.ext), REQ.d_main, REQ.d_idx)
    t0 = time.monotonic()
    errors = announce_all(sender, d, REQ)
    assert time.monotonic() - t0 < SHORT + 2.0
    assert len(errors) == 2
    assert "no MF_META acknowledgement" in str(errors[0]) and "auth_secret" in str(errors[0])
    # Decode says why, stored nothing, read nothing and failed nothing.
    refusals = [line for line in d.log.lines("error") if "refusing unauthenticated" in line]
    assert refusals and "not signed" in refusals[0]
    assert d.receiver.stats.auth_refused >= 1
    assert d.receiver.counters()["peers"] == 0
    assert d.receiver.stats.bytes_read == 0
    assert_guarded(d, NOTHING)
    assert step(d.receiver).failed == frozenset()
    assert d.receiver.counters()["admitted"] == 1


def test_unsigned_ready_batch_gets_read_failed_naming_authentication_and_changes_nothing(
    rig: Rig,
) -> None:
    """A peer without the secret, skipping MF_META, names an admitted request: it is told
    READ_FAILED (authentication), the request is not failed, and the real Prefill's
    signed transfer of the same request still succeeds."""
    p = prefill(rig)
    d = decode(rig, SIGNED)
    d.receiver.admit(internal(REQ.ext), REQ.d_main, REQ.d_idx)
    intruder = rig.dealer(d.endpoint)
    read = REQ.read(0, 3)
    for codec in (PLAIN, OTHER_PEER):
        intruder.send(codec.encode(p.meta()))  # no ACK for either
        intruder.send(codec.encode(ReadReadyBatch(7, layer_name(0), (read,), (REQ.ext,))))
        (reply,) = recv_frames(intruder)
        msg = PLAIN.decode(reply)  # readable without the secret (appended field ignored)
        assert isinstance(msg, ReadFailed) and msg.layer_idx == 7
        assert "authentication failed" in msg.error and "auth_secret" in msg.error
    assert not intruder.poll(100)  # and nothing else (no ACK)
    assert d.receiver.stats.auth_refused == 4
    assert_guarded(d, NOTHING)
    assert step(d.receiver).failed == frozenset()

    sender = sender_of(rig, p, SIGNED)
    out = run_transfer(p, d, sender, REQ, [(0, 3)])
    assert out.failed == frozenset() and internal(REQ.ext) in out.finished
    assert_transfer_landed(p, d, REQ)


def test_different_secrets_are_refused_on_both_sides(rig: Rig) -> None:
    p = prefill(rig)
    d = decode(rig, SIGNED)
    sender = sender_of(rig, p, OTHER, meta_ack_timeout_s=SHORT)
    errors = sender.prepare([d.endpoint], WAIT)
    assert "no MF_META acknowledgement" in errors[d.endpoint]
    refusals = [line for line in d.log.lines("error") if "refusing unauthenticated" in line]
    assert refusals and "does not match" in refusals[0]
    d.receiver.admit(internal(REQ.ext), REQ.d_main, REQ.d_idx)
    assert len(announce_all(sender, d, REQ)) == 2
    assert d.receiver.stats.bytes_read == 0
    assert_guarded(d, NOTHING)


# ====================================================================== Prefill holds a secret


def test_prefill_with_secret_refuses_decode_without_one_at_once(rig: Rig) -> None:
    p = prefill(rig)
    d = decode(rig, UNSIGNED)
    sender = sender_of(rig, p, SIGNED, meta_ack_timeout_s=WAIT)
    t0 = time.monotonic()
    errors = sender.prepare([d.endpoint], WAIT)
    assert time.monotonic() - t0 < 2.0  # refused on the ACK, not by the deadline
    assert "refused" in errors[d.endpoint] and "not signed" in errors[d.endpoint]
    assert "auth_secret" in errors[d.endpoint]
    # Its announcements fail with the same reason; no READ_READY ever reaches Decode.
    d.receiver.admit(internal(REQ.ext), REQ.d_main, REQ.d_idx)
    errors_ = announce_all(sender, d, REQ)
    assert len(errors_) == 2 and all("not signed" in str(e) for e in errors_)
    assert d.receiver.stats.layers_done == 0 and d.receiver.stats.layers_failed == 0
    assert d.receiver.stats.bytes_read == 0
    assert_guarded(d, NOTHING)


def test_prefill_drops_unsigned_replies(rig: Rig) -> None:
    """A fake Decode that signs its ACK but then answers READ_DONE unsigned: the reply is
    dropped (logged), so the layer ends by its deadline, not as acknowledged."""
    router, endpoint = rig.router()
    fake = AuthenticatedCodec(PLAIN, SECRET.encode())  # the fake Decode's own codec
    p = prefill(rig)
    log = RecordingLogger(role="prefill")
    sender = sender_of(rig, p, SIGNED, log, layer_ack_timeout_s=SHORT,
                       meta_ack_timeout_s=SHORT)
    sender.submit(0, None, targets(endpoint, [ReadRequest("r", (1,), (1,))]))
    frames = recv_frames(router)
    identity = frames[0]
    assert isinstance(fake.decode(frames[-1], identity), MfMeta)
    router.send_multipart([identity, b"", fake.encode(MetaAck(), identity)])
    frames = recv_frames(router)
    batch = fake.decode(frames[-1], identity)
    assert isinstance(batch, ReadReadyBatch) and batch.layer_idx == 0
    router.send_multipart([identity, b"", PLAIN.encode(ReadDone(0, batch.seq))])
    with pytest.raises(LayerSendError, match="no acknowledgement"):
        sender.wait_for_layer_send(0, WAIT)
    assert any("not signed" in line for line in log.lines("warning")), log.lines()
    # The same signed reply sent twice counts once; a replay is refused (logged). The
    # deadline reset the connection, so the next announcement handshakes again.
    sender.submit(0, None, targets(endpoint, [ReadRequest("r", (1,), (1,))]))
    while True:
        frames = recv_frames(router)
        msg = fake.decode(frames[-1], frames[0])
        if isinstance(msg, MfMeta):
            router.send_multipart([frames[0], b"", fake.encode(MetaAck(), frames[0])])
            continue
        assert isinstance(msg, ReadReadyBatch)
        break
    reply = fake.encode(ReadDone(0, msg.seq), frames[0])
    router.send_multipart([frames[0], b"", reply])
    sender.wait_for_layer_send(0, WAIT)
    router.send_multipart([frames[0], b"", reply])
    deadline = time.monotonic() + WAIT
    while not any("replayed" in line for line in log.lines("warning")):
        assert time.monotonic() < deadline, log.lines()
        time.sleep(0.02)


# ====================================================================== replays


def test_decode_refuses_replayed_and_foreign_signed_frames(rig: Rig) -> None:
    """A holder of the secret on one connection; its frames replayed on the same and on
    another connection (whose MF_META was itself a replay): each replay is answered
    READ_FAILED naming the replay, nothing is read and the request is not failed; the
    real transfer of the same request then lands."""
    p = prefill(rig)
    d = decode(rig, SIGNED)
    d.receiver.admit(internal(REQ.ext), REQ.d_main, REQ.d_idx)
    honest = rig.dealer(d.endpoint)
    codec = AuthenticatedCodec(PLAIN, SECRET.encode())
    meta = codec.encode(p.meta(), "ep")
    honest.send(meta)
    (ack,) = recv_frames(honest)
    assert codec.decode(ack, "ep") == MetaAck()
    nothing = ReadReadyBatch(0, layer_name(0), (), (), 0, 1, 99)  # names no request
    frame = codec.encode(nothing, "ep")
    honest.send(frame)
    (reply,) = recv_frames(honest)
    assert codec.decode(reply, "ep") == ReadDone(0, 99)
    honest.send(frame)  # the same frame again, on its own connection
    (reply,) = recv_frames(honest)
    refused = codec.decode(reply, "ep")
    assert isinstance(refused, ReadFailed) and "replayed" in refused.error
    # Another connection: the captured MF_META is accepted (an ACK it cannot use), the
    # captured batch is not.
    thief = rig.dealer(d.endpoint)
    thief.send(meta)
    assert recv_frames(thief)[0].startswith(b"ACK")
    read = REQ.read(0, 3)
    thief.send(codec.encode(ReadReadyBatch(1, layer_name(1), (read,), (REQ.ext,), 0, 1, 5),
                            "ep"))
    (reply,) = recv_frames(thief)
    msg = PLAIN.decode(reply)
    assert isinstance(msg, ReadFailed) and msg.layer_idx == 1
    assert "another connection" in msg.error or "does not match" in msg.error
    assert d.receiver.stats.bytes_read == 0 and d.receiver.stats.auth_refused == 2
    assert_guarded(d, NOTHING)
    assert step(d.receiver).failed == frozenset()
    sender = sender_of(rig, p, SIGNED)
    out = run_transfer(p, d, sender, REQ, [(0, 3)])
    assert out.failed == frozenset() and internal(REQ.ext) in out.finished
    assert_transfer_landed(p, d, REQ)


class Recording(AuthenticatedCodec):
    """Prefill's signing codec, keeping every MF_META frame it sends (what a wire
    capture of the connection would give an attacker)."""

    def __init__(self) -> None:
        super().__init__(PLAIN, SECRET.encode())
        self.metas: list[bytes] = []

    def encode(self, message: Message, conn: Hashable = None) -> bytes:
        frame = super().encode(message, conn)
        if isinstance(message, MfMeta):
            self.metas.append(frame)
        return frame


def test_replayed_mf_meta_on_more_connections_than_the_cap_costs_valid_peers_nothing(
    rig: Rig,
) -> None:
    """A valid Prefill transfers, then idles; its captured MF_META is replayed on more
    connections than ``max_peers``. The idle Prefill's next transfer lands with no
    refusal, and a new valid Prefill takes a slot a replay held."""
    cap = 4
    # The cap on peers (limits.max_peers) is also the signing codec's cap on connections.
    d = decode(rig, {**SIGNED, "limits": {"max_peers": cap}})
    decode_codec = d.container.codec()
    assert isinstance(decode_codec, AuthenticatedCodec) and d.receiver.counters()["peers"] == 0
    p, capture = prefill(rig), Recording()
    sender = rig.start_sender(p, capture)  # Prefill's codec replaced by one that captures
    first = Transfer("req-replay-1", (5, 1, 6), (2, 7, 0), (9, 3, 4), (0, 7, 2))
    out = run_transfer(p, d, sender, first, [(0, 2), (2, 3)])
    assert out.failed == frozenset() and internal(first.ext) in out.finished
    assert_transfer_landed(p, d, first)
    (meta,) = capture.metas

    thieves = [rig.dealer(d.endpoint) for _ in range(10)]
    deadline = time.monotonic() + WAIT
    for thief in thieves:  # one at a time: each replay is handled before the next
        thief.send(meta)
        assert recv_frames(thief, max(0.1, deadline - time.monotonic()))[0].startswith(b"ACK")
    assert d.receiver.counters()["peers"] == cap  # the valid one and the 3 newest replays
    assert decode_codec.connections == cap  # evicted replays keep no signing state

    second = Transfer("req-replay-2", (0, 4), (3, 5), (1, 12), (11, 6))
    out = run_transfer(p, d, sender, second, [(0, 2)])
    assert out.failed == frozenset() and internal(second.ext) in out.finished
    assert_transfer_landed(p, d, second)
    assert d.receiver.stats.auth_refused == 0
    assert capture.metas == [meta]  # no refusal made it handshake again

    p2 = prefill(rig)
    third = Transfer("req-replay-3", (2, 7), (1, 6), (14, 8), (13, 15))
    out = run_transfer(p2, d, sender_of(rig, p2, SIGNED), third, [(0, 2)])
    assert out.failed == frozenset() and internal(third.ext) in out.finished
    assert_transfer_landed(p2, d, third)
    assert d.receiver.counters()["peers"] == cap and d.receiver.stats.auth_refused == 0
    assert_guarded(d, {"main": (9, 3, 4, 1, 12, 14, 8), "indexer": (0, 7, 2, 11, 6, 13, 15)})
