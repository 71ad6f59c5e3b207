"""``rd2h probe memfabric``: the two-endpoint transport check a deployment runs before
serving.

A Prefill process registers a buffer holding a known pattern; a Decode process reads it
with the transfer engine (one batch of block-sized descriptors), verifies every byte after
every read and times the reads. MemFabric needs a config store: the probe starts one on a
free port of ``--host`` unless ``--store-url`` names a running one. ``--transport cma``
runs the same check with the same-host ``process_vm_readv`` engine, which proves the probe
itself anywhere.

Success prints a report (or ``--json``) and exits 0. Any failure, including a library that
cannot initialise (no Ascend driver), prints one sentence on stderr saying why (with the
library's own message and the path of the endpoints' log) and exits 1; bad flags exit 2.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import secrets
import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any

from rd2h.domain.wire.addresses import TRANSFER_TYPE_NAMES, parse_ipv4, parse_store_url
from rd2h.probe.endpoints import EndpointSpec, decode_main, prefill_main, store_main

TRANSPORTS = ("memfabric", "cma", "mooncake")
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
MAX_BYTES = 64 << 30
MAX_DESCRIPTORS = 1 << 20
DEFAULT_BLOCK = 1 << 20
_STOP_S = 5.0


class ProbeFailure(Exception):
    """The probe's verdict when it fails: ``sentence`` is what the operator reads."""

    def __init__(self, sentence: str) -> None:
        self.sentence = sentence
        super().__init__(sentence)


