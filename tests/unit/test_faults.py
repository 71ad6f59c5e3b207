"""``rd2h demo --fault``: parsing and validation up front, and the decorators that make
real components fail (no sockets, no sleeps: fakes and an injected sleep)."""

from __future__ import annotations

import numpy as np
import pytest

from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.demo.config import DemoConfig
from rd2h.demo.faults import (
    DroppingServer,
    DyingServer,
    Fault,
    FaultSpecError,
    FlakyTransfer,
    SlowTransfer,
    decode_server,
    decode_transfer,
    may_die,
    parse_fault,
    prefill_kill_layer,
)
from rd2h.domain.errors import TransferError
from rd2h.domain.wire.protocol import ACK, MfMeta, ReadDone, ReadFailed, ReadReadyBatch

CODEC = MsgpackCodec()


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        ("kill-prefill@layer=0", Fault("kill-prefill", layer=0)),
        ("kill-decode@layer=3,rank=1", Fault("kill-decode", layer=3, rank=1)),
        ("read-error@rate=0.25", Fault("read-error", rate=0.25)),
        ("read-error@rate=1", Fault("read-error", rate=1.0)),
        ("drop-ack@layer=2", Fault("drop-ack", layer=2)),
        ("slow-decode@ms=50", Fault("slow-decode", ms=50.0)),
        (" slow-decode@ rank = 0 , ms = 2.5 ", Fault("slow-decode", ms=2.5, rank=0)),
    ],
)
def test_parse_fault_accepts_every_kind(spec: str, fault: Fault) -> None:
    assert parse_fault(spec) == fault
    assert parse_fault(str(fault)) == fault  # str() is a valid spec again


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("explode@layer=1", "unknown fault 'explode'; expected one of kill-prefill"),
        ("kill-prefill", "missing parameters; write kill-prefill@layer=..."),
        ("kill-prefill@", "missing parameters"),
        ("kill-prefill@layer", "'layer' is not key=value"),
        ("kill-prefill@layer=", "is not key=value"),
        ("kill-prefill@rank=1", "kill-prefill needs layer=..."),
        ("kill-prefill@layer=one", "layer must be an integer, got 'one'"),
        ("kill-decode@layer=-2", "layer must be >= 0, got -2"),
        ("drop-ack@layer=1.5", "layer must be an integer"),
        ("drop-ack@layer=1,layer=2", "layer given twice"),
        ("drop-ack@ms=3", "drop-ack takes layer, rank, not 'ms'"),
        ("read-error@rate=0", "rate must be in (0, 1], got 0"),
        ("read-error@rate=1.5", "rate must be in (0, 1]"),
        ("read-error@rate=inf", "rate must be finite"),
        ("read-error@rate=x", "rate must be a number, got 'x'"),
        ("slow-decode@ms=0", "ms must be > 0"),
        ("slow-decode@ms=5,rank=r", "rank must be an integer"),
    ],
)
def test_parse_fault_rejects_bad_specs_clearly(spec: str, message: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        parse_fault(spec)
    assert message in str(info.value)
    assert str(info.value).startswith(f"--fault {spec!r}")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("kill-prefill@layer=4", "layer 4 does not exist (--layers 4)"),
        ("drop-ack@layer=9", "layer 9 does not exist"),
        ("kill-decode@layer=1,rank=1", "decode rank 1 does not exist (--decode-tp 1)"),
        ("kill-prefill@layer=1,rank=2", "prefill rank 2 does not exist (--prefill-tp 2)"),
    ],
)
def test_demo_config_checks_faults_against_the_run(spec: str, message: str) -> None:
    cfg = DemoConfig(prefill_tp=2, decode_tp=1, layers=4, faults=(parse_fault(spec),))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cfg.validate()


@pytest.mark.parametrize("flag", ["request_timeout_s", "layer_ack_timeout_s",
                                  "meta_ack_timeout_s", "exchange_timeout_s"])
def test_demo_deadline_overrides_are_validated_and_applied(flag: str) -> None:
    with pytest.raises(ValueError, match="must be > 0 seconds"):
        DemoConfig(**{flag: 0.0}).validate()
    cfg = DemoConfig(**{flag: 1.5})
    cfg.validate()
    applied = cfg.deadlines().model_dump()
    assert sorted(k for k, v in applied.items() if v == 1.5) == [
        {"request_timeout_s": "request_s", "layer_ack_timeout_s": "layer_ack_s",
         "meta_ack_timeout_s": "meta_ack_s", "exchange_timeout_s": "tp_exchange_s"}[flag]
    ]


def test_which_rank_a_fault_hits() -> None:
    kill_p = parse_fault("kill-prefill@layer=1")
    kill_d1 = parse_fault("kill-decode@layer=1,rank=1")
    slow = parse_fault("slow-decode@ms=1")
    assert kill_p.hits("prefill", 0) and not kill_p.hits("prefill", 1)
    assert not kill_p.hits("decode", 0)
    assert kill_d1.hits("decode", 1) and not kill_d1.hits("decode", 0)
    assert slow.hits("decode", 0) and slow.hits("decode", 3) and not slow.hits("prefill", 0)
    faults = (kill_p, parse_fault("kill-prefill@layer=0"), kill_d1)
    assert prefill_kill_layer(faults, 0) == 0 and prefill_kill_layer(faults, 1) is None
    assert may_die(faults, "decode", 1) and not may_die(faults, "decode", 0)


