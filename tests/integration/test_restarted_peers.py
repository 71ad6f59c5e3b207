"""A peer that restarts is a new peer (issue 29, part 4): real ZeroMQ sockets, codecs and
the in-process transport.

Each engine states a generation, a nonce drawn at start: Prefill in MF_META (field 4),
Decode in its acknowledgement (after ``b"ACK"``, only to a Prefill that stated its own).

- A Decode restarted on the same port while Prefill holds an announcement for the old
  one: the new Decode's acknowledgement states another generation, so the old process
  (which can no longer read) holds nothing: the storage is given back at the handshake,
  not at the 30 s hold; the new Decode then serves a transfer.
- A Prefill restarted under the same session (its transfer address): Decode drops the
  old one's metadata and fails the request it was contributing to at once, not at the
  request deadline."""

from __future__ import annotations

import time

import pytest
import zmq
from fakes.net import HOST, free_port, wait_until
from fakes.rig import (
    WAIT,
    Rig,
    Transfer,
    assert_transfer_landed,
    internal,
    run_transfer,
    step,
    targets,
)

from rd2h.adapters.msgpack.codec import MsgpackCodec
from rd2h.adapters.zmq.channel import BindError
from rd2h.domain.errors import LayerSendError
from rd2h.domain.wire.protocol import MetaAck, MfMeta, ReadReadyBatch

pytestmark = pytest.mark.integration

LAYERS = (0, 1)
HOLD_S = 30.0
OLD_GENERATION = 1


def _old_decode(port: int) -> zmq.Socket:
    """A Decode process as Prefill sees it on the wire (the test acknowledges MF_META with
    a generation, then receives an announcement and never answers)."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(f"tcp://{HOST}:{port}")
    return sock


def _recv(sock: zmq.Socket) -> tuple[bytes, object]:
    assert sock.poll(int(WAIT * 1000)), "nothing from Prefill"
    identity, *rest = sock.recv_multipart()
    return identity, MsgpackCodec().decode(b"".join(f for f in rest if f))


def test_a_restarted_decode_releases_what_was_held_for_the_old_one(rig: Rig) -> None:
    port = free_port()
    endpoint = f"tcp://{HOST}:{port}"
    old = _old_decode(port)
    p = rig.prefill_memory(LAYERS, seed=5, advertise=True)
    sender = rig.start_sender(p, settings={"deadlines": {"layer_ack_s": HOLD_S}})
    t = Transfer("held", (1, 2), (3, 4), (5, 6), (7, 8))
    try:
        handshake = sender.prepare([endpoint], 0.0)  # starts it; answered below
        identity, meta = _recv(old)
        assert isinstance(meta, MfMeta) and meta.generation is not None
        old.send_multipart([identity, b"", MsgpackCodec().encode(MetaAck(OLD_GENERATION))])
        assert handshake == {endpoint: "handshake not finished within 0 s"}
        wait_until(lambda: sender.prepare([endpoint], 1.0) == {}, "the old handshake")
        sender.submit(0, None, targets(endpoint, [t.read(0, 2)]))
        identity, batch = _recv(old)  # on the wire, never answered: held for 30 s
        assert isinstance(batch, ReadReadyBatch) and batch.hold_until_ms is not None
    finally:
        old.close(0)
    t_closed = time.monotonic()
    wait_until(lambda: sender.stats.layers_failed == 1, "the loss reported")
    assert not sender.gate_open(0)  # held: the old Decode may still be reading

    restarted = []

    def rebind() -> bool:
        try:
            restarted.append(rig.decode(LAYERS, settings={"kv_port": port}))
        except BindError:
            return False
        return True

    wait_until(rebind, "the port to be free again")
    d = restarted[0]
    # Once the transport connected again, the next handshake meets the new generation.
    wait_until(lambda: sender.prepare([d.endpoint], 1.0) == {}, "the new handshake", WAIT)
    wait_until(lambda: sender.gate_open(0), "the held storage to be given back", WAIT)
    assert time.monotonic() - t_closed < HOLD_S / 2  # at the handshake, not at the hold
    with pytest.raises(LayerSendError, match="disconnected"):
        sender.wait_for_layer_send(0, WAIT)
    fresh = Transfer("fresh", (3, 4), (5, 6), (1, 2), (3, 4))
    out = run_transfer(p, d, sender, fresh, [(0, 2)])
    assert out.finished == {internal(fresh.ext)} and not out.failed
    assert_transfer_landed(p, d, fresh)


def test_a_restarted_prefill_fails_what_the_old_one_was_contributing(rig: Rig) -> None:
    d = rig.decode(LAYERS, settings={"deadlines": {"request_s": 60.0}})
    p = rig.prefill_memory(LAYERS, seed=6, advertise=True)
    first = rig.start_sender(p)
    t = Transfer("half", (1, 2), (3, 4), (5, 6), (7, 8))
    d.receiver.admit(internal(t.ext), t.d_main, t.d_idx)
    first.submit(0, None, targets(d.endpoint, [t.read(0, 2)]))
    first.wait_for_layer_send(0, WAIT)  # layer 0 read; layer 1 never comes from it
    assert step(d.receiver).failed == frozenset()
    again = rig.start_sender(p)  # the same session (address), a new generation
    t0 = time.monotonic()
    assert again.prepare([d.endpoint], WAIT) == {}
    reasons: dict[str, str] = {}

    def failed() -> bool:
        reasons.update(step(d.receiver).reasons)
        return internal(t.ext) in reasons

    wait_until(failed, "the old generation's request to fail", WAIT)
    assert "restarted (a new generation)" in reasons[internal(t.ext)]
    assert time.monotonic() - t0 < 5.0  # not the 60 s request deadline
    fresh = Transfer("fresh", (3, 4), (5, 6), (1, 2), (3, 4))
    out = run_transfer(p, d, again, fresh, [(0, 2)])
    assert out.finished == {internal(fresh.ext)} and not out.failed
    assert_transfer_landed(p, d, fresh)
