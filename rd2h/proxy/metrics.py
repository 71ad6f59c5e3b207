"""``rd2h proxy``'s Prometheus series, on a registry of its own.

Each proxy gets a fresh ``CollectorRegistry`` (never prometheus_client's global
default), so two proxies in one process, or a proxy inside a vLLM process, never
clash. ``GET /metrics`` renders it in the Prometheus text format.

Series (all names start with ``rd2h_proxy_``):

* ``requests_total{endpoint,outcome}``: client requests by path and how they ended
  (``ok``, ``engine_error``: the engine answered an HTTP error, relayed as is,
  ``invalid``: refused by the proxy, ``unavailable``: no engine answered or none
  was admitted, ``prefill_failed``: the Prefill leg failed for good and its status
  was relayed, ``broken``: Decode's stream broke mid-answer, ``disconnected``: the
  client left).
* ``requests_in_flight{endpoint}``, ``pending_rendezvous``, ``prefill_in_flight``.
* ``upstream_failures_total{leg,reason}``: failed engine requests (``leg``:
  ``decode``, ``prefill``, ``models``, ``tokenize``, ``detokenize``; ``reason``:
  ``connect``, ``connect_timeout``, ``timeout``, ``connection_reset``,
  ``connection_closed``, ``transport``,
  ``status_4xx``, ``status_5xx``, ``stream_broken``, ``bad_answer``), including
  the ones that were sent again and then succeeded.
* ``upstream_retries_total{leg,reason}``: requests sent again: ``stale_connection``
  (the engine closed a pooled connection before reading the request: same engine,
  fresh connection) or ``failover`` (the next instance).
* ``metaserver_posts_total{status}``: Decode's posts by outcome (``waiting``,
  ``dispatched``, ``duplicate``, ``rejected``, ``unknown``, ``unexpected``).
* ``prefill_dispatches_total{outcome}``: ``ok`` or ``failed``.
* Latency histograms, seconds, per hop of a request:
  ``decode_response_start_seconds{endpoint}`` client request received -> Decode's
  response headers; ``decode_admission_seconds`` request sent to Decode -> its last
  metaserver post (every Decode rank admitted it); ``prefill_dispatch_seconds``
  that post received -> the Prefill request written to its connection;
  ``prefill_leg_seconds{outcome}`` Prefill dispatch started -> Prefill's answer
  (resends included); ``request_duration_seconds{endpoint}`` client request
  received -> last byte of the answer relayed; ``decode_first_byte_seconds{endpoint}``
  client request received -> Decode's first answer byte.
* Routing: ``instance_in_flight{role,instance}`` (requests the proxy has in flight
  at each engine), ``instance_healthy{role,instance}`` (1 admitted, 0 ejected),
  ``ejections_total{role,cause}`` (``connect``, ``probe``, ``probe_timeout``,
  ``error``, ``timeout``, ``broken``), ``readmissions_total{role}``,
  ``prefill_skipped_total{reason}``
  (``decode_holds_prompt``: Decode computed the few missing tokens itself),
  ``affinity_total{result}`` (Decode picks by prefix: ``hit``, ``overloaded``: the
  instance holding the prefix was too busy or out, ``miss``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

PREFIX = "rd2h_proxy_"
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                     1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class HealthCounters:
    """The plain counters ``GET /healthcheck`` shows."""

    requests: int = 0
    decode_errors: int = 0
    metaserver_posts: int = 0
    metaserver_rejected: int = 0
    prefill_dispatched: int = 0
    prefill_ok: int = 0
    prefill_failed: int = 0
    incomplete_rendezvous: int = 0
    decode_resent: int = 0
    prefill_resent: int = 0
    prefill_skipped: int = 0
    prefill_parallel: int = 0  # sent to Prefill with Decode at once (parallel dispatch)
    parallel_mismatch: int = 0  # of those, sent again: Decode posted another contact


class ProxyMetrics:
    """The series of one proxy; ``pending`` and ``prefill_in_flight`` are read at scrape."""

    def __init__(self, pending: Callable[[], int], prefill_in_flight: Callable[[], int]) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(PREFIX + "requests", "Client requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.in_flight = Gauge(PREFIX + "requests_in_flight",
                               "Client requests being answered", ["endpoint"], registry=r)
        self.failures = Counter(PREFIX + "upstream_failures",
                                "Failed engine requests by leg and reason (resent ones included)",
                                ["leg", "reason"], registry=r)
        self.retries = Counter(PREFIX + "upstream_retries",
                               "Engine requests sent again, by leg and reason",
                               ["leg", "reason"], registry=r)
        self.posts = Counter(PREFIX + "metaserver_posts", "Metaserver posts by outcome",
                             ["status"], registry=r)
        self.dispatches = Counter(PREFIX + "prefill_dispatches",
                                  "Prefill dispatches by outcome", ["outcome"], registry=r)
        pending_gauge = Gauge(PREFIX + "pending_rendezvous",
                              "Requests sent to Decode whose answer has not ended", registry=r)
        pending_gauge.set_function(pending)
        prefill_gauge = Gauge(PREFIX + "prefill_in_flight",
                              "Prefill dispatches running", registry=r)
        prefill_gauge.set_function(prefill_in_flight)

        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, doc, list(labels), buckets=LATENCY_BUCKETS_S,
                             registry=r)

        self.decode_response_start = histogram(
            "decode_response_start_seconds",
            "Client request received -> Decode's response headers", ("endpoint",))
        self.decode_admission = histogram(
            "decode_admission_seconds",
            "Request sent to Decode -> its last metaserver post (every rank admitted it)")
        self.prefill_dispatch = histogram(
            "prefill_dispatch_seconds",
            "Last metaserver post received -> Prefill request written to its connection")
        self.prefill_leg = histogram(
            "prefill_leg_seconds", "Prefill dispatch started -> Prefill's answer (resends "
            "included)", ("outcome",))
        self.request_duration = histogram(
            "request_duration_seconds",
            "Client request received -> last byte of the answer relayed", ("endpoint",))

        self.decode_first_byte = histogram(
            "decode_first_byte_seconds",
            "Client request received -> Decode's first answer byte", ("endpoint",))
        self.instance_in_flight = Gauge(PREFIX + "instance_in_flight",
                                        "Requests in flight per engine instance",
                                        ["role", "instance"], registry=r)
        self.instance_healthy = Gauge(PREFIX + "instance_healthy",
                                      "1 while an engine instance is admitted, 0 when ejected",
                                      ["role", "instance"], registry=r)
        self.ejections = Counter(PREFIX + "ejections", "Engine instances ejected, by cause",
                                 ["role", "cause"], registry=r)
        self.readmissions = Counter(PREFIX + "readmissions",
                                    "Ejected engine instances readmitted by a probe",
                                    ["role"], registry=r)
        self.prefill_skipped = Counter(PREFIX + "prefill_skipped",
                                       "Requests answered without a Prefill dispatch",
                                       ["reason"], registry=r)
        self.affinity = Counter(PREFIX + "affinity", "Decode picks by prompt prefix",
                                ["result"], registry=r)

    def failure(self, leg: str, reason: str) -> None:
        self.failures.labels(leg, reason).inc()

    def retry(self, leg: str, reason: str) -> None:
        self.retries.labels(leg, reason).inc()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition in the format the scraper's ``Accept`` header asks for (the
        Prometheus text format 0.0.4 when it names none) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


def status_reason(status: int) -> str:
    return "status_4xx" if status < 500 else "status_5xx"
