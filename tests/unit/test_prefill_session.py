"""``PrefillSession`` alone, sans IO: inputs with explicit times, actions and events out.

Every deadline is reached by passing a later ``now``; nothing sleeps, no socket opens.
Each scenario ends with the session idle and its leak counters at zero.
"""

from __future__ import annotations

import pytest

from rd2h.domain.errors import CompletionError, LayerSendError
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.prefill.announce import LayerTarget, group_batches
from rd2h.domain.prefill.prefill_events import (
    Connect,
    Disconnect,
    EndpointReset,
    HandshakeDone,
    LayerAnswered,
    SendBatch,
    SendMeta,
)
from rd2h.domain.prefill.prefill_session import PrefillSession, PrefillTimeouts
from rd2h.domain.wire.protocol import ReadDone, ReadFailed, ReadRequest

T = PrefillTimeouts(meta_ack_s=2.0, layer_ack_s=5.0, device_event_s=3.0, reconnect_after_s=4.0)
REQ = ReadRequest("r", (0,), (0,), 0, 0)


def session(layers: int = 3) -> PrefillSession:
    return PrefillSession({n: SourceLayout(f"model.layers.{n}.attn",
                                           (TensorComponent(0x1000 * (n + 1), 64),))
                           for n in range(layers)}, T)


def announce(s: PrefillSession, layer: int, endpoints: list[str], now: float = 0.0,
             ticket: str | None = None) -> int:
    """With a ``ticket``: the announcement names request ``ticket`` to every endpoint, so
    the session's book holds it until each endpoint's entry ended (``book.open_tickets``)."""
    targets = [LayerTarget(ep, REQ, False, 0, 1) for ep in endpoints]
    named = None if ticket is None else {ep: [(ticket, ticket)] for ep in endpoints}
    return s.announce(layer, group_batches(layer, s.layer_name(layer), targets), now, named)


def kinds(outs: list) -> list[str]:
    return [type(o).__name__ for o in outs]


def answered(outs: list) -> list[tuple[int, str, str | None]]:
    return [(o.layer_idx, o.endpoint, o.error) for o in outs if isinstance(o, LayerAnswered)]


def ready(s: PrefillSession, endpoint: str, now: float = 0.0) -> None:
    """Handshake with ``endpoint`` so that later announcements go out at once."""
    assert kinds(s.prepare([endpoint], now)) == ["Connect", "SendMeta"]
    assert s.ack_received(endpoint, now) == [HandshakeDone(endpoint, None)]


def assert_clean(s: PrefillSession) -> None:
    due = s.next_deadline()  # the links stay: nothing is due before one may close idle
    assert s.idle and (due is None or due >= T.idle_link_s)
    assert s.counters() == {"pending_layers": 0, "closed_slots": 0, "unacked_sends": 0,
                            "open_tickets": 0}


# ====================================================================== the happy path


def test_handshake_then_send_then_answer() -> None:
    s = session()
    aid = announce(s, 0, ["A"], now=1.0, ticket="t0")
    assert not s.gate(0).open and s.gate(0).waiting_on == ("A",)
    assert s.event_deadline(aid) == s.next_deadline() == 1.0 + T.device_event_s
    outs = s.event_done(aid, now=1.5)
    assert outs == [Connect("A"), SendMeta("A")]
    assert s.next_deadline() == 1.5 + T.meta_ack_s  # the handshake's deadline now
    outs = s.ack_received("A", now=1.6)
    assert kinds(outs) == ["HandshakeDone", "SendBatch"]
    send = outs[1]
    assert isinstance(send, SendBatch) and send.batch.layer_idx == 0
    s.sent("A", send.announcement, now=1.7)  # the reply deadline runs from the real send
    assert s.next_deadline() == pytest.approx(1.7 + T.layer_ack_s)
    outs = s.reply("A", ReadDone(0), now=2.0)
    assert outs == [LayerAnswered(0, "A", None, pytest.approx(0.3))]
    assert s.gate(0).open and s.gate(0).error is None
    assert s.book.open_tickets(["t0"]) == {} and s.book.errors(["t0"]) == {}
    # The link stays ready: the next announcement goes out without a handshake.
    aid = announce(s, 1, ["A"], now=3.0)
    assert kinds(s.event_done(aid, now=3.0)) == ["SendBatch"]
    s.reply("A", ReadDone(1), now=3.1)
    assert_clean(s)


