"""The one rig: every test that runs Prefill senders, Decode receivers or the
connector's worker roles builds them here, through the app's own composition root
(``rd2h.bootstrap.container.bootstrap`` with overrides), never by wiring classes by hand.

Two kinds of control plane: real ZeroMQ sockets on loopback (``Rig()``, the default;
Decode binds a free port, retried) or the in-memory network of ``fakes.control``
(``Rig(control="memory")``: each Decode container's server binds
``tcp://<host>:<rank port>`` of its settings on the network, so endpoints read as in
production). Transfers use the ``inproc`` transport copying real numpy memory. The
clock is the rig's (``Rig(clock=ManualClock())``: every driver the rig starts is woken
when the test advances it).

Prefill source tensors are seeded random blocks; every Decode destination tensor
sits between two guard regions registered with the engine too, so only rd2h's own
bounds checks (not the transport's region table) keep writes out of them. ``Rig``
tracks everything a test builds and closes it in reverse order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
import zmq

from fakes.control import MemoryNetwork
from fakes.logs import RecordingLogger
from fakes.net import HOST, free_port, wait_until
from rd2h.adapters.inproc import InprocTransferEngine
from rd2h.adapters.msgpack import MsgpackCodec
from rd2h.adapters.torch.exchange import InMemoryExchangeGroup
from rd2h.adapters.zmq.channel import BindError
from rd2h.app.clock import MonotonicClock
from rd2h.app.connector.decode_worker import DecodeWorker
from rd2h.app.connector.prefill_worker import PrefillWorker
from rd2h.app.decode import DecodeReceiver
from rd2h.app.prefill import LayerTarget, PrefillSender
from rd2h.app.settings import Rd2hSettings, Role
from rd2h.bootstrap.container import Container, bootstrap
from rd2h.domain.decode.request_book import StepOutcome
from rd2h.domain.planning.layout import DestinationLayout, DestTensor, SourceLayout, TensorComponent
from rd2h.domain.planning.topology import tcp_endpoint
from rd2h.domain.wire.protocol import ACK, Message, MfMeta, ReadRequest
from rd2h.ports.codec import WireCodec
from rd2h.ports.runtime import Clock

SUFFIX = "-e0000001"  # vLLM's 9-character engine suffix
SENTINEL = 0xEE  # every destination and guard byte before any pull
WAIT = 5.0  # upper bound of any single wait; the happy paths take milliseconds
P_BLOCKS = 8
D_BLOCKS = 16
GUARD = 2  # guard blocks before and after every destination tensor
COMPONENTS = ("main_k", "main_v", "indexer", "scale")
PLAIN = MsgpackCodec()  # for the tests' own hand-driven peers (raw sockets)
# The rig's settings unless a test gives others: short waits, CPU device events, and
# requests that never expire on their own.
DEFAULTS: dict[str, Any] = {
    "transport": "inproc", "host": HOST, "device_events": "cpu",
    "deadlines": {"meta_ack_s": WAIT, "layer_ack_s": WAIT, "device_event_s": WAIT,
                  "request_s": 600.0, "stop_s": 2.0},
}

Bufs = dict[tuple[int, str], np.ndarray]
Control = Literal["zmq", "memory"]


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


def settings_of(role: Role, given: Mapping[str, Any] | None = None) -> Rd2hSettings:
    """``Rd2hSettings`` for ``role``: the rig's defaults, then ``given`` (its
    ``deadlines`` and ``limits`` merge into the defaults key by key)."""
    given = dict(given or {})
    merged: dict[str, Any] = {**DEFAULTS, **given, "role": role}
    for key in ("deadlines", "limits"):
        if key in given:
            merged[key] = {**DEFAULTS.get(key, {}), **dict(given[key])}
    return Rd2hSettings(**merged)


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
    container: Container | None = None  # what built the receiver (its codec, ...)

    def rows(self, layer: int, comp: str) -> np.ndarray:
        return self.bufs[(layer, comp)]

    def snapshot(self) -> Bufs:
        return {k: v.copy() for k, v in self.bufs.items()}


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


# ====================================================================== the rig


class Bound(NamedTuple):
    """A started Decode receiver, the endpoint it listens on, its container."""

    receiver: DecodeReceiver
    endpoint: str
    container: Container


class Rig:
    """Builds (through ``bootstrap``) and tracks every engine, sender, receiver, worker
    and raw socket of a test; ``close`` (fixture teardown) stops and closes them in
    reverse order."""

    def __init__(self, *, control: Control = "zmq", clock: Clock | None = None) -> None:
        self.ctx = zmq.Context.instance()
        self.net = MemoryNetwork() if control == "memory" else None
        self.clock = clock or MonotonicClock()
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

    def _woken(self, driver: PrefillSender | DecodeReceiver) -> None:
        """The driver sleeps until its next deadline: a manual clock's jump wakes it."""
        wakes = getattr(self.clock, "wakes", None)
        if wakes is not None:
            wakes(driver.wake)

    def _driven(self, driver: PrefillSender | DecodeReceiver) -> None:
        """A started driver: woken when a manual clock jumps, stopped at teardown."""
        self._woken(driver)
        self._finalizers.append(lambda: driver.stop(2.0))

    # ------------------------------------------------------------ the app
    def container(self, role: Role, settings: Mapping[str, Any] | None = None,
                  **overrides: Any) -> Container:
        """``bootstrap`` of one endpoint: the rig's settings (``settings_of``), its clock
        and control plane, a ``RecordingLogger``, then ``overrides`` (None: keep)."""
        s = settings_of(role, settings)
        made: dict[str, Any] = {"clock": self.clock,
                                "logger": RecordingLogger(role=role, rank=s.tp_rank)}
        if self.net is not None:
            net = self.net
            made["control_server"] = lambda: net.server(tcp_endpoint(s.host, s.rank_port))
            made["control_clients"] = net.clients
        made.update((k, v) for k, v in overrides.items() if v is not None)
        return bootstrap(s, **made)

    # ------------------------------------------------------------ Prefill
    def sender(self, layers: Mapping[int, SourceLayout], p_session: str, *,
               settings: Mapping[str, Any] | None = None, codec: WireCodec | None = None,
               log: Any = None, **call_kw: Any) -> PrefillSender:
        """A started sender from its container; ``call_kw`` go to the provider (e.g. a
        test's own ``layer_ack_timeout_s``, ``compat``)."""
        c = self.container("prefill", settings, codec=codec, logger=log)
        sender = c.prefill_sender(p_session=p_session, layers=dict(layers), **call_kw)
        sender.start()
        self._driven(sender)
        return sender

    def prefill_memory(self, layers: Iterable[int] | Mapping[int, Shape], *, seed: int = 0,
                       share: Mapping[int, int] | None = None,
                       engine: InprocTransferEngine | None = None,
                       advertise: bool = False) -> PSide:
        p = prefill_memory(layers, engine or self.engine(), seed=seed, share=share,
                           advertise=advertise)
        self.keep.append(p.bufs)
        return p

    def start_sender(self, p: PSide, codec: WireCodec | None = None, *,
                     layouts: Mapping[int, SourceLayout] | None = None,
                     **kw: Any) -> PrefillSender:
        p.sender = self.sender(layouts or p.layouts, p.session, codec=codec, **kw)
        return p.sender

    def prefill(self, layers: Iterable[int] | Mapping[int, Shape], *,
                codec: WireCodec | None = None, settings: Mapping[str, Any] | None = None,
                **kw: Any) -> PSide:
        """Seeded source memory (``prefill_memory``'s keywords) and a started sender (its
        ``*_timeout_s`` keywords)."""
        timeouts = {k: kw.pop(k) for k in list(kw) if k.endswith("_timeout_s")}
        p = self.prefill_memory(layers, **kw)
        self.start_sender(p, codec, settings=settings, **timeouts)
        return p

    def prefill_worker(self, layers: Mapping[int, SourceLayout], p_session: str, *,
                       settings: Mapping[str, Any] | None = None, log: Any = None,
                       overrides: Mapping[str, Any] | None = None,
                       **worker_kw: Any) -> PrefillWorker:
        """The Prefill worker role over its own sender, both from one container (as
        the connector builds them), started. ``overrides`` replace the container's
        providers (``device_events``, ``timeline``...); ``worker_kw`` go to the worker's
        provider (``reuse_timeout_s``, ``settle_timeout_s``...)."""
        c = self.container("prefill", settings, logger=log, **dict(overrides or {}))
        sender = c.prefill_sender(p_session=p_session, layers=dict(layers))
        worker = c.prefill_worker(  # with the layouts, as ``build_prefill_worker`` gives
            sender=sender, layer_names={i: lay.layer_name for i, lay in layers.items()},
            **{"layouts": dict(layers), **worker_kw})
        worker.start()
        self._woken(sender)
        self._finalizers.append(worker.shutdown)
        return worker

    # ------------------------------------------------------------ Decode
    def receiver(self, destinations: Mapping[str, DestinationLayout], transfer: Any, *,
                 settings: Mapping[str, Any] | None = None, codec: WireCodec | None = None,
                 log: Any = None, **call_kw: Any) -> Bound:
        """A started receiver from its container, bound to the settings' port, or (over
        ZeroMQ, when the settings name none) to a free one, retried if taken meanwhile."""
        given = dict(settings or {})
        probe = self.net is None and "kv_port" not in given
        for _ in range(20 if probe else 1):
            if probe:  # the rank binds kv_port + tp_rank (one DP rank)
                given["kv_port"] = free_port() - given.get("tp_rank", 0)
            c = self.container("decode", given, transport=transfer, codec=codec, logger=log)
            receiver = c.decode_receiver(destinations=dict(destinations), **call_kw)
            try:
                endpoint = receiver.start()
            except BindError:
                if probe:
                    continue
                raise
            self._driven(receiver)
            return Bound(receiver, endpoint, c)
        raise RuntimeError("no free port for the decode receiver")

    def decode(self, layers: Iterable[int] | Mapping[int, Shape],
               codec: WireCodec | None = None, *, d_rank: int = 0, d_tp: int = 1,
               shared_main: Bufs | None = None, settings: Mapping[str, Any] | None = None,
               **receiver_kw: Any) -> DSide:
        """Guarded destination memory and a started receiver (Decode TP rank ``d_rank`` of
        ``d_tp``; ``shared_main``: another rank's main tensors, the TP-shared pool)."""
        engine = self.engine()
        whole, bufs, dests = decode_memory(layers, engine, shared_main)
        self.keep.append(whole)
        log = RecordingLogger(role="decode", rank=d_rank)
        place = {"tp_size": d_tp, "tp_rank": d_rank, **dict(settings or {})}
        receiver, endpoint, container = self.receiver(dests, engine, settings=place,
                                                      codec=codec, log=log, **receiver_kw)
        return DSide(engine, whole, bufs, dests, receiver, endpoint, log, container)

    def decode_worker(self, destinations: Mapping[str, DestinationLayout], transfer: Any, *,
                      settings: Mapping[str, Any] | None = None, log: Any = None,
                      overrides: Mapping[str, Any] | None = None,
                      **worker_kw: Any) -> DecodeWorker:
        """The Decode worker role over its own receiver (one container), started: its
        control server bound (settings' host and port). ``overrides`` and ``worker_kw``
        as for ``prefill_worker`` (``idle_wait_s``...)."""
        c = self.container("decode", settings, transport=transfer, logger=log,
                           **dict(overrides or {}))
        receiver = c.decode_receiver(destinations=dict(destinations))
        worker = c.decode_worker(receiver=receiver, exchange=c.tp_exchange(), **worker_kw)
        worker.start()
        self._woken(receiver)
        self._finalizers.append(worker.shutdown)
        return worker

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
