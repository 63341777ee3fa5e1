"""transport: the zmq stream of groups from the rollout actors to the replay queue, and the receiver's
buffer formulas the load-time rule and the receiver share."""

from __future__ import annotations

from pydantic import Field

from async_dapo.config.section import Section


class TransportConfig(Section):
    """zmq + msgpack group stream from rollout actors to the replay queue."""

    bind_host: str = Field(
        "127.0.0.1", description="Interface the replay queue binds (and where the weight group's rendezvous "
        "is advertised): an address; 0.0.0.0 for every interface; or node, the address Ray knows for the "
        "queue's node (reachable by the other nodes, and nothing else listens). Set for multi-node.",
    )
    port: int = Field(0, ge=0, le=65535, description="0 = pick a free port.")
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024, description="Larger messages are dropped and counted."
    )
    max_peers: int | None = Field(
        None, ge=1, le=100_000, description="Most producer connections the queue's receiver admits at once; "
        "connections without the run's key never count (queue stat rejected_handshake). One beyond them is "
        "refused at the handshake, before any of its message frames is read, and counted as queue stat rejected_peers (a "
        "refused producer connects again 0.5-1.5 s later and gets in once a slot is free). None = 2 x "
        "placement.num_engines (room for a replacement that connects before a dead peer's connection is torn "
        "down).",
    )
    receive_budget_bytes: int | None = Field(
        None, ge=1024 * 1024, description="Bytes zmq may hold in the queue's receiver for all peers together, "
        "each message counted at the hard cap H = max(2 x max_message_bytes, max_message_bytes + 1 MiB) + 32 "
        "tag bytes: per admitted peer the messages waiting in its pipe, one in its decoder and two copies of its "
        "handshake properties (up to one H), plus the message being read. Each peer's receive high-water mark "
        "is set from it: min(100, (budget // H - 1) // max_peers - 3). Must be >= (4 x max_peers + 1) x H. "
        "None = that minimum, but at least 4 GiB.",
    )


# The queue's receiver (transport.GroupReceiver) sizes its zmq buffers with these; they live here so the
# load-time rule and the receiver share one formula (config imports nothing else of the package).
RECEIVE_TAG_BYTES = 32  # = transport.TAG_BYTES, the HMAC-SHA256 tag: the run's receiver always has a secret
RECEIVE_MAX_HWM = 100  # messages per peer; more would add latency, not throughput
RECEIVE_DEFAULT_BUDGET_BYTES = 4 * 1024**3  # transport.receive_budget_bytes None: at least this


def receive_hard_cap(max_message_bytes: int, tag_bytes: int = RECEIVE_TAG_BYTES) -> int:
    """zmq MAXMSGSIZE of the receiver: room to receive and count a message somewhat over the limit
    (instead of cutting the connection), plus the tag; zmq drops the connection on a larger one."""
    return max(2 * max_message_bytes, max_message_bytes + 1024 * 1024) + tag_bytes


def receive_max_peers(max_peers: int | None, num_engines: int) -> int:
    """transport.max_peers resolved: None = 2 x ``num_engines`` (the most engines the run may have,
    :func:`engine_ceiling`)."""
    return max_peers or 2 * num_engines


# Hard-capped messages zmq may hold per admitted peer besides its pipe: one in its decoder and two copies
# of its handshake properties (a READY command up to the hard cap, kept for the connection's life).
RECEIVE_PEER_EXTRA = 3


def receive_min_budget(max_peers: int, hard_cap: int) -> int:
    """Smallest budget: per peer one message in its pipe + the extras, plus the one being read."""
    return (max_peers * (1 + RECEIVE_PEER_EXTRA) + 1) * hard_cap


def receive_budget(budget_bytes: int | None, max_peers: int, hard_cap: int) -> int:
    """The budget in force: as set, or (None) the smallest that fits, at least the 4 GiB default."""
    if budget_bytes is not None:
        return budget_bytes
    return max(RECEIVE_DEFAULT_BUDGET_BYTES, receive_min_budget(max_peers, hard_cap))


def receive_hwm(budget_bytes: int, max_peers: int, hard_cap: int) -> int:
    """Per-peer receive high-water mark so that max_peers x (hwm + extras) + 1 hard-capped messages fit
    the budget; < 1 means the budget is too small."""
    return min(RECEIVE_MAX_HWM, (budget_bytes // hard_cap - 1) // max_peers - RECEIVE_PEER_EXTRA)
