"""``rd2h proxy``'s configuration, validated at construction so that a bad flag fails
before the server starts."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from rd2h.proxy.routing import Policy

METASERVER_PATH = "/v1/metaserver"
FORWARDED_HEADERS = ("authorization",)


def normalize_base_url(url: str, what: str) -> str:
    """``http(s)://host[:port]`` without a trailing slash; ValueError naming ``what``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{what} {url!r} must look like http://HOST:PORT")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{what} {url!r} has an invalid port: {exc}") from exc
    if port == 0:
        raise ValueError(f"{what} {url!r} has port 0")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{what} {url!r} must be a base URL with no path, query or fragment")
    return f"{parts.scheme}://{parts.netloc}"


DISPATCH_MODES = ("decode-first", "parallel")
UPSTREAM_SOCKETS = ("aiohttp", "asyncio", "anyio")


@dataclass(frozen=True)
class ProxyConfig:
    """Validated at construction, so a bad flag fails before the server starts."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    public_url: str
    connect_timeout_s: float = 10.0
    decode_timeout_s: float = 600.0
    prefill_timeout_s: float = 600.0
    shutdown_timeout_s: float = 5.0
    # Idle pooled connections to the engines are dropped after this long: below the
    # engines' own keep-alive (uvicorn's and vLLM's default is 5 s), so that the proxy
    # does not reuse a connection the engine is about to close.
    engine_keepalive_s: float = 2.0
    # How long the proxy's own server keeps an idle client connection (clients and the
    # engines' metaserver posts): above the clients' pool expiry (httpx: 5 s, vLLM's
    # serving benchmark: 60 s), so that a client does not reuse one the proxy closes.
    client_keepalive_s: float = 75.0
    models_timeout_s: float = 10.0
    # Routing (rd2h.proxy.routing): a policy per role, /health probes, ejection.
    decode_policy: str = Policy.LEAST_OUTSTANDING.value
    prefill_policy: str = Policy.LEAST_OUTSTANDING.value
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 1.0
    eject_after: int = 5
    # Probes in a row that connect but get no answer in time before an ejection.
    eject_after_probe_timeouts: int = 2
    eject_base_s: float = 1.0
    eject_max_s: float = 30.0
    # Scrape each engine's /metrics this often for load-aware picking; 0: off.
    engine_metrics_s: float = 0.0
    # Prefix affinity for Decode (rd2h.proxy.affinity); 0 characters: off.
    affinity_chunk_chars: int = 64
    # The instance holding a prefix is used while its load is within this many
    # requests of the least loaded instance.
    affinity_slack: float = 4.0
    # Decode computes the prompt itself when it lacks at most this many tokens; 0: off.
    local_prefill_tokens: int = 0
    # Admin API (/admin/...): the bearer token; None: the API is off.
    admin_token: str | None = None
    # Sidecar mode: honour x-prefiller-host-port (one of the Prefill URLs).
    prefiller_header: bool = False
    # A Prefill leg that failed for good: "fail" closes Decode's request and answers the
    # client with Prefill's status; "decode" leaves the answer to Decode (told at once,
    # it applies its kv_load_failure_policy: "recompute" computes the prompt itself).
    on_prefill_failure: str = "fail"
    # "decode-first": Prefill is sent a request once Decode posted its contact (spec
    # 3.1). "parallel": Prefill and Decode at once, with the contact the Decode instance
    # posted last (its first request goes Decode-first); Decode keeps announcements that
    # arrive before its admission. Single-prompt requests only, and not with
    # local_prefill_tokens.
    dispatch: str = "decode-first"
    # The proxy's HTTP client to its engines and its sockets: "aiohttp" (aiohttp's client,
    # rd2h.proxy.aioclient: the least CPU per request), "asyncio" (httpx on asyncio's
    # streams, rd2h.proxy.netio) or "anyio" (httpx on httpcore's default backend, the
    # most CPU). The two httpx ones are kept to compare and to fall back on.
    upstream_sockets: str = "aiohttp"

    def __post_init__(self) -> None:
        for role in ("prefill", "decode"):
            urls = tuple(normalize_base_url(u, f"{role} URL") for u in getattr(self, role))
            if not urls:
                raise ValueError(f"at least one {role} instance URL is needed")
            dupes = sorted({u for u in urls if urls.count(u) > 1})
            if dupes:
                raise ValueError(f"{role} URL listed more than once: {', '.join(dupes)}")
            object.__setattr__(self, role, urls)
        object.__setattr__(self, "public_url", normalize_base_url(self.public_url, "public URL"))
        for name in ("connect_timeout_s", "decode_timeout_s", "prefill_timeout_s",
                     "shutdown_timeout_s", "engine_keepalive_s", "client_keepalive_s",
                     "models_timeout_s", "probe_interval_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        for name in ("engine_metrics_s", "affinity_slack"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, not {getattr(self, name)!r}")
        for name in ("affinity_chunk_chars", "local_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
        for name in ("decode_policy", "prefill_policy"):
            value = getattr(self, name)
            if value not in {p.value for p in Policy}:
                raise ValueError(f"{name} {value!r} is not one of "
                                 f"{', '.join(p.value for p in Policy)}")
        if self.on_prefill_failure not in ("fail", "decode"):
            raise ValueError(f"on_prefill_failure must be 'fail' or 'decode', not "
                             f"{self.on_prefill_failure!r}")
        if self.dispatch not in DISPATCH_MODES:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH_MODES)}, not "
                             f"{self.dispatch!r}")
        if self.upstream_sockets not in UPSTREAM_SOCKETS:
            raise ValueError(f"upstream_sockets must be one of {', '.join(UPSTREAM_SOCKETS)}, "
                             f"not {self.upstream_sockets!r}")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        from rd2h.proxy.routing import HealthRules

        HealthRules(self.eject_after, self.eject_base_s, self.eject_max_s,
                    self.eject_after_probe_timeouts)  # validates

    @property
    def metaserver_url(self) -> str:
        return self.public_url + METASERVER_PATH
