"""``rd2h proxy-admin``: live membership and drain of a running ``rd2h proxy``."""

from __future__ import annotations

import argparse
import json
import sys
import time

_DESCRIPTION = """\
Talk to a running 'rd2h proxy' started with an admin token (--admin-token-file,
$RD2H_PROXY_ADMIN_TOKEN_FILE or $RD2H_PROXY_ADMIN_TOKEN); this command reads the same.

  status                       every instance: state, in-flight count, last error
  add ROLE URL                 add an instance (or take back a drained or removed one)
  remove ROLE URL              take an instance out now; requests in flight finish
  drain ROLE URL [--wait S]    no new requests; with --wait, wait up to S seconds until
                               its requests in flight are done (exit 1 if not by then)

ROLE is prefill or decode; URL the instance's base URL as the proxy knows it.

Exit status: 0 done (drain --wait: drained in time); 1 the proxy refused the request
(its HTTP status and answer on stderr), could not be reached, or drain --wait ran out
of time; 2 bad arguments or no admin token.
"""


def add_proxy_admin_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("proxy-admin", help="add, remove or drain instances of a running proxy",
                       description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--proxy", default="http://127.0.0.1:8000", metavar="URL",
                   help="the proxy's base URL (default: %(default)s)")
    p.add_argument("--token-file", metavar="FILE",
                   help="file holding the admin token, readable by its owner only or, "
                        "owned by root, its group (default: $RD2H_PROXY_ADMIN_TOKEN_FILE, "
                        "else the token in $RD2H_PROXY_ADMIN_TOKEN)")
    p.add_argument("--token", metavar="TOKEN",
                   help="the token itself (visible in process listings; prefer --token-file)")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="deadline of each call (default: %(default)s)")
    p.add_argument("action", choices=["status", "add", "remove", "drain"])
    p.add_argument("role", nargs="?", choices=["prefill", "decode"])
    p.add_argument("url", nargs="?")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="drain: wait up to S seconds until drained (default: no wait)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import httpx

    from rd2h.cli.proxy import admin_token

    try:
        token = admin_token(args.token, args.token_file, flag="--token")
    except ValueError as exc:
        print(f"rd2h proxy-admin: {exc}", file=sys.stderr)
        return 2
    if not token:
        print("rd2h proxy-admin: no token (--token-file, $RD2H_PROXY_ADMIN_TOKEN_FILE or "
              "$RD2H_PROXY_ADMIN_TOKEN)", file=sys.stderr)
        return 2
    if args.action != "status" and (args.role is None or args.url is None):
        print(f"rd2h proxy-admin: {args.action} needs ROLE and URL", file=sys.stderr)
        return 2
    base = args.proxy.rstrip("/") + "/admin/instances"
    headers = {"Authorization": f"Bearer {token}"}
    target = {"role": args.role, "url": args.url}
    try:
        with httpx.Client(timeout=args.timeout, headers=headers) as client:
            if args.action == "status":
                r = client.get(base)
            elif args.action == "add":
                r = client.post(base, json=target)
            else:
                r = client.post(f"{base}/{args.action}", json=target)
            if r.status_code != 200:
                print(f"rd2h proxy-admin: HTTP {r.status_code}: {r.text}", file=sys.stderr)
                return 1
            print(json.dumps(r.json(), indent=2))
            if args.action != "drain" or args.wait <= 0:
                return 0
            deadline = time.monotonic() + args.wait
            while True:
                state = client.get(f"{base}/drain", params=target).json()
                if state.get("drained"):
                    print(f"drained: {args.role} {args.url}")
                    return 0
                if time.monotonic() >= deadline:
                    print(f"rd2h proxy-admin: still {state.get('in_flight')} in flight after "
                          f"{args.wait:g} s", file=sys.stderr)
                    return 1
                print(f"draining: {state.get('in_flight')} in flight", file=sys.stderr)
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
    except httpx.HTTPError as exc:
        print(f"rd2h proxy-admin: {args.proxy}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
