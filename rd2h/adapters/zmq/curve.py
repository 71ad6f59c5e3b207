"""ZeroMQ CURVE for the control channel: keys, validation and the ZAP gate.

Strong mode: every connection is encrypted and authenticated. Decode (the ROUTER)
is a CURVE server and admits only the Prefill public keys it lists; Prefill (each
DEALER) knows Decode's public key and proves its own. Keys are Z85 text, 40
characters, as ``zmq.curve_keypair()`` makes them.

The admission check is a ZAP handler (RFC 27) bound on a context owned by one
server, never on a shared one such as ``zmq.Context.instance()``. A refused client
never gets a connection; its own handshake deadline reports that. Error messages
and ``repr`` never show a secret key.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

__all__ = [
    "CurveClientKeys",
    "CurveServerKeys",
    "ZapGate",
    "apply_client_keys",
    "apply_server_keys",
    "curve_available",
    "generate_keypair",
    "public_key_of",
    "require_curve",
    "term_bounded",
]

_Z85_CHARS = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)
_KEY_TEXT_LEN = 40
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by RFC 27
ZAP_DOMAIN = b"rd2h"
_POLL_MS = 50


def curve_available() -> bool:
    """Whether the loaded libzmq supports CURVE."""
    return bool(zmq.has("curve"))


def require_curve() -> None:
    if not curve_available():
        raise RuntimeError("the loaded libzmq has no CURVE support (built without libsodium?)")


def _key_bytes(text: object, what: str) -> bytes:
    """The 32 raw bytes of a Z85 key; ``ValueError`` naming ``what``, never the text."""
    problem = f"{what} must be {_KEY_TEXT_LEN} Z85 characters"
    if not isinstance(text, str) or len(text) != _KEY_TEXT_LEN or not set(text) <= _Z85_CHARS:
        raise ValueError(problem)
    try:
        raw = z85.decode(text.encode("ascii"))
    except Exception:  # a 5-character group above 2**32: struct.error
        raise ValueError(problem) from None
    if len(raw) != 32:
        raise ValueError(problem)
    return raw


def generate_keypair() -> tuple[str, str]:
    """A new ``(public, secret)`` CURVE key pair, Z85 text."""
    require_curve()
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def public_key_of(secret: str) -> str:
    """The Z85 public key that belongs to a Z85 secret key."""
    _key_bytes(secret, "curve secret key")
    require_curve()
    return zmq.curve_public(secret.encode("ascii")).decode("ascii")


@dataclass(frozen=True)
class CurveServerKeys:
    """Decode's secret key and the Prefill public keys it admits (at least one)."""

    secret_key: str = field(repr=False)
    allowed_client_keys: tuple[str, ...]

    def __post_init__(self) -> None:
        _key_bytes(self.secret_key, "curve secret key")
        if isinstance(self.allowed_client_keys, str):
            raise ValueError("allowed_client_keys must be a sequence of keys, not one string")
        keys = tuple(self.allowed_client_keys)
        if not keys:
            raise ValueError("allowed_client_keys must list at least one client public key")
        for i, key in enumerate(keys):
            _key_bytes(key, f"allowed client public key #{i}")
        object.__setattr__(self, "allowed_client_keys", keys)

    @property
    def public_key(self) -> str:
        return public_key_of(self.secret_key)

    def allowed_raw(self) -> frozenset[bytes]:
        return frozenset(_key_bytes(k, "allowed client public key")
                         for k in self.allowed_client_keys)


@dataclass(frozen=True)
class CurveClientKeys:
    """Prefill's secret key and the public key of the Decode server it trusts."""

    secret_key: str = field(repr=False)
    server_key: str

    def __post_init__(self) -> None:
        _key_bytes(self.secret_key, "curve secret key")
        _key_bytes(self.server_key, "curve server public key")

    @property
    def public_key(self) -> str:
        return public_key_of(self.secret_key)


def apply_server_keys(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (before it binds)."""
    require_curve()
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public_key.encode("ascii"))


def apply_client_keys(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server ``keys.server_key`` (before connect)."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_key.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public_key.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret_key.encode("ascii"))


def _zap_reply(request: list[bytes], allowed: frozenset[bytes]) -> list[bytes]:
    """RFC 27: ``[version, request_id, domain, address, identity, mechanism, *creds]``
    in; ``[version, request_id, status, text, user_id, metadata]`` out."""
    request_id = request[1] if len(request) > 1 else b""
    if len(request) < 6 or request[0] != b"1.0":
        return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
    mechanism, creds = request[5], request[6:]
    if mechanism == b"CURVE" and len(creds) == 1 and creds[0] in allowed:
        return [b"1.0", request_id, b"200", b"OK", z85.encode(creds[0]), b""]
    return [b"1.0", request_id, b"400", b"client key not allowed", b"", b""]


class ZapGate:
    """A ZAP handler thread on ``ctx``, admitting CURVE clients whose raw public key is
    in ``allowed``. Start it before the server binds; ``stop`` waits a bounded time."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes],
                 start_timeout: float = 5.0) -> None:
        self._ctx = ctx
        self._allowed = allowed
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="rd2h-zap", daemon=True)
        self._thread.start()
        if not self._ready.wait(start_timeout):
            self.stop()
            raise RuntimeError("the ZAP handler did not start in time")
        if self._error is not None:
            self._thread.join(1.0)
            raise RuntimeError(f"cannot start the ZAP handler: {self._error}") from self._error

    def _run(self) -> None:
        # The socket lives and dies in this thread only.
        try:
            sock = self._ctx.socket(zmq.REP)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            sock.close(0)
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
                request = sock.recv_multipart(zmq.NOBLOCK)
                sock.send_multipart(_zap_reply(request, self._allowed))
        except zmq.ZMQError:
            pass  # context terminated or socket gone: nothing more to admit
        finally:
            sock.close(0)

    def stop(self, timeout: float = 2.0) -> bool:
        """Ask the thread to end; True once it has (its socket closed)."""
        self._stop.set()
        self._thread.join(max(0.0, timeout))
        return not self._thread.is_alive()


def term_bounded(ctx: zmq.Context, timeout: float = 2.0) -> bool:
    """Terminate ``ctx`` without waiting more than ``timeout``; True if it ended.
    Every socket of ``ctx`` must already be closed (linger 0), so it ends at once."""
    done = threading.Thread(target=ctx.term, name="rd2h-zmq-term", daemon=True)
    done.start()
    done.join(max(0.0, timeout))
    return not done.is_alive()
