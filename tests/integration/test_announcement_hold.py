"""Decode never completes a request from a read that may have ended after Prefill's hold
on the announced blocks (issue 29, part 1): real ZeroMQ sockets and codec, the
in-process transport (real byte copies), each side's wall clock given as a function.

Prefill states in every READ_READY_BATCH until when (its clock) it keeps the blocks,
``layer_ack_s`` from the send; Decode checks that hold, less ``hold_margin_s``, before
the read and when it ended, and fails the layer otherwise: Prefill hears READ_FAILED
naming the hold, Decode's destination blocks are never reported complete."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fakes.net import wait_until
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

from rd2h.domain.errors import LayerSendError

pytestmark = pytest.mark.integration

LAYERS = (0, 1)
HOLD_S = 2.0  # Prefill's layer_ack_s: the hold each announcement states


def _decode(rig: Rig, **kw: object):
    return rig.decode(LAYERS, settings={"deadlines": {"request_s": 30.0,
                                                      "hold_margin_s": 1.0}}, **kw)


def _sender(rig: Rig, p):
    return rig.start_sender(p, settings={"deadlines": {"layer_ack_s": HOLD_S}})


def _announce_and_wait_failed(p, d, sender, t: Transfer) -> list[str]:
    """Admit ``t``, announce both layers, step until Decode fails it; the errors Prefill
    heard for the layers that failed (Decode skips a layer of a request it failed
    already: READ_DONE with the request skipped)."""
    d.receiver.admit(internal(t.ext), t.d_main, t.d_idx)
    for layer in LAYERS:
        done = [t.ext] if layer == LAYERS[-1] else []
        sender.submit(layer, None, targets(d.endpoint, [t.read(0, len(t.p_main))], done))
    errors = []
    for layer in LAYERS:
        try:
            sender.wait_for_layer_send(layer, WAIT)
        except LayerSendError as exc:
            errors.append(str(exc))
    assert errors, "no layer failed on Prefill"
    failed: set[str] = set()

    def ended() -> bool:
        out = step(d.receiver)
        # vLLM learns of a failed load as finished with its blocks invalid: never
        # finished without being failed.
        ext = internal(t.ext)
        assert ext in out.failed or ext not in out.finished, "completed past the hold"
        failed.update(out.failed)
        return internal(t.ext) in failed

    wait_until(ended, f"request {t.ext} to fail", WAIT)
    return errors


class ReadTakes:
    """A wall clock on which every read takes ``seconds``: each second call (the check
    when a read ended) is that much later than the first (the check before it)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._calls: Iterator[int] = iter(range(1 << 30))

    def __call__(self) -> float:
        return time.time() + (self.seconds if next(self._calls) % 2 else 0.0)


def test_a_decode_within_the_hold_completes(rig: Rig) -> None:
    """Decode's clock 0.5 s ahead of Prefill's, 1 s margin, 2 s hold: reads as usual."""
    p = rig.prefill_memory(LAYERS, seed=1, advertise=True)
    d = _decode(rig, wall=lambda: time.time() + 0.5)
    sender = _sender(rig, p)
    t = Transfer("in-hold", (1, 2), (3, 4), (5, 6), (7, 8))
    out = run_transfer(p, d, sender, t, [(0, 2)])
    assert out.finished == {internal(t.ext)} and not out.failed
    assert_transfer_landed(p, d, t)
    assert d.receiver.stats.reads_past_hold == 0


def test_a_hold_that_ended_before_the_read_fails_every_layer_unread(rig: Rig) -> None:
    """Decode's clock 1.5 s ahead: with the 1 s margin, every 2 s hold has ended before
    Decode even starts (a Decode resumed late): no byte is read, nothing completes."""
    p = rig.prefill_memory(LAYERS, seed=2, advertise=True)
    d = _decode(rig, wall=lambda: time.time() + 1.5)
    sender = _sender(rig, p)
    t = Transfer("late", (1, 2), (3, 4), (5, 6), (7, 8))
    errors = _announce_and_wait_failed(p, d, sender, t)
    assert all("hold on the announced blocks ended before the read" in e for e in errors)
    assert d.receiver.stats.reads_past_hold >= 1
    assert d.receiver.stats.bytes_read == 0


def test_a_read_that_ended_after_the_hold_does_not_complete(rig: Rig) -> None:
    """The read started inside the hold but ended 5 s later (a Decode stopped mid-read):
    the bytes landed, yet the layer fails, so they are never used."""
    p = rig.prefill_memory(LAYERS, seed=3, advertise=True)
    d = _decode(rig, wall=ReadTakes(5.0))
    sender = _sender(rig, p)
    t = Transfer("slow-read", (1, 2), (3, 4), (5, 6), (7, 8))
    errors = _announce_and_wait_failed(p, d, sender, t)
    assert all("ended when the read ended" in e for e in errors), errors
    assert d.receiver.stats.reads_past_hold >= 1
    assert d.receiver.stats.bytes_read > 0  # it did read: only the check stopped it


def test_a_peer_without_holds_is_read_as_before(rig: Rig) -> None:
    """An announcement stating no hold (older builds, the original implementation) is
    read without the check, whatever Decode's clock says."""
    p = rig.prefill_memory(LAYERS, seed=4, advertise=True)
    d = _decode(rig, wall=lambda: time.time() + 1e6)
    sender = _sender(rig, p)
    sender._held = lambda batch: batch  # type: ignore[method-assign]  (states no hold)
    t = Transfer("no-hold", (1, 2), (3, 4), (5, 6), (7, 8))
    out = run_transfer(p, d, sender, t, [(0, 2)])
    assert out.finished == {internal(t.ext)}
    assert_transfer_landed(p, d, t)
