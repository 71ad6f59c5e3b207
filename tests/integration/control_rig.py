"""A small real-socket rig for control-plane tests (hostile input, authentication, ports).

Prefill source tensors and Decode destination tensors are numpy arrays registered with
``inproc`` engines. Every Decode destination tensor sits between two guard regions that
are registered with the engine too, so only rd2h's own bounds checks (not the
transport's region table) keep writes out of them. Not a test module (no ``test_``
prefix): the test modules import it (``tests/integration`` is on ``sys.path``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.adapters.zmq.channel import BindError, ZmqControlClients, ZmqControlServer
from rd2h.app.clock import MonotonicClock
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.domain.completion import StepOutcome
from rd2h.domain.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.protocol import MfMeta, ReadRequest
from rd2h.ports.codec import WireCodec

HOST = "127.0.0.1"
SUFFIX = "-e0000001"  # vLLM's 9-character engine suffix
SENTINEL = 0xEE  # every destination and guard byte before any pull
WAIT = 5.0  # upper bound of any single wait
P_BLOCKS = 8
D_BLOCKS = 16
GUARD = 2  # guard blocks before and after every destination tensor
# bytes per block of each component (main K, main V, indexer, LIC8 scale)
COMPONENTS = {"main_k": 96, "main_v": 32, "indexer": 16, "scale": 8}

Bufs = dict[tuple[int, str], np.ndarray]


def internal(ext: str) -> str:
    return ext + SUFFIX


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until(cond: Callable[[], bool], what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.002)


class RecordingLogger:
    """A structlog-like logger that keeps every line (thread-safe appends)."""

    def __init__(
        self, records: list[tuple[str, str, dict[str, Any]]] | None = None, **context: Any
    ) -> None:
        self.records = [] if records is None else records
        self._context = context

    def bind(self, **context: Any) -> RecordingLogger:
        return RecordingLogger(self.records, **{**self._context, **context})

    def _log(self, level: str, event: str, **kw: Any) -> None:
        self.records.append((level, event, {**self._context, **kw}))

    def debug(self, event: str, **kw: Any) -> None:
        self._log("debug", event, **kw)

    def info(self, event: str, **kw: Any) -> None:
        self._log("info", event, **kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._log("warning", event, **kw)

    def error(self, event: str, **kw: Any) -> None:
        self._log("error", event, **kw)

    def events(self, level: str | None = None) -> list[str]:
        return [e for lv, e, _ in list(self.records) if level is None or lv == level]

    def lines(self, level: str | None = None) -> list[str]:
        return [
            f"{e} {kw}" for lv, e, kw in list(self.records) if level is None or lv == level
        ]


# ====================================================================== Prefill


@dataclass
class PrefillSide:
    engine: InprocTransferEngine
    bufs: Bufs
    layouts: dict[int, SourceLayout]

    @property
    def session(self) -> str:
        return self.engine.session_id

    def meta(self) -> MfMeta:
        return MfMeta(
            self.session, {lay.layer_name: lay.to_metadata() for lay in self.layouts.values()}
        )


def make_prefill(layers: Iterable[int], *, seed: int = 0, advertise: bool = True) -> PrefillSide:
    """Seeded random source blocks per layer and component, registered exactly (no more).

    ``advertise`` puts each tensor's block count in MF_META (``num_blocks``)."""
    engine = InprocTransferEngine()
    rng = np.random.default_rng(seed)
    bufs: Bufs = {}
    layouts: dict[int, SourceLayout] = {}
    for layer in layers:
        tensors = {}
        for comp, nbytes in COMPONENTS.items():
            arr = rng.integers(0, 256, (P_BLOCKS, nbytes), dtype=np.uint8)
            engine.register_memory(arr.ctypes.data, arr.nbytes)
            bufs[(layer, comp)] = arr
            tensors[comp] = TensorComponent(
                arr.ctypes.data, nbytes, num_blocks=P_BLOCKS if advertise else None
            )
        layouts[layer] = SourceLayout(
            layer_name(layer), (tensors["main_k"], tensors["main_v"]), tensors["indexer"],
            tensors["scale"],
        )
    return PrefillSide(engine, bufs, layouts)


