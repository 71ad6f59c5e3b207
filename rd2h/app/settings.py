"""rd2h's one settings model (pydantic): validated up front, errors name the field.

``Rd2hOptions`` is everything a deployment configures; it is exactly the schema
of vLLM's ``kv_connector_extra_config`` (``Rd2hOptions.parse``), where secrets are
named by file or environment variable, never written inline (``rd2h.app.secrets``). ``Rd2hSettings``
is one endpoint: the same options plus where the rank sits (role, ports, TP
rank), which the vLLM adapter, the demo and the probe fill in. Every entrypoint
builds its objects from an ``Rd2hSettings`` through ``rd2h.bootstrap.container``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from rd2h.app.secrets import SecretSourceError, read_secret
from rd2h.domain.errors import Rd2hError, TopologyError
from rd2h.domain.planning.topology import MAX_PORT, plan_ports
from rd2h.domain.wire.addresses import TransferTypeName, parse_ipv4, parse_store_url

Transport = Literal["cma", "inproc", "memfabric", "mooncake"]
Role = Literal["prefill", "decode"]
MIN_SECRET_CHARS = 16
# Secret options: in kv_connector_extra_config only as ``<key>_file`` or ``<key>_env``.
SECRET_KEYS = ("auth_secret", "curve_secret_key")


FRAME_SLACK_BYTES = 8192
"""Room above ``max_frame_bytes`` on the Decode socket: a signature envelope (4 KiB) and
what its receive budget counts per held message."""


class ConnectorConfigError(Rd2hError, ValueError):
    """``kv_connector_extra_config`` is not valid; the message names the key."""


class Deadlines(BaseModel):
    """Every wait in rd2h has one of these deadlines (seconds)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    meta_ack_s: float = Field(10.0, gt=0, description="MF_META -> b'ACK' on Prefill")
    layer_ack_s: float = Field(30.0, gt=0, description="READ_READY_BATCH -> reply on Prefill")
    device_event_s: float = Field(30.0, gt=0, description="a layer's device event on Prefill")
    request_s: float = Field(120.0, gt=0, description="Decode request: admission -> all KV")
    tp_exchange_s: float = Field(60.0, gt=0, description="one TP all-gather among Decode ranks")
    start_s: float = Field(10.0, gt=0, description="start of a sender / receiver")
    stop_s: float = Field(5.0, gt=0, description="stop (join) of a sender / receiver")
    heartbeat_ivl_s: float = Field(
        1.0, ge=0, description="control-connection heartbeat interval (0 = no heartbeats)"
    )
    heartbeat_timeout_s: float = Field(
        5.0, gt=0, description="a silent control connection is dropped (and its pending "
        "layers / requests failed) after this long"
    )
    hold_margin_s: float = Field(
        0.25, ge=0, description="Decode: a read must end this long before the hold Prefill "
        "stated for the announced blocks (room for the two hosts' clocks to differ), else "
        "the layer fails instead of completing requests from blocks Prefill may reuse"
    )
    admission_wait_s: float = Field(
        5.0, ge=0, description="Decode, parallel dispatch: how long an announcement naming "
        "requests this rank has not admitted yet is kept for their admission (at most its "
        "hold, less hold_margin_s); then they are answered skipped (0 = never kept)"
    )
    idle_link_s: float = Field(
        300.0, gt=0, description="Prefill: a Decode connection with nothing in flight "
        "for this long is closed (reopened on demand)"
    )

    @model_validator(mode="after")
    def _check_heartbeat(self) -> Deadlines:
        if self.heartbeat_ivl_s > 0 and self.heartbeat_timeout_s <= self.heartbeat_ivl_s:
            raise ValueError(
                f"heartbeat_timeout_s {self.heartbeat_timeout_s:g} must exceed "
                f"heartbeat_ivl_s {self.heartbeat_ivl_s:g}"
            )
        return self