@dataclass
class ProbeConfig:
    transport: str = "memfabric"
    prefill_device: int = 0
    decode_device: int = 1
    host: str = "127.0.0.1"
    store_url: str | None = None
    transfer_type: str = "SDMA"
    nic: str = ""
    size: int = 64 << 20
    block: int | None = None  # None: min(DEFAULT_BLOCK, size)
    iterations: int = 5
    timeout_s: float = 60.0
    log_file: str | None = None
    # Mooncake across two hosts: ``serve`` exposes the Prefill buffer here; ``peer`` (with
    # ``remote`` and ``seed``, the ticket the serving side prints) reads it from there.
    mooncake_protocol: str = "tcp"
    mooncake_device: str = ""
    serve: bool = False
    peer: str | None = None
    remote: int | None = None
    seed: int | None = None

    @property
    def block_bytes(self) -> int:
        return self.block if self.block is not None else min(DEFAULT_BLOCK, self.size)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad flag."""
        if self.transport not in TRANSPORTS:
            raise ValueError(f"--transport must be one of {list(TRANSPORTS)}, got "
                             f"{self.transport!r}")
        for flag, value in (("--prefill-device", self.prefill_device),
                            ("--decode-device", self.decode_device)):
            if value < 0:
                raise ValueError(f"{flag} must be >= 0, got {value}")
        if self.transport == "memfabric":
            parse_ipv4(self.host, "--host")
            if self.store_url is not None:
                parse_store_url(self.store_url)
        if self.transfer_type not in TRANSFER_TYPE_NAMES:
            raise ValueError(f"--transfer-type must be one of {list(TRANSFER_TYPE_NAMES)}")
        if not 1 <= self.size <= MAX_BYTES:
            raise ValueError(f"--bytes must be in [1, {MAX_BYTES}], got {self.size}")
        if not 1 <= self.block_bytes <= self.size:
            raise ValueError(f"--block-bytes must be in [1, --bytes], got {self.block_bytes}")
        if -(-self.size // self.block_bytes) > MAX_DESCRIPTORS:
            raise ValueError(
                f"--bytes / --block-bytes gives more than {MAX_DESCRIPTORS} descriptors; "
                "use larger blocks"
            )
        if not 1 <= self.iterations <= 1000:
            raise ValueError(f"--iterations must be in [1, 1000], got {self.iterations}")
        if not self.timeout_s > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout_s}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"--protocol must be one of {list(MOONCAKE_PROTOCOLS)}")
        ticket = (self.peer, self.remote, self.seed)
        if self.serve and any(x is not None for x in ticket):
            raise ValueError("--serve exposes a buffer; --peer, --remote and --seed read one: "
                             "give one side's flags only")
        if any(x is not None for x in ticket) and None in ticket:
            raise ValueError("--peer, --remote and --seed go together (the command the "
                             "serving side printed)")
        if (self.serve or self.peer is not None) and self.transport != "mooncake":
            raise ValueError("--serve and --peer are for two hosts: transport mooncake only")
        if self.peer is not None:
            host, _, port = self.peer.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--peer must be HOST:PORT (the Prefill session), got "
                                 f"{self.peer!r}")


@dataclass
class ProbeResult:
    transport: str
    bytes: int
    descriptors: int
    iterations: int
    best_gbps: float
    median_gbps: float
    seconds: list[float]
    prefill_session: str
    decode_session: str
    prefill_device: int | None = None
    decode_device: int | None = None
    transfer_type: str | None = None
    store_url: str | None = None
    verified: bool = True


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _Child:
    """A spawned endpoint process and its end of the pipe."""

    def __init__(self, ctx: Any, name: str, target: Any, *args: Any) -> None:
        self.name = name
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=target, name=f"rd2h-probe-{name}",
                                args=(child_conn, *args), daemon=True)
        self.proc.start()
        child_conn.close()

    def wait(self, deadline: float, what: str) -> tuple[Any, ...]:
        """The child's next message; ``ProbeFailure`` if it dies or the deadline passes."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProbeFailure(f"the {self.name} did not {what} before the deadline")
            try:
                if self.conn.poll(min(left, 0.2)):
                    return tuple(self.conn.recv())
            except (EOFError, OSError):
                self.proc.join(_STOP_S)
                raise ProbeFailure(
                    f"the {self.name} exited (code {self.proc.exitcode}) before it could "
                    f"{what}"
                ) from None
            if not self.proc.is_alive() and not self.conn.poll(0):
                raise ProbeFailure(
                    f"the {self.name} exited (code {self.proc.exitcode}) before it could {what}"
                )

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send("exit")
        self.proc.join(_STOP_S)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(_STOP_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(_STOP_S)
        self.conn.close()


def _explain(child: _Child, message: tuple[Any, ...], spec: EndpointSpec) -> ProbeFailure:
    """Turn a child's ``("error", phase, text)`` into the probe's sentence."""
    _, phase, text = message
    engine = {"memfabric": "MemFabric", "mooncake": "Mooncake"}.get(spec.transport, "cma")
    if phase == "store":
        return ProbeFailure(f"the MemFabric config store at {spec.store_url} could not start: "
                            f"{text}")
    if phase == "start":
        return ProbeFailure(f"the {child.name} could not start its {engine} engine: {text}")
    if phase == "register":
        return ProbeFailure(f"the {child.name} could not register its {spec.size}-byte "
                            f"buffer: {text}")
    if phase == "verify":
        return ProbeFailure(f"the bytes the Decode endpoint read differ from the Prefill "
                            f"pattern: {text}")
    return ProbeFailure(f"the Decode endpoint could not read from the Prefill endpoint: {text}")


def _expect(child: _Child, spec: EndpointSpec, deadline: float, kind: str,
            what: str) -> tuple[Any, ...]:
    message = child.wait(deadline, what)
    if message[0] == "error":
        raise _explain(child, message, spec)
    if message[0] != kind:
        raise ProbeFailure(f"the {child.name} sent an unexpected {message[0]!r} message")
    return message


def _serve(prefill: _Child, spec: EndpointSpec, cfg: ProbeConfig, session: str,
           address: int, deadline: float, announce: Any) -> None:
    """Keep the Prefill buffer exposed until the deadline (or an interrupt), after telling
    the operator the command that reads it on the Decode host."""
    announce(
        f"rd2h probe: serving {cfg.size} bytes at {session} over Mooncake "
        f"{cfg.mooncake_protocol} for {cfg.timeout_s:g} s (Ctrl-C stops); on the Decode "
        f"host run:\n  rd2h probe mooncake --host DECODE_HOST_ADDRESS --peer {session} "
        f"--remote {address} --seed {spec.seed} --bytes {cfg.size}"
        + (f" --protocol {cfg.mooncake_protocol}" if cfg.mooncake_protocol != "tcp" else "")
    )
    while (left := deadline - time.monotonic()) > 0:
        if not prefill.proc.is_alive():
            raise ProbeFailure(f"the {prefill.name} exited (code {prefill.proc.exitcode}) "
                               "while serving")
        if prefill.conn.poll(min(left, 0.5)):
            message = tuple(prefill.conn.recv())
            if message[0] == "error":
                raise _explain(prefill, message, spec)


def run_probe(cfg: ProbeConfig, log_path: str, announce: Any = print) -> ProbeResult | None:
    """Run the endpoints; ``ProbeFailure`` with one sentence if anything goes wrong.
    With ``cfg.serve`` it only exposes the Prefill buffer (``announce`` gets the command
    to run on the Decode host) until ``cfg.timeout_s`` passed, and returns None."""
    cfg.validate()
    deadline = time.monotonic() + cfg.timeout_s
    store_url = cfg.store_url or ""
    if cfg.transport == "memfabric" and not store_url:
        try:
            store_url = f"tcp://{cfg.host}:{free_port(cfg.host)}"
        except OSError as exc:
            raise ProbeFailure(f"cannot bind a config store port on --host {cfg.host}: "
                               f"{exc.strerror or exc}") from None
    spec = EndpointSpec(
        transport=cfg.transport, host=cfg.host, store_url=store_url,
        transfer_type=cfg.transfer_type, nic=cfg.nic, prefill_device=cfg.prefill_device,
        decode_device=cfg.decode_device, size=cfg.size, block=cfg.block_bytes,
        iterations=cfg.iterations,
        seed=cfg.seed if cfg.seed is not None else secrets.randbits(32),
        timeout_s=cfg.timeout_s, log_path=log_path, mooncake_protocol=cfg.mooncake_protocol,
        mooncake_device=cfg.mooncake_device,
    )
    ctx = mp.get_context("spawn")
    children: list[_Child] = []
    try:
        if cfg.transport == "memfabric" and cfg.store_url is None:
            store = _Child(ctx, "MemFabric config store", store_main, spec)
            children.append(store)
            _expect(store, spec, deadline, "ready", "start")
        where = (f" (device {cfg.prefill_device})", f" (device {cfg.decode_device})")
        if cfg.transport != "memfabric":
            where = ("", "")
        if cfg.peer is not None:  # the Prefill buffer is on another host
            p_session, address = cfg.peer, int(cfg.remote or 0)
        else:
            prefill = _Child(ctx, f"Prefill endpoint{where[0]}", prefill_main, spec)
            children.append(prefill)
            _, p_session, address = _expect(prefill, spec, deadline, "ready",
                                            "expose its buffer")
        if cfg.serve:
            _serve(prefill, spec, cfg, p_session, address, deadline, announce)
            return None
        decode = _Child(ctx, f"Decode endpoint{where[1]}", decode_main, spec, p_session,
                        address)
        children.append(decode)
        _, report = _expect(decode, spec, deadline, "result", "read and verify")
    finally:
        for child in reversed(children):
            child.stop()
    seconds = report["seconds"]
    rates = [cfg.size / s / 1e9 for s in seconds if s > 0]
    memfabric = cfg.transport == "memfabric"
    return ProbeResult(
        transport=cfg.transport, bytes=cfg.size, descriptors=report["descriptors"],
        iterations=cfg.iterations, best_gbps=max(rates, default=0.0),
        median_gbps=statistics.median(rates) if rates else 0.0, seconds=seconds,
        prefill_session=p_session, decode_session=report["session"],
        prefill_device=cfg.prefill_device if memfabric else None,
        decode_device=cfg.decode_device if memfabric else None,
        transfer_type=(cfg.transfer_type if memfabric else cfg.mooncake_protocol
                       if cfg.transport == "mooncake" else None),
        store_url=store_url or None,
    )


def summary_text(res: ProbeResult) -> str:
    over = res.transport
    if res.transport == "mooncake":
        over = f"Mooncake {res.transfer_type}"
    if res.transport == "memfabric":
        over = f"MemFabric {res.transfer_type} (store {res.store_url})"
    devices = ""
    if res.prefill_device is not None:
        devices = f" (devices {res.prefill_device} -> {res.decode_device})"
    return (
        f"rd2h probe: OK: Decode {res.decode_session} read {res.bytes} bytes from Prefill "
        f"{res.prefill_session}{devices} over {over} in {res.descriptors} descriptors, "
        f"{res.iterations + 1} reads, every byte verified\n"
        f"  bandwidth: best {res.best_gbps:.2f} GB/s, median {res.median_gbps:.2f} GB/s "
        f"over {res.iterations} timed reads (10^9 bytes/s)"
    )
