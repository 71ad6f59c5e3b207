"""The one control-plane rig: Prefill senders and Decode receivers over real ZeroMQ
sockets on loopback, with the ``inproc`` transport copying real numpy memory.

Prefill source tensors are seeded random blocks; every Decode destination tensor
sits between two guard regions registered with the engine too, so only rd2h's own
bounds checks (not the transport's region table) keep writes out of them. ``Rig``
tracks everything a test builds and closes it in reverse order; the functions below
it build the same pieces for tests that manage their own lifetimes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from fakes.logs import RecordingLogger
from fakes.net import HOST, free_port, wait_until
from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.adapters.zmq.channel import BindError, ZmqControlClients, ZmqControlServer
from rd2h.app.clock import MonotonicClock
from rd2h.app.container import build_container
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.app.settings import Rd2hSettings
from rd2h.domain.compat import Compat
from rd2h.domain.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.protocol import ACK, Message, MfMeta, ReadRequest
from rd2h.domain.request_book import StepOutcome
from rd2h.domain.topology import tcp_endpoint
from rd2h.ports.codec import WireCodec

SUFFIX = "-e0000001"  # vLLM's 9-character engine suffix
SENTINEL = 0xEE  # every destination and guard byte before any pull
WAIT = 5.0  # upper bound of any single wait; the happy paths take milliseconds
P_BLOCKS = 8
D_BLOCKS = 16
GUARD = 2  # guard blocks before and after every destination tensor
COMPONENTS = ("main_k", "main_v", "indexer", "scale")
PLAIN = MsgpackCodec()

Bufs = dict[tuple[int, str], np.ndarray]


def internal(ext: str) -> str:
    return ext + SUFFIX


def layer_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn"


@dataclass(frozen=True)
class Shape:
    """Bytes of one block of each component of a layer (None: component absent)."""

    main_k: int = 96
    main_v: int = 32
    indexer: int | None = 16
    scale: int | None = 8

    def sizes(self) -> dict[str, int]:
        values = (self.main_k, self.main_v, self.indexer, self.scale)
        return {c: n for c, n in zip(COMPONENTS, values) if n}


FULL = Shape()
MAIN_ONLY = Shape(indexer=None, scale=None)


def shapes_of(layers: Iterable[int] | Mapping[int, Shape]) -> dict[int, Shape]:
    return dict(layers) if isinstance(layers, Mapping) else dict.fromkeys(layers, FULL)


# ====================================================================== the two sides


@dataclass
class PSide:
    """One Prefill rank: its engine, its patterned source memory, its sender."""

    engine: InprocTransferEngine
    bufs: Bufs
    layouts: dict[int, SourceLayout]
    sender: PrefillSender | None = None

    @property
    def session(self) -> str:
        return self.engine.session_id

    def meta(self) -> MfMeta:
        return MfMeta(self.session,
                      {lay.layer_name: lay.to_metadata() for lay in self.layouts.values()})


@dataclass
class DSide:
    """One Decode rank: engine, guarded destination memory (SENTINEL), receiver."""

    engine: InprocTransferEngine
    whole: Bufs  # guard + destination + guard, per (layer, component)
    bufs: Bufs  # the destination blocks only (views into ``whole``)
    destinations: dict[str, DestinationLayout]
    receiver: DecodeReceiver
    endpoint: str
    log: RecordingLogger = field(default_factory=RecordingLogger)

    def rows(self, layer: int, comp: str) -> np.ndarray:
        return self.bufs[(layer, comp)]

    def snapshot(self) -> Bufs:
        return {k: v.copy() for k, v in self.bufs.items()}

    def stop(self) -> None:
        assert self.receiver.stop(2.0), "decode receiver did not stop"
        self.engine.close()


def prefill_memory(
    layers: Iterable[int] | Mapping[int, Shape], engine: InprocTransferEngine, *,
    seed: int = 0, share: Mapping[int, int] | None = None, advertise: bool = True,
) -> PSide:
    """Seeded random source blocks per layer and component, registered exactly.
    ``share`` maps a layer to an earlier layer whose physical storage it reuses;
    ``advertise`` puts each tensor's block count in MF_META (``num_blocks``)."""
    shapes, share = shapes_of(layers), dict(share or {})
    rng = np.random.default_rng(seed)
    bufs: Bufs = {}
    for layer, shape in shapes.items():
        owner = share.get(layer, layer)
        for comp, nbytes in shape.sizes().items():
            if owner != layer:
                bufs[(layer, comp)] = bufs[(owner, comp)]
                continue
            arr = rng.integers(0, 256, (P_BLOCKS, nbytes), dtype=np.uint8)
            engine.register_memory(arr.ctypes.data, arr.nbytes)
            bufs[(layer, comp)] = arr

    def tc(layer: int, comp: str) -> TensorComponent:
        arr = bufs[(layer, comp)]
        return TensorComponent(arr.ctypes.data, arr.shape[1],
                               num_blocks=P_BLOCKS if advertise else None)

    layouts = {
        layer: SourceLayout(
            layer_name(layer), (tc(layer, "main_k"), tc(layer, "main_v")),
            tc(layer, "indexer") if shape.indexer else None,
            tc(layer, "scale") if shape.scale else None,
        )
        for layer, shape in shapes.items()
    }
    return PSide(engine, bufs, layouts)


