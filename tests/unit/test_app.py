"""App services with in-memory fakes: settings, the container, and a full
Prefill -> Decode pull, each side built by its container (``bootstrap``) over an
in-memory control channel (no sockets)."""

from __future__ import annotations

import time

import numpy as np
import pydantic
import pytest
from fakes.control import MemoryNetwork
from fakes.logs import RecordingLogger

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.app.prefill import LayerTarget, group_batches
from rd2h.app.settings import Deadlines, Rd2hSettings
from rd2h.bootstrap.container import InPlaceOf, bootstrap
from rd2h.domain.errors import LayerSendError
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.wire.protocol import MetaAck, MfMeta, ReadFailed, ReadReadyBatch, ReadRequest

# ---------------------------------------------------------------- settings / container


def test_settings_reject_bad_values_naming_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="tp_rank"):
        Rd2hSettings(role="decode", tp_size=2, tp_rank=2)
    with pytest.raises(pydantic.ValidationError, match="bogus"):
        Rd2hSettings(role="decode", bogus=1)
    with pytest.raises(pydantic.ValidationError, match="65535"):
        Rd2hSettings(role="decode", kv_port=65534, tp_size=4)
    with pytest.raises(pydantic.ValidationError, match="transport"):
        Rd2hSettings(role="prefill", transport="carrier-pigeon")
    with pytest.raises(pydantic.ValidationError, match="meta_ack_s"):
        Rd2hSettings(role="prefill", deadlines={"meta_ack_s": 0})


def test_settings_port_plan() -> None:
    s = Rd2hSettings(role="decode", kv_port=30000, global_dp_rank=3, tp_size=4, tp_rank=2)
    assert s.base_port == 30012 and s.rank_port == 30014


def test_container_builds_only_the_selected_transport() -> None:
    c = bootstrap(Rd2hSettings(role="decode", transport="inproc"))
    engine = c.transport()
    assert isinstance(engine, InprocTransferEngine)
    assert c.transport() is engine  # one engine per process
    engine.close()
    with pytest.raises(pydantic.ValidationError, match="memfabric_store_url is required"):
        Rd2hSettings(role="decode", transport="memfabric")


def test_bootstrap_replaces_a_provider_with_a_fake_and_refuses_unknown_names() -> None:
    fake = InprocTransferEngine()
    c = bootstrap(Rd2hSettings(role="decode", transport="cma"), transport=fake)
    assert c.transport() is fake
    with pytest.raises(ValueError, match="no provider 'transfer'"):
        bootstrap(Rd2hSettings(role="decode"), transfer=fake)
    fake.close()


def test_in_place_of_builds_the_fake_from_the_providers_own_arguments() -> None:
    made: list[dict] = []

    def server(**kwargs):
        made.append(kwargs)
        return object()

    c = bootstrap(Rd2hSettings(role="decode", kv_port=30000, tp_size=2, tp_rank=1,
                               host="10.0.0.7"), control_server=InPlaceOf(server))
    first, second = c.control_server(), c.control_server()
    assert first is not second  # still made per use, as the real provider is
    assert (made[0]["host"], made[0]["port"]) == ("10.0.0.7", 30001)
    with pytest.raises(ValueError, match="'transport' is not built from arguments"):
        bootstrap(Rd2hSettings(role="decode"), transport=InPlaceOf(server))


def test_group_batches_one_message_per_endpoint() -> None:
    r1 = ReadRequest("a", (1, 2), (3,), 0, 0)
    r2 = ReadRequest("b", (4,), (5,), 2, 1)
    out = group_batches(7, "model.layers.7.attn", [
        LayerTarget("tcp://x:1", r1, False, 1, 2),
        LayerTarget("tcp://x:1", r2, True, 1, 2),
        LayerTarget("tcp://y:2", None, True, 1, 2, ext_req_id="c"),
    ])
    assert set(out) == {"tcp://x:1", "tcp://y:2"}
    assert out["tcp://x:1"].read_reqs == (r1, r2)
    assert out["tcp://x:1"].done_ext_ids == ("b",)
    assert out["tcp://y:2"].read_reqs == () and out["tcp://y:2"].done_ext_ids == ("c",)
    assert (out["tcp://x:1"].group_member_idx, out["tcp://x:1"].tp_ratio) == (1, 2)
    with pytest.raises(ValueError, match="mixed"):
        group_batches(
            0, "l", [LayerTarget("e", r1, False, 0, 2), LayerTarget("e", r2, False, 1, 2)]
        )