def test_a_layer_with_nothing_to_send_stays_open_and_holds_no_request() -> None:
    s = session()
    announce(s, 0, [], ticket="empty")
    assert s.gate(0).open and s.book.open_tickets(["empty"]) == {}
    assert_clean(s)


def test_unknown_layers_are_refused() -> None:
    s = session()
    with pytest.raises(CompletionError, match="layer 9 has no storage slot mapping"):
        s.layer_name(9)
    with pytest.raises(CompletionError):
        s.announce(9, {}, 0.0)
    s.stop("done")


# ====================================================================== tickets and replies


def test_replies_without_an_id_answer_the_oldest_announcement_of_their_layer() -> None:
    """A Decode that echoes no announcement id (an older peer): FIFO per (layer, endpoint).
    A request's tickets (one per endpoint) close as each endpoint answers."""
    s = session()
    ready(s, "e1")
    ready(s, "e2")
    for ticket, layer, eps in (("t1", 0, ["e1", "e2"]), ("t2", 0, ["e1"]), ("t3", 1, ["e1"])):
        s.event_done(announce(s, layer, eps, ticket=ticket), 0.0)
    s.reply("e1", ReadDone(0), 1.0)  # the oldest open announcement of (0, e1): t1
    every = ["t1", "t2", "t3"]
    assert s.book.open_tickets(every) == {"t1": 1, "t2": 1, "t3": 1}  # e2's part of t1 open
    s.reply("e1", ReadDone(0), 1.0)
    assert s.book.open_tickets(every) == {"t1": 1, "t3": 1}
    s.reply("e2", ReadFailed(0, "x"), 1.0)
    s.reply("e1", ReadDone(1), 1.0)
    assert s.book.open_tickets(every) == {}
    assert s.book.errors(every) == {"t1": "decode endpoint e2: x"}
    assert s.reply("e1", ReadDone(0), 1.0) == []  # a reply nobody waits for is ignored
    assert s.reply("nobody", ReadDone(0), 1.0) == []
    assert_clean(s)


def test_replies_answer_exactly_the_announcement_whose_id_they_echo() -> None:
    """Every batch carries its announcement id; a reply echoing an id answers that one,
    and a late reply to an announcement that already failed counts for nothing, not
    for a newer announcement of the same (layer, endpoint)."""
    s = session()
    ready(s, "A")
    (old,) = s.event_done(announce(s, 0, ["A"], ticket="old"), 0.0)
    assert isinstance(old, SendBatch) and old.batch.seq == old.announcement
    s.sent("A", old.announcement, 0.0)
    s.tick(T.layer_ack_s + 0.1)  # no reply in time: failed, connection reset
    assert s.book.open_tickets(["old"]) == {} and "old" in s.book.errors(["old"])
    ready(s, "A", 6.0)
    (new,) = s.event_done(announce(s, 0, ["A"], ticket="new"), 6.0)
    assert new.batch.seq != old.batch.seq
    late = ReadDone(0, old.batch.seq)
    assert s.reply("A", late, 6.5) == []  # the old announcement's reply, late
    assert not s.gate(0).open and s.book.open_tickets(["new"]) == {"new": 1}
    (second,) = s.event_done(announce(s, 0, ["A"], ticket="second"), 6.6)
    s.reply("A", ReadDone(0, second.batch.seq), 7.0)  # answers the second, not the first
    assert s.book.open_tickets(["new", "second"]) == {"new": 1}
    assert s.book.errors(["second"]) == {}
    s.reply("A", ReadFailed(0, "no", new.batch.seq), 7.1)
    assert s.book.open_tickets(["new"]) == {}
    assert s.book.errors(["new"]) == {"new": "decode endpoint A: no"}
    assert_clean(s)


