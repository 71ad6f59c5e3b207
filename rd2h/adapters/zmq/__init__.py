"""ZeroMQ control channel: ROUTER on Decode, DEALERs on Prefill (spec 4)."""

from rd2h.adapters.zmq.channel import BindError, ZmqControlClients, ZmqControlServer
from rd2h.adapters.zmq.curve import (
    CurveClientKeys,
    CurveServerKeys,
    curve_available,
    generate_keypair,
    public_key_of,
)

__all__ = [
    "BindError",
    "CurveClientKeys",
    "CurveServerKeys",
    "ZmqControlClients",
    "ZmqControlServer",
    "curve_available",
    "generate_keypair",
    "public_key_of",
]