# ---------------------------------------------------------------- in-memory pull


EP = "mem://d0"
BPB = {"k": 256, "v": 64, "idx": 32, "scale": 8}
NB = 16


@pytest.fixture
def pair():
    """P sender and D receiver sharing an in-memory wire and the inproc transport."""
    net = MemoryNetwork()
    p_engine, d_engine = InprocTransferEngine(), InprocTransferEngine()
    rng = np.random.default_rng(0)
    p_bufs = {c: rng.integers(0, 255, (NB, n), dtype=np.uint8) for c, n in BPB.items()}
    d_bufs = {c: np.zeros((NB, n), dtype=np.uint8) for c, n in BPB.items()}
    for a in p_bufs.values():
        p_engine.register_memory(a.ctypes.data, a.nbytes)
    for a in d_bufs.values():
        d_engine.register_memory(a.ctypes.data, a.nbytes)
    name = "model.layers.0.attn"

    def tc(c: str) -> TensorComponent:
        return TensorComponent(p_bufs[c].ctypes.data, BPB[c], 1)

    def dt(c: str) -> DestTensor:
        return DestTensor(d_bufs[c].ctypes.data, BPB[c], NB)

    src = SourceLayout(name, (tc("k"), tc("v")), tc("idx"), tc("scale"))
    dst = DestinationLayout(name, (dt("k"), dt("v")), dt("idx"), dt("scale"))
    receiver = bootstrap(
        Rd2hSettings(role="decode"), control_server=lambda: net.server(EP),
        transport=d_engine, logger=RecordingLogger(),
    ).decode_receiver(destinations={name: dst})
    sender = bootstrap(
        Rd2hSettings(role="prefill", deadlines=Deadlines(meta_ack_s=2, layer_ack_s=2)),
        control_clients=net.clients, logger=RecordingLogger(),
    ).prefill_sender(p_session=p_engine.session_id, layers={0: src})
    receiver.start()
    sender.start()
    yield sender, receiver, p_bufs, d_bufs
    sender.stop(2)
    receiver.stop(2)
    p_engine.close()
    d_engine.close()


def test_in_memory_pull_lands_bytes_and_completes(pair) -> None:
    sender, receiver, p_bufs, d_bufs = pair
    receiver.admit("req-a" + "X" * 9, [5, 6, 7], [8, 9, 10])
    req = ReadRequest("req-a", (0, 1, 2), (3, 4, 5), 0, 0)
    sender.submit(0, None, [LayerTarget(EP, req, True, 0, 1)])
    sender.wait_for_layer_send(0, timeout=5)
    for c in ("k", "v"):
        assert np.array_equal(d_bufs[c][[5, 6, 7]], p_bufs[c][[0, 1, 2]])
    for c in ("idx", "scale"):
        assert np.array_equal(d_bufs[c][[8, 9, 10]], p_bufs[c][[3, 4, 5]])
    out = receiver.step(InMemoryExchangeGroup(1).member(0), (), timeout=5)
    assert out.finished == {"req-a" + "X" * 9} and not out.failed
    assert all(v == 0 for k, v in receiver.counters().items() if k != "peers")
    assert all(v == 0 for v in sender.counters().values()), sender.counters()