def start_sender(
    p: PrefillSide, codec: WireCodec, log: RecordingLogger | None = None, **timeouts: float
) -> PrefillSender:
    sender = PrefillSender(
        clients_factory=ZmqControlClients,
        codec=codec,
        p_session=p.session,
        layers=p.layouts,
        clock=MonotonicClock(),
        log=log or RecordingLogger(role="prefill"),
        meta_ack_timeout_s=timeouts.get("meta_ack_timeout_s", WAIT),
        layer_ack_timeout_s=timeouts.get("layer_ack_timeout_s", WAIT),
        event_timeout_s=WAIT,
        poll_interval_s=0.005,
    )
    sender.start()
    return sender


# ====================================================================== Decode


@dataclass
class DecodeSide:
    engine: InprocTransferEngine
    whole: Bufs  # guard + destination + guard, per (layer, component)
    destinations: dict[str, DestinationLayout]
    receiver: DecodeReceiver
    endpoint: str
    log: RecordingLogger
    keep: list[Any] = field(default_factory=list)

    def rows(self, layer: int, comp: str) -> np.ndarray:
        """The destination blocks of one tensor (a view, guards excluded)."""
        return self.whole[(layer, comp)][GUARD : GUARD + D_BLOCKS]

    def stop(self) -> None:
        assert self.receiver.stop(2.0), "decode receiver did not stop"
        self.engine.close()


def decode_memory(
    layers: Iterable[int], engine: InprocTransferEngine
) -> tuple[Bufs, dict[str, DestinationLayout]]:
    whole: Bufs = {}
    dests: dict[str, DestinationLayout] = {}
    for layer in layers:
        tensors = {}
        for comp, nbytes in COMPONENTS.items():
            arr = np.full((D_BLOCKS + 2 * GUARD, nbytes), SENTINEL, dtype=np.uint8)
            engine.register_memory(arr.ctypes.data, arr.nbytes)  # guards included
            whole[(layer, comp)] = arr
            tensors[comp] = DestTensor(arr.ctypes.data + GUARD * nbytes, nbytes, D_BLOCKS)
        dests[layer_name(layer)] = DestinationLayout(
            layer_name(layer), (tensors["main_k"], tensors["main_v"]), tensors["indexer"],
            tensors["scale"],
        )
    return whole, dests


def start_decode(
    layers: Iterable[int],
    codec: WireCodec,
    *,
    max_frame_bytes: int = 64 * 1024 * 1024,
    request_timeout_s: float = 600.0,
    engine: InprocTransferEngine | None = None,
) -> DecodeSide:
    layers = list(layers)
    engine = engine or InprocTransferEngine()
    whole, dests = decode_memory(layers, engine)
    log = RecordingLogger(role="decode")
    for _ in range(20):  # a free port can be taken between probing and binding
        port = free_port()
        receiver = DecodeReceiver(
            server_factory=lambda port=port: ZmqControlServer(
                HOST, port, max_frame_bytes=max_frame_bytes
            ),
            codec=codec,
            transfer=engine,
            destinations=dests,
            d_rank=0,
            d_tp=1,
            clock=MonotonicClock(),
            log=log,
            request_timeout_s=request_timeout_s,
            poll_interval_s=0.01,
        )
        try:
            endpoint = receiver.start()
        except BindError:
            continue
        return DecodeSide(engine, whole, dests, receiver, endpoint, log)
    raise RuntimeError("no free port for the decode receiver")


def step(receiver: DecodeReceiver) -> StepOutcome:
    return receiver.step(InMemoryExchangeGroup(1).member(0), (), WAIT)


# ====================================================================== requests


