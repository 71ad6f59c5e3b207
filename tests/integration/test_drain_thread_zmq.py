"""The Decode control socket's drain thread (``rd2h.adapters.zmq.channel``) sleeps while
the loop reads the socket itself, and drains it when the loop is away: counted in the
drain thread's own voluntary context switches (each sleep it woke from; preemptions on
a loaded host are not counted) and in messages moved into the inbox while the loop
does not read. Real libzmq sockets."""

from __future__ import annotations

import time

import pytest
import zmq
from fakes.net import HOST, free_port
from fakes.threads import voluntary_switches

from rd2h.adapters.zmq.channel import ZmqControlServer

pytestmark = pytest.mark.integration


def test_the_drain_thread_sleeps_while_the_loop_reads_and_drains_while_it_is_away() -> None:
    port = free_port()
    server = ZmqControlServer(HOST, port)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(f"tcp://{HOST}:{port}")
        tid = server._drainer.native_id
        assert tid is not None
        assert server.recv(0.3) is None  # the loop reads: the drain thread goes to sleep
        before = voluntary_switches(tid)
        assert server.recv(1.5) is None  # 1.5 s idle in recv: 75 periods of the drain
        idle = voluntary_switches(tid) - before
        # a wake per second to see a stop; the old drain thread woke every 20 ms (75)
        assert idle <= 6, f"drain thread woke {idle} times while the loop read"

        # The loop away (handling, reading KV): what arrives is moved into the inbox.
        for i in range(10):
            dealer.send_multipart([b"", b"m%d" % i])
        time.sleep(0.5)
        assert server.queue_figures()["held_bytes"] > 0  # drained while nobody read
        got = []
        while len(got) < 10:
            item = server.recv(2.0)
            assert item is not None
            got.append(item[1])
        assert got == [b"m%d" % i for i in range(10)]
    finally:
        dealer.close(0)
        ctx.term()
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 1.0  # the sleeping drain thread is woken to stop
