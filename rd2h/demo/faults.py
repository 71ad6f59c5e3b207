"""Fault injection for ``rd2h demo --fault``: parse the specs, wrap real components.

A fault is never a faked outcome. Each one wraps a real part of a rank so that
the rest of rd2h meets the failure exactly as it would in production:

* ``kill-prefill@layer=N``  the Prefill rank process ``os._exit``s when it is
  about to announce layer N (first chunk), once Decode acknowledged the layers
  before it; its connections close mid-request.
* ``kill-decode@layer=N``   the Decode rank process ``os._exit``s when a ready
  message for layer N reaches its control socket (``DyingServer``).
* ``read-error@rate=R``     a fraction R of Decode's batched reads fail
  (``FlakyTransfer``, a transfer-engine decorator).
* ``drop-ack@layer=N``      Decode reads layer N but its reply to Prefill is
  dropped (``DroppingServer``, a control-server decorator).
* ``slow-decode@ms=M``      every batched read on Decode takes M ms longer
  (``SlowTransfer``).
* ``corrupt@rate=R``        a fraction R of Decode's batched reads land corrupted: the
  first bytes of the first block read are flipped after the transport returned
  (``CorruptingTransfer``). Nothing but ``--verify-kv`` (or the demo's own byte check)
  notices.
* ``misplace@rate=R``       a fraction R of Decode's batched reads land in the wrong
  destination: descriptors of the first one's size swap destinations (a lone one is
  flipped instead), as a wrong-destination bug would.

Every fault takes an optional ``rank=R``: the rank of the affected role it
applies to. Without it, the kill faults hit rank 0 and the others every Decode
rank. Grammar: ``KIND@key=value[,key=value]``.
"""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from rd2h.domain.errors import ProtocolError, TransferError
from rd2h.domain.wire.protocol import ReadDone, ReadFailed, ReadReadyBatch
from rd2h.ports.codec import WireCodec
from rd2h.ports.control import ControlServer
from rd2h.ports.transfer import TransferEngine

KILLED_EXIT_CODE = 86  # how an injected kill ends a rank process (tells it from a crash)

Role = Literal["prefill", "decode"]

# kind -> (role it hits, required parameter, help text)
KINDS: dict[str, tuple[Role, str, str]] = {
    "kill-prefill": ("prefill", "layer", "Prefill rank exits when about to announce layer N "
                     "(after the layers before it were acknowledged)"),
    "kill-decode": ("decode", "layer", "Decode rank exits when layer N's ready message arrives"),
    "read-error": ("decode", "rate", "fraction R (0 < R <= 1) of Decode's batched reads fail"),
    "drop-ack": ("decode", "layer", "Decode's reply for layer N is dropped (never sent)"),
    "slow-decode": ("decode", "ms", "every batched read on Decode takes M ms longer"),
    "corrupt": ("decode", "rate", "fraction R of Decode's batched reads land with bytes "
                "flipped after the read (only --verify-kv catches it)"),
    "misplace": ("decode", "rate", "fraction R of Decode's batched reads land in the wrong "
                 "destination blocks (only --verify-kv catches it)"),
}
_PARAMS = {"layer", "rate", "ms", "rank"}


class FaultSpecError(ValueError):
    """A ``--fault`` value that cannot be used; the message names the offending part."""


@dataclass(frozen=True)
class Fault:
    kind: str
    layer: int | None = None
    rate: float | None = None
    ms: float | None = None
    rank: int | None = None

    @property
    def role(self) -> Role:
        return KINDS[self.kind][0]

    def hits(self, role: Role, rank: int) -> bool:
        if role != self.role:
            return False
        if self.rank is not None:
            return rank == self.rank
        return rank == 0 if self.kind.startswith("kill-") else True

    def __str__(self) -> str:
        params = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                  for k in ("layer", "rate", "ms", "rank")
                  if (v := getattr(self, k)) is not None]
        return f"{self.kind}@{','.join(params)}"


