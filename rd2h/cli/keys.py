"""``rd2h keys``: make a ZeroMQ CURVE key pair for the control channel."""

from __future__ import annotations

import argparse
import json
import os
import sys

_DESCRIPTION = """\
Print a new CURVE key pair (Z85 text) for rd2h's control channel.

With CURVE every control connection is encrypted and authenticated, and Decode
accepts only the Prefill keys it lists. Make one pair for the Decode side and one
per Prefill instance (or one shared by all), then configure, in
kv_connector_extra_config:

  Decode:  "curve_secret_key_file": <file holding the Decode secret>,
           "curve_allowed_keys": [<Prefill public>, ...]
  Prefill: "curve_secret_key_file": <file holding the Prefill secret>,
           "curve_server_key": <Decode public>

A secret key is given as a file readable by its owner only or, owned by root, its
group (or an environment variable, curve_secret_key_env), never inline: vLLM logs
kv_connector_extra_config.
--secret-file writes the secret straight into such a file (mode 0600) and prints only
the public key. The public key may be shared.

Exit status: 0 the pair was made; 2 --secret-file cannot be created (it exists, or its
folder is missing or not writable).
"""


def add_keys_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make a CURVE key pair for the control channel",
                       description=_DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true",
                   help='print {"public": ..., "secret": ...} instead of two lines')
    p.add_argument("--secret-file", metavar="FILE",
                   help="write the secret key to FILE (created with mode 0600; an existing "
                        "file is refused) and print only the public key")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from rd2h.bootstrap.gateways import curve_keypair

    public, secret = curve_keypair()
    if args.secret_file is not None:
        try:
            fd = os.open(args.secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            print(f"rd2h keys: cannot create {args.secret_file!r}: {exc.strerror}",
                  file=sys.stderr)
            return 2
        with os.fdopen(fd, "w") as fh:
            fh.write(secret + "\n")
        print(json.dumps({"public": public}) if args.json else f"public: {public}")
        return 0
    if args.json:
        print(json.dumps({"public": public, "secret": secret}))
    else:
        print(f"public: {public}")
        print(f"secret: {secret}")
    return 0
