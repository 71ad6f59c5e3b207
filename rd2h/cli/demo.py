"""``rd2h demo``: the command line of the multi-process pull demo."""

from __future__ import annotations

import argparse
import os
import sys

from rd2h.app.settings import Deadlines
from rd2h.demo.config import DemoConfig
from rd2h.demo.faults import FaultSpecError, fault_help, parse_fault


def add_demo_parser(sub: argparse._SubParsersAction) -> None:
    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="multi-process Prefill -> Decode pull on this host, every byte verified",
        description=(
            "Start --prefill-tp Prefill rank processes and --decode-tp Decode rank processes "
            "on loopback with synthetic KV in DeepSeek-V3.2-like shapes (main K/V, indexer, "
            "LIC8 scale). Decode pulls every layer with the embedded same-host transport, "
            "completes requests through a real torch.distributed (gloo) exchange and verifies "
            "every destination byte. Rates are in 10^9 bytes/s. "
            "With --fault, real components fail on purpose (a rank process exits, reads "
            "fail, replies are dropped, reads are slow); the summary still appears and "
            "reports every request as ok or failed with its reason. "
            "Exit status: 0 when the run kept rd2h's promises (verified): every request "
            "ended (none hanging), every ok request carries exactly the right bytes, no "
            "request state was left on any rank, and, without --fault, every request was "
            "ok; 1 when it did not; 2 for a bad configuration."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp, help="Prefill TP ranks")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp,
                   help="Decode TP ranks (prefill-tp must be a multiple)")
    p.add_argument("--layers", type=int, default=d.layers, help="model layers")
    p.add_argument("--requests", type=int, default=d.requests, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens,
                   help="tokens per prompt (a partial last block is fine)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per block")
    p.add_argument("--chunks", type=int, default=d.chunks, help="chunked-prefill chunks")
    p.add_argument("--shared-buffers", type=int, default=d.shared_buffers, metavar="K",
                   help="Prefill writes layer L into physical buffer L mod K after waiting on "
                        "its reuse gate (0 = one buffer per layer)")
    p.add_argument("--layers-per-frame", type=int, default=d.max_layers_per_frame,
                   metavar="N",
                   help="layer runs: at most N layers in one READ_READY_BATCH while Decode "
                        "is behind (1: one layer per frame; default %(default)s)")
    p.add_argument("--verify-kv", action="store_true",
                   help="Prefill states an XXH3 digest of every announced block and Decode "
                        "checks what it read (verify_kv): try it with --fault corrupt@rate=R")
    p.add_argument("--auth-secret-file", metavar="FILE",
                   help="sign and check every control message with HMAC-SHA256 under the "
                        "shared secret in FILE (at least 16 characters; readable by its "
                        "owner only or, owned by root, its group; default: "
                        "$RD2H_AUTH_SECRET, unset = no "
                        "authentication)")
    p.add_argument("--auth-secret", metavar="SECRET",
                   help="the secret itself (visible in every process listing; prefer "
                        "--auth-secret-file or $RD2H_AUTH_SECRET)")
    p.add_argument("--via-provider", action="store_true",
                   help="Prefill ranks drive rd2h's connector roles (PrefillScheduler, "
                        "PrefillWorker) as vLLM does, through the buffer-reuse provider "
                        "interface: wait_for_layer_reuse before overwriting a buffer, "
                        "on_kv_cache_written to announce, save_kv_layer skipping it")
    p.add_argument("--no-indexer", action="store_true", help="main K/V only")
    p.add_argument("--no-scale", action="store_true", help="no LIC8 indexer scale")
    p.add_argument("--transport", default=d.transport, choices=["cma", "mooncake"],
                   help="transfer engine: 'cma' (same-host process_vm_readv) or 'mooncake' "
                        "(Mooncake Transfer Engine, one-sided reads over TCP or RDMA)")
    p.add_argument("--mooncake-protocol", default=d.mooncake_protocol, choices=["tcp", "rdma"],
                   help="Mooncake protocol")
    p.add_argument("--netns", action="store_true",
                   help="place Prefill and Decode in two network namespaces joined by a veth "
                        "pair (needs root and iproute2; falls back to loopback with a message)")
    p.add_argument("--cma-threads", type=int, default=d.cma_threads,
                   help="threads per Decode rank for large cma batches")
    p.add_argument("--kv-port", type=int, default=d.kv_port,
                   help="Decode base control port (0 = pick free ports)")
    p.add_argument("--seed", type=int, default=d.seed, help="block allocation seed")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="whole-run deadline (s)")
    p.add_argument("--no-replay", action="store_true",
                   help="skip the bare-transport replay (raw_gbps)")
    p.add_argument("--rounds", type=int, default=d.rounds,
                   help="A/B rounds in the same processes: each pulls every request anew "
                        "(new ids, every byte verified) and replays round 0's reads on the "
                        "bare transport, alternating which goes first; the summary gives "
                        "each round's pipeline/bare ratio and the medians")
    p.add_argument("--layer-compute-ms", type=float, default=d.layer_compute_ms, metavar="M",
                   help="each Prefill rank spends M ms per layer (host idle, as while a "
                        "device computes) before the layer is ready; the summary reports "
                        "tail_ms: last layer ready -> request complete on every Decode rank")
    p.add_argument("--fault", action="append", default=[], metavar="KIND@KEY=VALUE",
                   help="inject a fault (repeatable): " + fault_help() + ". Each also takes "
                        "rank=R (default: rank 0 for kill-*, every Decode rank otherwise), "
                        "e.g. --fault kill-decode@layer=3,rank=1")
    lib = Deadlines()
    # "%(default).0s" prints nothing: it only stops the formatter adding "(default: None)".
    for flag, text, seconds in (
        ("--request-timeout", "Decode request deadline, admission -> all KV", lib.request_s),
        ("--layer-ack-timeout", "Prefill: a layer's reply deadline per Decode endpoint "
         "(then the endpoint is reset)", lib.layer_ack_s),
        ("--meta-ack-timeout", "Prefill: MF_META acknowledgement deadline (also bounds "
         "one send)", lib.meta_ack_s),
        ("--exchange-timeout", "one TP all-gather among Decode ranks", lib.tp_exchange_s),
    ):
        p.add_argument(flag, type=float, default=None, metavar="S",
                       help=f"{text} (unset: the library default, {seconds:g} s; "
                            "see docs/operations/deadlines.md 'Deadlines')%(default).0s")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--log-level", default=d.log_level,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="rd2h log level (stderr)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_demo)


