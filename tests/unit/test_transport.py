"""Tests for async_dapo.stream.transport over real zmq sockets on 127.0.0.1.

Every socket is closed in a fixture's ``finally`` (or a ``with``), so a failing test leaves no
bound port behind. Timeouts are short: each test runs well under 2 s.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

import msgpack
import numpy as np
import pytest
import zmq

from async_dapo.config import load_config
from async_dapo.stream.transport import (
    CURVE_OVERHEAD,
    TAG_BYTES,
    GroupReceiver,
    GroupSender,
    new_secret,
    producer_credentials,
)
from async_dapo.stream.wire import Group, OversizedMessage, Sample, decode_group, encode_group

from .rx import recv

RECV_MS = 1000  # generous per-message wait; a healthy local delivery takes well under 10 ms


def make_group(tag: str, n_tokens: int = 3, version: int = 0) -> Group:
    sample = Sample(
        response_ids=np.arange(1, n_tokens + 1, dtype=np.int32),
        logprobs=np.full(n_tokens, -0.5, dtype=np.float32),
        versions=np.full(n_tokens, version, dtype=np.int32),
        reward=1.0, score=1.0, acc=True, truncated=False, finish_reason="stop", gen_seconds=0.1,
    )
    return Group(group_id=tag, prompt_index=0, epoch=0, engine_rank=0, prompt_ids=np.array([7, 8], np.int32),
                 ground_truth="1", data_source="t", samples=(sample,), created_at=1.0, admitted_version=version)


def foreign_schema_bytes() -> bytes:
    obj = msgpack.unpackb(encode_group(make_group("foreign")), raw=False)
    obj["schema"] = "someone_else.batch"
    return msgpack.packb(obj, use_bin_type=True)


@pytest.fixture
def receiver():
    rx = GroupReceiver(max_message_bytes=4096)
    try:
        yield rx
    finally:
        rx.close()


@pytest.fixture
def connect():
    """Factory of senders connected to a receiver; all closed at teardown."""
    made: list[GroupSender] = []

    def _connect(rx: GroupReceiver, **kw) -> GroupSender:
        made.append(GroupSender(rx.address, **kw))
        return made[-1]

    try:
        yield _connect
    finally:
        for tx in made:
            tx.close()


@pytest.fixture
def raw_push():
    """A bare PUSH socket for frames GroupSender cannot produce (multipart); with ``secret``, the run's
    handshake credential (CURVE keys) but no signing."""
    socks: list[zmq.Socket] = []

    def _make(address: str, secret: bytes | None = None) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        for option, value in (producer_credentials(secret) if secret is not None else {}).items():
            sock.setsockopt(option, value)
        sock.connect(address)
        socks.append(sock)
        return sock

    try:
        yield _make
    finally:
        for sock in socks:
            sock.close(linger=0)


def test_groups_arrive_in_order_and_intact(receiver, connect):
    tx = connect(receiver)
    sent = [make_group(f"g{i}", n_tokens=i + 1, version=i) for i in range(20)]
    for group in sent:
        tx.send(group)
    got = [recv(receiver, RECV_MS) for _ in sent]
    assert [g.group_id for g in got] == [f"g{i}" for i in range(20)]
    assert got == sent
    assert got[19].samples[0].versions.tolist() == [19] * 20
    assert receiver.counters == {"received": 20, "received_partials": 0, "rejected_auth": 0, "rejected_malformed": 0,
                                 "rejected_oversized": 0, "rejected_schema": 0, "rejected_peers": 0,
                                 "rejected_handshake": 0}
    assert receiver.last_error is None


def test_bad_frames_dropped_and_counted_valid_ones_delivered(receiver, connect):
    tx = connect(receiver)
    tx.send(make_group("first"))
    tx.send_bytes(b"not msgpack at all \xc1")
    tx.send(make_group("too-big", n_tokens=1000))  # a VALID group, but ~12 kB > 4096
    tx.send_bytes(foreign_schema_bytes())
    tx.send(make_group("last"))
    assert recv(receiver, RECV_MS).group_id == "first"
    assert recv(receiver, RECV_MS).group_id == "last"
    assert receiver.counters == {"received": 2, "received_partials": 0, "rejected_auth": 0, "rejected_malformed": 1,
                                 "rejected_oversized": 1, "rejected_schema": 1, "rejected_peers": 0,
                                 "rejected_handshake": 0}
    assert receiver.last_error == "schema: foreign schema 'someone_else.batch' (expected 'async_dapo.group' or 'async_dapo.partial')"
    assert recv(receiver, timeout_ms=20) is None


def test_newer_version_counted_as_schema_and_reason_kept(receiver, connect):
    obj = msgpack.unpackb(encode_group(make_group("v2")), raw=False)
    obj["v"] = 2
    tx = connect(receiver)
    tx.send_bytes(msgpack.packb(obj, use_bin_type=True))
    tx.send_bytes(b"\x81\xa1a")  # truncated map
    tx.send(make_group("ok"))
    assert recv(receiver, RECV_MS).group_id == "ok"
    assert receiver.counters["rejected_schema"] == 1 and receiver.counters["rejected_malformed"] == 1
    assert receiver.last_error.startswith("message: not valid msgpack (")


def test_multipart_frames_are_malformed(receiver, raw_push):
    sock = raw_push(receiver.address)
    good = encode_group(make_group("ok"))
    sock.send_multipart([good, good])
    sock.send(good)
    assert recv(receiver, RECV_MS).group_id == "ok"
    assert receiver.counters == {"received": 1, "received_partials": 0, "rejected_auth": 0, "rejected_malformed": 1,
                                 "rejected_oversized": 0, "rejected_schema": 0, "rejected_peers": 0,
                                 "rejected_handshake": 0}
    assert receiver.last_error == "message: 2 frames, expected 1"


def test_recv_timeout_returns_none(receiver):
    start = time.monotonic()
    assert recv(receiver, timeout_ms=100) is None
    assert 0.09 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    assert recv(receiver, timeout_ms=0) is None
    assert time.monotonic() - start < 0.1


def test_only_garbage_within_timeout_returns_none(receiver, connect):
    tx = connect(receiver)
    for _ in range(5):
        tx.send_bytes(b"\xc1")
    deadline = time.monotonic() + 1.0
    while receiver.counters["rejected_malformed"] < 5 and time.monotonic() < deadline:
        assert recv(receiver, timeout_ms=50) is None
    assert receiver.counters["rejected_malformed"] == 5 and receiver.counters["received"] == 0


def test_two_senders_into_one_receiver(receiver, connect):
    a, b = connect(receiver), connect(receiver)
    for i in range(10):
        a.send(make_group(f"a{i}"))
        b.send(make_group(f"b{i}"))
    got = [recv(receiver, RECV_MS).group_id for _ in range(20)]
    # Fair-queued: interleaving is zmq's business, but each sender's order is kept.
    assert [g for g in got if g[0] == "a"] == [f"a{i}" for i in range(10)]
    assert [g for g in got if g[0] == "b"] == [f"b{i}" for i in range(10)]
    assert receiver.counters["received"] == 20


def test_binds_loopback_by_default():
    with GroupReceiver() as rx:
        assert rx.port > 0
        assert rx.address == f"tcp://127.0.0.1:{rx.port}"
        assert rx._sock.getsockopt_string(zmq.LAST_ENDPOINT) == rx.address
    cfg = load_config(None)
    with GroupReceiver.from_config(cfg) as rx:
        assert rx.address.startswith("tcp://127.0.0.1:") and rx.max_message_bytes == cfg.transport.max_message_bytes
        assert rx.hard_cap_bytes == 2 * cfg.transport.max_message_bytes


def test_arecv_under_asyncio_and_loop_stays_free(receiver, connect):
    tx = connect(receiver)

    async def main() -> tuple[list[str], int, Group | None]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        task = asyncio.create_task(ticker())
        # Nothing sent yet: arecv must wait without blocking the loop, then time out.
        empty = await receiver.arecv(timeout_ms=150)
        tx.send(make_group("x1"))
        tx.send_bytes(b"garbage")
        tx.send(make_group("x2"))
        got = [(await receiver.arecv(RECV_MS)).group_id for _ in range(2)]
        task.cancel()
        return got, ticks, empty

    got, ticks, empty = asyncio.run(main())
    assert empty is None and ticks >= 5
    assert got == ["x1", "x2"]
    # A second and a third event loop (pyzmq re-registers the socket each time; tests/unit/rx.recv runs one) still work.
    tx.send(make_group("x3"))
    assert asyncio.run(receiver.arecv(RECV_MS)).group_id == "x3"
    tx.send(make_group("x4"))
    assert recv(receiver, RECV_MS).group_id == "x4"
    assert receiver.counters == {"received": 4, "received_partials": 0, "rejected_auth": 0, "rejected_malformed": 1,
                                 "rejected_oversized": 0, "rejected_schema": 0, "rejected_peers": 0,
                                 "rejected_handshake": 0}


def test_message_over_hard_cap_disconnects_peer_but_receiver_survives(connect):
    with GroupReceiver(max_message_bytes=1024, hard_cap_bytes=4096) as rx:
        tx = connect(rx)
        tx.send_bytes(b"\x00" * 64 * 1024)  # zmq refuses it and drops the connection
        deadline = time.monotonic() + 1.5
        got = None
        while got is None and time.monotonic() < deadline:
            tx.send(make_group("after"))  # the sender reconnects by itself
            got = recv(rx, timeout_ms=50)
        assert got is not None and got.group_id == "after"
        assert rx.counters["rejected_oversized"] == 0  # not seen by Python: documented


def test_send_times_out_when_hwm_full_and_close_does_not_hang():
    with GroupReceiver() as rx:
        address = rx.address
    # Nobody listens any more: messages queue locally until the HWM, then send blocks.
    tx = GroupSender(address, hwm=2, linger_ms=100)
    try:
        with pytest.raises(TimeoutError, match="HWM"):
            for _ in range(100):
                tx.send(make_group("stuck"), timeout_ms=20)
    finally:
        start = time.monotonic()
        tx.close()
        tx.close()  # idempotent
        assert time.monotonic() - start < 1.0


def test_counters_is_a_copy(receiver):
    receiver.counters["received"] = 99
    assert receiver.counters["received"] == 0


# ------------------------------------------------------------------------------ authentication
@pytest.fixture
def secret():
    return new_secret()


@pytest.fixture
def signed_receiver(secret):
    rx = GroupReceiver(max_message_bytes=4096, secret=secret)
    try:
        yield rx
    finally:
        rx.close()


def counts(**nonzero: int) -> dict[str, int]:
    base = {"received": 0, "received_partials": 0, "rejected_auth": 0, "rejected_malformed": 0,
            "rejected_oversized": 0, "rejected_schema": 0, "rejected_peers": 0, "rejected_handshake": 0}
    return {**base, **nonzero}


def test_new_secret_is_random_and_long():
    a, b = new_secret(), new_secret()
    assert isinstance(a, bytes) and len(a) == 32 and a != b


def test_bad_secrets_refused():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        GroupReceiver(secret=b"short")
    with pytest.raises(TypeError, match="secret must be bytes"):
        GroupSender("tcp://127.0.0.1:1", secret="a str, not bytes")  # type: ignore[arg-type]


def test_signed_round_trip(signed_receiver, connect, secret):
    tx = connect(signed_receiver, secret=secret)
    sent = [make_group(f"s{i}", n_tokens=i + 1) for i in range(5)]
    for group in sent:
        tx.send(group)
    assert [recv(signed_receiver, RECV_MS) for _ in sent] == sent
    assert signed_receiver.counters == counts(received=5)
    assert signed_receiver.last_error is None


def hmac_frame(secret: bytes, payload: bytes) -> bytes:
    """The documented frame layout, built independently of transport.py."""
    return hmac.new(secret, payload, hashlib.sha256).digest() + payload


def test_signed_frame_is_one_frame_tag_then_payload(signed_receiver, raw_push, secret):
    sock = raw_push(signed_receiver.address, secret)
    sock.send(hmac_frame(secret, encode_group(make_group("by-hand"))))
    sock.send_multipart([hmac_frame(secret, encode_group(make_group("split")))[:TAG_BYTES],
                         encode_group(make_group("split"))])  # tag in its own frame: not the format
    sock.send(hmac_frame(secret, encode_group(make_group("last"))))
    assert recv(signed_receiver, RECV_MS).group_id == "by-hand"
    assert recv(signed_receiver, RECV_MS).group_id == "last"
    assert signed_receiver.counters == counts(received=2, rejected_malformed=1)
    assert TAG_BYTES == 32


def wait_counter(rx: GroupReceiver, name: str, at_least: int, seconds: float = 5.0) -> None:
    """Receive (and expect nothing) until ``rx.counters[name] >= at_least``; bounded."""
    deadline = time.monotonic() + seconds
    while rx.counters[name] < at_least:
        assert time.monotonic() < deadline, rx.counters
        assert recv(rx, timeout_ms=50) is None


def test_sender_without_the_secret_is_refused_at_the_handshake(signed_receiver, connect, secret):
    foreign = connect(signed_receiver)  # no secret: the NULL mechanism, a well-formed unsigned group queued
    foreign.send(make_group("intruder"))
    wait_counter(signed_receiver, "rejected_handshake", 1)
    tx = connect(signed_receiver, secret=secret)
    tx.send(make_group("legit"))
    assert recv(signed_receiver, RECV_MS) == make_group("legit")
    # Nothing of the foreign sender was read: no frame of it reached the HMAC check.
    assert signed_receiver.counters["rejected_auth"] == 0 and signed_receiver.counters["received"] == 1
    assert signed_receiver.last_error is None


def test_another_runs_sender_is_refused_and_its_tag_would_be_too(signed_receiver, connect, raw_push, secret):
    other = new_secret()
    connect(signed_receiver, secret=other).send(make_group("other-run"))  # another run's CURVE keys
    wait_counter(signed_receiver, "rejected_handshake", 1)
    # With the run's handshake credential, a frame tagged with another key still stops at the HMAC.
    tx = connect(signed_receiver, secret=secret)
    tx.send_bytes(b"\x00" * 5, sign=False)  # shorter than a tag: rejected before any parsing too
    tx.send_bytes(hmac_frame(other, encode_group(make_group("other-key"))), sign=False)
    tx.send(make_group("ours"))
    assert recv(signed_receiver, RECV_MS).group_id == "ours"
    counters = signed_receiver.counters
    assert counters["rejected_handshake"] >= 1
    assert counters == counts(received=1, rejected_auth=2, rejected_handshake=counters["rejected_handshake"])


def test_tampered_payload_rejected(signed_receiver, connect, secret):
    tx = connect(signed_receiver, secret=secret)
    payload = encode_group(make_group("tampered"))
    frame = bytearray(hmac_frame(secret, payload))
    frame[-1] ^= 0x01  # one bit of the payload flipped after signing
    # Still a valid group (admitted_version 0 -> 1): only the HMAC can catch this one.
    assert decode_group(bytes(frame[TAG_BYTES:])).admitted_version == 1
    tx.send_bytes(bytes(frame), sign=False)
    tag_flipped = bytearray(hmac_frame(secret, payload))
    tag_flipped[0] ^= 0x80
    tx.send_bytes(bytes(tag_flipped), sign=False)
    tx.send(make_group("after"))
    assert recv(signed_receiver, RECV_MS).group_id == "after"
    assert signed_receiver.counters == counts(received=1, rejected_auth=2)


def test_send_bytes_signs_unless_told_not_to(signed_receiver, connect, secret):
    tx = connect(signed_receiver, secret=secret)
    payload = encode_group(make_group("raw"))
    tx.send_bytes(payload, sign=False)  # unsigned: rejected
    tx.send_bytes(payload)  # signed by the sender
    tx.send_bytes(hmac_frame(secret, payload), sign=False)  # signed by hand
    assert recv(signed_receiver, RECV_MS).group_id == "raw"
    assert recv(signed_receiver, RECV_MS).group_id == "raw"
    assert signed_receiver.counters == counts(received=2, rejected_auth=1)


def test_sender_max_message_bytes_raises_and_sends_nothing(signed_receiver, connect, secret):
    tx = connect(signed_receiver, secret=secret, max_message_bytes=4096)
    big = make_group("too-big", n_tokens=1000)
    size = len(encode_group(big))
    with pytest.raises(OversizedMessage, match=f"'too-big': {size} bytes > max_message_bytes 4096, not sent"):
        tx.send(big)
    tx.send(make_group("fits"))
    assert recv(signed_receiver, RECV_MS).group_id == "fits"
    assert recv(signed_receiver, timeout_ms=100) is None
    assert signed_receiver.counters == counts(received=1)


def test_signed_payload_of_exactly_max_bytes_fits_the_caps(connect, secret):
    limit = len(encode_group(make_group("edge")))
    # max_message_bytes limits the payload; the hard cap (on the frame as zmq reads it) must leave room
    # for the 32 tag bytes and CURVE's 33.
    exact = limit + TAG_BYTES + CURVE_OVERHEAD
    assert CURVE_OVERHEAD == 33
    with pytest.raises(ValueError, match="hard_cap_bytes"):
        GroupReceiver(max_message_bytes=limit, secret=secret, hard_cap_bytes=exact - 1)
    with GroupReceiver(max_message_bytes=limit, secret=secret, hard_cap_bytes=exact) as rx:
        tx = connect(rx, secret=secret)
        tx.send(make_group("edge"))  # CURVE frame = limit + 32 + 33 == hard cap: accepted
        assert recv(rx, RECV_MS).group_id == "edge"
    # One byte over the cap on the wire (so the overhead is exactly 33): zmq drops it with the connection
    # before reading it (had it been read, it would count as oversized), and the sender's next one delivers.
    with GroupReceiver(max_message_bytes=limit + 1, secret=secret, hard_cap_bytes=exact + 1) as rx:
        tx = connect(rx, secret=secret)
        tx.send_bytes(b"\x00" * (limit + 2))
        deadline = time.monotonic() + 5
        while (got := recv(rx, timeout_ms=200)) is None:
            assert time.monotonic() < deadline, rx.counters
            tx.send(make_group("after"), timeout_ms=RECV_MS)
        assert got.group_id == "after" and rx.counters["rejected_oversized"] == 0
    with GroupReceiver(max_message_bytes=limit, secret=secret, hard_cap_bytes=exact + 64) as rx:
        tx = connect(rx, secret=secret, max_message_bytes=limit)
        tx.send(make_group("edge"))
        tx.send_bytes(b"\x00" * (limit + 1))  # one byte over: counted, neither verified nor unpacked
        tx.send(make_group("edge"))
        assert [recv(rx, RECV_MS).group_id for _ in range(2)] == ["edge", "edge"]
        assert rx.counters == counts(received=2, rejected_oversized=1)
        assert rx.last_error == f"message: {limit + 1} bytes > max_message_bytes {limit}"
    with GroupReceiver(max_message_bytes=1000, secret=secret) as rx:
        assert rx.hard_cap_bytes == 1000 + 1024 * 1024 + TAG_BYTES


def test_from_config_passes_the_secret(secret, connect):
    with GroupReceiver.from_config(load_config(None), secret=secret) as rx:
        connect(rx).send(make_group("unsigned"))
        connect(rx, secret=secret).send(make_group("signed"))
        assert recv(rx, RECV_MS * 5).group_id == "signed"
        wait_counter(rx, "rejected_handshake", 1)
        assert rx.counters == counts(received=1, rejected_handshake=rx.counters["rejected_handshake"])
