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

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from rd2h.adapters.memfabric.config import (
    TRANSFER_TYPES,
    parse_ipv4,
    parse_store_url,
)
from rd2h.app.probe_endpoint import EndpointSpec, decode_main, prefill_main, store_main

TRANSPORTS = ("memfabric", "cma")
MAX_BYTES = 64 << 30
MAX_DESCRIPTORS = 1 << 20
DEFAULT_BLOCK = 1 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
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
        if self.transfer_type not in TRANSFER_TYPES:
            raise ValueError(f"--transfer-type must be one of {list(TRANSFER_TYPES)}")
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


def parse_size(text: str) -> int:
    """``"4096"``, ``"512K"``, ``"64M"``, ``"1G"`` (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 512K, 64M, 1G)")
    return int(number) * _UNITS[unit]


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
    engine = "MemFabric" if spec.transport == "memfabric" else "cma"
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


def run_probe(cfg: ProbeConfig, log_path: str) -> ProbeResult:
    """Run the endpoints; ``ProbeFailure`` with one sentence if anything goes wrong."""
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
        iterations=cfg.iterations, seed=secrets.randbits(32), timeout_s=cfg.timeout_s,
        log_path=log_path,
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
        prefill = _Child(ctx, f"Prefill endpoint{where[0]}", prefill_main, spec)
        children.append(prefill)
        _, p_session, address = _expect(prefill, spec, deadline, "ready",
                                        "expose its buffer")
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
        transfer_type=cfg.transfer_type if memfabric else None,
        store_url=store_url or None,
    )


def summary_text(res: ProbeResult) -> str:
    over = res.transport
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


def _run(args: argparse.Namespace) -> int:
    cfg = ProbeConfig(
        transport=args.transport, prefill_device=args.prefill_device,
        decode_device=args.decode_device, host=args.host, store_url=args.store_url,
        transfer_type=args.transfer_type, nic=args.nic, size=args.bytes,
        block=args.block_bytes, iterations=args.iterations, timeout_s=args.timeout,
        log_file=args.log_file,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"rd2h probe memfabric: {exc}", file=sys.stderr)
        return 2
    log_path = cfg.log_file
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="rd2h-probe-", suffix=".log")
        os.close(fd)
    try:
        result = run_probe(cfg, log_path)
    except ProbeFailure as exc:
        sentence = " ".join(exc.sentence.split()).rstrip(".")
        print(f"rd2h probe memfabric: {sentence} (endpoint log: {log_path}).", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rd2h probe memfabric: interrupted.", file=sys.stderr)
        return 130
    if cfg.log_file is None:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    print(json.dumps(asdict(result)) if args.json else summary_text(result))
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except empty ones and those the help text already explains."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default == ""
        if empty or "default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _print_help(parser: argparse.ArgumentParser) -> Any:
    def show(_args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    return show


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``rd2h probe`` and its ``memfabric`` check on the CLI's subcommands."""
    d = ProbeConfig()
    probe = sub.add_parser(
        "probe",
        help="check a transport between two endpoints on this host before serving",
        description="Two-endpoint transport checks a deployment runs before serving.",
    )
    probe.set_defaults(func=_print_help(probe))
    targets = probe.add_subparsers(dest="target", metavar="TARGET")
    p = targets.add_parser(
        "memfabric",
        help="a Prefill and a Decode endpoint: register, read, verify, time",
        description=(
            "Start a Prefill and a Decode endpoint as two processes on this host. Prefill "
            "registers a host buffer holding a known pattern with the transfer engine; "
            "Decode registers its own buffer and reads Prefill's with one batch of "
            "--block-bytes descriptors, 1 + --iterations times, verifying every byte after "
            "every read, and reports the bandwidth of the timed reads in 10^9 bytes/s. "
            "With MemFabric the probe also starts a config store on a free port of --host, "
            "unless --store-url names a running one. Exit status: 0 verified; 1 failed, with "
            "one sentence on stderr saying why (e.g. the library cannot initialise: no "
            "Ascend driver); 2 bad flags. The endpoints' output (the MemFabric library logs "
            "on stdout) goes to a log file, kept when the probe fails."
        ),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--transport", choices=TRANSPORTS, default=d.transport,
                   help="transfer engine: 'memfabric' (memfabric_hybrid on Ascend) or 'cma' "
                        "(same-host process_vm_readv; checks the probe itself anywhere)")
    p.add_argument("--prefill-device", type=int, default=d.prefill_device, metavar="ID",
                   help="Ascend device id the Prefill endpoint binds (memfabric)")
    p.add_argument("--decode-device", type=int, default=d.decode_device, metavar="ID",
                   help="Ascend device id the Decode endpoint binds (memfabric)")
    p.add_argument("--host", default=d.host,
                   help="IPv4 address both endpoints advertise (and the config store binds)")
    p.add_argument("--store-url", default=None, metavar="tcp://IP:PORT",
                   help="an existing MemFabric config store (default: start one)")
    p.add_argument("--transfer-type", choices=list(TRANSFER_TYPES), default=d.transfer_type,
                   help="MemFabric data path (TransDataOpType)")
    p.add_argument("--nic", default=d.nic, help="MemFabric NIC for RDMA transfer types")
    p.add_argument("--bytes", type=parse_size, default=d.size, metavar="SIZE",
                   help="buffer size, e.g. 4096, 512K, 64M, 1G")
    p.add_argument("--block-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="bytes per read descriptor, the last may be shorter (default: 1M, "
                        "or --bytes if smaller)")
    p.add_argument("--iterations", type=int, default=d.iterations, metavar="N",
                   help="timed reads after one verified warm-up read")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="S",
                   help="deadline for the whole probe (s)")
    p.add_argument("--log-file", default=None, metavar="PATH",
                   help="endpoints' stdout/stderr (default: a temporary file, deleted on "
                        "success)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=_run)