def test_read_failure_is_reported_to_prefill_and_blocks_invalidated(pair) -> None:
    sender, receiver, _, _ = pair
    receiver.admit("req-b" + "X" * 9, [1], [2])
    req = ReadRequest("req-b", (0, 1), (0, 1), 0, 0)  # two blocks into one destination
    sender.submit(0, None, [LayerTarget(EP, req, True, 0, 1)])
    with pytest.raises(LayerSendError, match="do not fit"):
        sender.wait_for_layer_send(0, timeout=5)
    out = receiver.step(InMemoryExchangeGroup(1).member(0), (), timeout=5)
    assert out.failed == {"req-b" + "X" * 9}
    assert out.invalid_block_ids == {1, 2}


def test_unanswered_layer_fails_at_its_deadline() -> None:
    net = MemoryNetwork()
    silent = net.server("mem://silent")  # bound, but nobody ever answers
    src = SourceLayout("model.layers.0.attn", (TensorComponent(4096, 64, 1),))
    deadlines = Deadlines(meta_ack_s=0.2, layer_ack_s=0.2, device_event_s=0.2)
    sender = bootstrap(
        Rd2hSettings(role="prefill", deadlines=deadlines), control_clients=net.clients,
        logger=RecordingLogger(),
    ).prefill_sender(p_session="s", layers={0: src})
    sender.start()
    try:
        req = ReadRequest("r", (0,), (0,), 0, 0)
        sender.submit(0, None, [LayerTarget(silent.endpoint, req, True, 0, 1)])
        with pytest.raises(LayerSendError, match="MF_META"):
            sender.wait_for_layer_send(0, timeout=5)
        assert sender.counters()["pending_layers"] == 0
        assert len(silent.disconnected()) == 1  # Prefill dropped the failed connection
        _, frame = silent.recv(1.0)  # MF_META did go out: only its answer is missing
        assert MsgpackCodec().decode(frame).p_session == "s"
    finally:
        assert sender.stop(2)
    with pytest.raises(LayerSendError, match="stopped"):
        sender.submit(0, None, [LayerTarget(silent.endpoint, req, True, 0, 1)])


class ExplodingTransfer(InprocTransferEngine):
    """A transfer engine whose read fails with something other than TransferError."""

    def batch_read(self, session, local_addrs, remote_addrs, lengths) -> None:  # type: ignore[override]
        raise RuntimeError("driver fell over")


def test_any_read_failure_is_answered_for_its_layer_and_the_loop_goes_on() -> None:
    net = MemoryNetwork()
    codec = MsgpackCodec()
    dst = np.zeros((NB, 64), dtype=np.uint8)
    name = "model.layers.0.attn"
    engine = ExplodingTransfer()
    engine.register_memory(dst.ctypes.data, dst.nbytes)
    receiver = bootstrap(
        Rd2hSettings(role="decode"), control_server=lambda: net.server(EP), codec=codec,
        transport=engine, logger=RecordingLogger(),
    ).decode_receiver(
        destinations={name: DestinationLayout(name, (DestTensor(dst.ctypes.data, 64, NB),))})
    receiver.start()
    prefill = net.clients()
    try:
        prefill.connect(EP)
        src = SourceLayout(name, (TensorComponent(0x10000, 64, num_blocks=NB),))
        receiver.admit("r" + "X" * 9, [1], [])
        prefill.send(EP, codec.encode(MfMeta("p", {name: src.to_metadata()})))
        batch = ReadReadyBatch(0, name, (ReadRequest("r", (2,), (), 0, 0),), ("r",))
        replies: list[bytes] = []
        for frame in (None, codec.encode(batch)):
            if frame is not None:
                prefill.send(EP, frame)
            deadline = time.monotonic() + 5
            while len(replies) < (1 if frame is None else 2) and time.monotonic() < deadline:
                replies += [p for _, p in prefill.poll(0.05)]
        assert codec.decode(replies[0]) == MetaAck()
        failed = codec.decode(replies[1])
        assert failed == ReadFailed(0, "read failed: RuntimeError: driver fell over")
        assert receiver.running and receiver.stats.reads_failed == 1
        out = receiver.step(InMemoryExchangeGroup(1).member(0), (), timeout=5)
        assert out.failed == {"r" + "X" * 9}
    finally:
        assert receiver.stop(2)
        engine.close()
