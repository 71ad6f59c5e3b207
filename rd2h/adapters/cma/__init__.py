"""Same-host cross-memory-attach transfer engine (Linux ``process_vm_readv``)."""

from rd2h.adapters.cma.transport import IOV_MAX, CmaTransferEngine

__all__ = ["IOV_MAX", "CmaTransferEngine"]
