"""``rd2h proxy``: the rendezvous proxy a P/D deployment puts in front of its engines."""

from __future__ import annotations

import argparse
import ipaddress
import sys

_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}

_DESCRIPTION = """\
Serve the OpenAI endpoints /v1/completions and /v1/chat/completions in front of
vLLM engines running the rd2h connector (Decode: kv_consumer, Prefill: kv_producer).

Each client request goes to a Decode instance first (round robin) with
kv_transfer_params {"do_remote_prefill": true, "metaserver": "<public-url>/v1/metaserver"}
and the header X-Request-Id. Decode's connector posts its contact information to
that metaserver URL; the proxy then sends the same request to a Prefill instance
(round robin; one output token, not streamed) with Decode's contact information as
kv_transfer_params, and streams Decode's answer back to the client. A prompt list
goes to Prefill once, after every prompt's post arrived, with
batch_kv_transfer_params.

Connections to the engines are kept open between requests (pooled) for
--engine-keepalive seconds, which should stay below the engines' own keep-alive
(uvicorn's and vLLM's default: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A request whose
pooled connection the engine closed before reading it (a reset or a close with no
response byte) is sent once more on a fresh connection, logged at info, on both
legs; a Decode request only while no metaserver post arrived for it, under a new
X-Request-Id. A Decode instance that refuses connections is skipped for the next
one; a failed Prefill dispatch is tried once on the next Prefill instance.

Other endpoints:
  GET /v1/models    the engines' model list (Decode instances first, then Prefill;
                    502 if the engines answered errors, 503 if none answered within
                    --models-timeout)
  GET /metrics      the proxy's own Prometheus series (text format), all named
                    rd2h_proxy_*: requests_total{endpoint,outcome},
                    requests_in_flight{endpoint}, upstream_failures_total{leg,reason},
                    upstream_retries_total{leg,reason}, metaserver_posts_total{status},
                    prefill_dispatches_total{outcome}, pending_rendezvous,
                    prefill_in_flight, and per-hop latency histograms in seconds:
                    decode_response_start (client request -> Decode's response
                    headers), decode_admission (request sent to Decode -> its last
                    metaserver post), prefill_dispatch (that post -> the Prefill
                    request written), prefill_leg (Prefill dispatch -> its answer),
                    request_duration (client request -> last byte relayed)
  GET /healthcheck  the instance lists, the requests in flight and plain counters
"""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, not {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be within 1..65535, not {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, not {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"seconds must be > 0, not {text}")
    return value


def add_proxy_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``proxy`` subcommand on the ``rd2h`` parser."""
    p = sub.add_parser(
        "proxy",
        help="rendezvous proxy in front of Prefill and Decode vLLM engines",
        description=_DESCRIPTION,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=100),
    )
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000,
                   help="port to listen on (default: %(default)s)")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="Prefill instance base URLs, e.g. http://10.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="Decode instance base URLs, e.g. http://10.0.0.2:8200")
    p.add_argument("--public-url", metavar="URL",
                   help="base URL at which the engines reach this proxy's metaserver "
                        "(default: http://HOST:PORT; 127.0.0.1 when HOST is a wildcard)")
    p.add_argument("--connect-timeout", type=_seconds, default=10.0, metavar="S",
                   help="deadline to connect to an engine (default: %(default)s)")
    p.add_argument("--decode-timeout", type=_seconds, default=600.0, metavar="S",
                   help="longest wait for Decode's next bytes, including its first answer "
                        "(default: %(default)s)")
    p.add_argument("--prefill-timeout", type=_seconds, default=600.0, metavar="S",
                   help="deadline for a whole Prefill dispatch (default: %(default)s)")
    p.add_argument("--models-timeout", type=_seconds, default=10.0, metavar="S",
                   help="deadline for answering GET /v1/models from the engines "
                        "(default: %(default)s)")
    p.add_argument("--engine-keepalive", type=_seconds, default=2.0, metavar="S",
                   help="idle connections to the engines are closed after S seconds; keep it "
                        "below the engines' keep-alive, 5 s by default (default: %(default)s)")
    p.add_argument("--client-keepalive", type=_seconds, default=75.0, metavar="S",
                   help="idle connections from clients and the engines' metaserver posts are "
                        "closed after S seconds; keep it above the clients' own pool expiry "
                        "(vLLM's serving benchmark: 60 s, httpx: 5 s) (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level for rd2h and uvicorn (stderr; default: %(default)s)")
    p.add_argument("--timeline-dir", metavar="DIR",
                   help="write per-request timeline stamps under DIR for 'rd2h timeline' "
                        "(default: $RD2H_TIMELINE_DIR; unset: none)")
    p.set_defaults(func=_run_proxy)


def default_public_url(host: str, port: int) -> str:
    """Where engines on this host reach the proxy when --public-url is not given."""
    if host in _WILDCARD_HOSTS:
        host = "127.0.0.1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


def _run_proxy(args: argparse.Namespace) -> int:
    from rd2h.app.gateways import proxy_config, serve_proxy

    public_url = args.public_url or default_public_url(args.host, args.port)
    try:
        config = proxy_config(
            prefill=tuple(args.prefill), decode=tuple(args.decode), public_url=public_url,
            connect_timeout_s=args.connect_timeout, decode_timeout_s=args.decode_timeout,
            prefill_timeout_s=args.prefill_timeout, models_timeout_s=args.models_timeout,
            engine_keepalive_s=args.engine_keepalive, client_keepalive_s=args.client_keepalive,
        )
    except ValueError as exc:
        print(f"rd2h proxy: {exc}", file=sys.stderr)
        return 2
    if args.public_url is None and args.host in _WILDCARD_HOSTS:
        print(f"rd2h proxy: engines are told {config.metaserver_url}; pass --public-url if they "
              "run on other hosts", file=sys.stderr)
    serve_proxy(config, args.host, args.port, args.log_level, timeline_dir=args.timeline_dir)
    return 0