def test_idle_connections_are_closed_and_forgotten() -> None:
    s = session()
    ready(s, "A", now=0.0)
    ready(s, "B", now=0.0)
    assert s.tick(T.idle_link_s - 1) == []
    (send,) = s.event_done(announce(s, 0, ["B"]), T.idle_link_s - 1)
    assert s.tick(T.idle_link_s) == [Disconnect("A")]  # B has a batch in flight
    s.reply("B", ReadDone(0, send.batch.seq), T.idle_link_s + 1)
    assert s.tick(2 * T.idle_link_s) == []
    assert s.tick(2 * T.idle_link_s + 1) == [Disconnect("B")]
    assert s.prepare(["A"], 1000.0) == [Connect("A"), SendMeta("A")]  # a new connection
    s.stop("done")


def test_next_deadline_is_also_when_an_idle_link_closes() -> None:
    """``tick`` closes idle links too, so ``next_deadline`` names that time (a backoff
    ends first): a driver that sleeps until it misses nothing."""
    s = session()
    ready(s, "A", now=0.0)
    assert s.next_deadline() == T.idle_link_s  # nothing in flight: only A's idle close
    assert s.tick(T.idle_link_s - 0.5) == []
    assert s.tick(T.idle_link_s) == [Disconnect("A")] and s.next_deadline() is None
    short = PrefillSession({0: SourceLayout("model.layers.0.attn",
                                            (TensorComponent(0x1000, 64),))},
                           PrefillTimeouts(meta_ack_s=2.0, reconnect_after_s=4.0,
                                           idle_link_s=1.0))
    short.prepare(["B"], 10.0)
    assert short.next_deadline() == 12.0  # the handshake's deadline
    assert kinds(short.tick(12.0)) == ["Disconnect", "HandshakeDone"]  # no ACK: backoff
    assert short.next_deadline() == 16.0  # idle since 10.0, but backing off until 16.0
    assert short.tick(15.9) == []
    assert short.tick(16.0) == [Disconnect("B")] and short.next_deadline() is None


def test_a_request_keeps_its_first_error_and_the_gate_its_layers_error() -> None:
    s = session()
    for ep in ("e1", "e2", "e3"):
        ready(s, ep)
    s.event_done(announce(s, 0, ["e1", "e2", "e3"], ticket="t"), 0.0)
    s.reply("e1", ReadFailed(0, "first"), 1.0)
    s.reply("e2", ReadFailed(0, ""), 1.0)
    assert not s.gate(0).open  # e3 may still be reading the storage
    s.reply("e3", ReadDone(0), 1.0)
    assert s.book.open_tickets(["t"]) == {}
    assert s.book.errors(["t"]) == {"t": "decode endpoint e1: first"}
    assert s.gate(0).open and s.gate(0).error == (
        "decode endpoint e2: decode reported READ_FAILED")
    assert_clean(s)


def test_read_failed_makes_the_next_announcement_handshake_again() -> None:
    """Decode may have restarted behind the same endpoint with no MF_META of ours."""
    s = session()
    ready(s, "A")
    s.event_done(announce(s, 0, ["A"]), 0.0)
    s.reply("A", ReadFailed(0, "READ_READY_BATCH before MF_META"), 1.0)
    outs = s.event_done(announce(s, 1, ["A"]), 2.0)
    assert outs == [Connect("A"), SendMeta("A")]
    s.ack_received("A", 2.1)
    s.reply("A", ReadDone(1), 2.2)
    assert_clean(s)


# ====================================================================== deadlines


