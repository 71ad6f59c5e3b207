"""Two Prefill sessions (a contributor group of ratio 2) against one Decode session, wired
in memory with a manual clock, under arbitrary interleavings (hypothesis
``RuleBasedStateMachine``): announcements, device events that complete or never do,
messages delivered in either direction, reads that succeed, fail or lose their peer
before or during the read, lost connections, time passing, Decode steps and requests
vLLM finishes.

Invariants, after every rule:
* nothing a Prefill session waits on is past its deadline (every announcement resolves
  by its deadline);
* a layer's gate is open exactly when no announcement of that layer is unresolved, and
  every ticket resolves once (each gate opens exactly once per closing);
* no request finishes ok if a READ_FAILED named it (a read that failed, or a peer lost
  before or during the read);
and at the end, once every request has ended, no state is left on either side.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rd2h.domain.decode.decode_session import DecodeSession, Read, Reply
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.prefill.announce import LayerTarget, group_batches
from rd2h.domain.prefill.prefill_events import Connect, Disconnect, SendBatch, SendMeta
from rd2h.domain.prefill.prefill_session import PrefillSession, PrefillTimeouts
from rd2h.domain.wire.protocol import ReadFailed, ReadReadyBatch, ReadRequest

EP = "tcp://decode-0:30000"
X9 = "-abcdefgh"  # vLLM's engine suffix
LAYERS, NB, RANKS = 2, 16, 2
T = PrefillTimeouts(meta_ack_s=1.0, layer_ack_s=2.0, device_event_s=1.5, reconnect_after_s=1.0)
REQUEST_S = 6.0


def name(layer: int) -> str:
    return f"model.layers.{layer}.attn"


def source(rank: int) -> dict[int, SourceLayout]:
    base = 0x100000 * (rank + 1)
    return {layer: SourceLayout(name(layer),
                                (TensorComponent(base + 0x10000 * layer, 64, num_blocks=NB),),
                                TensorComponent(base + 0x10000 * layer + 0x8000, 16,
                                                num_blocks=NB))
            for layer in range(LAYERS)}


DEST = {name(layer): DestinationLayout(name(layer), (DestTensor(0x900000 + 0x10000 * layer, 64,
                                                                 NB),),
                                       DestTensor(0x900000 + 0x10000 * layer + 0x8000, 16, NB))
        for layer in range(LAYERS)}


class SessionPair(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.p = [PrefillSession(source(r), T) for r in range(RANKS)]
        self.d = DecodeSession(destinations=DEST, d_rank=0, d_tp=1, main_shared=False,
                               request_timeout_s=REQUEST_S)
        self.gen = [0] * RANKS  # connection generation: a lost connection's frames are gone
        self.to_d: list[deque[tuple[int, Any]]] = [deque() for _ in range(RANKS)]
        self.to_p: list[deque[tuple[int, Any]]] = [deque() for _ in range(RANKS)]
        self.reads: dict[int, tuple[tuple[int, int], tuple[str, ...]]] = {}
        self.events: list[tuple[int, int]] = []  # (rank, announcement) awaiting the device
        self.open: dict[tuple[int, int], int] = {}  # (rank, ticket) -> layer
        self.resolved: set[tuple[int, int]] = set()
        self.tickets = 0
        self.requests: list[str] = []
        self.ended: set[str] = set()
        self.tainted: set[str] = set()  # named by a READ_FAILED: must never end ok

    # ------------------------------------------------------------ wiring
    def run_p(self, r: int, outs: list[Any]) -> None:
        for out in outs:
            if isinstance(out, Disconnect):
                self.drop(r)
            elif isinstance(out, SendMeta):
                self.to_d[r].append((self.gen[r], None))
            elif isinstance(out, SendBatch):
                self.to_d[r].append((self.gen[r], out.batch))
                self.p[r].sent(EP, out.announcement, self.now)
            else:
                assert not isinstance(out, Connect) or out.endpoint == EP
        for ticket in [t for t in self.open if t[0] == r]:  # the book holds each until then
            if not self.p[r].book.open_tickets([f"q{ticket[1]}"]):
                del self.open[ticket]
                self.resolved.add(ticket)

    def run_d(self, outs: list[Any], named: tuple[str, ...] = ()) -> None:
        for out in outs:
            if isinstance(out, Read):
                self.reads[out.token] = (out.peer, named)
            elif isinstance(out, Reply):
                r, g = out.peer
                if isinstance(out.message, ReadFailed):
                    self.tainted.update(named)
                if g == self.gen[r]:
                    self.to_p[r].append((g, out.message))
            elif type(out).__name__ == "SendAck":
                r, g = out.peer
                if g == self.gen[r]:
                    self.to_p[r].append((g, "ACK"))

    def drop(self, r: int) -> None:
        """The connection of rank ``r`` is gone: its frames in flight with it; Decode
        sees the loss."""
        old = self.gen[r]
        self.gen[r] += 1
        self.to_d[r].clear()
        self.to_p[r].clear()
        self.run_d(self.d.peer_lost((r, old), self.now))

    # ------------------------------------------------------------ rules
    @rule(main=st.integers(0, NB - 2), idx=st.integers(0, NB - 2))
    def admit(self, main: int, idx: int) -> None:
        ext = f"req-{len(self.requests)}"
        self.requests.append(ext)
        self.d.admit(ext + X9, [main, main + 1], [idx, idx + 1], self.now)

    @rule(r=st.integers(0, RANKS - 1), layer=st.integers(0, LAYERS - 1),
          which=st.integers(0, 50), start=st.integers(0, 1), count=st.integers(0, 2),
          ghost=st.integers(0, 9), done=st.booleans())
    def announce(self, r: int, layer: int, which: int, start: int, count: int, ghost: int,
                 done: bool) -> None:
        ext = ("ghost" if ghost == 0 or not self.requests  # a request Decode never admitted
               else self.requests[which % len(self.requests)])
        blocks = tuple(range(start + 4 * r, start + 4 * r + count))
        req = ReadRequest(ext, blocks, blocks, start, start) if count else None
        done = done and layer == LAYERS - 1
        if req is None and not done:
            return
        target = LayerTarget(EP, req, done, r, RANKS, ext)
        ticket = (r, self.tickets)
        self.tickets += 1
        batches = group_batches(layer, name(layer), [target])
        aid = self.p[r].announce(layer, batches, self.now, {EP: [(f"q{ticket[1]}", ext)]})
        self.open[ticket] = layer
        self.events.append((r, aid))

    @precondition(lambda self: self.events)
    @rule(i=st.integers(0, 50), completes=st.booleans())
    def device_event(self, i: int, completes: bool) -> None:
        r, aid = self.events.pop(i % len(self.events))
        if completes:  # else the device never finishes: the session's deadline ends it
            self.run_p(r, self.p[r].event_done(aid, self.now))

    @rule(r=st.integers(0, RANKS - 1))
    def deliver_to_decode(self, r: int) -> None:
        if not self.to_d[r]:
            return
        g, msg = self.to_d[r].popleft()
        if msg is None:
            self.run_d(self.d.receive((r, g), self.meta(r), self.now))
        else:
            assert isinstance(msg, ReadReadyBatch)
            self.run_d(self.d.receive((r, g), msg, self.now), msg.named_ext_ids)

    @rule(r=st.integers(0, RANKS - 1))
    def deliver_to_prefill(self, r: int) -> None:
        if not self.to_p[r]:
            return
        _, msg = self.to_p[r].popleft()
        if msg == "ACK":
            self.run_p(r, self.p[r].ack_received(EP, self.now))
        else:
            self.run_p(r, self.p[r].reply(EP, msg, self.now))

    @precondition(lambda self: self.reads)
    @rule(i=st.integers(0, 50),
          how=st.sampled_from(["ok", "ok", "error", "lost_before", "lost_during"]))
    def read(self, i: int, how: str) -> None:
        token = sorted(self.reads)[i % len(self.reads)]
        (r, g), named = self.reads.pop(token)
        if how == "lost_before" and g == self.gen[r]:
            self.lose(r)
        go = self.d.begin_read(token)
        if how == "lost_during" and go and g == self.gen[r]:
            self.lose(r)
        error = "injected read error" if how == "error" else None
        outs = self.d.read_done(token, self.now, error)
        if how != "ok" or not go:
            assert any(isinstance(o, Reply) and isinstance(o.message, ReadFailed)
                       for o in outs), outs
        self.run_d(outs, named)

    @rule(r=st.integers(0, RANKS - 1))
    def lose(self, r: int) -> None:
        """Both ends see the connection close (process gone, reset, heartbeat)."""
        self.drop(r)
        self.run_p(r, self.p[r].connection_lost(EP, self.now))

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 1.5, 2.5, 7.0]))
    def advance(self, dt: float) -> None:
        self.now += dt
        for r in range(RANKS):
            self.run_p(r, self.p[r].tick(self.now))
        self.run_d(self.d.tick(self.now))

    @rule()
    def step(self) -> None:
        self.finish(())

    @precondition(lambda self: self.requests)
    @rule(which=st.integers(0, 50))
    def whole_request(self, which: int) -> None:
        """Both members announce every layer of a request (final chunk), then a healthy
        stretch: unless something already failed it, it finishes ok."""
        for r in range(RANKS):
            for layer in range(LAYERS):
                self.announce(r, layer, which, start=0, count=2, ghost=1, done=True)
        self.pump()
        self.step()

    @rule()
    def pump(self) -> None:
        """A healthy stretch: every event completes, every frame arrives, every read
        succeeds, until nothing is left in flight."""
        for _ in range(500):
            moved = False
            for r in range(RANKS):
                if self.to_d[r]:
                    self.deliver_to_decode(r)
                    moved = True
                if self.to_p[r]:
                    self.deliver_to_prefill(r)
                    moved = True
            if self.events:
                self.device_event(0, True)
                moved = True
            if self.reads:
                self.read(0, "ok")
                moved = True
            if not moved:
                return

    @precondition(lambda self: self.requests)
    @rule(i=st.integers(0, 50))
    def vllm_finishes(self, i: int) -> None:
        self.finish((self.requests[i % len(self.requests)] + X9,))

    def finish(self, by_vllm: tuple[str, ...]) -> None:
        out = self.d.finish_step([self.d.local_report()], by_vllm, self.now)
        for rid in out.finished:
            ext = rid[: -len(X9)]
            if rid not in out.failed:
                assert ext not in self.tainted, f"{ext} finished ok after a READ_FAILED"
            self.ended.add(ext)
        self.ended.update(rid[: -len(X9)] for rid in by_vllm)

    def meta(self, r: int) -> Any:
        from rd2h.domain.wire.protocol import MfMeta

        return MfMeta(f"p{r}", {lay.layer_name: lay.to_metadata() for lay in source(r).values()})

    # ------------------------------------------------------------ invariants
    @invariant()
    def every_wait_is_within_its_deadline(self) -> None:
        for s in self.p:
            deadline = s.next_deadline()
            assert deadline is None or deadline > self.now

    @invariant()
    def gates_follow_the_unresolved_announcements(self) -> None:
        for r, s in enumerate(self.p):
            waiting = {layer for (rank, _), layer in self.open.items() if rank == r}
            for layer in range(LAYERS):
                assert s.gate(layer).open == (layer not in waiting), (r, layer)
            assert s.counters()["open_tickets"] == sum(1 for t in self.open if t[0] == r)

    def teardown(self) -> None:
        """Let everything finish: whatever is still in flight is delivered or read (or
        ends at its deadline); then every request ends and no state is left."""
        for _ in range(6):
            self.pump()
            self.advance(REQUEST_S + T.layer_ack_s)
            self.step()
        self.advance(T.idle_link_s)  # and every idle connection closes
        for s in self.p:
            assert s.idle and s.next_deadline() is None
            assert s.counters() == dict.fromkeys(s.counters(), 0), s.counters()
        assert not self.open
        left = self.d.counters()
        left.pop("peers")
        assert left == dict.fromkeys(left, 0), left
        assert self.d.reads_in_flight == 0


SessionPair.TestCase.settings = settings(max_examples=300, stateful_step_count=60,
                                         deadline=None)
test_session_pair = SessionPair.TestCase
