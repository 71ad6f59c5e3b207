"""``verify_kv`` on Prefill's worker (``PrefillWorker._announce``): what each reading
Decode rank is told, through the real sender and codec to scripted Decode endpoints on
the in-memory control network. With a
Decode TP above Prefill's, one Prefill rank serves several Decode ranks: with a shared
main pool each gets (and Prefill hashes) only its share of main; without, every rank
gets every main digest, hashed once for all of them."""

from __future__ import annotations

import numpy as np
from fakes.clock import ManualClock
from fakes.control import MemoryNetwork, ScriptedDecode
from fakes.logs import RecordingLogger

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.app.connector.plans import DecodeEndpoint, PrefillSend, StepPlan
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.planning.layout import SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import ReadReadyBatch

NAME = "model.layers.0.self_attn.attn"
CODEC = MsgpackCodec()
MAIN = TensorComponent(0x100000, 64)
INDEXER = TensorComponent(0x200000, 16)


ENDPOINTS = ["tcp://10.0.0.9:31000", "tcp://10.0.0.9:31001"]


def _announce(main_shared: bool) -> tuple[dict[str, list[ReadReadyBatch]], list[list[int]]]:
    net = MemoryNetwork()
    decode = ScriptedDecode(net, ENDPOINTS, CODEC)
    hashed: list[list[int]] = []

    def digest(addrs, sizes):
        hashed.append(np.asarray(addrs).tolist())
        return np.asarray(addrs, dtype=np.int64) + 1  # predictable: address plus one

    container = bootstrap(Rd2hSettings(role="prefill"), clock=ManualClock(),
                          logger=RecordingLogger(), codec=CODEC,
                          control_clients=net.clients)
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
        worker.wait_for_save()
        batches: dict[str, list[ReadReadyBatch]] = {}
        for endpoint, batch in decode.wait_batches(2):
            batches.setdefault(endpoint, []).append(batch)
    finally:
        worker.shutdown()
        decode.close()
    return batches, hashed


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