def test_each_phase_fails_exactly_at_its_own_deadline() -> None:
    s = session()
    # event: device_event_s after the announcement
    announce(s, 0, ["A"], now=10.0)
    assert s.tick(10.0 + T.device_event_s - 0.01) == []
    outs = s.tick(10.0 + T.device_event_s)
    assert answered(outs) == [(0, "A", "decode endpoint A: device event not complete within "
                                        "3 s")]
    assert s.gate(0).open
    # handshake: meta_ack_s after MF_META went out
    aid = announce(s, 1, ["A"], now=20.0)
    s.event_done(aid, now=20.0)
    assert s.tick(20.0 + T.meta_ack_s - 0.01) == []
    outs = s.tick(20.0 + T.meta_ack_s)
    assert kinds(outs)[:2] == ["Disconnect", "HandshakeDone"]
    (err,) = [e for _, _, e in answered(outs)]
    assert "no MF_META acknowledgement from A within 2 s" in err and "auth_secret" in err
    assert_clean(s)


def test_a_failed_handshake_backs_off_then_tries_again() -> None:
    s = session()
    s.event_done(announce(s, 0, ["A"]), 0.0)
    s.tick(T.meta_ack_s)
    # Within reconnect_after_s a send to A fails at once, with the handshake's reason.
    outs = s.event_done(announce(s, 1, ["A"], now=1.0 + T.meta_ack_s), 1.0 + T.meta_ack_s)
    assert kinds(outs) == ["LayerAnswered"] and "no MF_META acknowledgement" in outs[0].error
    assert s.prepare(["A"], 3.0)[0].error is not None
    later = T.meta_ack_s + T.reconnect_after_s
    assert s.event_done(announce(s, 2, ["A"], now=later), later) == [Connect("A"), SendMeta("A")]
    s.ack_received("A", later)
    s.reply("A", ReadDone(2), later)
    assert_clean(s)


def test_no_reply_in_time_resets_the_endpoint_failing_everything_for_it() -> None:
    s = session()
    ready(s, "A")
    ready(s, "B")
    s.event_done(announce(s, 0, ["A"], now=0.0), 0.0)
    s.event_done(announce(s, 1, ["A", "B"], now=1.0), 1.0)
    announce(s, 2, ["A"], now=3.0)  # still waiting for its device event
    assert s.tick(T.layer_ack_s - 0.01) == []
    outs = s.tick(T.layer_ack_s)
    assert outs[0] == Disconnect("A")  # Decode fails the requests through the lost peer
    reason = "no acknowledgement of layer 0 from decode endpoint A within 5 s"
    assert answered(outs) == [(0, "A", reason), (1, "A", reason), (2, "A", reason)]
    assert outs[-1] == EndpointReset("A", reason, (0, 1, 2))
    assert s.gate(0).open and s.gate(2).open
    assert not s.gate(1).open and s.gate(1).waiting_on == ("B",)  # B still reads layer 1
    s.reply("B", ReadDone(1), 6.0)
    assert_clean(s)


def test_a_lost_connection_fails_only_the_entries_for_that_endpoint() -> None:
    s = session()
    ready(s, "A")
    ready(s, "B")
    s.event_done(announce(s, 0, ["A", "B"]), 0.0)
    s.event_done(announce(s, 1, ["A"]), 0.0)
    s.event_done(announce(s, 1, ["A"]), 0.0)  # two chunks of layer 1 to A
    s.event_done(announce(s, 2, ["B"]), 0.0)
    outs = s.connection_lost("A", 1.0)
    assert [a[:2] for a in answered(outs)] == [(0, "A"), (1, "A"), (1, "A")]
    assert isinstance(outs[-1], EndpointReset) and outs[-1].layers == (0, 1)
    assert Disconnect("A") not in outs  # the transport reconnects by itself
    assert s.gate(1).open and "A disconnected" in s.gate(1).error
    assert not s.gate(0).open and s.gate(0).waiting_on == ("B",)
    assert "A disconnected" in s.gate(0).error and s.gate(2).error is None
    assert answered(s.connection_lost("A", 1.0)) == []  # nothing left on A
    s.reply("B", ReadDone(0), 2.0)
    s.reply("B", ReadDone(2), 2.0)
    assert_clean(s)
    # A is gone until the transport connects again: a send fails at once, without the
    # handshake that would only wait for meta_ack_s; prepare says so too.
    outs = s.event_done(announce(s, 0, ["A"]), 2.5)
    assert [a[:2] for a in answered(outs)] == [(0, "A")]
    assert "has not reconnected" in answered(outs)[0][2]
    assert not any(isinstance(o, Connect | SendMeta) for o in outs)
    assert "has not reconnected" in (s.prepare(["A"], 2.6)[0].error or "")
    # Once connected again, the next announcement to A handshakes again.
    s.connection_restored("A")
    assert s.event_done(announce(s, 0, ["A"]), 3.0) == [Connect("A"), SendMeta("A")]
    s.stop("end")


