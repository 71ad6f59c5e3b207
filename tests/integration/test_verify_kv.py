"""End-to-end KV digests catch corrupted reads (issue 29, parts 2 and 3): real ZeroMQ
sockets and codec, the in-process transport (real byte copies), Decode's real
``DecodeReceiver`` with XXH3 digests (``rd2h.adapters.hashing``).

Prefill states per block and tensor the digest of its source bytes (here computed the
way ``PrefillWorker`` does under ``verify_kv``: ``stated_digests`` + ``digest_blocks``).
Two corruption faults sit between the transport and Decode's check:
- ``flip``: bytes of the first block read are flipped after the transport returned;
- ``misplace``: every block is read into the next destination block (a wrong-destination
  bug).
With digests, every affected request fails (its layer answered READ_FAILED naming the
request, tensor and block) and none completes; without them it completes, and the test's
own byte comparison shows the corruption, so the fault is real. The matrix is printed
with ``-s``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from fakes.net import wait_until
from fakes.rig import (
    WAIT,
    Rig,
    Transfer,
    assert_transfer_landed,
    internal,
    step,
    targets,
)

from rd2h.adapters.hashing import digest_blocks
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.digests import stated_digests
from rd2h.domain.wire.protocol import ReadRequest

pytestmark = pytest.mark.integration

LAYERS = (0, 1)
MATRIX: list[str] = []


class Corrupting:
    """A transfer engine that reads as the real one, then corrupts what landed."""

    def __init__(self, inner: Any, fault: str) -> None:
        self._inner, self.fault, self.reads = inner, fault, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def batch_read(self, session: str, local: np.ndarray, remote: np.ndarray,
                   lengths: np.ndarray) -> None:
        self.reads += 1
        if self.fault == "misplace":  # into the next block of each destination run
            local = local + lengths
        self._inner.batch_read(session, local, remote, lengths)
        if self.fault == "flip":
            view = (np.ctypeslib.as_array(
                (np.ctypeslib.ctypes.c_uint8 * int(lengths[0])).from_address(int(local[0]))))
            view[: min(16, view.size)] ^= 0xFF


def _with_digests(p, req: ReadRequest, layer: int) -> ReadRequest:
    return dataclasses.replace(req, digests=stated_digests(p.layouts[layer], req,
                                                           digest_blocks))


def _run(rig: Rig, fault: str, verify: bool) -> tuple[bool, bool, str]:
    """One request of both layers through a corrupting Decode: (completed, landed
    intact, what Prefill heard)."""
    p = rig.prefill_memory(LAYERS, seed=7, advertise=True)
    d = rig.decode(LAYERS, settings={"deadlines": {"request_s": 30.0}})
    d.receiver._transfer = Corrupting(d.receiver._transfer, fault)  # the test seam
    sender = rig.start_sender(p)
    t = Transfer(f"{fault}-{verify}", (1, 2), (3, 4), (2, 4), (3, 5))
    d.receiver.admit(internal(t.ext), t.d_main, t.d_idx)
    heard = []
    for layer in LAYERS:
        req = t.read(0, 2)
        if verify:
            req = _with_digests(p, req, layer)
        done = [t.ext] if layer == LAYERS[-1] else []
        sender.submit(layer, None, targets(d.endpoint, [req], done))
    for layer in LAYERS:
        try:
            sender.wait_for_layer_send(layer, WAIT)
        except LayerSendError as exc:
            heard.append(str(exc))
    ended: dict[str, bool] = {}

    def over() -> bool:
        out = step(d.receiver)
        ext = internal(t.ext)
        if ext in out.finished:
            ended["completed"] = ext not in out.failed
        return bool(ended)

    wait_until(over, f"request {t.ext} to end", WAIT)
    try:
        assert_transfer_landed(p, d, t)
        intact = True
    except AssertionError:
        intact = False
    mismatches = d.receiver.stats.digest_mismatches
    MATRIX.append(f"{fault:9s} verify {'on ' if verify else 'off'}: completed "
                  f"{ended['completed']!s:5s} bytes intact {intact!s:5s} digest mismatches "
                  f"{mismatches}")
    return ended["completed"], intact, " | ".join(heard)


@pytest.mark.parametrize("fault", ["flip", "misplace"])
def test_a_corrupted_read_is_caught_with_digests_and_real_without(rig: Rig,
                                                                   fault: str) -> None:
    completed, intact, heard = _run(rig, fault, verify=True)
    assert not completed, "served from corrupted blocks"
    assert "KV digest mismatch" in heard and f"{fault}-True" in heard
    completed, intact, _ = _run(rig, fault, verify=False)
    assert completed and not intact  # the fault is real: only digests catch it
    print("\n".join(["", *MATRIX]))


def test_intact_reads_with_digests_complete(rig: Rig) -> None:
    p = rig.prefill_memory(LAYERS, seed=8, advertise=True)
    d = rig.decode(LAYERS)
    sender = rig.start_sender(p)
    t = Transfer("intact", (1, 2), (3, 4), (5, 6), (7, 8))
    d.receiver.admit(internal(t.ext), t.d_main, t.d_idx)
    for layer in LAYERS:
        done = [t.ext] if layer == LAYERS[-1] else []
        sender.submit(layer, None, targets(d.endpoint, [_with_digests(p, t.read(0, 2), layer)],
                                           done))
    for layer in LAYERS:
        sender.wait_for_layer_send(layer, WAIT)
    wait_until(lambda: internal(t.ext) in step(d.receiver).finished, "the request", WAIT)
    assert_transfer_landed(p, d, t)
    stats = d.receiver.stats
    # Every block of every tensor of both layers was checked, none differed.
    assert stats.digest_mismatches == 0 and stats.blocks_verified > 0
