"""The ``rd2h`` command line."""

from __future__ import annotations

import argparse
import sys

from rd2h import __version__
from rd2h.cli.demo import add_demo_parser
from rd2h.cli.keys import add_keys_parser
from rd2h.cli.probe import add_probe_parser
from rd2h.cli.proxy import add_proxy_parser
from rd2h.cli.proxy_admin import add_proxy_admin_parser
from rd2h.cli.serve import add_serve_parser
from rd2h.cli.timeline import add_timeline_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rd2h",
        description="rd2h: pull-model KV-cache transfer from Prefill to Decode workers.",
    )
    parser.add_argument("--version", action="version", version=f"rd2h {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_demo_parser(sub)
    add_probe_parser(sub)
    add_proxy_parser(sub)
    add_proxy_admin_parser(sub)
    add_serve_parser(sub)
    add_keys_parser(sub)
    add_timeline_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
