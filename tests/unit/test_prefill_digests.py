"""``verify_kv`` on Prefill's worker (``PrefillWorker._announce``): what each reading
Decode rank is told, through the real sender and codec to a recording Decode. With a
Decode TP above Prefill's, one Prefill rank serves several Decode ranks: with a shared
main pool each gets (and Prefill hashes) only its share of main; without, every rank
gets every main digest, hashed once for all of them."""

from __future__ import annotations

import queue
import time

import numpy as np
from fakes.clock import ManualClock
from fakes.logs import RecordingLogger

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend, StepPlan
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import ACK, MfMeta, ReadDone, ReadReadyBatch

NAME = "model.layers.0.self_attn.attn"
CODEC = MsgpackCodec()
MAIN = TensorComponent(0x100000, 64)
INDEXER = TensorComponent(0x200000, 16)


class RecordingDecode:
    """Every Decode endpoint at once: ACKs MF_META, answers each announcement at once
    and keeps it."""

    def __init__(self) -> None:
        self._replies: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.batches: dict[str, list[ReadReadyBatch]] = {}

    def connect(self, endpoint: str) -> None:
        pass

    def disconnect(self, endpoint: str) -> None:
        pass

    def send(self, endpoint: str, payload: bytes, timeout: float = 5.0) -> None:
        msg = CODEC.decode(payload)
        if isinstance(msg, MfMeta):
            self._replies.put((endpoint, ACK))
            return
        assert isinstance(msg, ReadReadyBatch)
        self.batches.setdefault(endpoint, []).append(msg)
        self._replies.put((endpoint, CODEC.encode(ReadDone(msg.layer_idx, msg.seq))))

    def poll(self, timeout: float) -> list[tuple[str, bytes]]:
        try:
            out = [self._replies.get(timeout=timeout)]
        except queue.Empty:
            return []
        while not self._replies.empty():
            out.append(self._replies.get_nowait())
        return [(ep, p) for ep, p in out if p]

    def disconnected(self) -> list[str]:
        return []

    def reconnected(self) -> list[str]:
        return []

    def wake(self) -> None:
        self._replies.put(("", b""))

    def close(self) -> None:
        pass


def _announce(main_shared: bool) -> tuple[dict[str, list[ReadReadyBatch]], list[list[int]]]:
    decode = RecordingDecode()
    hashed: list[list[int]] = []

    def digest(addrs, sizes):
        hashed.append(np.asarray(addrs).tolist())
        return np.asarray(addrs, dtype=np.int64) + 1  # predictable: address plus one

    container = bootstrap(Rd2hSettings(role="prefill"), clock=ManualClock(),
                          logger=RecordingLogger(), codec=CODEC,
                          control_clients=lambda: decode)
    layout = SourceLayout(NAME, (MAIN,), indexer=INDEXER)
    sender = container.prefill_sender(p_session="p", layers={0: layout})
    worker = container.prefill_worker(sender=sender, layer_names={0: NAME}, layouts={0: layout},
                                      digest=digest, main_shared=main_shared)
    worker.start()
    try:  # Prefill TP 1 -> Decode TP 2: this rank alone serves both Decode ranks
        worker.bind_connector_metadata(StepPlan(sends=(PrefillSend(
            "a-0123abcd", "a", DecodeEndpoint("10.0.0.9", 31000, 2), (1, 2, 3, 4),
            (5, 6), 0, 0, True),)))
        worker.save_kv_layer(NAME)
        deadline = time.monotonic() + 5
        while sum(map(len, decode.batches.values())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.shutdown()
    return decode.batches, hashed


def _main(batches: dict[str, list[ReadReadyBatch]]) -> dict[int, tuple[int, ...]]:
    """Decode rank (by port) -> the main digests it was told."""
    out = {}
    for endpoint, sent in batches.items():
        (batch,) = sent
        (req,) = batch.read_reqs
        assert req.digests is not None
        out[int(endpoint.rsplit(":", 1)[1]) - 31000] = req.digests[0]
    return out


def test_a_shared_pool_gives_each_reader_its_own_share_of_main() -> None:
    batches, hashed = _announce(main_shared=True)
    told = _main(batches)
    assert sorted(told) == [0, 1]
    # owned_range(4, 2, r, 0): rank 0 blocks 1 and 2, rank 1 blocks 3 and 4.
    assert told[0] == tuple(MAIN.base_addr + b * 64 + 1 for b in (1, 2))
    assert told[1] == tuple(MAIN.base_addr + b * 64 + 1 for b in (3, 4))
    main_hashed = sorted(a for call in hashed for a in call if a < INDEXER.base_addr)
    assert main_hashed == [MAIN.base_addr + b * 64 for b in (1, 2, 3, 4)]  # each once


def test_without_a_shared_pool_every_reader_gets_every_main_digest_hashed_once() -> None:
    batches, hashed = _announce(main_shared=False)
    told = _main(batches)
    every = tuple(MAIN.base_addr + b * 64 + 1 for b in (1, 2, 3, 4))
    assert told == {0: every, 1: every}
    assert len(hashed) == 2  # main and indexer, once for both readers
