"""Liveness over real ZeroMQ sockets and real processes: a peer process that dies or
freezes is reported by ``disconnected()`` (socket monitor, ZMTP heartbeats) long before
any acknowledgement deadline, and the Prefill sender fails exactly the layers that
waited on it. Every wait has a deadline."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
from fakes.net import free_port, wait_until

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.zmq.channel import ZmqControlClients, ZmqControlServer, tcp_endpoint
from rd2h.app.prefill import LayerTarget
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import MfMeta, ReadRequest

pytestmark = pytest.mark.integration

HOST = "127.0.0.1"
WAIT = 10.0

# A bare Decode endpoint in its own process: ACKs MF_META, never answers a layer.
DECODE_PEER = textwrap.dedent("""
    import sys
    from rd2h.adapters.msgpack import MsgpackCodec
    from rd2h.adapters.zmq.channel import ZmqControlServer
    from rd2h.domain.wire.protocol import ACK, MfMeta
    server = ZmqControlServer("127.0.0.1", int(sys.argv[1]), heartbeat_ivl_s=0.1,
                              heartbeat_timeout_s=0.5)
    codec = MsgpackCodec()
    print("bound", flush=True)
    while True:
        item = server.recv(1.0)
        if item is not None and isinstance(codec.decode(item[1]), MfMeta):
            server.send(item[0], ACK)
