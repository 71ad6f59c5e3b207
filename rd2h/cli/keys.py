"""``rd2h keys``: make a ZeroMQ CURVE key pair for the control channel."""

from __future__ import annotations

import argparse
import json

_DESCRIPTION = """\
Print a new CURVE key pair (Z85 text) for rd2h's control channel.

With CURVE every control connection is encrypted and authenticated, and Decode
accepts only the Prefill keys it lists. Make one pair for the Decode side and one
per Prefill instance (or one shared by all), then configure, in
kv_connector_extra_config:

  Decode:  "curve_secret_key": <Decode secret>,
           "curve_allowed_keys": [<Prefill public>, ...]
  Prefill: "curve_secret_key": <Prefill secret>,
           "curve_server_key": <Decode public>

Keep secret keys out of logs and shell history; the public key may be shared.
"""


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make a CURVE key pair for the control channel",
                       description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true",
                   help='print {"public": ..., "secret": ...} instead of two lines')
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rd2h.app.gateways import curve_keypair

    public, secret = curve_keypair()
    if args.json:
        print(json.dumps({"public": public, "secret": secret}))
    else:
        print(f"public: {public}")
        print(f"secret: {secret}")
    return 0
