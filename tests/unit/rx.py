"""A blocking receive for tests: ``recv(receiver, timeout_ms)``.

The replay queue only ever awaits ``GroupReceiver.arecv`` (inside its asyncio actor); the transport
tests want a plain call. This runs that same ``arecv`` to completion in a fresh event loop, so the
tests exercise the production receive path (pyzmq re-registers the receiver's socket with each new
loop). Not for use inside a running event loop: ``await receiver.arecv(...)`` there.
"""

from __future__ import annotations

import asyncio

from async_dapo.stream.transport import GroupReceiver
from async_dapo.stream.wire import Group


def recv(receiver: GroupReceiver, timeout_ms: int | None = None) -> Group | None:
    """Next valid group, or None once ``timeout_ms`` passed (None = wait forever): ``arecv``, blocking."""
    return asyncio.run(receiver.arecv(timeout_ms))