def decode_memory(
    layers: Iterable[int] | Mapping[int, Shape], engine: InprocTransferEngine,
    shared_main: Bufs | None = None,
) -> tuple[Bufs, Bufs, dict[str, DestinationLayout]]:
    """``(whole, bufs, destinations)``; main tensors from ``shared_main`` (the TP-shared
    pool of another rank) when given."""
    shapes = shapes_of(layers)
    whole: Bufs = {}
    bufs: Bufs = {}
    for layer, shape in shapes.items():
        for comp, nbytes in shape.sizes().items():
            if shared_main is not None and comp.startswith("main"):
                bufs[(layer, comp)] = shared_main[(layer, comp)]
                engine.register_memory(bufs[(layer, comp)].ctypes.data,
                                       bufs[(layer, comp)].nbytes)
                continue
            arr = np.full((D_BLOCKS + 2 * GUARD, nbytes), SENTINEL, dtype=np.uint8)
            engine.register_memory(arr.ctypes.data, arr.nbytes)  # guards included
            whole[(layer, comp)] = arr
            bufs[(layer, comp)] = arr[GUARD : GUARD + D_BLOCKS]

    def dt(layer: int, comp: str) -> DestTensor:
        arr = bufs[(layer, comp)]
        return DestTensor(arr.ctypes.data, arr.shape[1], D_BLOCKS)

    dests = {
        layer_name(layer): DestinationLayout(
            layer_name(layer), (dt(layer, "main_k"), dt(layer, "main_v")),
            dt(layer, "indexer") if shape.indexer else None,
            dt(layer, "scale") if shape.scale else None,
        )
        for layer, shape in shapes.items()
    }
    return whole, bufs, dests


def start_sender(
    p: PSide, codec: WireCodec = PLAIN, log: RecordingLogger | None = None, *,
    layouts: Mapping[int, SourceLayout] | None = None, compat: Compat | None = None,
    **timeouts: float,
) -> PrefillSender:
    sender = PrefillSender(
        clients_factory=ZmqControlClients, codec=codec, p_session=p.session,
        layers=dict(layouts or p.layouts), clock=MonotonicClock(),
        log=log or RecordingLogger(role="prefill"),
        meta_ack_timeout_s=timeouts.get("meta_ack_timeout_s", WAIT),
        layer_ack_timeout_s=timeouts.get("layer_ack_timeout_s", WAIT),
        event_timeout_s=timeouts.get("event_timeout_s", WAIT),
        compat=compat,
    )
    sender.start()
    p.sender = sender
    return sender