def test_what_went_out_keeps_its_storage_until_its_hold_after_a_loss() -> None:
    """A lost connection reports every entry failed at once; one whose frame went out
    (``sent``) keeps its gate and ticket until its reply deadline, the hold the frame
    stated: a Decode that was only slow may still read its blocks until then."""
    s = session()
    ready(s, "A")
    aid0 = announce(s, 0, ["A"], ticket="t0")
    s.event_done(aid0, 0.0)
    s.sent("A", aid0, 0.0)  # on the wire: held until 0 + layer_ack_s
    s.event_done(announce(s, 1, ["A"], ticket="t1"), 0.0)  # still in the outbox
    outs = s.connection_lost("A", 1.0)
    assert [a[:2] for a in answered(outs)] == [(0, "A"), (1, "A")]  # reported at once
    assert s.gate(1).open and not s.gate(0).open
    assert s.book.open_tickets(["t0", "t1"]) == {"t0": 1}
    assert answered(s.connection_lost("A", 2.0)) == [] and not s.gate(0).open
    assert s.next_deadline() == T.layer_ack_s
    assert s.tick(T.layer_ack_s - 0.01) == []
    assert answered(s.tick(T.layer_ack_s)) == []  # reported once, when it failed
    assert s.gate(0).open and "A disconnected" in (s.gate(0).error or "")
    assert s.book.open_tickets(["t0"]) == {}
    assert "A disconnected" in s.book.errors(["t0"])["t0"]
    assert_clean(s)


def test_a_new_decode_generation_gives_back_what_was_held_for_the_old_one() -> None:
    """Decode restarted behind the endpoint: its ACK states a new generation, so the old
    process (which can no longer read) held nothing: the held storage is given back at
    the handshake, not at the hold. The same generation again (the same process
    reconnected) holds on."""
    s = session()
    assert kinds(s.prepare(["A"], 0.0)) == ["Connect", "SendMeta"]
    s.ack_received("A", 0.0, generation=5)
    for layer, gen in ((0, 5), (1, 6)):
        aid = announce(s, layer, ["A"], now=0.0, ticket=f"t{layer}")
        s.event_done(aid, 0.0)
        s.sent("A", aid, 0.0)
        s.connection_lost("A", 1.0)
        assert not s.gate(layer).open and s.book.open_tickets([f"t{layer}"]) == {f"t{layer}": 1}
        s.connection_restored("A")
        assert kinds(s.prepare(["A"], 1.5)) == ["Connect", "SendMeta"]
        s.ack_received("A", 1.6, generation=gen)
        assert s.gate(layer).open is (gen != 5), layer
    # Generation 6 replaced 5 too: layer 0, still held for 5, is given back with layer 1.
    assert s.gate(0).open and s.book.open_tickets(["t0", "t1"]) == {}
    assert_clean(s)


