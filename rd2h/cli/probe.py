"""``rd2h probe memfabric``: the command line of the two-endpoint transport check."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
from dataclasses import asdict
from typing import Any

from rd2h.domain.wire.addresses import TRANSFER_TYPE_NAMES
from rd2h.probe.run import (
    MOONCAKE_PROTOCOLS,
    TRANSPORTS,
    ProbeConfig,
    ProbeFailure,
    run_probe,
    summary_text,
)

SERVE_TIMEOUT_S = 600.0
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4096"``, ``"512K"``, ``"64M"``, ``"1G"`` (binary units) -> bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in "KMG" else ""
    number = t[: len(t) - len(unit)]
    if not number.isdigit():
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 4096, 512K, 64M, 1G)")
    return int(number) * _UNITS[unit]


def _run(args: argparse.Namespace) -> int:
    mooncake = args.target == "mooncake"
    d = ProbeConfig()
    timeout = args.timeout
    if timeout is None:  # serving waits for the operator to run the reading side
        timeout = SERVE_TIMEOUT_S if getattr(args, "serve", False) else d.timeout_s
    cfg = ProbeConfig(
        transport="mooncake" if mooncake else args.transport,
        prefill_device=getattr(args, "prefill_device", d.prefill_device),
        decode_device=getattr(args, "decode_device", d.decode_device), host=args.host,
        store_url=getattr(args, "store_url", None),
        transfer_type=getattr(args, "transfer_type", d.transfer_type),
        nic=getattr(args, "nic", d.nic), size=args.bytes,
        block=args.block_bytes, iterations=args.iterations, timeout_s=timeout,
        log_file=args.log_file,
        mooncake_protocol=getattr(args, "protocol", d.mooncake_protocol),
        mooncake_device=getattr(args, "device", d.mooncake_device),
        serve=getattr(args, "serve", False), peer=getattr(args, "peer", None),
        remote=getattr(args, "remote", None), seed=getattr(args, "seed", None),
    )
    name = f"rd2h probe {args.target}"
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    log_path = cfg.log_file
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="rd2h-probe-", suffix=".log")
        os.close(fd)
    if cfg.serve:  # stopped as a service is (SIGTERM) as well as with Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        result = run_probe(cfg, log_path, announce=lambda text: print(text, flush=True))
    except ProbeFailure as exc:
        sentence = " ".join(exc.sentence.split()).rstrip(".")
        print(f"{name}: {sentence} (endpoint log: {log_path}).", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if cfg.serve:
            print(f"{name}: stopped serving.", file=sys.stderr)
            return 0
        print(f"{name}: interrupted.", file=sys.stderr)
        return 130
    if cfg.log_file is None:
        with contextlib.suppress(OSError):
            os.unlink(log_path)
    if result is None:  # served until the deadline
        print(f"{name}: served for {cfg.timeout_s:g} s; stopped.", flush=True)
        return 0
    print(json.dumps(asdict(result)) if args.json else summary_text(result))
    return 0


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt


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
    p.add_argument("--transport", choices=[t for t in TRANSPORTS if t != "mooncake"],
                   default=d.transport,
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
    p.add_argument("--transfer-type", choices=list(TRANSFER_TYPE_NAMES), default=d.transfer_type,
                   help="MemFabric data path (TransDataOpType)")
    p.add_argument("--nic", default=d.nic, help="MemFabric NIC for RDMA transfer types")
    _common(p, d)
    m = targets.add_parser(
        "mooncake",
        help="Mooncake between two endpoints, on this host or across two hosts",
        description=(
            "Check the Mooncake path rd2h reads KV over. Without --serve or --peer both "
            "endpoints run on this host. Across hosts: on the Prefill host run "
            "'rd2h probe mooncake --serve --host PREFILL_ADDRESS', which exposes a "
            "patterned buffer and prints the command to run on the Decode host (with "
            "--peer, --remote and --seed); that command reads the buffer over the network, "
            "verifies every byte and reports the bandwidth. Both hosts need the Mooncake "
            "handshake and data ports open between them (15000-16999/tcp; see the "
            "'Across hosts' page). Exit status: 0 verified (or served until --timeout); 1 "
            "failed, with one sentence on stderr saying why; 2 bad flags."
        ),
        formatter_class=_HelpFormatter,
    )
    m.add_argument("--host", default=d.host,
                   help="this host's address as the other host reaches it (advertised)")
    m.add_argument("--protocol", choices=list(MOONCAKE_PROTOCOLS), default=d.mooncake_protocol,
                   help="Mooncake transfer protocol")
    m.add_argument("--device", default=d.mooncake_device,
                   help="RDMA device names (with --protocol rdma)")
    m.add_argument("--serve", action="store_true",
                   help="Prefill host: expose the buffer and print the Decode host's command; "
                        "serve until --timeout (default 600 s) or Ctrl-C")
    m.add_argument("--peer", default=None, metavar="HOST:PORT",
                   help="Decode host: the Prefill endpoint's session, as --serve printed it")
    m.add_argument("--remote", type=int, default=None, metavar="ADDR",
                   help="Decode host: the buffer's address, as --serve printed it")
    m.add_argument("--seed", type=int, default=None, metavar="N",
                   help="Decode host: the pattern's seed, as --serve printed it")
    _common(m, d)


def _common(p: argparse.ArgumentParser, d: ProbeConfig) -> None:
    p.add_argument("--bytes", type=parse_size, default=d.size, metavar="SIZE",
                   help="buffer size, e.g. 4096, 512K, 64M, 1G")
    p.add_argument("--block-bytes", type=parse_size, default=None, metavar="SIZE",
                   help="bytes per read descriptor, the last may be shorter (default: 1M, "
                        "or --bytes if smaller)")
    p.add_argument("--iterations", type=int, default=d.iterations, metavar="N",
                   help="timed reads after one verified warm-up read")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help=f"deadline for the whole probe (s) (default: {d.timeout_s:g}; "
                        f"serving: {SERVE_TIMEOUT_S:g})")
    p.add_argument("--log-file", default=None, metavar="PATH",
                   help="endpoints' stdout/stderr (default: a temporary file, deleted on "
                        "success)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=_run)
