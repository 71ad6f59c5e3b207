"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes.rig import Rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    """The real-socket rig (ZeroMQ peers, codecs, transports), closed after the test."""
    r = Rig()
    try:
        yield r
    finally:
        r.close()
