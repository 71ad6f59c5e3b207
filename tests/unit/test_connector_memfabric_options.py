"""The connector's MemFabric options: validated when ``kv_connector_extra_config`` is
parsed, and carried into the rank's settings (device: the rank's local device unless
set)."""

from __future__ import annotations

import pytest

from rd2h.app.connector.facts import EngineFacts
from rd2h.app.settings import ConnectorConfigError, Rd2hOptions

STORE = "tcp://10.0.0.5:7000"


def facts(local_rank: int) -> EngineFacts:
    return EngineFacts(side="decode", kv_port=30000, global_dp_rank=0, tp_size=4,
                       tp_rank=local_rank % 4, engine_id="e", block_size=128,
                       group_layer_names=(), local_rank=local_rank)


@pytest.mark.parametrize(("extra", "message"), [
    ({"transport": "memfabric"}, "memfabric_store_url is required"),
    ({"transport": "memfabric", "memfabric_store_url": STORE, "host": "decode-0.local"},
     "numeric IPv4"),
    ({"memfabric_store_url": "10.0.0.5:7000"}, "tcp://<IPv4>:<port>"),
    ({"transport": "memfabric", "memfabric_store_url": STORE, "memfabric_transfer_type": "X"},
     "memfabric_transfer_type"),
    ({"memfabric_device_id": -1}, "memfabric_device_id"),
])
def test_bad_memfabric_options_are_refused_when_parsed(extra: dict, message: str) -> None:
    with pytest.raises(ConnectorConfigError, match=message):
        Rd2hOptions.parse(extra)


def test_memfabric_settings_follow_the_options_and_the_ranks_device() -> None:
    opts = Rd2hOptions.parse({"transport": "memfabric", "memfabric_store_url": STORE,
                                   "host": "10.0.0.9", "memfabric_transfer_type": "DEVICE_RDMA",
                                   "memfabric_nic": "eth1"})
    s = facts(local_rank=6).settings(opts)
    assert (s.transport, s.host, s.memfabric_store_url) == ("memfabric", "10.0.0.9", STORE)
    assert (s.memfabric_transfer_type, s.memfabric_nic) == ("DEVICE_RDMA", "eth1")
    assert s.memfabric_device == 6  # vLLM's local rank, not the TP rank (2)
    pinned = Rd2hOptions.parse({**opts.model_dump(), "memfabric_device_id": 1})
    assert facts(local_rank=6).settings(pinned).memfabric_device == 1