""")

# A bare Prefill peer in its own process: connects, says hello, then waits to be killed.
PREFILL_PEER = textwrap.dedent("""
    import sys, time
    from rd2h.adapters.zmq.channel import ZmqControlClients
    clients = ZmqControlClients(heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    clients.connect(sys.argv[1])
    clients.send(sys.argv[1], b"hello", timeout=10)
    print("sent", flush=True)
    time.sleep(60)
""")




def spawn(script: str, arg: str, expect: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", script, arg], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child prints at once or dies (EOF)
    assert line.strip() == expect, f"peer did not start: {line!r}"
    return proc


def poll_until(step: Callable[[], list], timeout: float) -> tuple[list, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        got = step()
        if got:
            return got, time.monotonic() - t0
    raise AssertionError(f"nothing within {timeout:g} s")


@pytest.fixture
def decode_peer():
    port = free_port()
    proc = spawn(DECODE_PEER, str(port), "bound")
    yield proc, tcp_endpoint(HOST, port)
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(WAIT)


def test_prefill_sees_a_killed_decode_process_at_once(decode_peer) -> None:
    proc, endpoint = decode_peer
    clients = ZmqControlClients(heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    try:
        clients.connect(endpoint)
        clients.send(endpoint, MsgpackCodec().encode(_meta()), timeout=WAIT)
        (reply,), _ = poll_until(lambda: clients.poll(0.1), WAIT)
        assert reply == (endpoint, b"ACK")
        assert clients.disconnected() == []
        proc.kill()
        lost, took = poll_until(lambda: clients.poll(0.05) or clients.disconnected(), WAIT)
        assert lost == [endpoint] and took < 2.0
    finally:
        clients.close()


def test_prefill_sees_a_restarted_decode_reconnect() -> None:
    """A killed Decode is reported once; a Decode started again on the same port is
    reported by ``reconnected()`` once ZeroMQ has connected to it by itself."""
    port = free_port()
    endpoint = tcp_endpoint(HOST, port)
    proc = spawn(DECODE_PEER, str(port), "bound")
    clients = ZmqControlClients(heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    try:
        clients.connect(endpoint)
        clients.send(endpoint, MsgpackCodec().encode(_meta()), timeout=WAIT)
        poll_until(lambda: clients.poll(0.1), WAIT)
        assert clients.reconnected() == []  # the first connection is no reconnection
        proc.kill()
        proc.wait(WAIT)
        lost, _ = poll_until(lambda: clients.poll(0.05) or clients.disconnected(), WAIT)
        assert lost == [endpoint]
        time.sleep(0.5)  # ZeroMQ retries meanwhile: refused attempts are no new loss
        clients.poll(0.05)
        assert clients.disconnected() == [] and clients.reconnected() == []
        proc = spawn(DECODE_PEER, str(port), "bound")
        back, _ = poll_until(lambda: clients.poll(0.05) or clients.reconnected(), WAIT)
        assert back == [endpoint], back
        clients.send(endpoint, MsgpackCodec().encode(_meta()), timeout=WAIT)
        (reply,), _ = poll_until(lambda: clients.poll(0.1), WAIT)
        assert reply == (endpoint, b"ACK")
    finally:
        clients.close()
        proc.kill()
        proc.wait(WAIT)


def test_prefill_sees_a_frozen_decode_process_by_heartbeat(decode_peer) -> None:
    """SIGSTOP keeps the TCP connection open (the kernel still ACKs); only the missing
    ZMTP heartbeat replies tell."""
    proc, endpoint = decode_peer
    clients = ZmqControlClients(heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    try:
        clients.connect(endpoint)
        clients.send(endpoint, MsgpackCodec().encode(_meta()), timeout=WAIT)
        poll_until(lambda: clients.poll(0.1), WAIT)
        os.kill(proc.pid, signal.SIGSTOP)
        lost, took = poll_until(lambda: clients.poll(0.05) or clients.disconnected(), WAIT)
        assert lost == [endpoint]
        assert 0.3 < took < 3.0, took  # about the heartbeat timeout, not at once
    finally:
        clients.close()


def test_decode_sees_a_killed_prefill_process_and_names_its_identity() -> None:
    port = free_port()
    server = ZmqControlServer(HOST, port, heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    proc = spawn(PREFILL_PEER, tcp_endpoint(HOST, port), "sent")
    try:
        item = server.recv(WAIT)
        assert item is not None and item[1] == b"hello"
        identity = item[0]
        assert server.disconnected() == []
        proc.kill()
        t0 = time.monotonic()
        while time.monotonic() - t0 < WAIT:
            assert server.recv(0.1) is None  # returns early once the loss is seen
            lost = server.disconnected()
            if lost:
                break
        assert lost == [identity] and time.monotonic() - t0 < 2.0
    finally:
        proc.kill()
        proc.wait(WAIT)
        server.close()


def test_a_client_disconnecting_itself_is_not_reported_as_lost(decode_peer) -> None:
    _, endpoint = decode_peer
    clients = ZmqControlClients(heartbeat_ivl_s=0.1, heartbeat_timeout_s=0.5)
    try:
        clients.connect(endpoint)
        clients.send(endpoint, MsgpackCodec().encode(_meta()), timeout=WAIT)
        poll_until(lambda: clients.poll(0.1), WAIT)
        clients.disconnect(endpoint)
        clients.poll(0.3)
        assert clients.disconnected() == []
    finally:
        clients.close()


def test_heartbeat_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="must exceed the interval"):
        ZmqControlClients(heartbeat_ivl_s=1.0, heartbeat_timeout_s=0.5)
    with pytest.raises(ValueError, match="must exceed the interval"):
        ZmqControlServer(HOST, free_port(), heartbeat_ivl_s=2.0, heartbeat_timeout_s=2.0)


def test_sender_fails_a_layer_at_once_when_its_decode_process_dies(decode_peer, rig) -> None:
    proc, endpoint = decode_peer
    src = SourceLayout("model.layers.0.attn", (TensorComponent(4096, 64, 1),))
    # Heartbeats as fast as the peer's: a dead process is noticed within 0.5 s. The
    # layer fails at once; its storage waits for the 3 s hold its frame stated (a
    # silent Decode cannot be told from a dead one: it may still read until then).
    deadlines = {"heartbeat_ivl_s": 0.1, "heartbeat_timeout_s": 0.5, "layer_ack_s": 3.0,
                 "meta_ack_s": 5.0}
    sender = rig.sender({0: src}, "s", settings={"deadlines": deadlines})
    assert sender.prepare([endpoint], WAIT) == {}
    sender.submit(0, None, [LayerTarget(endpoint, ReadRequest("r", (0,), (0,), 0, 0))])
    with pytest.raises(LayerSendError, match=r"within 0\.5 s"):
        sender.wait_for_layer_send(0, timeout=0.5)  # Decode never answers
    proc.kill()
    wait_until(lambda: sender.stats.layers_failed == 1, "the loss reported", 2.0)
    assert not sender.gate_open(0)  # held until 3 s after the send, not released at once
    with pytest.raises(LayerSendError) as info:
        sender.wait_for_layer_send(0, timeout=WAIT)
    assert f"layer 0: decode endpoint {endpoint} disconnected" in str(info.value)
    assert sender.drain(WAIT)
    assert all(v == 0 for v in sender.counters().values()), sender.counters()
    assert sender.stop(WAIT)


def _meta() -> MfMeta:
    return MfMeta("s", {})
