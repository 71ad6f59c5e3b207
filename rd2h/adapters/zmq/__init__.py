"""ZeroMQ control channel: ROUTER on Decode, DEALERs on Prefill (spec 4)."""

from rd2h.adapters.zmq.channel import BindError, ZmqControlClients, ZmqControlServer

__all__ = ["BindError", "ZmqControlClients", "ZmqControlServer"]
