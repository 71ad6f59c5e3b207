"""``Rd2hOptions.parse``: rd2h's ``kv_connector_extra_config``, validated before any
socket or memory registration, with errors that name the offending key; the same model
is every endpoint's settings (``Rd2hSettings``), so every option reaches every rank."""

from __future__ import annotations

import pytest
from fakes.logs import RecordingLogger

from rd2h.app.connector.facts import EngineFacts
from rd2h.app.settings import ConnectorConfigError, Deadlines, Rd2hOptions, Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import Rd2hError
from rd2h.domain.wire.protocol import MetaAck


@pytest.mark.parametrize("extra", [None, {}])
def test_defaults(extra) -> None:
    o = Rd2hOptions.parse(extra)
    assert o.transport == "cma" and o.host == "127.0.0.1" and o.engine_id == ""
    assert o.cma_threads == 1 and o.mooncake_protocol == "tcp" and o.mooncake_env == {}
    assert o.destinations == "vllm" and o.main_sharing is None and not o.main_shared
    assert o.buffer_reuse is False and o.device_events == "auto"
    assert o.deadlines == Deadlines()
    assert (o.metaserver_timeout_s, o.metaserver_retries, o.metaserver_retry_interval_s) == (
        5.0, 3, 1.0)
    assert o.max_frame_bytes == 16 * 1024 * 1024 and o.log_level == "WARNING"
    assert (o.limits.recv_hwm, o.limits.max_frame_objects, o.limits.max_peers) == (
        64, 1 << 20, 1024)
    assert (o.limits.max_orphans_per_peer, o.limits.max_orphans) == (4096, 65536)
    assert o.curve_secret_key is None and o.curve_allowed_keys == ()


def test_values_are_taken_and_frozen() -> None:
    o = Rd2hOptions.parse({
        "transport": "inproc", "host": "10.0.0.7", "cma_threads": 4, "buffer_reuse": True,
        "deadlines": {"layer_ack_s": 2.5, "request_s": 9}, "log_level": "DEBUG",
        "mooncake_env": {"MC_X": "1"},
    })
    assert o.transport == "inproc" and o.host == "10.0.0.7" and o.cma_threads == 4
    assert o.buffer_reuse and o.log_level == "DEBUG" and o.mooncake_env == {"MC_X": "1"}
    assert o.deadlines.layer_ack_s == 2.5 and o.deadlines.request_s == 9
    assert o.deadlines.meta_ack_s == Deadlines().meta_ack_s  # untouched keys keep defaults
    with pytest.raises(Exception, match="frozen"):
        o.host = "x"  # type: ignore[misc]


def _error(extra) -> str:
    with pytest.raises(ConnectorConfigError) as info:
        Rd2hOptions.parse(extra)
    assert isinstance(info.value, Rd2hError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert msg.startswith("invalid kv_connector_extra_config for rd2h: ")
    return msg


def test_unknown_key_is_named() -> None:
    msg = _error({"transport": "cma", "transprot": "cma"})
    assert "unknown key 'transprot'" in msg
    assert "'transport'" not in msg  # the valid key is not blamed


def test_unknown_nested_deadline_key_is_named_with_its_path() -> None:
    assert "unknown key 'deadlines.layer_ack'" in _error({"deadlines": {"layer_ack": 1}})


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"transport": "carrier-pigeon"}, "'transport'"),
        ({"cma_threads": "many"}, "'cma_threads'"),
        ({"cma_threads": 0}, "'cma_threads'"),
        ({"cma_threads": 65}, "'cma_threads'"),
        ({"buffer_reuse": "perhaps"}, "'buffer_reuse'"),
        ({"host": ""}, "'host'"),
        ({"host": 17}, "'host'"),
        ({"mooncake_env": {"A": 1}}, "'mooncake_env.A'"),
        ({"mooncake_protocol": "udp"}, "'mooncake_protocol'"),
        ({"destinations": "gpu"}, "'destinations'"),
        ({"device_events": "cuda"}, "'device_events'"),
        ({"metaserver_timeout_s": 0}, "'metaserver_timeout_s'"),
        ({"metaserver_retries": -1}, "'metaserver_retries'"),
        ({"max_frame_bytes": 100}, "'max_frame_bytes'"),
        ({"log_level": "LOUD"}, "'log_level'"),
        ({"deadlines": {"layer_ack_s": 0}}, "'deadlines.layer_ack_s'"),
        ({"deadlines": {"request_s": "soon"}}, "'deadlines.request_s'"),
        ({"deadlines": 5}, "'deadlines'"),
    ],
)
def test_wrong_value_is_named(extra, key) -> None:
    assert key in _error(extra)


