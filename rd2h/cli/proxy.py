"""``rd2h proxy``: the rendezvous proxy a P/D deployment puts in front of its engines."""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from collections.abc import Mapping

_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}

_DESCRIPTION = """\
Serve the OpenAI endpoints /v1/completions and /v1/chat/completions in front of
vLLM engines running the rd2h connector (Decode: kv_consumer, Prefill: kv_producer).

Each client request goes to a Decode instance first with kv_transfer_params
{"do_remote_prefill": true, "metaserver": "<public-url>/v1/metaserver"} and the
headers X-Request-Id and traceparent (the client's, or a new one). Decode's connector
posts its contact information to that metaserver URL; the proxy then sends the same
request to a Prefill instance (one output token, not streamed) with Decode's contact
information as kv_transfer_params, and streams Decode's answer back to the client. A
prompt list goes to Prefill once, after every prompt's post arrived, with
batch_kv_transfer_params.

Picking (per role, --decode-policy / --prefill-policy):
  least_outstanding  the instance with the fewest requests this proxy has in flight
                     there (ties rotate); the default
  power_of_two       two instances at random, the less loaded one
  round_robin        each in turn
With --engine-metrics S the load also counts each engine's vllm:num_requests_waiting
(its /metrics read every S seconds), and ties go to the lower vllm:kv_cache_usage_perc.
Decode picking has prefix affinity (--affinity-chunk, 0: off): a prompt that begins
like one a Decode instance served recently goes back there while that instance's load
is within --affinity-slack of the least loaded one, so its prefix cache holds the
start and only the rest is pulled. With --local-prefill-tokens N, a Decode whose
prefix cache lacks at most N of the prompt's tokens computes them itself and no
Prefill is dispatched (counted in prefill_skipped_total).

Health: every instance's /health is probed each --probe-interval seconds (deadline
--probe-timeout). A refused connection, or a probe refused, unreachable or answered
with another status than 200, ejects an instance at once; probes that connect but get
no answer in time eject it after --eject-after-probe-timeouts in a row (one late answer
from a busy API server is not enough); 5xx answers, timeouts and broken streams eject
it after --eject-after in a row. It stays out for a back-off that doubles while it
keeps failing (--eject-backoff up to --eject-backoff-max) and is readmitted by the
first good probe after that; when no instance of its role can serve, by the first
good probe at once (a request arriving then probes the ejected ones itself).

Failures reach the client honestly: the answer starts only with Decode's first byte,
so a Prefill leg that fails for good is answered with Prefill's status and error body
(502 unreachable, 504 timed out) and Decode's request is closed (with
--on-prefill-failure decode, Decode is told at once and answers as its
kv_load_failure_policy says, and an error it then answers names the Prefill
failure); a client that leaves closes both legs. A request goes to another instance
only when nothing can have been handed off: a refused connection (any instance not
yet tried), a pooled connection the engine closed before reading the request (once,
same instance), or, on the Decode leg, any other failure before Decode answered or
posted to the metaserver (once, another Decode).

Connections to the engines are kept open between requests (pooled) for
--engine-keepalive seconds, which should stay below the engines' own keep-alive
(uvicorn's and vLLM's default: 5 s, VLLM_HTTP_TIMEOUT_KEEP_ALIVE). A request whose
pooled connection the engine closed before reading it (a reset or a close with no
response byte) is sent once more on a fresh connection, logged at info, on both
legs; a Decode request only while no metaserver post arrived for it, under a new
X-Request-Id.

Other endpoints:
  GET /v1/models    the engines' model list (Decode instances first, then Prefill;
                    502 if the engines answered errors, 503 if none answered within
                    --models-timeout)
  POST /tokenize, POST /detokenize
                    relayed to the engines in the same order, with the same
                    answers and deadline as GET /v1/models
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
  GET /health       200 while at least one Prefill and one Decode can take requests,
                    else 503
  GET /status       every instance: state (admitted, ejected, draining, drained),
                    in-flight count, last error, engine load
  GET /healthcheck  the instance lists, the requests in flight and plain counters
  /admin/...        live membership and drain, on only with an admin token
                    (--admin-token-file FILE, $RD2H_PROXY_ADMIN_TOKEN_FILE or
                    $RD2H_PROXY_ADMIN_TOKEN), each call with "Authorization: Bearer
                    TOKEN"; see 'rd2h proxy-admin --help'

Sidecar mode (--prefiller-header), for fleets routed by llm-d's endpoint picker: a
request's x-prefiller-host-port header (host:port) names the Prefill to use; it must
be one of --prefill (the allowlist; others are refused with 403).

Exit status: 0 stopped by Ctrl-C or SIGTERM; 2 a bad flag or configuration (one line
naming it); 3 it could not listen on --host:--port (in use, or not permitted: the
ERROR line before says which).
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


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {text}")
    return value


def _policies() -> list:
    from rd2h.proxy.routing import Policy

    return list(Policy)


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
    g = p.add_argument_group("routing")
    policies = [x.value for x in _policies()]
    g.add_argument("--decode-policy", choices=policies, default="least_outstanding",
                   help="how a Decode instance is picked (default: %(default)s)")
    g.add_argument("--prefill-policy", choices=policies, default="least_outstanding",
                   help="how a Prefill instance is picked (default: %(default)s)")
    g.add_argument("--engine-metrics", type=_non_negative, default=0.0, metavar="S",
                   help="read each engine's /metrics every S seconds for load-aware picking; "
                        "0: off (default: %(default)s)")
    g.add_argument("--affinity-chunk", type=int, default=64, metavar="CHARS",
                   help="prefix affinity for Decode keyed on whole chunks of this many prompt "
                        "characters; 0: off (default: %(default)s)")
    g.add_argument("--affinity-slack", type=_non_negative, default=4.0, metavar="N",
                   help="keep affinity while the instance has at most N more requests in "
                        "flight than the least loaded one (default: %(default)s)")
    g.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="no Prefill when Decode's prefix cache lacks at most N prompt tokens: "
                        "Decode computes them; 0: off (default: %(default)s)")
    g.add_argument("--on-prefill-failure", choices=["fail", "decode"], default="fail",
                   help="a Prefill leg that failed for good: 'fail' closes Decode's request and "
                        "answers the client with Prefill's status and body; 'decode' leaves the "
                        "answer to Decode, told at once, which applies its "
                        "kv_load_failure_policy (recompute: it computes the prompt itself) "
                        "(default: %(default)s)")
    g.add_argument("--dispatch", choices=["decode-first", "parallel"], default="decode-first",
                   help="'decode-first' sends a request to Prefill once Decode admitted it and "
                        "posted its contact; 'parallel' sends it to Prefill and Decode at once, "
                        "with the contact that Decode instance posted last (its first request "
                        "goes Decode-first; single prompts only; not with "
                        "--local-prefill-tokens): Prefill's start no longer waits for "
                        "Decode's queue (default: %(default)s)")
    g.add_argument("--upstream-sockets", choices=["aiohttp", "asyncio", "anyio"], default="aiohttp",
                   help="the proxy's HTTP client to the engines: 'aiohttp' (aiohttp's "
                        "client, the least CPU per request), 'asyncio' (httpx on asyncio's "
                        "streams) or 'anyio' (httpx on httpcore's default sockets, the most "
                        "CPU); the httpx ones are kept to compare or fall back on "
                        "(default: %(default)s)")
    g.add_argument("--prefiller-header", action="store_true",
                   help="sidecar mode: honour x-prefiller-host-port (one of --prefill)")
    h = p.add_argument_group("health")
    h.add_argument("--probe-interval", type=_seconds, default=2.0, metavar="S",
                   help="probe every instance's /health every S seconds (default: %(default)s)")
    h.add_argument("--probe-timeout", type=_seconds, default=1.0, metavar="S",
                   help="deadline of one probe (default: %(default)s)")
    h.add_argument("--eject-after", type=int, default=5, metavar="N",
                   help="eject after N failed requests in a row (5xx, timeout, broken "
                        "stream); refused connections and failed (not late) probes eject at once "
                        "(default: %(default)s)")
    h.add_argument("--eject-after-probe-timeouts", type=int, default=2, metavar="N",
                   help="eject after N probes in a row connect but get no answer within "
                        "--probe-timeout (1: at the first; default: %(default)s)")
    h.add_argument("--eject-backoff", type=_seconds, default=1.0, metavar="S",
                   help="first ejection's back-off; doubles while failing (default: %(default)s)")
    h.add_argument("--eject-backoff-max", type=_seconds, default=30.0, metavar="S",
                   help="longest back-off (default: %(default)s)")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="file holding the admin API's bearer token (at least 16 "
                        "characters; readable by its owner only, e.g. a mounted Kubernetes "
                        "Secret; default: $RD2H_PROXY_ADMIN_TOKEN_FILE, else the token in "
                        "$RD2H_PROXY_ADMIN_TOKEN; none: the admin API is off)")
    p.add_argument("--admin-token", metavar="TOKEN",
                   help="the token itself: visible in every process listing, so prefer "
                        "--admin-token-file or $RD2H_PROXY_ADMIN_TOKEN")
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


ADMIN_TOKEN_ENV = "RD2H_PROXY_ADMIN_TOKEN"
ADMIN_TOKEN_FILE_ENV = "RD2H_PROXY_ADMIN_TOKEN_FILE"


def admin_token(token: str | None, token_file: str | None, *, flag: str = "--admin-token",
                environ: Mapping[str, str] | None = None) -> str | None:
    """The admin token from ``token_file`` (``{flag}-file``), ``token`` (``flag``, with a
    warning: every process listing shows it), ``$RD2H_PROXY_ADMIN_TOKEN_FILE`` or
    ``$RD2H_PROXY_ADMIN_TOKEN``, in that order; None if none is given. ``ValueError``
    names the source that cannot be used, never the token."""
    from rd2h.app.secrets import read_secret_file

    env = os.environ if environ is None else environ
    if token is not None and token_file is not None:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if token_file is not None:
        return read_secret_file(token_file, f"{flag}-file")
    if token is not None:
        print(f"rd2h: {flag} puts the token in every process listing; prefer {flag}-file "
              f"or ${ADMIN_TOKEN_ENV}", file=sys.stderr)
        return token
    if env.get(ADMIN_TOKEN_FILE_ENV):
        return read_secret_file(env[ADMIN_TOKEN_FILE_ENV], f"${ADMIN_TOKEN_FILE_ENV}")
    return env.get(ADMIN_TOKEN_ENV) or None


def _run_proxy(args: argparse.Namespace) -> int:
    from rd2h.bootstrap.gateways import proxy_config, serve_proxy

    public_url = args.public_url or default_public_url(args.host, args.port)
    try:
        config = proxy_config(
            prefill=tuple(args.prefill), decode=tuple(args.decode), public_url=public_url,
            connect_timeout_s=args.connect_timeout, decode_timeout_s=args.decode_timeout,
            prefill_timeout_s=args.prefill_timeout, models_timeout_s=args.models_timeout,
            engine_keepalive_s=args.engine_keepalive, client_keepalive_s=args.client_keepalive,
            decode_policy=args.decode_policy, prefill_policy=args.prefill_policy,
            engine_metrics_s=args.engine_metrics, affinity_chunk_chars=args.affinity_chunk,
            affinity_slack=args.affinity_slack, local_prefill_tokens=args.local_prefill_tokens,
            prefiller_header=args.prefiller_header,
            on_prefill_failure=args.on_prefill_failure, probe_interval_s=args.probe_interval,
            dispatch=args.dispatch, upstream_sockets=args.upstream_sockets,
            probe_timeout_s=args.probe_timeout, eject_after=args.eject_after,
            eject_after_probe_timeouts=args.eject_after_probe_timeouts,
            eject_base_s=args.eject_backoff, eject_max_s=args.eject_backoff_max,
            admin_token=admin_token(args.admin_token, args.admin_token_file),
        )
    except ValueError as exc:
        print(f"rd2h proxy: {exc}", file=sys.stderr)
        return 2
    if args.public_url is None and args.host in _WILDCARD_HOSTS:
        print(f"rd2h proxy: engines are told {config.metaserver_url}; pass --public-url if they "
              "run on other hosts", file=sys.stderr)
    serve_proxy(config, args.host, args.port, args.log_level, timeline_dir=args.timeline_dir)
    return 0