def _auth_secret(args: argparse.Namespace) -> str | None:
    from rd2h.app.secrets import read_secret_file

    if args.auth_secret is not None and args.auth_secret_file is not None:
        raise ValueError("give --auth-secret or --auth-secret-file, not both")
    if args.auth_secret_file is not None:
        return read_secret_file(args.auth_secret_file, "--auth-secret-file")
    if args.auth_secret is not None:
        print("rd2h demo: --auth-secret puts the secret in every process listing; prefer "
              "--auth-secret-file or $RD2H_AUTH_SECRET", file=sys.stderr)
        return args.auth_secret
    return os.environ.get("RD2H_AUTH_SECRET") or None


def _run_demo(args: argparse.Namespace) -> int:
    from rd2h.demo import run_demo, summary_text, to_json

    try:
        faults = tuple(parse_fault(spec) for spec in args.fault)
        auth_secret = _auth_secret(args)
    except (FaultSpecError, ValueError) as exc:
        print(f"rd2h demo: {exc}", file=sys.stderr)
        return 2
    cfg = DemoConfig(
        prefill_tp=args.prefill_tp, decode_tp=args.decode_tp, layers=args.layers,
        requests=args.requests, prompt_tokens=args.prompt_tokens, block_size=args.block_size,
        chunks=args.chunks, shared_buffers=args.shared_buffers, indexer=not args.no_indexer,
        via_provider=args.via_provider, auth_secret=auth_secret,
        scale=not (args.no_scale or args.no_indexer), transport=args.transport,
        cma_threads=args.cma_threads, kv_port=args.kv_port, seed=args.seed,
        mooncake_protocol=args.mooncake_protocol, netns=args.netns,
        timeout_s=args.timeout, replay=not args.no_replay, log_level=args.log_level,
        faults=faults, request_timeout_s=args.request_timeout, verify_kv=args.verify_kv,
        layer_ack_timeout_s=args.layer_ack_timeout, meta_ack_timeout_s=args.meta_ack_timeout,
        exchange_timeout_s=args.exchange_timeout, rounds=args.rounds,
        layer_compute_ms=args.layer_compute_ms, max_layers_per_frame=args.layers_per_frame,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"rd2h demo: {exc}", file=sys.stderr)
        return 2
    result = run_demo(cfg, progress=not (args.quiet or args.json))
    print(to_json(result) if args.json else summary_text(result))
    return 0 if result.verified else 1
