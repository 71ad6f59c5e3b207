"""Completion rules (spec 7): Prefill storage-slot gates and Decode request completion.

Every scenario ends with a leak check: no pending layer, no closed slot, and
all ``DecodeRequestBook.counters()`` back at zero.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.completion import (
    ContributorTracker,
    DecodeRequestBook,
    ExpiredLayer,
    GateState,
    MergedReport,
    RankReport,
    StepOutcome,
    StorageSlotGates,
    merge_tp_reports,
)
from rd2h.domain.errors import CompletionError, ProtocolError
from rd2h.domain.layout import (
    DestinationLayout,
    DestTensor,
    SourceLayout,
    TensorComponent,
)
from rd2h.domain.planning import plan_reads
from rd2h.domain.protocol import ReadReadyBatch, ReadRequest

HSETTINGS = settings(deadline=None, max_examples=150)
SUFFIX = "-abcdefgh"  # vLLM's 9-character engine suffix
assert len(SUFFIX) == 9


# ====================================================================== gates


def assert_gates_clean(gates: StorageSlotGates) -> None:
    assert gates.pending_layers == ()
    assert gates.closed_slots == 0
    assert gates.next_deadline() is None


def shared_storage_gates() -> StorageSlotGates:
    """Five logical layers over reused physical buffers (layer-wise prefill).

    layer 0: main (A, B) + indexer (C, S)     layer 1: main (E, F) + indexer (G, T)
    layer 2: main (A, B), no indexer          layer 3: main (H, I) + indexer (C, S)
    layer 4: main (E, F) + indexer (G, T)     (same storage as layer 1)
    """
    def layout(name, main, idx=None, scale=None):
        return SourceLayout(
            name, tuple(TensorComponent(a, 64) for a in main),
            None if idx is None else TensorComponent(idx, 16),
            None if scale is None else TensorComponent(scale, 4),
        )

    layouts = {
        0: layout("l0", (0xA0, 0xB0), 0xC0, 0x50),
        1: layout("l1", (0xE0, 0xF0), 0x60, 0x70),
        2: layout("l2", (0xA0, 0xB0)),
        3: layout("l3", (0x80, 0x90), 0xC0, 0x50),
        4: layout("l4", (0xE0, 0xF0), 0x60, 0x70),
    }
    gates = StorageSlotGates()
    for idx, lay in layouts.items():
        main_key, idx_key = lay.storage_keys
        gates.register_layer(idx, main_key, idx_key)
    return gates


def test_storage_keys_follow_spec_7_1() -> None:
    gates = shared_storage_gates()
    assert gates.slots_of(0) == (("main", (0xA0, 0xB0)), ("indexer", (0xC0, 0x50)))
    assert gates.slots_of(2) == (("main", (0xA0, 0xB0)),)


def test_layers_sharing_main_storage_share_a_gate() -> None:
    gates = shared_storage_gates()
    assert gates.announce(0, ["d0"]) is True
    assert gates.state(0).open is False
    blocked = gates.state(2)
    assert blocked.open is False and blocked.error is None
    assert blocked.waiting_on == ("d0",)
    assert gates.state(1).open is True
    assert gates.state(4).open is True
    assert gates.acknowledge(0, "d0") is True
    assert gates.state(2).open is True
    assert gates.state(0).open is True
    assert_gates_clean(gates)


def test_main_and_indexer_slots_are_independent() -> None:
    gates = shared_storage_gates()
    gates.announce(2, ["d0"])  # main-only layer shares main with layer 0
    assert gates.state(0).open is False  # layer 0's main slot is closed
    assert gates.state(3).open is True  # layer 3 shares only layer 0's indexer slot
    assert gates.closed_slots == 1
    gates.announce(3, ["d1"])
    assert gates.closed_slots == 3  # main (A, B), main (H, I), indexer (C, S)
    assert gates.state(0).waiting_on == ("d0", "d1")
    gates.acknowledge(2, "d0")
    assert gates.state(2).open is True
    assert gates.state(0).open is False  # still closed by layer 3 through its indexer
    assert gates.state(0).waiting_on == ("d1",)
    gates.acknowledge(3, "d1")
    assert gates.state(0).open is True
    assert_gates_clean(gates)


def test_announce_with_no_endpoints_stays_open() -> None:
    gates = shared_storage_gates()
    assert gates.announce(0, [], deadline=5.0) is False
    assert gates.state(0).open is True
    assert gates.state(2).open is True
    assert gates.expire(100.0) == []
    assert_gates_clean(gates)


def test_gate_opens_only_after_every_endpoint_acknowledged() -> None:
    gates = shared_storage_gates()
    gates.announce(1, ["d0", "d0", "d1"])  # two ready messages went to d0
    assert gates.acknowledge(1, "d0") is False
    assert gates.acknowledge(1, "stray") is False
    assert gates.acknowledge(0, "d0") is False  # a layer that was never announced
    assert gates.acknowledge(1, "d1") is False
    assert gates.acknowledge(1, "d1") is False  # duplicate: d1 had one message only
    assert gates.state(1).open is False
    assert gates.state(4).waiting_on == ("d0",)
    assert gates.acknowledge(1, "d0") is True
    assert gates.acknowledge(1, "d0") is False  # late duplicate after opening
    assert gates.state(1) == gates.state(4)
    assert gates.state(4).open is True and gates.state(4).error is None
    assert_gates_clean(gates)


def test_read_failed_records_the_error_and_still_opens() -> None:
    gates = shared_storage_gates()
    gates.announce(0, ["d0", "d1"])
    assert gates.acknowledge(0, "d0", error="transfer returned -5") is False
    state = gates.state(0)
    assert state.open is False and state.error == "transfer returned -5"
    assert gates.acknowledge(0, "d1") is True
    state = gates.state(0)
    assert state.open is True and state.error == "transfer returned -5"
    assert gates.state(2).error is None  # the error belongs to the logical layer
    assert_gates_clean(gates)


def test_fail_all_opens_everything_and_reports_pending_layers() -> None:
    gates = shared_storage_gates()
    gates.announce(0, ["d0"])
    gates.announce(1, ["d0", "d1"], deadline=3.0)
    gates.announce(3, ["d1"])
    assert gates.acknowledge(3, "d1") is True
    assert gates.fail_all("sender stopped") == [0, 1]
    for layer in (0, 1):
        assert gates.state(layer) == GateState(True, "sender stopped", ())
    assert gates.state(3).error is None and gates.state(3).open is True
    assert gates.state(2).open is True and gates.state(4).open is True
    assert gates.acknowledge(0, "d0") is False  # a late reply is stray now
    assert gates.fail_all("again") == []
    assert_gates_clean(gates)


def test_expire_fails_exactly_the_expired_layers() -> None:
    gates = shared_storage_gates()
    gates.announce(0, ["d0"], deadline=10.0)
    gates.announce(1, ["d1", "d2"], deadline=20.0)
    gates.announce(3, ["d0"])  # no deadline: never expires
    gates.announce(2, ["d3"], deadline=1.0)
    assert gates.acknowledge(2, "d3") is True  # completed in time: its deadline is gone
    assert gates.next_deadline() == 10.0
    assert gates.expire(9.99) == []
    assert gates.expire(10.0) == [ExpiredLayer(0, ("d0",))]
    s0 = gates.state(0)
    assert s0.error is not None and "d0" in s0.error
    assert s0.open is False  # layer 3 still holds the shared indexer slot
    assert gates.state(2).open is True and gates.state(2).error is None
    assert gates.pending_layers == (1, 3)
    assert gates.next_deadline() == 20.0
    gates.acknowledge(1, "d1")
    assert gates.expire(25.0) == [ExpiredLayer(1, ("d2",))]
    assert gates.state(1).open is True and gates.state(1).error is not None
    assert gates.expire(1e9) == []
    assert gates.acknowledge(3, "d0") is True
    assert gates.state(0).open is True
    assert_gates_clean(gates)


def test_re_announce_keeps_the_earliest_deadline() -> None:
    gates = shared_storage_gates()
    gates.announce(1, ["d0"], deadline=5.0)
    gates.announce(1, ["d1"], deadline=50.0)
    assert gates.next_deadline() == 5.0
    assert gates.expire(5.0) == [ExpiredLayer(1, ("d0", "d1"))]
    assert_gates_clean(gates)


def test_unknown_layer_and_layer_without_storage() -> None:
    gates = shared_storage_gates()
    for call in (
        lambda: gates.state(9),
        lambda: gates.announce(9, ["d0"]),
        lambda: gates.slots_of(9),
    ):
        with pytest.raises(CompletionError, match="9"):
            call()
    with pytest.raises(CompletionError):
        gates.register_layer(9, (), None)
    with pytest.raises(CompletionError):
        gates.state(9)  # a failed registration leaves no mapping behind
    assert_gates_clean(gates)


def test_re_announce_clears_the_old_error() -> None:
    gates = shared_storage_gates()
    gates.announce(0, ["d0"])
    gates.fail_layer(0, "boom")
    assert gates.state(0) == GateState(True, "boom", ())
    assert gates.acknowledge(0, "d0") is False  # stray after the failure
    gates.announce(0, ["d0"])
    assert gates.state(0).error is None and gates.state(0).open is False
    gates.acknowledge(0, "d0")
    assert gates.state(0).error is None and gates.state(0).open is True
    gates.fail_layer(0, "boom again")
    gates.announce(0, [])  # a layer with nothing to send also starts afresh
    assert gates.state(0).error is None
    assert_gates_clean(gates)


# A model of the gates, checked against the real thing after every operation.

GATE_MAIN_KEYS = [(1, 2), (3, 4), (5,)]
GATE_IDX_KEYS = [None, (10,), (10, 11), (12,)]
ENDPOINTS = ["d0", "d1", "d2"]


@st.composite
def gate_scripts(draw):
    n_layers = draw(st.integers(1, 5))
    slots = [
        (draw(st.sampled_from(GATE_MAIN_KEYS)), draw(st.sampled_from(GATE_IDX_KEYS)))
        for _ in range(n_layers)
    ]
    layer = st.integers(0, n_layers - 1)
    endpoint = st.sampled_from([*ENDPOINTS, "stray"])
    op = st.one_of(
        st.tuples(
            st.just("announce"), layer, st.lists(st.sampled_from(ENDPOINTS), max_size=3),
            st.none() | st.integers(0, 10),
        ),
        st.tuples(st.just("ack"), layer, endpoint, st.none() | st.just("read failed")),
        st.tuples(st.just("ack"), layer, endpoint, st.none()),
        st.tuples(st.just("fail"), layer),
        st.tuples(st.just("fail_all")),
        st.tuples(st.just("expire"), st.integers(0, 12)),
    )
    return slots, draw(st.lists(op, max_size=40))


def _slot_set(main, idx) -> set:
    return {("main", main)} | ({("indexer", idx)} if idx else set())


@HSETTINGS
@given(gate_scripts())
def test_gates_follow_the_model_under_any_interleaving(script) -> None:
    slots, ops = script
    gates = StorageSlotGates()
    for i, (main, idx) in enumerate(slots):
        gates.register_layer(i, main, idx)
    slot_sets = [_slot_set(m, i) for m, i in slots]
    pending: dict[int, Counter] = {}
    errors: dict[int, str] = {}
    deadlines: dict[int, int] = {}

    def release(layer: int) -> None:
        pending.pop(layer, None)
        deadlines.pop(layer, None)

    def check() -> None:
        assert gates.pending_layers == tuple(sorted(pending))
        closed = set().union(*(slot_sets[lyr] for lyr in pending)) if pending else set()
        assert gates.closed_slots == len(closed)
        assert gates.next_deadline() == min(deadlines.values(), default=None)
        for layer in range(len(slots)):
            state = gates.state(layer)
            blockers = sorted(lyr for lyr in pending if slot_sets[lyr] & slot_sets[layer])
            assert state.open == (not blockers)
            assert state.error == errors.get(layer)
            assert sorted(state.waiting_on) == sorted(
                ep for lyr in blockers for ep in pending[lyr]
            )

    for op in ops:
        kind = op[0]
        if kind == "announce":
            _, layer, eps, deadline = op
            errors.pop(layer, None)
            closed = gates.announce(layer, eps, deadline=deadline)
            assert closed == bool(eps)
            if eps:
                pending.setdefault(layer, Counter()).update(eps)
                if deadline is not None:
                    deadlines[layer] = min(deadline, deadlines.get(layer, deadline))
        elif kind == "ack":
            _, layer, ep, error = op
            counted = pending.get(layer, Counter())[ep] > 0
            done = gates.acknowledge(layer, ep, error)
            if counted:
                if error is not None:
                    errors[layer] = error
                pending[layer][ep] -= 1
                pending[layer] = +pending[layer]
                if not pending[layer]:
                    release(layer)
            assert done == (counted and layer not in pending)
        elif kind == "fail":
            gates.fail_layer(op[1], "failed")
            errors[op[1]] = "failed"
            release(op[1])
        elif kind == "fail_all":
            want = sorted(pending)
            assert gates.fail_all("sender gone") == want
            for layer in want:
                errors[layer] = "sender gone"
                release(layer)
        else:
            now = op[1]
            want = [
                ExpiredLayer(lyr, tuple(sorted(pending[lyr], key=str)))
                for lyr in sorted(deadlines)
                if deadlines[lyr] <= now
            ]
            assert gates.expire(now) == want
            for e in want:
                names = ", ".join(e.endpoints)
                errors[e.layer_idx] = (
                    f"layer {e.layer_idx}: no acknowledgement from {names} in time"
                )
                release(e.layer_idx)
        check()

    # Every outstanding acknowledgement arrives: all gates open, nothing pending.
    for layer, eps in list(pending.items()):
        for ep, count in eps.items():
            for _ in range(count):
                gates.acknowledge(layer, ep)
    for layer in range(len(slots)):
        assert gates.state(layer).open
        assert gates.state(layer).waiting_on == ()
    assert_gates_clean(gates)


# ====================================================================== contributors


def test_contributor_done_when_every_member_reported() -> None:
    tracker = ContributorTracker()
    assert tracker.report("x", 0, 3) is False
    assert tracker.report("x", 0, 3) is False  # duplicate does not advance
    assert tracker.report("x", 2, 3) is False
    assert not tracker.is_complete("x")
    assert "x" in tracker and len(tracker) == 1
    assert tracker.report("x", 1, 3) is True
    assert tracker.is_complete("x")
    assert tracker.report("x", 1, 3) is False  # True exactly once
    assert tracker.report("y", 0, 1) is True
    assert len(tracker) == 2
    tracker.discard("x")
    tracker.discard("y")
    tracker.discard("never-seen")
    assert len(tracker) == 0 and "x" not in tracker
    assert not tracker.is_complete("x")


@pytest.mark.parametrize("ratio", [0, -1, 1])
def test_contributor_ratio_below_one_counts_as_one(ratio: int) -> None:
    tracker = ContributorTracker()
    assert tracker.report("x", 0, ratio) is True
    with pytest.raises(ProtocolError):
        tracker.report("z", 1, ratio)
    tracker.discard("x")
    assert len(tracker) == 0


@pytest.mark.parametrize(("member", "ratio"), [(2, 2), (-1, 2), (5, 1), (1, 0)])
def test_contributor_member_out_of_range(member: int, ratio: int) -> None:
    tracker = ContributorTracker()
    with pytest.raises(ProtocolError):
        tracker.report("x", member, ratio)
    assert len(tracker) == 0


def test_contributor_ratio_change_is_a_protocol_error() -> None:
    tracker = ContributorTracker()
    tracker.report("x", 0, 2)
    with pytest.raises(ProtocolError, match="ratio"):
        tracker.report("x", 1, 3)
    assert not tracker.is_complete("x")
    assert tracker.report("x", 1, 2) is True
    tracker.discard("x")
    assert len(tracker) == 0


@HSETTINGS
@given(st.integers(1, 4), st.lists(st.integers(0, 3), max_size=12))
def test_contributor_completes_exactly_when_the_set_fills(ratio: int, members) -> None:
    tracker = ContributorTracker()
    seen: set[int] = set()
    trues = 0
    for m in members:
        m %= ratio
        fresh = m not in seen
        seen.add(m)
        got = tracker.report("x", m, ratio)
        assert got == (fresh and len(seen) == ratio)
        trues += got
        assert tracker.is_complete("x") == (len(seen) == ratio)
    assert trues == (1 if len(seen) == ratio else 0)
    tracker.discard("x")
    assert len(tracker) == 0


# ====================================================================== merge


def test_merge_tp_reports_table() -> None:
    a = RankReport(frozenset({"x", "y", "z"}), frozenset({"z"}))
    b = RankReport(frozenset({"x", "z"}), frozenset())
    c = RankReport(frozenset({"x", "z", "w"}), frozenset({"w", "x"}))
    assert merge_tp_reports([a, b, c]) == MergedReport(
        frozenset({"x", "z"}), frozenset({"w", "x", "z"})
    )
    assert merge_tp_reports([a]) == MergedReport(a.terminal, a.failed)
    assert merge_tp_reports([]) == MergedReport(frozenset(), frozenset())


@HSETTINGS
@given(
    st.lists(
        st.builds(
            RankReport,
            st.frozensets(st.sampled_from("abcdef")),
            st.frozensets(st.sampled_from("abcdef")),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_merge_is_intersection_of_terminal_and_union_of_failed(reports) -> None:
    merged = merge_tp_reports(reports)
    for x in "abcdef":
        assert (x in merged.finished) == all(x in r.terminal for r in reports)
        assert (x in merged.failed) == any(x in r.failed for r in reports)


# ====================================================================== request book


def step(books: Sequence[DecodeRequestBook], finished_by_vllm=()) -> list[StepOutcome]:
    """One worker step on every Decode rank: exchange reports, then resolve."""
    reports = [b.local_report() for b in books]
    return [b.finish_step(reports, finished_by_vllm) for b in books]


def assert_book_clean(*books: DecodeRequestBook) -> None:
    for book in books:
        assert book.counters() == {
            "admitted": 0, "terminal": 0, "failed": 0, "pending_finished": 0, "contributors": 0,
            "orphans": 0, "peer_contributions": 0,
        }
        assert len(book.destinations) == 0


EMPTY = StepOutcome(frozenset(), frozenset(), frozenset())


@pytest.mark.parametrize(
    ("internal", "external"),
    [
        ("chatcmpl-42" + SUFFIX, "chatcmpl-42"),
        ("0123456789", "0"),
        ("123456789", "123456789"),  # exactly 9 characters: unchanged
        ("short", "short"),
    ],
)
def test_admit_maps_internal_to_external_id(internal: str, external: str) -> None:
    book = DecodeRequestBook()
    assert book.admit(internal, [1, 2], [3], now=0.0) == external
    dest = book.destination(external)
    assert dest is not None
    assert (dest.main_block_ids.tolist(), dest.indexer_block_ids.tolist()) == ([1, 2], [3])
    assert book.destination(internal) is None or internal == external
    assert list(book.destinations) == [external]
    assert book.destinations[external] is dest
    assert book.record_done([external], 0, 1) == [external]
    assert step([book]) == [StepOutcome(frozenset({internal}), frozenset(), frozenset())]
    assert_book_clean(book)


def test_book_destinations_feed_the_planner() -> None:
    book = DecodeRequestBook()
    ext = book.admit("r1" + SUFFIX, [4, 5], [6, 7], now=0.0)
    src = SourceLayout("L", (TensorComponent(1000, 8),), TensorComponent(5000, 2))
    dst = DestinationLayout("L", (DestTensor(0, 8, 16),), DestTensor(900, 2, 16))
    batch = ReadReadyBatch(0, "L", (ReadRequest(ext, (0, 1), (2, 3)),))
    plan = plan_reads(batch, src, dst, book.destinations, d_rank=0, d_tp=1)
    assert plan.local_addrs.tolist() == [4 * 8, 900 + 6 * 2]
    assert plan.remote_addrs.tolist() == [1000, 5000 + 2 * 2]
    book.record_done([ext], 0, 1)
    step([book])
    assert_book_clean(book)


def test_record_done_with_ratio_two_needs_both_members() -> None:
    book = DecodeRequestBook()
    ext = book.admit("req" + SUFFIX, [1], [2], now=0.0)
    assert book.record_done([ext], 0, 2) == []
    assert book.record_done([ext], 0, 2) == []  # duplicate
    assert step([book]) == [EMPTY]
    assert book.counters()["contributors"] == 1
    assert book.record_done([ext], 1, 2) == [ext]
    assert book.record_done([ext], 1, 2) == []  # already terminal
    assert step([book])[0].finished == {"req" + SUFFIX}
    assert_book_clean(book)


def test_finish_needs_every_rank_terminal() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    for b in books:
        b.admit("a" + SUFFIX, [1, 2], [3], now=0.0)
        b.admit("b" + SUFFIX, [4], [5], now=0.0)
    books[0].record_done(["a", "b"], 0, 1)
    books[1].record_done(["b"], 0, 1)
    assert [o.finished for o in step(books)] == [{"b" + SUFFIX}] * 2
    assert [o.finished for o in step(books)] == [frozenset()] * 2
    books[1].record_done(["a"], 0, 1)
    outcomes = step(books)
    assert outcomes == [StepOutcome(frozenset({"a" + SUFFIX}), frozenset(), frozenset())] * 2
    assert_book_clean(*books)


def test_failure_on_one_rank_fails_everywhere_and_invalidates_blocks() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "req" + SUFFIX
    for b in books:
        b.admit(internal, [10, 11], [20, 21, 22], now=0.0)
    books[1].record_failed(["req"], "read failed: -5")
    first = step(books)
    for o in first:
        # Rank 0 was not terminal yet: not finished, but the blocks are already invalid.
        assert o.finished == frozenset()
        assert o.invalid_block_ids == {10, 11, 20, 21, 22}
        assert all(type(b) is int for b in o.invalid_block_ids)  # plain ints for vLLM
    second = step(books)
    for rank, o in enumerate(second):
        assert o.finished == {internal} and o.failed == {internal}
        assert o.invalid_block_ids == frozenset()  # reported once only
        want = "read failed: -5" if rank == 1 else "failed on another decode rank"
        assert o.reasons == {internal: want}
    assert_book_clean(*books)


def test_failure_and_success_in_the_same_step() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    for b in books:
        b.admit("r" + SUFFIX, [1], [2], now=0.0)
    books[0].record_done(["r"], 0, 1)
    books[1].record_failed(["r"], "boom")
    for o in step(books):
        assert o.finished == {"r" + SUFFIX} and o.failed == {"r" + SUFFIX}
        assert o.invalid_block_ids == {1, 2}
    assert_book_clean(*books)


def test_finished_before_admission_stays_pending_until_admitted() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "late" + SUFFIX
    books[0].admit(internal, [1], [2], now=0.0)
    books[0].record_done(["late"], 0, 1)
    books[1].record_done(["late"], 0, 1)  # rank 1 heard P before its admission
    out = step(books)
    assert out[0].finished == {internal}
    assert out[1].finished == frozenset()
    assert books[1].counters()["pending_finished"] == 1
    assert step(books)[1].finished == frozenset()
    books[1].admit(internal, [1], [2], now=1.0)
    out = step(books)
    assert out[0] == EMPTY
    assert out[1] == StepOutcome(frozenset({internal}), frozenset(), frozenset())
    assert_book_clean(*books)


def test_failed_before_admission_on_another_rank_is_reported_once_admitted() -> None:
    """A failure on rank 0 while rank 1 has not admitted the request yet."""
    books = [DecodeRequestBook(), DecodeRequestBook()]
    internal = "late" + SUFFIX
    books[0].admit(internal, [1, 2], [3], now=0.0)
    books[0].record_failed(["late"], "boom")
    out = step(books)
    assert out[0].invalid_block_ids == {1, 2, 3}
    out = step(books)
    assert out[0].finished == {internal} and out[0].failed == {internal}
    assert out[1] == EMPTY
    for _ in range(3):  # rank 1 is still waiting for its admission
        assert step(books) == [EMPTY, EMPTY]
    books[1].admit(internal, [1, 2], [3], now=1.0)
    out = step(books)
    assert out[0] == EMPTY
    assert out[1].finished == {internal} and out[1].failed == {internal}
    assert out[1].invalid_block_ids == {1, 2, 3}
    for _ in range(3):
        assert step(books) == [EMPTY, EMPTY]
    assert_book_clean(*books)


def test_finished_by_vllm_is_cleaned_after_this_steps_completions() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    done, partial, failed = "done" + SUFFIX, "part" + SUFFIX, "fail" + SUFFIX
    for b in books:
        for internal in (done, partial, failed):
            b.admit(internal, [1], [2], now=0.0)
        b.record_done(["done"], 0, 1)
        b.record_done(["part"], 1, 2)  # partial contributor state
    books[0].record_failed(["fail"], "boom")
    out = step(books, finished_by_vllm=[done, partial, failed])
    for o in out:
        # 'done' completed this step: it is reported before the cleanup.
        assert o.finished == {done}
        # 'fail' was failed on rank 0 only; its blocks are still reported invalid.
        assert o.invalid_block_ids == {1, 2}
    assert_book_clean(*books)
    assert step(books) == [EMPTY, EMPTY]


def test_finished_by_vllm_cleans_state_of_a_request_never_admitted() -> None:
    book = DecodeRequestBook()
    book.record_done(["ghost"], 0, 2)
    book.record_failed(["ghost2"], "no destination")
    assert book.counters()["contributors"] == 1
    step([book], finished_by_vllm=["ghost" + SUFFIX, "ghost2" + SUFFIX])
    assert_book_clean(book)


def test_expire_fails_late_requests() -> None:
    books = [DecodeRequestBook(), DecodeRequestBook()]
    a, b, c = "a" + SUFFIX, "b" + SUFFIX, "c" + SUFFIX
    for book in books:
        book.admit(a, [1], [2], now=0.0)
        book.admit(b, [3], [4], now=5.0)
        book.admit(c, [5], [6], now=0.0)
        book.record_done(["c"], 0, 1)
    assert books[0].expire(now=9.9, timeout=10.0) == []
    assert books[0].expire(now=10.0, timeout=10.0) == ["a"]
    assert books[0].expire(now=12.0, timeout=10.0) == []  # already terminal
    out = step(books)
    for o in out:
        assert o.finished == {c}
        assert o.invalid_block_ids == {1, 2}
    out = step(books)
    assert out[0].finished == {a} and out[0].failed == {a}
    assert "10 s" in out[0].reasons[a]
    assert out[1].failed == {a}
    assert books[1].expire(now=15.0, timeout=10.0) == ["b"]
    step(books)
    out = step(books)
    assert all(o.finished == {b} and o.failed == {b} for o in out)
    assert_book_clean(*books)


# A random interleaving over 1-3 Decode ranks, checked against the completion rules.


@st.composite
def book_scripts(draw):
    n_ranks = draw(st.integers(1, 3))
    n_reqs = draw(st.integers(1, 4))
    ratios = [draw(st.integers(0, 3)) for _ in range(n_reqs)]
    op = st.tuples(
        st.sampled_from(["admit", "done", "done", "fail", "step", "step"]),
        st.integers(0, n_reqs - 1),
        st.integers(0, n_ranks - 1),
        st.integers(0, 2),
    )
    return n_ranks, ratios, draw(st.lists(op, max_size=40))


@settings(deadline=None, max_examples=300)
@given(book_scripts())
def test_request_book_random_interleavings(script) -> None:
    n_ranks, ratios, ops = script
    books = [DecodeRequestBook() for _ in range(n_ranks)]
    internal = [f"req{i}" + SUFFIX for i in range(len(ratios))]
    ext = [f"req{i}" for i in range(len(ratios))]
    main_ids = [[100 + 10 * i, 101 + 10 * i] for i in range(len(ratios))]
    idx_ids = [[500 + 10 * i] for i in range(len(ratios))]
    block_owner = {b: i for i in range(len(ratios)) for b in main_ids[i] + idx_ids[i]}
    admitted = [[False] * len(ratios) for _ in range(n_ranks)]
    failed_anywhere = [False] * len(ratios)
    all_terminal_at: list[int | None] = [None] * len(ratios)  # step all ranks were terminal
    finished_at = [[None] * len(ratios) for _ in range(n_ranks)]
    invalid_at = [[None] * len(ratios) for _ in range(n_ranks)]
    step_no = 0

    def admit(rank: int, i: int) -> None:
        if not admitted[rank][i]:
            admitted[rank][i] = True
            books[rank].admit(internal[i], main_ids[i], idx_ids[i], now=0.0)

    def run_step() -> None:
        nonlocal step_no
        step_no += 1
        reports = [b.local_report() for b in books]
        merged = merge_tp_reports(reports)
        for i in range(len(ratios)):
            if all_terminal_at[i] is None and ext[i] in merged.finished:
                all_terminal_at[i] = step_no
        for rank, book in enumerate(books):
            out = book.finish_step(reports)
            assert out.failed <= out.finished
            for b in out.invalid_block_ids:
                i = block_owner[b]
                assert failed_anywhere[i], "blocks of a request that did not fail"
                assert invalid_at[rank][i] in (None, step_no)
                invalid_at[rank][i] = step_no
            for name in out.finished:
                i = internal.index(name)
                assert finished_at[rank][i] is None, "reported finished twice"
                assert all_terminal_at[i] is not None, "finished before every rank was terminal"
                assert admitted[rank][i]
                finished_at[rank][i] = step_no
                assert (name in out.failed) == failed_anywhere[i]
                if failed_anywhere[i]:
                    assert invalid_at[rank][i] is not None, "failed blocks never reported"
                    assert name in out.reasons

    for kind, i, rank, member in ops:
        if kind == "admit":
            admit(rank, i)
        elif kind == "step":
            run_step()
        elif all_terminal_at[i] is None:  # no records once the request resolved
            if kind == "done":
                books[rank].record_done([ext[i]], member % max(1, ratios[i]), ratios[i])
            else:
                books[rank].record_failed([ext[i]], "boom")
                failed_anywhere[i] = True

    # Everything arrives: every rank admits and hears every contributor.
    for rank in range(n_ranks):
        for i in range(len(ratios)):
            admit(rank, i)
            if all_terminal_at[i] is None:
                for m in range(max(1, ratios[i])):
                    books[rank].record_done([ext[i]], m, ratios[i])
    for _ in range(3):
        run_step()
    for rank in range(n_ranks):
        assert all(f is not None for f in finished_at[rank]), "a request never finished"
    assert_book_clean(*books)


def test_failures_for_never_admitted_requests_expire() -> None:
    """A READ_FAILED naming a request this rank never admitted (or already forgot)
    must not leave state behind forever."""
    book = DecodeRequestBook()
    book.record_failed(["ghost"], "no destination blocks", now=100.0)
    out = book.finish_step([book.local_report()])
    assert out.finished == frozenset()
    assert book.expire(now=110.0, timeout=30.0) == []
    assert book.counters()["orphans"] == 1
    book.expire(now=131.0, timeout=30.0)
    assert all(v == 0 for v in book.counters().values()), book.counters()


def test_late_admission_of_a_failed_request_is_still_reported() -> None:
    book = DecodeRequestBook()
    book.record_failed(["late"], "read failed", now=1.0)
    book.finish_step([book.local_report()])
    book.admit("late" + "s" * 9, [4, 5], [6], now=2.0)
    book.expire(now=3.0, timeout=30.0)
    out = book.finish_step([book.local_report()])
    assert out.finished == {"late" + "s" * 9} and out.failed == {"late" + "s" * 9}
    assert out.invalid_block_ids == {4, 5, 6}
    assert all(v == 0 for v in book.counters().values()), book.counters()
