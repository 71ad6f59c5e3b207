"""Deprecated: the connector's old module path, kept for one deprecation period.

Configurations written as ``"kv_connector_module_path":
"rd2h.adapters.vllm.connector"`` keep working, with a ``DeprecationWarning`` naming the
new path, ``rd2h.entry.connector``. Nothing in rd2h imports this module.
"""

from __future__ import annotations

import warnings

from rd2h.entry.connector import (  # the one import of rd2h.entry from the library
    Rd2hConnectorMetadata,
    Rd2hWorkerMeta,
    SfaRemoteD2HConnector,
)

NEW_PATH = "rd2h.entry.connector"

warnings.warn(
    "rd2h.adapters.vllm.connector is deprecated and will be removed: set "
    f'"kv_connector_module_path": "{NEW_PATH}" in --kv-transfer-config',
    DeprecationWarning, stacklevel=2)

__all__ = ["NEW_PATH", "Rd2hConnectorMetadata", "Rd2hWorkerMeta", "SfaRemoteD2HConnector"]