# ---------------------------------------------------------------- decorators


class RecordingTransfer:
    session_id = "peer"

    def __init__(self) -> None:
        self.reads = 0
        self.closed = False

    def register_memory(self, addr: int, size: int) -> None:
        pass

    def batch_read(self, session: str, local_addrs: np.ndarray, remote_addrs: np.ndarray,
                   lengths: np.ndarray) -> None:
        self.reads += 1

    def close(self) -> None:
        self.closed = True


EMPTY = np.zeros(0, dtype=np.uint64)


def test_flaky_transfer_fails_the_requested_fraction_repeatably() -> None:
    def run(seed: int) -> list[bool]:
        flaky = FlakyTransfer(RecordingTransfer(), 0.3, seed=seed)
        out = []
        for _ in range(2000):
            try:
                flaky.batch_read("peer", EMPTY, EMPTY, EMPTY)
                out.append(True)
            except TransferError as exc:
                assert "injected read error (read-error@rate=0.3)" in str(exc)
                out.append(False)
        assert flaky.injected == out.count(False)
        return out

    first = run(7)
    assert first == run(7)  # seeded
    assert 0.25 < first.count(False) / len(first) < 0.35
    always = FlakyTransfer(RecordingTransfer(), 1.0)
    for _ in range(20):
        with pytest.raises(TransferError):
            always.batch_read("peer", EMPTY, EMPTY, EMPTY)


def test_slow_transfer_waits_before_every_read_then_reads() -> None:
    inner, slept = RecordingTransfer(), []
    slow = SlowTransfer(inner, 0.25, sleep=slept.append)
    for _ in range(3):
        slow.batch_read("peer", EMPTY, EMPTY, EMPTY)
    assert slept == [0.25] * 3 and inner.reads == 3
    assert slow.session_id == "peer"
    slow.close()
    assert inner.closed


def test_decode_transfer_stacks_only_this_ranks_faults() -> None:
    inner = RecordingTransfer()
    faults = (parse_fault("read-error@rate=1,rank=1"), parse_fault("slow-decode@ms=5"))
    assert isinstance(decode_transfer(faults, 0, inner, seed=0), SlowTransfer)
    both = decode_transfer(faults, 1, inner, seed=0)
    with pytest.raises(TransferError):
        both.batch_read("peer", EMPTY, EMPTY, EMPTY)
    assert decode_transfer((), 0, inner, seed=0) is inner


class RecordingServer:
    endpoint = "mem://d0"

    def __init__(self, inbound: list[tuple[bytes, bytes]] | None = None) -> None:
        self.inbound = list(inbound or [])
        self.sent: list[tuple[bytes, bytes]] = []

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        return self.inbound.pop(0) if self.inbound else None

    def send(self, identity: bytes, payload: bytes) -> bool:
        self.sent.append((identity, payload))
        return True

    def disconnected(self) -> list[bytes]:
        return [b"gone"]

    def close(self) -> None:
        pass


def test_dropping_server_drops_only_the_replies_for_its_layer() -> None:
    inner = RecordingServer()
    server = DroppingServer(inner, CODEC, layer=2)
    frames = [ACK, CODEC.encode(ReadDone(1)), CODEC.encode(ReadDone(2)),
              CODEC.encode(ReadFailed(2, "x")), CODEC.encode(ReadFailed(3, "y"))]
    for frame in frames:
        assert server.send(b"p", frame) is True  # dropped replies look delivered
    assert [p for _, p in inner.sent] == [frames[0], frames[1], frames[4]]
    assert server.dropped == 2
    assert server.disconnected() == [b"gone"] and server.endpoint == "mem://d0"


def test_dying_server_dies_when_its_layer_arrives() -> None:
    deaths = []
    meta = CODEC.encode(MfMeta("s", {}))
    ready = [CODEC.encode(ReadReadyBatch(n, f"model.layers.{n}.attn", (), ())) for n in (0, 1)]
    inner = RecordingServer([(b"p", meta), (b"p", ready[0]), (b"p", ready[1])])
    server = DyingServer(inner, CODEC, layer=1, die=lambda: deaths.append(True))
    assert server.recv(0) == (b"p", meta) and not deaths
    assert server.recv(0) == (b"p", ready[0]) and not deaths
    server.recv(0)
    assert deaths == [True]


def test_decode_server_wraps_per_rank() -> None:
    faults = (parse_fault("drop-ack@layer=1"), parse_fault("kill-decode@layer=0,rank=1"))
    inner = RecordingServer()
    assert isinstance(decode_server(faults, 0, inner, CODEC, lambda: None), DroppingServer)
    outer = decode_server(faults, 1, inner, CODEC, lambda: None)
    assert isinstance(outer, DyingServer)
    assert decode_server((), 0, inner, CODEC, lambda: None) is inner
