"""Port plans on one host (spec 9), with real sockets: every Decode rank of many DP
engines binds its own port, every Prefill rank reaches exactly its Decode rank, and an
out-of-range port is refused at start with a clear error (settings, the control server,
the receiver, and a container built from settings that skipped validation)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pydantic
import pytest
import zmq
from fakes.logs import RecordingLogger
from fakes.net import HOST
from hypothesis import given, settings
from hypothesis import strategies as st

from rd2h.adapters.zmq.channel import BindError, ZmqControlServer, tcp_endpoint
from rd2h.app.settings import Rd2hSettings
from rd2h.bootstrap.container import bootstrap
from rd2h.domain.errors import TopologyError
from rd2h.domain.planning.topology import MAX_PORT, compute_mapping, plan_ports, remote_port

pytestmark = pytest.mark.integration

DP, D_TP, RATIO = 4, 4, 2  # 16 Decode ranks, 32 Prefill ranks


def free_run(length: int) -> int:
    """A base port with ``length`` consecutive ports free right now (probed by binding)."""
    for base in range(21000, 60000, 97):
        held = []
        try:
            for port in range(base, base + length):
                s = socket.socket()
                held.append(s)
                s.bind((HOST, port))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"no {length} consecutive free ports")


@pytest.fixture
def servers() -> Iterator[dict[tuple[int, int], ZmqControlServer]]:
    bound: dict[tuple[int, int], ZmqControlServer] = {}
    try:
        yield bound
    finally:
        for server in bound.values():
            server.close()


def test_many_dp_engines_and_tp_ranks_on_one_host_bind_and_route(servers) -> None:
    kv_port = free_run(DP * D_TP)
    bases = {}
    for dp in range(DP):
        for rank in range(D_TP):
            s = Rd2hSettings(role="decode", transport="inproc", host=HOST, kv_port=kv_port,
                             global_dp_rank=dp, tp_size=D_TP, tp_rank=rank)
            # the production path: the container's control server on the planned port
            servers[(dp, rank)] = bootstrap(s).control_server()
            bases[dp] = s.base_port
    endpoints = {server.endpoint for server in servers.values()}
    assert len(endpoints) == DP * D_TP  # no two ranks share a port (all bound, too)

    # Every Prefill rank of every engine reaches exactly the Decode rank it maps to.
    ctx = zmq.Context.instance()
    dealers = []
    try:
        for dp in range(DP):
            for p_rank in range(D_TP * RATIO):
                m = compute_mapping(D_TP * RATIO, D_TP, p_rank)
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(tcp_endpoint(HOST, remote_port(bases[dp], m.d_rank)))
                sock.send(f"{dp}:{p_rank}".encode())
                dealers.append(sock)
        for (dp, rank), server in servers.items():
            got = set()
            for _ in range(RATIO):
                item = server.recv(5.0)
                assert item is not None, f"decode dp {dp} rank {rank} heard nothing"
                got.add(item[1].decode())
            expected = {f"{dp}:{p}" for p in range(rank * RATIO, (rank + 1) * RATIO)}
            assert got == expected
            assert server.recv(0.0) is None
    finally:
        for sock in dealers:
            sock.close(0)


@given(
    kv_port=st.integers(1, MAX_PORT),
    dp_size=st.integers(1, 64),
    d_tp=st.integers(1, 16),
    ratio=st.integers(1, 4),
)
@settings(max_examples=300, deadline=None)
def test_port_plans_never_collide_and_prefill_finds_its_rank(kv_port, dp_size, d_tp, ratio):
    """Either the whole host plan fits 1..65535 and every (engine, rank) has its own port
    that each of its Prefill contributors computes, or settings refuse it up front."""
    owner: dict[int, tuple[int, int]] = {}
    for dp in range(dp_size):
        try:
            plan = plan_ports(kv_port, dp, d_tp)
        except TopologyError:
            assert kv_port + (dp + 1) * d_tp - 1 > MAX_PORT
            with pytest.raises(pydantic.ValidationError, match="65535"):
                Rd2hSettings(role="decode", kv_port=kv_port, global_dp_rank=dp, tp_size=d_tp)
            break
        for rank in range(d_tp):
            port = plan.rank_port(rank)
            assert 1 <= port <= MAX_PORT
            assert port not in owner, f"{(dp, rank)} collides with {owner[port]}"
            owner[port] = (dp, rank)
        for p_rank in range(d_tp * ratio):
            m = compute_mapping(d_tp * ratio, d_tp, p_rank)
            assert owner[remote_port(plan.base_port, m.d_rank)] == (dp, m.d_rank)


# ====================================================================== refused at start


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"kv_port": 0}, "kv_port"),
        ({"kv_port": 65536}, "kv_port"),
        ({"kv_port": 65535, "tp_size": 2}, "65535"),
        ({"kv_port": 65000, "global_dp_rank": 200, "tp_size": 4}, "65535"),
        ({"kv_port": 30000, "global_dp_rank": -1}, "global_dp_rank"),
    ],
)
def test_settings_refuse_out_of_range_ports(kw, field) -> None:
    with pytest.raises(pydantic.ValidationError, match=field):
        Rd2hSettings(role="decode", **kw)


@pytest.mark.parametrize("port", [0, -1, 65536, 70000, True, 30000.0, "30000"])
def test_control_server_refuses_a_port_outside_the_range(port) -> None:
    with pytest.raises(BindError, match=r"outside 1\.\.65535"):
        ZmqControlServer(HOST, port)  # type: ignore[arg-type]


def test_receiver_start_raises_for_an_out_of_range_port_and_starts_no_thread() -> None:
    # Settings cannot name such a port: the control server is replaced by one on it.
    container = bootstrap(Rd2hSettings(role="decode", transport="inproc"),
                          control_server=lambda: ZmqControlServer(HOST, 65536),
                          logger=RecordingLogger())
    receiver = container.decode_receiver(destinations={})
    with pytest.raises(BindError, match="65536"):
        receiver.start()
    assert not receiver.running
    container.transport().close()


def test_container_from_unvalidated_settings_refuses_at_receiver_start() -> None:
    """Settings built without validation (``model_construct``) still cannot bind an
    out-of-range port: the port plan is checked again when the receiver starts."""
    bad = Rd2hSettings.model_construct(
        role="decode", transport="inproc", host=HOST, kv_port=65535, global_dp_rank=1,
        tp_size=2, tp_rank=1,
    )
    container = bootstrap(bad)
    receiver = container.decode_receiver(destinations={})
    with pytest.raises(TopologyError, match="65535"):
        receiver.start()
    assert not receiver.running
    container.transport().close()


def test_a_taken_port_is_a_clear_bind_error() -> None:
    first = ZmqControlServer(HOST, free_run(1))
    try:
        port = int(first.endpoint.rsplit(":", 1)[1])
        with pytest.raises(BindError, match=str(port)):
            ZmqControlServer(HOST, port)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(first.endpoint)
        dealer.send(b"still served")
        assert first.recv(5.0) is not None
        dealer.close(0)
    finally:
        first.close()