class Limits(BaseModel):
    """Bounds on what peers can make an endpoint hold (docs/security.md: "Bounded state")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    recv_hwm: int = Field(
        64, ge=1, description="Prefill: replies taken per connection and poll (libzmq's "
        "own receive limit is off on both sides: it aborts the process when a connection "
        "it stopped reading errors)")
    max_frame_objects: int = Field(
        1 << 20, ge=16, description="msgpack objects one control frame may decode to, "
        "nested MF_META metadata included (checked while decoding)")
    max_peers: int = Field(
        1024, ge=1, description="Decode: connections whose MF_META is kept; MF_META from "
        "more is not acknowledged")
    max_orphans_per_peer: int = Field(
        4096, ge=1, description="Decode: ids of requests not admitted here that one "
        "connection may make this rank remember (each expires after request_s)")
    max_orphans: int = Field(65536, ge=1, description="Decode: the same, all peers together")
    max_queued_bytes_per_peer: int = Field(
        64 * 1024 * 1024, ge=1, description="Decode: bytes of received, not yet handled "
        "control frames one connection may have waiting (a flood over it is dropped unread; "
        "must hold one max_frame_bytes frame)")
    max_queued_bytes: int = Field(
        256 * 1024 * 1024, ge=1, description="Decode: the same, all connections together "
        "(over it, the connection holding most gives way)")
    max_parked_bytes_per_peer: int = Field(
        16 * 1024 * 1024, ge=1, description="Decode, parallel dispatch: bytes of "
        "announcements one connection may have kept for their requests' admission (over "
        "it, they are handled at once: not-yet-admitted requests are answered skipped)")
    max_parked_bytes: int = Field(
        64 * 1024 * 1024, ge=1, description="Decode, parallel dispatch: the same, all "
        "connections together")
    max_layers_per_frame: int = Field(
        64, ge=1, le=256, description="Prefill: layer runs, at most this many layers with "
        "the same read entries in one READ_READY_BATCH, to a Decode that acknowledged it "
        "reads them (while two frames to it are unanswered, announcements wait and go "
        "together); 1: one layer per frame, the feature not offered")
    min_announce_bytes: int = Field(
        4 * 1024 * 1024, ge=0, description="Prefill: a step's layers are held back and "
        "announced together until those held name this many bytes of reads, or the "
        "forward ends: announcing a layer alone overlaps its read with the rest of the "
        "forward, which pays only when the read takes longer than handling a frame costs "
        "(about 0.1 ms on each side at production shapes: 4 MiB at 50 GB/s); a step of "
        "short prompts then costs Decode one frame and one read instead of one per layer. "
        "0: every layer is announced as it completes")


_Z85_KEY = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def _check_key(value: str, what: str) -> None:
    if not _Z85_KEY.match(value):
        raise ValueError(f"{what} must be a CURVE key: 40 Z85 characters (see 'rd2h keys')")


class Rd2hOptions(BaseModel):
    """What a deployment configures (every key of ``kv_connector_extra_config``)."""

    # Errors name the field and the rule but never echo input: it may hold the secret.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    transport: Transport = Field("cma", description="transfer engine")
    host: str = Field(
        "127.0.0.1", min_length=1,
        description="this endpoint's address: Decode binds its control sockets there and "
        "Prefill is told it; network transports (mooncake) bind and advertise it",
    )
    engine_id: str = Field("", description="advertised engine id (default: vLLM's)")
    cma_threads: int = Field(1, ge=1, le=64,
                             description="cma: threads that split one batched read")
    mooncake_protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description="Mooncake transfer protocol")
    mooncake_device: str = Field("", description="RDMA device names (mooncake rdma)")
    mooncake_env: dict[str, str] = Field(
        default_factory=dict, description="MC_* tuning variables for the Mooncake engine"
    )
    memfabric_store_url: str | None = Field(
        None,
        description="MemFabric config store shared by the deployment, 'tcp://<IPv4>:<port>' "
        "(required with transport 'memfabric'); host must then be a numeric IPv4 address",
    )
    memfabric_transfer_type: TransferTypeName = Field(
        "SDMA", description="MemFabric data path (TransDataOpType)"
    )
    memfabric_device_id: int | None = Field(
        None, ge=0,
        description="Ascend device this rank's MemFabric engine binds; unset: the rank's "
        "local device (its local rank)",
    )
    memfabric_nic: str = Field("", description="MemFabric NIC (RDMA transfer types), or empty")
    destinations: Literal["vllm", "sparse_kv_pool"] = Field(
        "vllm",
        description="Decode destination memory: vLLM's registered KV caches (each rank "
        "has its own main cache) or a SparseKVOffloadManager-style TP-shared host pool",
    )
    main_sharing: Literal["rank_local", "shared_pool"] | None = Field(
        None,
        description="how Decode ranks hold main KV; follows 'destinations' when unset "
        "(vllm -> rank_local: every rank pulls all main blocks; sparse_kv_pool -> "
        "shared_pool: each rank pulls its share)",
    )
    buffer_reuse: bool = Field(
        False,
        description="Prefill: layers share physical buffers, so a layer's next write "
        "waits for Decode to have read it (wait_for_layer_load / wait_for_layer_reuse)",
    )
    verify_kv: bool = Field(
        False,
        description="Prefill: state a digest (XXH3-64) of every announced block, per layer "
        "and tensor; Decode checks the blocks it read against them and fails the layer on "
        "any difference (Decode checks whatever a peer states). Needs the KV cache in host "
        "memory; costs CPU on both sides (docs/operations/verify-kv.md 'End-to-end KV digests')")
    device_events: Literal["auto", "cpu", "npu"] = Field(
        "auto", description="Prefill: how a layer's KV write is awaited before it is "
        "announced (npu: an Ascend event; cpu: already written; auto: npu when torch_npu "
        "is installed, else cpu)")
    deadlines: Deadlines = Field(default_factory=Deadlines)
    metaserver_timeout_s: float = Field(5.0, gt=0, description="one metaserver POST")
    metaserver_retries: int = Field(3, ge=0, description="immediate retries on transport error")
    metaserver_retry_interval_s: float = Field(
        1.0, gt=0, description="retry interval after the immediate retries")
    max_frame_bytes: int = Field(
        16 * 1024 * 1024, ge=1024,
        description="longest control frame (a READ_READY_BATCH of 256 requests x 1,024 "
        "blocks is ~1.5 MiB); with limits.max_frame_objects it bounds what decoding one "
        "frame can cost (docs/security.md: 'Decode cost of a frame')")
    auth_secret: SecretStr | None = Field(
        None,
        description="shared secret (>= 16 characters) for HMAC-SHA256 signing of every "
        "control message; Prefill and Decode must configure the same one. Unset: "
        "unsigned legacy messages. Set: unsigned or wrongly signed messages are refused. "
        "In kv_connector_extra_config only through auth_secret_file or auth_secret_env "
        "(vLLM logs that config; an inline value is refused)",
    )
    auth_secret_file: str | None = Field(
        None, min_length=1,
        description="file holding auth_secret (readable by its owner only or, owned by "
        "root, its group: a Kubernetes Secret mounted with defaultMode 0440 and an "
        "fsGroup; one trailing newline ignored)")
    auth_secret_env: str | None = Field(
        None, min_length=1, description="environment variable holding auth_secret")
    curve_secret_key: SecretStr | None = Field(
        None,
        description="ZeroMQ CURVE (encrypted, authenticated control channel): this "
        "endpoint's secret key (Z85, from 'rd2h keys'). Decode then admits only "
        "curve_allowed_keys; Prefill needs curve_server_key. Unset: plain ZeroMQ. In "
        "kv_connector_extra_config only through curve_secret_key_file or "
        "curve_secret_key_env (an inline value is refused)",
    )
    curve_secret_key_file: str | None = Field(
        None, min_length=1,
        description="file holding curve_secret_key (readable by its owner only or, "
        "owned by root, its group)")
    curve_secret_key_env: str | None = Field(
        None, min_length=1, description="environment variable holding curve_secret_key")
    curve_server_key: str | None = Field(
        None, description="Prefill with CURVE: the Decode endpoints' public key")
    curve_allowed_keys: tuple[str, ...] = Field(
        (), description="Decode with CURVE: the Prefill public keys it accepts")
    limits: Limits = Field(default_factory=Limits)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "WARNING", description="rd2h's log level on the engine (stderr)")
    idle_wait_ms: float = Field(
        5.0, ge=0, le=100,
        description="Decode: a step that computes nothing (every request waits for its "
        "KV) waits up to this long for a request's KV to complete instead of returning at "
        "once; vLLM's engine loop steps again after 1 ms otherwise. 0: never wait")
    timeline_dir: str | None = Field(
        None, min_length=1,
        description="write per-request timeline stamps (JSON lines, one file per process) "
        "under this folder for 'rd2h timeline'; unset: $RD2H_TIMELINE_DIR, else none")

    @model_validator(mode="after")
    def _check_options(self) -> Rd2hOptions:
        if self.curve_secret_key is not None:
            _check_key(self.curve_secret_key.get_secret_value(), "curve_secret_key")
        elif (self.curve_server_key is not None or self.curve_allowed_keys) and not (
                self.curve_secret_key_file or self.curve_secret_key_env):
            raise ValueError("curve_server_key / curve_allowed_keys need curve_secret_key")
        if self.curve_server_key is not None:
            _check_key(self.curve_server_key, "curve_server_key")
        for n, key in enumerate(self.curve_allowed_keys):
            _check_key(key, f"curve_allowed_keys[{n}]")
        secret = self.auth_secret
        if secret is not None and len(secret.get_secret_value()) < MIN_SECRET_CHARS:
            raise ValueError(
                f"auth_secret must have at least {MIN_SECRET_CHARS} characters "
                f"(got {len(secret.get_secret_value())})"
            )
        frame = self.max_frame_bytes + FRAME_SLACK_BYTES
        if self.limits.max_queued_bytes_per_peer < frame:
            raise ValueError(
                f"limits.max_queued_bytes_per_peer ({self.limits.max_queued_bytes_per_peer}) "
                f"must hold one frame of max_frame_bytes + {FRAME_SLACK_BYTES} ({frame})")
        if self.limits.max_queued_bytes < self.limits.max_queued_bytes_per_peer:
            raise ValueError(
                f"limits.max_queued_bytes ({self.limits.max_queued_bytes}) is below "
                f"limits.max_queued_bytes_per_peer ({self.limits.max_queued_bytes_per_peer})")
        wanted = "rank_local" if self.destinations == "vllm" else "shared_pool"
        if self.main_sharing is not None and self.main_sharing != wanted:
            raise ValueError(
                f"main_sharing {self.main_sharing!r} does not fit destinations "
                f"{self.destinations!r} (which needs {wanted!r})"
            )
        if self.memfabric_store_url is not None:
            parse_store_url(self.memfabric_store_url)
        if self.transport == "memfabric":
            if self.memfabric_store_url is None:
                raise ValueError("memfabric_store_url is required with transport 'memfabric'")
            parse_ipv4(self.host, "host (with transport 'memfabric')")
        return self

    @property
    def main_shared(self) -> bool:
        # main_sharing, when set, was checked above to agree with destinations.
        return self.destinations == "sparse_kv_pool"

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None,
              environ: Mapping[str, str] | None = None) -> Rd2hOptions:
        """Validate ``kv_connector_extra_config``; ``ConnectorConfigError`` names every
        bad key. Secrets come from the files or environment variables it names (from
        ``environ``, default the process's); one written inline is refused."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConnectorConfigError(
                f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}"
            )
        raw = dict(extra or {})
        inline = [k for k in SECRET_KEYS if raw.get(k) is not None]
        if inline:
            raise ConnectorConfigError(
                "kv_connector_extra_config holds " + " and ".join(map(repr, inline))
                + " inline: vLLM prints the whole kv_connector_extra_config in its log at "
                "start (its 'non-default args' line) and it stays on the engine's command "
                "line, so every log and process listing would hold the secret. Name where "
                "it is instead: " + "; ".join(
                    f"'{k}_file' (a file readable by its owner only, or its group when root "
                    f"owns it, e.g. a Kubernetes "
                    f"Secret mounted as a file) or '{k}_env' (an environment variable)"
                    for k in inline)
                + " (docs/security.md, 'Providing secrets')")
        options = cls._validated(raw)  # every key's type, before any file is read
        secrets = {}
        try:
            for key in SECRET_KEYS:
                value = read_secret(key, file=getattr(options, f"{key}_file"),
                                    env=getattr(options, f"{key}_env"), environ=environ)
                if value is not None:
                    secrets[key] = value
        except SecretSourceError as exc:
            raise ConnectorConfigError(f"kv_connector_extra_config: {exc}") from None
        return cls._validated({**raw, **secrets}) if secrets else options

    @classmethod
    def _validated(cls, raw: dict[str, Any]) -> Rd2hOptions:
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                key = ".".join(str(p) for p in err["loc"]) or "(config)"
                if err["type"] == "extra_forbidden":
                    problems.append(f"unknown key {key!r}")
                else:
                    problems.append(f"{key!r}: {err['msg']}")
            raise ConnectorConfigError(
                "invalid kv_connector_extra_config for rd2h: " + "; ".join(problems)
            ) from None