def test_every_bad_key_is_reported_at_once() -> None:
    msg = _error({"cma_threads": 0, "bogus": 1, "deadlines": {"stop_s": -1}})
    for part in ("'cma_threads'", "unknown key 'bogus'", "'deadlines.stop_s'"):
        assert part in msg


def test_deadline_cross_field_rule_names_deadlines() -> None:
    msg = _error({"deadlines": {"heartbeat_ivl_s": 2, "heartbeat_timeout_s": 1}})
    assert "'deadlines'" in msg and "heartbeat_timeout_s" in msg


def test_not_an_object_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match="JSON object, got list"):
        Rd2hOptions.parse(["transport", "cma"])  # type: ignore[arg-type]
    with pytest.raises(ConnectorConfigError, match="JSON object, got str"):
        Rd2hOptions.parse("transport=cma")  # type: ignore[arg-type]


def test_main_sharing_follows_destinations() -> None:
    assert not Rd2hOptions.parse({"destinations": "vllm"}).main_shared
    assert Rd2hOptions.parse({"destinations": "sparse_kv_pool"}).main_shared
    explicit = Rd2hOptions.parse(
        {"destinations": "sparse_kv_pool", "main_sharing": "shared_pool"})
    assert explicit.main_shared
    assert not Rd2hOptions.parse({"main_sharing": "rank_local"}).main_shared


@pytest.mark.parametrize(
    ("destinations", "sharing", "wanted"),
    [("vllm", "shared_pool", "rank_local"), ("sparse_kv_pool", "rank_local", "shared_pool")],
)
def test_main_sharing_mismatch_is_refused(destinations, sharing, wanted) -> None:
    msg = _error({"destinations": destinations, "main_sharing": sharing})
    assert f"main_sharing {sharing!r} does not fit destinations {destinations!r}" in msg
    assert f"needs {wanted!r}" in msg


FACTS = EngineFacts(side="decode", kv_port=31000, global_dp_rank=1, tp_size=2, tp_rank=1,
                    engine_id="e", block_size=16, group_layer_names=(("l.0",),))


def test_every_option_reaches_the_rank_settings_unchanged() -> None:
    """One model: a rank's settings are the options plus its place, never a hand copy."""
    opts = Rd2hOptions.parse({
        "transport": "inproc", "host": "10.1.2.3", "cma_threads": 3, "buffer_reuse": True,
        "auth_secret_env": "SECRET", "max_frame_bytes": 4096, "log_level": "ERROR",
        "deadlines": {"layer_ack_s": 1.5}, "metaserver_retries": 7, "engine_id": "mine",
        "mooncake_env": {"MC_A": "b"}, "destinations": "sparse_kv_pool",
    }, environ={"SECRET": "s" * 20})
    assert opts.auth_secret is not None and opts.auth_secret.get_secret_value() == "s" * 20
    settings = FACTS.settings(opts)
    assert isinstance(settings, Rd2hSettings) and isinstance(settings, Rd2hOptions)
    for name in Rd2hOptions.model_fields:
        assert getattr(settings, name) == getattr(opts, name), name
    assert (settings.role, settings.tp_rank, settings.tp_size) == ("decode", 1, 2)
    assert settings.rank_port == 31000 + 1 * 2 + 1


def test_a_vllm_deployment_can_turn_message_signing_on() -> None:
    opts = Rd2hOptions.parse({"auth_secret_env": "S"}, environ={"S": "a-secret-of-twenty-chars"})
    container = bootstrap(FACTS.settings(opts))
    codec = container.codec()
    assert type(codec).__name__ == "AuthenticatedCodec"
    frame = codec.encode(MetaAck())
    assert frame.startswith(b"ACK") and len(frame) > 3  # signed
    assert type(bootstrap(FACTS.settings(Rd2hOptions())).codec()).__name__ == (
        "MsgpackCodec")


def test_the_metaserver_options_reach_its_client() -> None:
    opts = Rd2hOptions.parse({"metaserver_retries": 5, "metaserver_timeout_s": 2.5,
                              "metaserver_retry_interval_s": 0.5})
    client = bootstrap(FACTS.settings(opts), logger=RecordingLogger()).metaserver()
    try:
        assert type(client).__name__ == "MetaserverClient"
        assert (client._retries, client._retry_delay_s) == (5, 0.5)
        assert client._client.timeout.read == 2.5
    finally:
        assert client.shutdown(2.0)


def test_a_short_secret_is_refused_without_echoing_it() -> None:
    with pytest.raises(ConnectorConfigError, match="at least 16 characters") as info:
        Rd2hOptions.parse({"auth_secret_env": "S"}, environ={"S": "tooshort-xyz"})
    assert "tooshort-xyz" not in str(info.value)