def start_decode(
    layers: Iterable[int] | Mapping[int, Shape], codec: WireCodec = PLAIN, *,
    engine: InprocTransferEngine | None = None, d_rank: int = 0, d_tp: int = 1,
    shared_main: Bufs | None = None, request_timeout_s: float = 600.0,
    max_frame_bytes: int = 64 * 1024 * 1024, **receiver_kw: Any,
) -> DSide:
    engine = engine or InprocTransferEngine()
    whole, bufs, dests = decode_memory(layers, engine, shared_main)
    log = RecordingLogger(role="decode", rank=d_rank)
    for _ in range(20):  # a free port can be taken between probing and binding
        port = free_port()
        receiver = DecodeReceiver(
            server_factory=lambda port=port: ZmqControlServer(
                HOST, port, max_frame_bytes=max_frame_bytes),
            codec=codec, transfer=engine, destinations=dests, d_rank=d_rank, d_tp=d_tp,
            clock=MonotonicClock(), log=log, request_timeout_s=request_timeout_s,
            **receiver_kw,
        )
        try:
            endpoint = receiver.start()
        except BindError:
            continue
        return DSide(engine, whole, bufs, dests, receiver, endpoint, log)
    raise RuntimeError("no free port for the decode receiver")


class Rig:
    """Builds and tracks every engine, receiver, sender and raw socket of a test;
    ``close`` (fixture teardown) stops and closes them in reverse order."""

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self._finalizers: list[Callable[[], Any]] = []
        self.keep: list[Any] = []  # memory that must outlive every read

    def close(self) -> None:
        problems = []
        for fn in reversed(self._finalizers):
            try:
                if fn() is False:
                    problems.append(f"{fn!r} did not finish")
            except Exception as exc:
                problems.append(repr(exc))
        self._finalizers.clear()
        self.keep.clear()
        assert not problems, problems

    def on_close(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` at teardown (a ``False`` result counts as "did not finish")."""
        self._finalizers.append(fn)

    def engine(self) -> InprocTransferEngine:
        engine = InprocTransferEngine()
        self._finalizers.append(engine.close)
        return engine

    # ------------------------------------------------------------ Prefill
    def prefill_memory(self, layers: Iterable[int] | Mapping[int, Shape], *, seed: int = 0,
                       share: Mapping[int, int] | None = None,
                       engine: InprocTransferEngine | None = None,
                       advertise: bool = False) -> PSide:
        p = prefill_memory(layers, engine or self.engine(), seed=seed, share=share,
                           advertise=advertise)
        self.keep.append(p.bufs)
        return p

    def start_sender(self, p: PSide, codec: WireCodec = PLAIN, **kw: Any) -> PrefillSender:
        sender = start_sender(p, codec, **kw)
        self._finalizers.append(lambda: sender.stop(2.0))
        return sender

    def prefill(self, layers: Iterable[int] | Mapping[int, Shape], *,
                codec: WireCodec = PLAIN, **kw: Any) -> PSide:
        timeouts = {k: kw.pop(k) for k in list(kw) if k.endswith("_timeout_s")}
        p = self.prefill_memory(layers, **kw)
        self.start_sender(p, codec, **timeouts)
        return p

    def prefill_via_container(self, layers: Mapping[int, Shape], *, seed: int = 0) -> PSide:
        container = build_container(Rd2hSettings(role="prefill", transport="inproc"))
        engine = container.transport()
        assert isinstance(engine, InprocTransferEngine)
        self._finalizers.append(engine.close)
        p = self.prefill_memory(layers, seed=seed, engine=engine)
        p.sender = container.prefill_sender(p_session=engine.session_id, layers=p.layouts)
        p.sender.start()
        self._finalizers.append(lambda: p.sender.stop(2.0))
        return p

    # ------------------------------------------------------------ Decode
    def decode(self, layers: Iterable[int] | Mapping[int, Shape],
               codec: WireCodec = PLAIN, **kw: Any) -> DSide:
        d = start_decode(layers, codec, engine=self.engine(), **kw)
        self.keep.append(d.whole)
        self._finalizers.append(lambda: d.receiver.stop(2.0))
        return d

    def decode_via_container(self, layers: Mapping[int, Shape]) -> DSide:
        for _ in range(20):
            port = free_port()
            container = build_container(
                Rd2hSettings(role="decode", transport="inproc", host=HOST, kv_port=port)
            )
            engine = container.transport()
            whole, bufs, dests = decode_memory(layers, engine)
            receiver = container.decode_receiver(destinations=dests)
            try:
                endpoint = receiver.start()
            except BindError:
                engine.close()
                continue
            assert endpoint == tcp_endpoint(HOST, port)
            self.keep.append(whole)
            self._finalizers.append(engine.close)
            self._finalizers.append(lambda r=receiver: r.stop(2.0))
            return DSide(engine, whole, bufs, dests, receiver, endpoint)
        raise RuntimeError("no free port for the decode receiver")

    # ------------------------------------------------------------ raw sockets
    def dealer(self, endpoint: str) -> zmq.Socket:
        """A raw DEALER: a hand-driven Prefill connection."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        self._finalizers.append(lambda: sock.close(0))
        return sock

    def router(self) -> tuple[zmq.Socket, str]:
        """A raw ROUTER: a Decode endpoint that answers only what the test tells it to."""
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{HOST}")
        self._finalizers.append(lambda: sock.close(0))
        return sock, tcp_endpoint(HOST, port)


# ====================================================================== wire helpers


def recv_frame(sock: zmq.Socket, timeout: float = WAIT) -> list[bytes]:
    """The next multipart message on a raw socket, as it came."""
    if not sock.poll(int(timeout * 1000), zmq.POLLIN):
        raise AssertionError(f"no message within {timeout:g} s")
    return sock.recv_multipart(zmq.NOBLOCK)


def recv_frames(sock: zmq.Socket, timeout: float = WAIT) -> list[bytes]:
    """The next multipart message on a raw socket, empty frames dropped."""
    return [f for f in recv_frame(sock, timeout) if f]


def recv_reply(dealer: zmq.Socket, codec: WireCodec = PLAIN,
               timeout: float = WAIT) -> bytes | Message:
    """Decode's next reply on a raw DEALER: b"ACK" raw, anything else decoded."""
    frames = recv_frames(dealer, timeout)
    assert len(frames) == 1, frames
    return frames[0] if frames[0] == ACK else codec.decode(frames[0])


def targets(endpoint: str, reads: Iterable[ReadRequest] = (), done: Iterable[str] = (),
            member: int = 0, ratio: int = 1) -> list[LayerTarget]:
    done = list(done)
    out = [LayerTarget(endpoint, r, r.ext_req_id in done, member, ratio, r.ext_req_id)
           for r in reads]
    named = {t.ext_req_id for t in out}
    out += [LayerTarget(endpoint, None, True, member, ratio, e) for e in done if e not in named]
    return out


def step_all(receivers: Sequence[DecodeReceiver],
             finished_by_vllm: Iterable[str] = ()) -> list[StepOutcome]:
    """One worker step on every Decode rank at once (a real all-gather among threads)."""
    group = InMemoryExchangeGroup(len(receivers))
    finished_by_vllm = tuple(finished_by_vllm)
    with ThreadPoolExecutor(len(receivers)) as pool:
        futures = [pool.submit(r.step, group.member(i), finished_by_vllm, WAIT)
                   for i, r in enumerate(receivers)]
        return [f.result(timeout=2 * WAIT) for f in futures]


def step(receiver: DecodeReceiver, finished_by_vllm: Iterable[str] = ()) -> StepOutcome:
    return step_all([receiver], finished_by_vllm)[0]


# ====================================================================== whole transfers


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


def run_transfer(p: PSide, d: DSide, sender: PrefillSender, t: Transfer,
                 chunks: Sequence[tuple[int, int]],
                 between: Callable[[], None] = lambda: None) -> StepOutcome:
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

    wait_until(ended, f"request {t.ext} to finish", WAIT)
    return outcomes[-1]


def assert_transfer_landed(p: PSide, d: DSide, t: Transfer) -> None:
    for layer in p.layouts:
        for comp in COMPONENTS:
            main = comp.startswith("main")
            src = p.bufs[(layer, comp)][list(t.p_main if main else t.p_idx)]
            dst = d.rows(layer, comp)[list(t.d_main if main else t.d_idx)]
            np.testing.assert_array_equal(dst, src, err_msg=f"layer {layer} {comp} of {t.ext}")


def assert_guarded(d: DSide, writable: Mapping[str, Iterable[int]]) -> None:
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


def reset_blocks(d: DSide, t: Transfer) -> None:
    for (layer, comp) in d.whole:
        d.rows(layer, comp)[list(t.d_main if comp.startswith("main") else t.d_idx)] = SENTINEL