class Rd2hSettings(Rd2hOptions):
    """One rd2h endpoint (a Prefill or Decode TP rank): the options plus its place."""

    role: Role
    kv_port: int = Field(30000, ge=1, le=MAX_PORT)
    global_dp_rank: int = Field(0, ge=0)
    tp_size: int = Field(1, ge=1)
    tp_rank: int = Field(0, ge=0)
    local_rank: int = Field(0, ge=0, description="the rank's accelerator on its host")

    @classmethod
    def for_rank(cls, options: Rd2hOptions, **place: Any) -> Rd2hSettings:
        """``options`` as one endpoint's settings (``place``: role, ports, ranks)."""
        return cls(**{**dict(options), **place})

    @model_validator(mode="after")
    def _check_place(self) -> Rd2hSettings:
        if self.tp_rank >= self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} must be < tp_size {self.tp_size}")
        if self.role == "decode":
            try:
                plan_ports(self.kv_port, self.global_dp_rank, self.tp_size)
            except TopologyError as exc:
                raise ValueError(str(exc)) from exc
        if self.curve_secret_key is not None:
            if self.role == "decode" and not self.curve_allowed_keys:
                raise ValueError("CURVE on Decode needs curve_allowed_keys (the Prefill "
                                 "public keys it accepts)")
            if self.role == "prefill" and self.curve_server_key is None:
                raise ValueError("CURVE on Prefill needs curve_server_key (Decode's public key)")
        return self

    @property
    def memfabric_device(self) -> int:
        """The Ascend device this rank binds: the configured one, else its local rank."""
        return self.local_rank if self.memfabric_device_id is None else self.memfabric_device_id

    @property
    def rank_port(self) -> int:
        """Decode: the port this rank binds (spec 9)."""
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).rank_port(self.tp_rank)

    @property
    def base_port(self) -> int:
        return plan_ports(self.kv_port, self.global_dp_rank, self.tp_size).base_port
