"""``rd2h timeline``: the per-request breakdown of the serving path from timeline stamps."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rd2h.app.timeline import (
    breakdown,
    load,
    load_reads,
    pull_overlap,
    render,
    render_overlap,
    select,
)

_DESCRIPTION = """\
Merge the per-request stamps that the proxy and the engines' rd2h connectors write
when RD2H_TIMELINE_DIR (or the connector option timeline_dir) names a folder, and
print, for each hop of a request's path (proxy -> Decode admission -> metaserver post
-> Prefill -> announcements and reads -> Decode's first token), the p50 and p99 of
the time since the previous hop, the p50 of the time since the proxy received the
request, and who owns that interval ("vLLM": vLLM's own engine loop, IPC or API
server; "rd2h": the connector's waits; "proxy"; "model": the Prefill forward).
Then the pull overlap: the share of each request's bytes that Decode had read when
Prefill's last layer of the prompt was ready, and how long the pull went on after.

Exit status: 0 printed; 1 the folder holds no stamped request; 2 the folder does not
exist."""


def add_timeline_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "timeline", help="per-hop latency breakdown of requests from timeline stamps",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("directory", type=Path, help="the folder the processes stamped into")
    p.add_argument("--since", type=float, metavar="UNIX_TIME",
                   help="only requests that started at or after this time")
    p.add_argument("--until", type=float, metavar="UNIX_TIME",
                   help="only requests that started at or before this time")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if not args.directory.is_dir():
        print(f"rd2h timeline: {args.directory} is not a folder", file=sys.stderr)
        return 2
    requests = select(load(args.directory), args.since, args.until)
    if not requests:
        print(f"rd2h timeline: no stamped requests in {args.directory}", file=sys.stderr)
        return 1
    b = breakdown(requests)
    overlap = pull_overlap(requests, load_reads(args.directory))
    if args.json:
        out = b.to_json()
        out["pull_overlap"] = overlap.to_json() if overlap is not None else None
        print(json.dumps(out))
    else:
        print(render(b))
        print(render_overlap(overlap))
    return 0