def _int(spec: str, key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise FaultSpecError(f"--fault {spec!r}: {key} must be an integer, got {text!r}") from None
    if value < 0:
        raise FaultSpecError(f"--fault {spec!r}: {key} must be >= 0, got {value}")
    return value


def _float(spec: str, key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise FaultSpecError(f"--fault {spec!r}: {key} must be a number, got {text!r}") from None
    if not np.isfinite(value):
        raise FaultSpecError(f"--fault {spec!r}: {key} must be finite, got {text!r}")
    return value


def parse_fault(spec: str) -> Fault:
    """``KIND@key=value[,key=value]`` -> ``Fault``; ``FaultSpecError`` says what is wrong."""
    kind, sep, rest = spec.strip().partition("@")
    if kind not in KINDS:
        raise FaultSpecError(
            f"--fault {spec!r}: unknown fault {kind!r}; expected one of {', '.join(KINDS)}"
        )
    required = KINDS[kind][1]
    if not sep or not rest:
        raise FaultSpecError(f"--fault {spec!r}: missing parameters; write {kind}@{required}=...")
    values: dict[str, str] = {}
    for part in rest.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or not key or not value.strip():
            raise FaultSpecError(f"--fault {spec!r}: {part!r} is not key=value")
        if key not in _PARAMS or (key != "rank" and key != required):
            allowed = f"{required}, rank"
            raise FaultSpecError(f"--fault {spec!r}: {kind} takes {allowed}, not {key!r}")
        if key in values:
            raise FaultSpecError(f"--fault {spec!r}: {key} given twice")
        values[key] = value.strip()
    if required not in values:
        raise FaultSpecError(f"--fault {spec!r}: {kind} needs {required}=...")
    fields: dict[str, int | float] = {}
    if "rank" in values:
        fields["rank"] = _int(spec, "rank", values["rank"])
    if required == "layer":
        fields["layer"] = _int(spec, "layer", values["layer"])
    elif required == "rate":
        rate = _float(spec, "rate", values["rate"])
        if not 0 < rate <= 1:
            raise FaultSpecError(f"--fault {spec!r}: rate must be in (0, 1], got {rate:g}")
        fields["rate"] = rate
    else:
        ms = _float(spec, "ms", values["ms"])
        if ms <= 0:
            raise FaultSpecError(f"--fault {spec!r}: ms must be > 0, got {ms:g}")
        fields["ms"] = ms
    return Fault(kind, **fields)  # type: ignore[arg-type]


def check_faults(faults: Iterable[Fault], *, layers: int, prefill_tp: int, decode_tp: int) -> None:
    """Faults that name a layer or rank the run does not have are refused up front."""
    for fault in faults:
        if fault.layer is not None and fault.layer >= layers:
            raise FaultSpecError(
                f"--fault {fault}: layer {fault.layer} does not exist (--layers {layers})"
            )
        size = prefill_tp if fault.role == "prefill" else decode_tp
        if fault.rank is not None and fault.rank >= size:
            raise FaultSpecError(
                f"--fault {fault}: {fault.role} rank {fault.rank} does not exist "
                f"(--{fault.role}-tp {size})"
            )


def fault_help() -> str:
    lines = [f"{kind}@{param}={'N' if param == 'layer' else param.upper()[0]}: {text}"
             for kind, (_, param, text) in KINDS.items()]
    return "; ".join(lines)


# ---------------------------------------------------------------- decorators


class FlakyTransfer:
    """A transfer engine whose batched reads fail with probability ``rate``
    (seeded: a run is repeatable). The failure is a real ``TransferError`` from
    ``batch_read``, so Decode answers READ_FAILED and fails the requests."""

    def __init__(self, inner: TransferEngine, rate: float, seed: int = 0) -> None:
        self._inner = inner
        self._rate = rate
        self._rng = random.Random(seed)
        self.injected = 0

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    def register_memory(self, addr: int, size: int) -> None:
        self._inner.register_memory(addr, size)

    def batch_read(self, session: str, local_addrs: np.ndarray, remote_addrs: np.ndarray,
                   lengths: np.ndarray) -> None:
        if self._rng.random() < self._rate:
            self.injected += 1
            raise TransferError(f"injected read error (read-error@rate={self._rate:g})")
        self._inner.batch_read(session, local_addrs, remote_addrs, lengths)

    def close(self) -> None:
        self._inner.close()


class CorruptingTransfer(FlakyTransfer):
    """A transfer engine that reads for real, then (with probability ``rate``, seeded)
    flips the first 16 bytes of the first block it read: bytes that landed wrong
    while the transport reported success. ``misplace``: instead, the descriptors of the
    first one's size swap destinations (rotated) before the read: blocks land in the
    wrong destination blocks, all inside the plan's own destinations."""

    def __init__(self, inner: TransferEngine, rate: float, seed: int = 0,
                 misplace: bool = False) -> None:
        super().__init__(inner, rate, seed)
        self._misplace = misplace

    def batch_read(self, session: str, local_addrs: np.ndarray, remote_addrs: np.ndarray,
                   lengths: np.ndarray) -> None:
        hit = bool(lengths.size) and self._rng.random() < self._rate
        same = np.flatnonzero(lengths == lengths[0]) if hit else np.zeros(0, dtype=np.int64)
        if hit and self._misplace and same.size >= 2:
            self.injected += 1
            local_addrs = local_addrs.copy()
            local_addrs[same] = np.roll(local_addrs[same], 1)
        self._inner.batch_read(session, local_addrs, remote_addrs, lengths)
        if hit and not (self._misplace and same.size >= 2):
            self.injected += 1
            size = min(16, int(lengths[0]))
            view = np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(
                int(local_addrs[0])))
            view ^= 0xFF


class SlowTransfer:
    """A transfer engine whose every batched read first waits ``seconds``."""

    def __init__(self, inner: TransferEngine, seconds: float,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._inner = inner
        self._seconds = seconds
        self._sleep = sleep

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    def register_memory(self, addr: int, size: int) -> None:
        self._inner.register_memory(addr, size)

    def batch_read(self, session: str, local_addrs: np.ndarray, remote_addrs: np.ndarray,
                   lengths: np.ndarray) -> None:
        self._sleep(self._seconds)
        self._inner.batch_read(session, local_addrs, remote_addrs, lengths)

    def close(self) -> None:
        self._inner.close()


class _ServerDecorator:
    """``codec`` only peeks at frames: a plain codec, which reads signed frames as the
    plain message (a signing one would count each look as a replay)."""

    def __init__(self, inner: ControlServer, codec: WireCodec) -> None:
        self._inner = inner
        self._codec = codec

    @property
    def endpoint(self) -> str:
        return self._inner.endpoint

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        return self._inner.recv(timeout)

    def recv_many(self, timeout: float, limit: int) -> list[tuple[bytes, bytes]]:
        """One message at a time, through ``recv`` (where a fault looks at each)."""
        item = self.recv(timeout)
        return [] if item is None else [item]

    def send(self, identity: bytes, payload: bytes) -> bool:
        return self._inner.send(identity, payload)

    def disconnected(self) -> list[bytes]:
        return self._inner.disconnected()

    def wake(self) -> None:
        self._inner.wake()

    def shed(self) -> list[tuple[bytes, int, int]]:
        return self._inner.shed()

    def close(self) -> None:
        self._inner.close()

    def _decoded(self, payload: bytes) -> object | None:
        try:
            return self._codec.decode(payload)
        except ProtocolError:
            return None


class DroppingServer(_ServerDecorator):
    """Decode's control server that silently drops every reply for ``layer``: the
    read happened, Prefill never hears of it and must fail the layer at its deadline."""

    def __init__(self, inner: ControlServer, codec: WireCodec, layer: int) -> None:
        super().__init__(inner, codec)
        self._layer = layer
        self.dropped = 0

    def send(self, identity: bytes, payload: bytes) -> bool:
        msg = self._decoded(payload)
        if isinstance(msg, ReadDone | ReadFailed) and self._layer in (
                msg.layer_idx, *(idx for idx, _ in msg.also)):  # a layer run's too
            self.dropped += 1
            return True  # "delivered" as far as Decode can tell
        return self._inner.send(identity, payload)


class DyingServer(_ServerDecorator):
    """Decode's control server that calls ``die`` (``os._exit`` in the demo) when a
    ready message for ``layer`` arrives: the rank vanishes mid-layer."""

    def __init__(self, inner: ControlServer, codec: WireCodec, layer: int,
                 die: Callable[[], None]) -> None:
        super().__init__(inner, codec)
        self._layer = layer
        self._die = die

    def recv(self, timeout: float) -> tuple[bytes, bytes] | None:
        item = self._inner.recv(timeout)
        if item is not None:
            msg = self._decoded(item[1])
            if isinstance(msg, ReadReadyBatch) and self._layer in (
                    msg.layer_idx, *(lay.layer_idx for lay in msg.also)):
                self._die()
        return item


def decode_transfer(faults: Iterable[Fault], rank: int, inner: TransferEngine,
                    seed: int) -> TransferEngine:
    """Decode rank ``rank``'s transfer engine with its transfer faults applied."""
    out = inner
    for i, fault in enumerate(faults):
        if not fault.hits("decode", rank):
            continue
        if fault.kind == "read-error" and fault.rate is not None:
            out = FlakyTransfer(out, fault.rate, seed=seed * 1000 + rank * 31 + i)
        elif fault.kind == "slow-decode" and fault.ms is not None:
            out = SlowTransfer(out, fault.ms / 1000.0)
        elif fault.kind in ("corrupt", "misplace") and fault.rate is not None:
            out = CorruptingTransfer(out, fault.rate, seed=seed * 1000 + rank * 31 + i,
                                     misplace=fault.kind == "misplace")
    return out


def decode_server(faults: Iterable[Fault], rank: int, inner: ControlServer, codec: WireCodec,
                  die: Callable[[], None]) -> ControlServer:
    """Decode rank ``rank``'s control server with its control faults applied."""
    out = inner
    for fault in faults:
        if not fault.hits("decode", rank) or fault.layer is None:
            continue
        if fault.kind == "drop-ack":
            out = DroppingServer(out, codec, fault.layer)
        elif fault.kind == "kill-decode":
            out = DyingServer(out, codec, fault.layer, die)
    return out


def prefill_kill_layer(faults: Iterable[Fault], rank: int) -> int | None:
    """The layer before whose announcement Prefill rank ``rank`` dies, if any."""
    layers = [f.layer for f in faults
              if f.kind == "kill-prefill" and f.hits("prefill", rank) and f.layer is not None]
    return min(layers, default=None)


def may_die(faults: Iterable[Fault], role: Role, rank: int) -> bool:
    return any(f.kind.startswith("kill-") and f.hits(role, rank) for f in faults)
