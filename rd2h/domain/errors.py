"""Error types raised by the pure core. The app decides whom to tell."""

from __future__ import annotations


class Rd2hError(Exception):
    """Base of every error rd2h raises on purpose."""


class TopologyError(Rd2hError, ValueError):
    """An unsupported P/D parallel layout or port plan (spec sections 8 and 9)."""


class ChunkError(Rd2hError, ValueError):
    """A chunked-prefill block range that does not fit the request (spec 3.2)."""


class LayoutMismatch(Rd2hError):
    """A Prefill layer layout that does not match the Decode destination (spec 6).

    ``component`` is one of ``main``, ``indexer``, ``scale`` or ``destination``.
    """

    def __init__(self, layer: str, component: str, detail: str) -> None:
        self.layer = layer
        self.component = component
        self.detail = detail
        super().__init__(f"layer {layer!r}: {component} layout mismatch: {detail}")


class PlanningError(Rd2hError):
    """A READ_READY_BATCH that cannot be planned on this Decode rank (spec 5)."""

    def __init__(self, layer: str, detail: str, ext_req_id: str | None = None) -> None:
        self.layer = layer
        self.ext_req_id = ext_req_id
        self.detail = detail
        who = f" request {ext_req_id!r}:" if ext_req_id is not None else ""
        super().__init__(f"layer {layer!r}:{who} {detail}")


class ProtocolError(Rd2hError):
    """A control message that does not follow the wire contract (spec 4).

    ``layer_idx`` is set when the message got far enough to name its layer, so
    the receiver can still answer READ_FAILED for exactly that layer. ``handshake``:
    the frame is an MF_META acknowledgement or refusal that cannot be taken (unsigned
    where a secret is configured, wrongly signed, malformed), so the handshake it
    answers fails.
    """

    def __init__(self, detail: str, layer_idx: int | None = None, *,
                 handshake: bool = False) -> None:
        self.detail = detail
        self.layer_idx = layer_idx
        self.handshake = handshake
        super().__init__(detail)


class UnknownMessageType(ProtocolError):
    """A well-formed tuple whose tag this build does not know; logged and ignored."""

    def __init__(self, tag: bytes) -> None:
        self.tag = tag
        shown = repr(tag[:32]) + ("..." if len(tag) > 32 else "")  # a tag may be megabytes
        super().__init__(f"unknown message type {shown}")


class AuthenticationError(ProtocolError):
    """A control message without a valid shared-secret signature (spec 12).

    ``layer_idx`` is set when the unauthenticated message still names a layer, so
    Decode can answer READ_FAILED for it without acting on anything it says.
    """


class CompletionError(Rd2hError):
    """A completion-rule violation (unknown layer slot, failed layer, ...) (spec 7)."""


class TransferError(Rd2hError):
    """A one-sided read (or memory registration) failed; becomes READ_FAILED."""


class LayerSendError(CompletionError):
    """A Prefill layer announcement failed or was not acknowledged in time."""

    def __init__(self, layer_idx: int, detail: str) -> None:
        self.layer_idx = layer_idx
        self.detail = detail
        super().__init__(f"layer {layer_idx}: {detail}")


class TransportLibraryError(TransferError):
    """A transport library call reported failure (a non-zero return code).

    ``operation`` is the library call, ``rc`` what it returned and ``library_message``
    the library's own explanation ('' when it gave none), so the operator sees why.
    """

    def __init__(
        self, message: str, *, operation: str, rc: object, library_message: str = ""
    ) -> None:
        self.operation = operation
        self.rc = rc
        self.library_message = library_message
        super().__init__(message)


class TransportBindingError(TransferError):
    """A process-wide transfer engine asked for again with a different configuration
    (role, device, host, ...): the library binds one per process."""