@dataclass(frozen=True)
class Transfer:
    """One request: Prefill block ids, Decode destination ids (main and indexer)."""

    ext: str
    p_main: tuple[int, ...]
    p_idx: tuple[int, ...]
    d_main: tuple[int, ...]
    d_idx: tuple[int, ...]

    def read(self, start: int, end: int) -> ReadRequest:
        return ReadRequest(self.ext, self.p_main[start:end], self.p_idx[start:end], start, start)


def targets(
    endpoint: str, reads: Sequence[ReadRequest], done: Sequence[str] = ()
) -> list[LayerTarget]:
    out = [LayerTarget(endpoint, r, r.ext_req_id in done, 0, 1, r.ext_req_id) for r in reads]
    named = {t.ext_req_id for t in out}
    out += [LayerTarget(endpoint, None, True, 0, 1, e) for e in done if e not in named]
    return out


def run_transfer(
    p: PrefillSide,
    d: DecodeSide,
    sender: PrefillSender,
    t: Transfer,
    chunks: Sequence[tuple[int, int]],
    between: Callable[[], None] = lambda: None,
) -> StepOutcome:
    """Admit ``t`` on Decode, announce every layer of every chunk through ``sender``
    (calling ``between`` before each announcement) and step until it ends."""
    d.receiver.admit(internal(t.ext), t.d_main, t.d_idx)
    layers = sorted(p.layouts)
    for ci, (lo, hi) in enumerate(chunks):
        final = ci == len(chunks) - 1
        for layer in layers:
            between()
            done = [t.ext] if final and layer == layers[-1] else []
            reads = [t.read(lo, hi)] if hi > lo else []
            sender.submit(layer, None, targets(d.endpoint, reads, done))
        for layer in layers:
            sender.wait_for_layer_send(layer, WAIT)
    outcomes: list[StepOutcome] = []

    def ended() -> bool:
        outcomes.append(step(d.receiver))
        return internal(t.ext) in outcomes[-1].finished

    wait_until(ended, f"request {t.ext} to finish")
    return outcomes[-1]


def assert_landed(p: PrefillSide, d: DecodeSide, t: Transfer) -> None:
    for layer in p.layouts:
        for comp in COMPONENTS:
            main = comp.startswith("main")
            src = p.bufs[(layer, comp)][list(t.p_main if main else t.p_idx)]
            dst = d.rows(layer, comp)[list(t.d_main if main else t.d_idx)]
            np.testing.assert_array_equal(dst, src, err_msg=f"layer {layer} {comp} of {t.ext}")


def assert_untouched(d: DecodeSide, writable: Mapping[str, Iterable[int]]) -> None:
    """Guards hold SENTINEL, and so does every destination block outside ``writable``
    (``{"main": ids, "indexer": ids}``)."""
    for (layer, comp), arr in d.whole.items():
        assert (arr[:GUARD] == SENTINEL).all(), f"guard before {layer}/{comp} was written"
        assert (arr[GUARD + D_BLOCKS :] == SENTINEL).all(), f"guard after {layer}/{comp}"
        rows = d.rows(layer, comp)
        mask = np.ones(D_BLOCKS, dtype=bool)
        mask[list(writable["main" if comp.startswith("main") else "indexer"])] = False
        bad = np.flatnonzero((rows[mask] != SENTINEL).any(axis=1))
        assert bad.size == 0, f"destination blocks outside the allowed ones changed: {layer}/{comp}"


def reset_blocks(d: DecodeSide, t: Transfer) -> None:
    for (layer, comp) in d.whole:
        d.rows(layer, comp)[list(t.d_main if comp.startswith("main") else t.d_idx)] = SENTINEL


def recv_frames(sock: Any, timeout: float = WAIT) -> list[bytes]:
    """Next multipart message on a raw socket, empty frames dropped."""
    if not sock.poll(int(timeout * 1000)):
        raise AssertionError(f"no message within {timeout:g} s")
    return [f for f in sock.recv_multipart() if f]
