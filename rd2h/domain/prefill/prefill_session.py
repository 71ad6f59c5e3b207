"""Prefill's side of the control protocol as a sans-IO state machine (spec 3.3, 4, 7.1).

Inputs go in as method calls with the current time as an argument; what must
happen on the wire comes out as *actions* (``Connect``, ``SendMeta``,
``SendBatch``, ``Disconnect``) and what happened comes out as *events*
(``HandshakeDone``, ``LayerAnswered``, ``EndpointReset``). The caller (the
sender thread in ``rd2h.app.prefill``) owns the sockets, the codec, the device
events and the clock; this module owns every rule and every deadline.

Unit of work: one *entry* per (announcement, Decode endpoint). An entry always
sits in exactly one ``Phase``, each bounded by exactly one deadline: ``EVENT`` (the
layer's device event, ``device_event_s``), ``HANDSHAKE`` (the endpoint's MF_META
``ACK``, ``meta_ack_s``), ``SENT`` (READ_READY_BATCH out, its reply, ``layer_ack_s``).

An entry ends answered (READ_DONE) or failed (READ_FAILED, a deadline, a lost
connection, a refused handshake, the session stopped); either way its gate counts
it, and so does the request book (``rd2h.domain.prefill.prefill_book``): an announcement
that names requests holds them there until each of its entries ended. Replies from one
endpoint come in send order: the oldest entry of (layer, endpoint) owns the next.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from rd2h.domain.errors import CompletionError, LayerSendError
from rd2h.domain.planning.layout import SourceLayout
from rd2h.domain.prefill.gates import GateState, StorageSlotGates
from rd2h.domain.prefill.prefill_book import (
    Announced,
    BookEvent,
    PrefillRequestBook,
    RequestWithheld,
)
from rd2h.domain.prefill.prefill_events import (
    Connect,
    Disconnect,
    EndpointReset,
    HandshakeDone,
    LayerAnswered,
    Output,
    SendBatch,
    SendMeta,
)
from rd2h.domain.prefill.prefill_state import (
    BACKING_OFF,
    Announcement,
    Entry,
    EntryEvent,
    Link,
    LinkEvent,
    Links,
    LinkState,
    Phase,
    PrefillTimeouts,
    TransportEvent,
)
from rd2h.domain.wire.protocol import ReadDone, ReadFailed, ReadReadyBatch

__all__ = ["Named", "PrefillSession", "PrefillTimeouts", "RequestNews"]

# What happened to requests, in order, for the driver to log (``take_news``).
RequestNews = BookEvent | RequestWithheld | Announced
Named = Mapping[str, Sequence[tuple[str, str]]]  # endpoint -> (request id, ext id) pairs


class PrefillSession:
    """Every rule of Prefill's side, in one class: the inputs (calls with the time), the
    queries (its state, read-only), the request book it owns (which sends to announce,
    which requests are settled or released) and the rules that tie them together.

    An announcement that names requests is one ticket per Decode endpoint, keyed by the
    announcement id; the session resolves it in the book as each entry ends (with the
    requests that endpoint skipped), so nothing outside the session tracks tickets."""

    def __init__(self, layers: Mapping[int, SourceLayout], timeouts: PrefillTimeouts) -> None:
        self.timeouts = timeouts
        self._names = {idx: lay.layer_name for idx, lay in layers.items()}
        self._gates = StorageSlotGates()
        for idx, lay in layers.items():
            self._gates.register_layer(idx, *lay.storage_keys)
        self._ids = itertools.count()
        self._announcements: dict[int, Announcement] = {}
        self._links = Links()
        self._book = PrefillRequestBook()
        self._news: list[RequestNews] = []
        # (announcement, endpoint) -> requests that endpoint skipped (no longer known there)
        self._skipped: dict[tuple[int, str], tuple[str, ...]] = {}
        self._dead: str | None = None

    # ------------------------------------------------------------ inputs
    def layer_name(self, layer_idx: int) -> str:
        name = self._names.get(layer_idx)
        if name is None:
            raise CompletionError(f"layer {layer_idx} has no storage slot mapping")
        return name

    def announce(
        self, layer_idx: int, batches: Mapping[str, ReadReadyBatch], now: float,
        named: Named | None = None, final: Iterable[str] = (), refused: str | None = None,
    ) -> int:
        """A layer was written: close its gates and wait for its device event (then
        ``event_done``). Returns the announcement id, which each READ_READY_BATCH
        carries (``seq``) and its reply echoes. ``named``: per endpoint, the (request
        id, ext id) pairs it announces, held in the book until that endpoint's entry
        ends; ``final``: the requests whose last send it carries. ``refused`` (or a
        stopped session): raise ``LayerSendError``, the named requests failed."""
        self.layer_name(layer_idx)
        aid = next(self._ids)
        if named:
            self._open_tickets(aid, named, final)
        if (reason := refused or self._dead) is not None:
            for endpoint in named or ():
                self._close_ticket(aid, endpoint, f"layer {layer_idx}: {reason}", None)
            raise LayerSendError(layer_idx, reason)
        self._gates.announce(layer_idx, list(batches))
        if not batches:
            return aid
        ann = Announcement(layer_idx, bool(named))
        deadline = now + self.timeouts.device_event_s
        for ep, batch in batches.items():
            ann.entries[ep] = Entry(aid, layer_idx, ep, batch.numbered(aid),
                                    Phase.EVENT, deadline)
        self._announcements[aid] = ann
        return aid

    def event_done(self, aid: int, now: float) -> list[Output]:
        """The layer's KV is on the device: announce it to every endpoint still pending."""
        out: list[Output] = []
        ann = self._announcements.get(aid)
        if ann is None:
            return out
        for entry in [e for e in ann.entries.values() if e.phase == Phase.EVENT]:
            out += self._dispatch(entry, now)
        return out

    def prepare(self, endpoints: Iterable[str], now: float) -> list[Output]:
        """Handshake with ``endpoints`` now; each ends with a ``HandshakeDone``."""
        out: list[Output] = []
        for ep in dict.fromkeys(endpoints):
            if self._dead is not None:
                out.append(HandshakeDone(ep, self._dead))
                continue
            link = self._links.at(ep, now)
            if link.state == LinkState.READY:
                out.append(HandshakeDone(ep, None))
            elif link.state in BACKING_OFF or link.gone:
                out.append(HandshakeDone(ep, link.reason or link.gone))
            elif link.state == LinkState.DOWN:
                out += self._start_handshake(ep, link, now)
        return out

    def ack_received(self, endpoint: str, now: float,
                     generation: int | None = None, layer_runs: bool = False) -> list[Output]:
        """Decode acknowledged MF_META; an ACK outside a handshake is stray. A new Decode
        ``generation`` behind the endpoint: the process we announced to is gone, so what
        is held for it (``HELD``) is given back now, not at its hold. ``layer_runs``: the
        ACK said Decode reads layer runs (``layer_runs``)."""
        link = self._links.get(endpoint)
        if link is None or link.state != LinkState.HANDSHAKING:
            return []
        link.move(LinkEvent.ACK)
        link.layer_runs = layer_runs
        out: list[Output] = [HandshakeDone(endpoint, None)]
        if generation is not None and link.generation not in (None, generation):
            for entry in [e for a in list(self._announcements.values())
                          for e in a.entries.values()
                          if e.endpoint == endpoint and e.phase == Phase.HELD]:
                out += self._end(entry, entry.held_error)
        link.generation = generation if generation is not None else link.generation
        waiting, link.waiting = link.waiting, []
        for entry in waiting:
            out += self._send(entry, link, now)
        return out

    def ack_refused(self, endpoint: str, detail: str, now: float,
                    notify: bool = False) -> list[Output]:
        """An ACK that failed authentication, or Decode refused MF_META: fail at once.
        ``notify`` (an incompatible build): the link is ``refused`` (see ``Link``)."""
        link = self._links.get(endpoint)
        if link is None or link.state != LinkState.HANDSHAKING:
            return []
        return self._handshake_failed(endpoint, link, f"decode endpoint {endpoint} refused: "
                                      f"{detail}", now, notify=notify)

    def reply(self, endpoint: str, message: ReadDone | ReadFailed, now: float) -> list[Output]:
        """READ_DONE or READ_FAILED: the answer to the announcement whose id it echoes (or
        the oldest of its layer); a reply to nothing waiting (late, stray) changes nothing."""
        link = self._links.get(endpoint)
        if link is None:
            return []
        error = None if isinstance(message, ReadDone) else (
            message.error or "decode reported READ_FAILED")
        entry = next((e for e in link.inflight if e.layer_idx == message.layer_idx
                      and message.seq in (None, e.aid)), None)
        if entry is None:
            return []
        link.last_used = now
        ann = self._announcements.get(entry.aid)
        # Skipped requests: only ids this announcement named (a peer cannot drop others).
        if (isinstance(message, ReadDone) and message.skipped and ann and ann.named
                and (gone := tuple(set(message.skipped) & set(entry.batch.named_ext_ids)))):
            self._skipped[(entry.aid, endpoint)] = gone
        if error is not None and link.state == LinkState.READY:
            # Decode may have restarted behind the same endpoint (ZMQ reconnects silently
            # and a new ROUTER has no MF_META of ours): handshake again before the next.
            link.move(LinkEvent.READ_FAILED)
        return self._end(entry, error, latency=now - entry.sent_at)

    def sent(self, endpoint: str, aid: int, now: float, frame: int = -1) -> None:
        """A ``SendBatch`` went out (in ``frame``, a number the caller gives each frame):
        its reply deadline runs from now."""
        ann = self._announcements.get(aid)
        entry = None if ann is None else ann.entries.get(endpoint)
        if entry is not None and entry.phase == Phase.SENT:
            entry.sent_at, entry.on_wire, entry.frame = now, True, frame
            entry.deadline = now + self.timeouts.layer_ack_s

    def send_failed(self, action: SendMeta | SendBatch, reason: str, now: float) -> list[Output]:
        link = self._links.get(action.endpoint)
        if link is None:
            return []
        if isinstance(action, SendMeta):
            if link.state != LinkState.HANDSHAKING:
                return []
            return self._handshake_failed(action.endpoint, link, reason, now)
        ann = self._announcements.get(action.announcement)
        entry = None if ann is None else ann.entries.get(action.endpoint)
        if entry is None or entry.phase != Phase.SENT:
            return []
        return self._end(entry, reason)

    def connection_lost(self, endpoint: str, now: float) -> list[Output]:
        """The connection closed: no reply on it will come, and Decode fails the requests
        this rank was contributing to, so nothing still queued for it is worth sending.
        Until ``connection_restored``, sends fail at once (no ``meta_ack_s`` wait)."""
        link = self._links.get(endpoint)
        if link is not None:
            link.report(TransportEvent.LOSS,
                        f"decode endpoint {endpoint} disconnected and has not reconnected "
                        f"(process gone, connection reset or heartbeat timeout)")
        if link is not None and link.state == LinkState.HANDSHAKING:
            return self._handshake_failed(
                endpoint, link,
                f"decode endpoint {endpoint} disconnected during the MF_META handshake "
                f"(Decode gone, or refusing this peer: are the CURVE keys right?)", now,
            )
        return self._reset(endpoint, f"decode endpoint {endpoint} disconnected (process "
                           f"gone, connection reset or heartbeat timeout)", now, close=False)

    def connection_restored(self, endpoint: str) -> None:
        """The transport connected to ``endpoint`` again: handshakes may go ahead."""
        link = self._links.get(endpoint)
        if link is not None:
            link.report(TransportEvent.RESTORED)

    def tick(self, now: float) -> list[Output]:
        """Fail whatever passed its deadline."""
        out: list[Output] = []
        t = self.timeouts
        for ann in list(self._announcements.values()):
            for entry in [e for e in ann.entries.values()
                          if e.phase in (Phase.EVENT, Phase.HELD) and e.deadline <= now]:
                out += self._end(entry, entry.held_error or f"device event not complete "
                                 f"within {t.device_event_s:g} s")
        for ep, link in list(self._links.items()):
            if link.state == LinkState.HANDSHAKING and link.deadline <= now:
                out += self._handshake_failed(
                    ep, link,
                    f"no MF_META acknowledgement from {ep} within {t.meta_ack_s:g} s (decode "
                    f"down or unreachable, or refusing this peer: is auth_secret the same on "
                    f"both sides?)", now,
                )
            late = min(link.inflight, key=lambda e: e.deadline, default=None)
            if late is not None and late.deadline <= now:
                # Reset the connection too, so that Decode fails the requests this rank was
                # contributing to: it must not complete them from storage we may now reuse.
                out += self._reset(ep, f"no acknowledgement of {_frame_layers(link, late)} "
                                   f"from decode endpoint {ep} within {t.layer_ack_s:g} s",
                                   now, close=True)
        return out + [Disconnect(ep) for ep in self._links.close_idle(
            now, self.timeouts.idle_link_s)]

    def stop(self, reason: str) -> list[Output]:
        """The sender is gone: every entry fails, every gate opens, nothing more is
        accepted. The errors name what each layer was still waiting on."""
        self._dead = reason
        awaited = {lyr: self._gates.state(lyr).waiting_on for lyr in self._gates.pending_layers}
        out: list[Output] = []
        for ann in list(self._announcements.values()):
            for entry in list(ann.entries.values()):
                who = ", ".join(str(e) for e in awaited.get(entry.layer_idx, ())) or "no endpoint"
                out += self._end(entry, f"{reason} (layer {entry.layer_idx} awaited {who})")
        for layer_idx in self._gates.pending_layers:  # cannot happen; never leave one shut
            self._gates.fail_layer(layer_idx, reason)
        return out + [HandshakeDone(ep, reason) for ep in self._links.stop()]

    # ------------------------------------------------------------ queries
    def layer_runs(self, endpoint: str) -> bool:
        """Whether the endpoint's Decode acknowledged it reads layer runs (on the current
        connection: a new handshake asks again)."""
        link = self._links.get(endpoint)
        return link is not None and link.state == LinkState.READY and link.layer_runs

    def frames_on_wire(self, endpoint: str) -> int:
        """Frames sent to the endpoint whose layers are not all answered yet, except those
        naming requests Decode may not have admitted (``awaits``: Decode may keep them
        until it does, and other requests' layers must not wait behind them here)."""
        link = self._links.get(endpoint)
        if link is None:
            return 0
        return len({e.frame for e in link.inflight if e.on_wire and not e.batch.awaits})

    def gate(self, layer_idx: int) -> GateState:
        return self._gates.state(layer_idx)

    def event_deadline(self, aid: int) -> float | None:
        """Until when announcement ``aid`` waits for its device event (None: it does not,
        e.g. its entries ended meanwhile)."""
        ann = self._announcements.get(aid)
        return None if ann is None else min(
            (e.deadline for e in ann.entries.values() if e.phase == Phase.EVENT), default=None)

    def next_deadline(self) -> float | None:
        """When ``tick`` next acts: an entry, a handshake, an idle link (None: never)."""
        times = [e.deadline for a in self._announcements.values() for e in a.entries.values()
                 if e.phase != Phase.HANDSHAKE]
        times += self._links.deadlines(self.timeouts.idle_link_s)
        return min(times, default=None)

    @property
    def dead(self) -> str | None:
        return self._dead

    @property
    def idle(self) -> bool:
        """Nothing announced is unresolved and every gate is open."""
        return not self._announcements and not self._gates.pending_layers

    @property
    def pending_layers(self) -> tuple[int, ...]:
        return self._gates.pending_layers

    def counters(self) -> dict[str, int]:
        """Leak accounting: every value is 0 when no announcement is in flight."""
        return {
            "pending_layers": len(self._gates.pending_layers),
            "closed_slots": self._gates.closed_slots,
            "unacked_sends": sum(len(link.inflight) for link in self._links.values()),
            "open_tickets": sum(1 for a in self._announcements.values() if a.named),
        }

    # ------------------------------------------------------------ requests
    def start_step(self, sends: Iterable[tuple[str, int]]) -> frozenset[str]:
        """This step's sends as (request id, main blocks announced once it went); returns
        the requests to announce (``PrefillRequestBook.start_step``)."""
        verdict = self._book.start_step(sends)
        self._news += verdict.withheld
        return verdict.kept

    @property
    def book(self) -> PrefillRequestBook:
        """The request book this session keeps (its tickets, errors, releases and
        counters), read and released through directly; the session's own inputs are
        what change it otherwise."""
        return self._book

    def take_news(self) -> list[RequestNews]:
        """What happened to requests since the last call, in order."""
        out, self._news = self._news, []
        return out

    def _open_tickets(self, aid: int, named: Named, final: Iterable[str]) -> None:
        news = self._book.announce(aid, named, final)
        if news.first or news.final:
            self._news.append(news)

    def _close_ticket(self, aid: int, endpoint: str, error: str | None,
                      skipped: tuple[str, ...] | None) -> None:
        self._news += self._book.record_answers(
            [(aid, endpoint, error)], {(aid, endpoint): skipped} if skipped else {})

    # ------------------------------------------------------------ rules
    def _dispatch(self, entry: Entry, now: float) -> list[Output]:
        link = self._links.at(entry.endpoint, now)
        if link.state in BACKING_OFF:
            notice = [SendBatch(entry.endpoint, entry.batch, entry.aid)] if link.notify else []
            return notice + self._end(entry, link.reason)
        if link.gone and link.state != LinkState.READY:
            return self._end(entry, link.gone)
        if link.state == LinkState.READY:
            return self._send(entry, link, now)
        entry.move(EntryEvent.AWAIT_HANDSHAKE, now + self.timeouts.meta_ack_s)
        link.waiting.append(entry)
        down = link.state == LinkState.DOWN
        return self._start_handshake(entry.endpoint, link, now) if down else []

    def _start_handshake(self, endpoint: str, link: Link, now: float) -> list[Output]:
        link.move(LinkEvent.HANDSHAKE)
        link.deadline = now + self.timeouts.meta_ack_s
        link.layer_runs = False  # until this handshake's ACK says so
        return [Connect(endpoint), SendMeta(endpoint)]

    def _send(self, entry: Entry, link: Link, now: float) -> list[Output]:
        entry.move(EntryEvent.SEND, now + self.timeouts.layer_ack_s)
        entry.sent_at = link.last_used = now
        link.inflight.append(entry)
        return [SendBatch(entry.endpoint, entry.batch, entry.aid)]

    def _handshake_failed(self, endpoint: str, link: Link, reason: str,
                          now: float, *, notify: bool = False) -> list[Output]:
        """Drop the connection (with ``notify``: keep it, see ``ack_refused``); sends to
        it fail at once for ``reconnect_after_s``."""
        link.move(LinkEvent.INCOMPATIBLE if notify else LinkEvent.HANDSHAKE_FAILED)
        link.reason = reason
        link.deadline = now + self.timeouts.reconnect_after_s
        out: list[Output] = [HandshakeDone(endpoint, reason)]
        if not notify:
            out.insert(0, Disconnect(endpoint))
        for entry in [*link.waiting, *link.inflight]:
            if notify:
                out.append(SendBatch(entry.endpoint, entry.batch, entry.aid))
            out += self._end(entry, reason)
        return out

    def _reset(self, endpoint: str, reason: str, now: float, *, close: bool) -> list[Output]:
        """No reply will come from ``endpoint`` for what was sent so far: fail every entry
        for it, sent or still queued (gates open, the compute path raises; those that went
        out keep their storage until their hold ends: ``_end``). The next announcement to
        it handshakes again (with ``close``, over a new connection)."""
        entries = [e for ann in self._announcements.values() for e in ann.entries.values()
                   if e.endpoint == endpoint and e.phase != Phase.HELD]
        link = self._links.get(endpoint)
        if link is not None:
            link.move(LinkEvent.RESET)  # a backoff stays one (``TRANSITIONS``)
        out: list[Output] = [Disconnect(endpoint)] if close else []
        for entry in entries:
            out += self._end(entry, reason, hold_at=now)
        out.append(EndpointReset(endpoint, reason,
                                 tuple(sorted({e.layer_idx for e in entries}))))
        return out

    def _end(self, entry: Entry, error: str | None, latency: float | None = None,
             hold_at: float | None = None) -> list[Output]:
        """The entry ends: its answer or failure is reported, its gate and ticket resolve.
        ``hold_at`` (now): a failed entry that went out and whose reply deadline, the hold
        its frame stated, is still ahead is reported now but resolves at that deadline
        (``HELD``): Decode may still be reading its blocks."""
        ann = self._announcements.get(entry.aid)
        if ann is None or ann.entries.get(entry.endpoint) is not entry:
            return []
        held = (hold_at is not None and error is not None and entry.on_wire
                and entry.phase == Phase.SENT and hold_at < entry.deadline)
        if not held:
            del ann.entries[entry.endpoint]
        link = self._links.get(entry.endpoint)
        if link is not None:
            if entry.phase == Phase.HANDSHAKE and entry in link.waiting:
                link.waiting.remove(entry)
            elif entry.phase == Phase.SENT and entry in link.inflight:
                link.inflight.remove(entry)
        if error is not None and entry.endpoint not in error:
            error = f"decode endpoint {entry.endpoint}: {error}"  # the caller learns who
        if error is not None and ann.error is None:
            ann.error = error
        if held:
            entry.move(EntryEvent.HOLD)
            entry.held_error = error or ""
            return [LayerAnswered(entry.layer_idx, entry.endpoint, error, None)]
        if entry.phase == Phase.HELD:  # reported when it was held
            entry.move(EntryEvent.END)
            return self._resolve(entry, ann, entry.held_error)
        entry.move(EntryEvent.END)
        self._resolve(entry, ann, error)
        return [LayerAnswered(entry.layer_idx, entry.endpoint, error,
                              latency if error is None else None)]

    def _resolve(self, entry: Entry, ann: Announcement, error: str | None) -> list[Output]:
        """The entry's gate and ticket resolve: its storage is free for this endpoint."""
        self._gates.acknowledge(entry.layer_idx, entry.endpoint, error)
        if ann.named:
            self._close_ticket(entry.aid, entry.endpoint, error,
                               self._skipped.pop((entry.aid, entry.endpoint), None))
        if not ann.entries:
            del self._announcements[entry.aid]
        return []


def _frame_layers(link: Link, late: Entry) -> str:
    """``layer N``, or the layers of the layer run that carried ``late`` (one reply
    answers them all)."""
    run = [e.layer_idx for e in link.inflight if e.on_wire and e.frame == late.frame] if (
        late.on_wire and late.frame >= 0) else []
    if len(run) < 2:
        return f"layer {late.layer_idx}"
    return f"layers {', '.join(map(str, run))} (one layer run)"