def test_a_refused_build_gets_notices_so_decode_fails_its_requests_at_once() -> None:
    """Decode refused MF_META (incompatible builds): the connection stays, and what
    waited on the handshake, and every announcement until the backoff ends, still goes
    out (unread there: Decode fails the requests it names) while failing here at once."""
    s = session()
    aid = announce(s, 0, ["A"])
    assert s.event_done(aid, 0.0) == [Connect("A"), SendMeta("A")]
    outs = s.ack_refused("A", "incompatible builds: block_size: prefill 16, decode 32",
                         0.1, notify=True)
    assert Disconnect("A") not in outs
    sends = [o for o in outs if isinstance(o, SendBatch)]
    assert [(o.endpoint, o.batch.layer_idx) for o in sends] == [("A", 0)]
    assert "block_size" in answered(outs)[0][2]
    outs = s.event_done(announce(s, 1, ["A"]), 0.5)  # during the backoff
    assert [o.batch.layer_idx for o in outs if isinstance(o, SendBatch)] == [1]
    assert "block_size" in answered(outs)[0][2]
    s.sent("A", 1, 0.5)  # the notice went out: nothing waits for an answer to it
    assert_clean(s)
    # After the backoff the next announcement handshakes again (Decode may be upgraded).
    later = s.event_done(announce(s, 0, ["A"]), 0.1 + s.timeouts.reconnect_after_s + 1)
    assert later == [Connect("A"), SendMeta("A")]
    s.stop("end")


def test_losses_and_refusals_during_a_handshake_fail_it() -> None:
    s = session()
    s.event_done(announce(s, 0, ["A"]), 0.0)
    outs = s.connection_lost("A", 0.5)
    assert "disconnected during the MF_META handshake" in answered(outs)[0][2]
    s.event_done(announce(s, 1, ["B"]), 0.0)
    outs = s.ack_refused("B", "no signature", 0.5)
    assert "decode endpoint B refused: no signature" in answered(outs)[0][2]
    assert s.ack_received("B", 0.6) == [] and s.ack_refused("B", "x", 0.6) == []  # stray
    s.event_done(announce(s, 2, ["C"]), 0.0)
    outs = s.send_failed(SendMeta("C"), "decode endpoint C is not reachable", 0.5)
    assert kinds(outs)[:2] == ["Disconnect", "HandshakeDone"]
    assert_clean(s)


def test_a_batch_that_could_not_be_sent_fails_its_entry() -> None:
    s = session()
    ready(s, "A")
    (send,) = s.event_done(announce(s, 0, ["A"], ticket="t"), 0.0)
    outs = s.send_failed(send, "queue full", 0.1)
    assert answered(outs) == [(0, "A", "decode endpoint A: queue full")]
    assert s.book.errors(["t"]) == {"t": "decode endpoint A: queue full"}
    assert_clean(s)


# ====================================================================== stop


def test_stop_fails_everything_naming_what_each_layer_awaited() -> None:
    s = session()
    ready(s, "A")
    s.event_done(announce(s, 0, ["A"], ticket="t"), 0.0)
    announce(s, 1, ["B"])
    s.event_done(announce(s, 2, ["C"]), 0.0)  # handshaking
    outs = s.stop("prefill sender stopped")
    assert set(answered(outs)) == {
        (0, "A", "prefill sender stopped (layer 0 awaited A)"),
        (1, "B", "prefill sender stopped (layer 1 awaited B)"),
        (2, "C", "prefill sender stopped (layer 2 awaited C)"),
    }
    assert HandshakeDone("C", "prefill sender stopped") in outs
    assert all(s.gate(n).open for n in range(3))
    assert s.book.errors(["t"]) == {"t": "prefill sender stopped (layer 0 awaited A)"}
    assert s.book.open_tickets(["t"]) == {}
    with pytest.raises(LayerSendError, match="stopped"):
        announce(s, 0, ["A"])
    assert s.prepare(["A"], 1.0) == [HandshakeDone("A", "prefill sender stopped")]
    assert_clean(s)
