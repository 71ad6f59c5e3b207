"""Prefill storage-slot gates (spec 7.1): one gate per physical storage slot.

Every scenario ends with a leak check: no pending layer and no closed slot. The
deadlines that end a layer belong to the Prefill session (``test_prefill_session``).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.domain.errors import CompletionError
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.prefill.gates import GateState, StorageSlotGates

HSETTINGS = settings(deadline=None, max_examples=150)


# ====================================================================== gates


def assert_gates_clean(gates: StorageSlotGates) -> None:
    assert gates.pending_layers == ()
    assert gates.closed_slots == 0


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
    assert gates.announce(0, []) is False
    assert gates.state(0).open is True
    assert gates.state(2).open is True
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
    gates.announce(1, ["d0", "d1"])
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
        st.tuples(st.just("announce"), layer, st.lists(st.sampled_from(ENDPOINTS), max_size=3)),
        st.tuples(st.just("ack"), layer, endpoint, st.none() | st.just("read failed")),
        st.tuples(st.just("ack"), layer, endpoint, st.none()),
        st.tuples(st.just("fail"), layer),
        st.tuples(st.just("fail_all")),
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

    def release(layer: int) -> None:
        pending.pop(layer, None)

    def check() -> None:
        assert gates.pending_layers == tuple(sorted(pending))
        closed = set().union(*(slot_sets[lyr] for lyr in pending)) if pending else set()
        assert gates.closed_slots == len(closed)
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
            _, layer, eps = op
            errors.pop(layer, None)
            closed = gates.announce(layer, eps)
            assert closed == bool(eps)
            if eps:
                pending.setdefault(layer, Counter()).update(eps)
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
