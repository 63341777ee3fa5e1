"""Property-based fuzzing of the group stream over REAL zmq sockets on 127.0.0.1.

Bad input of every kind -- random bytes, truncated and mutated groups, foreign schemas and
versions, msgpack headers declaring absurd sizes, deep nesting, oversized frames -- is sent through
a real PUSH -> PULL connection, unsigned and (to a receiver with a secret) signed with the right
key, unsigned, or signed with another run's key, so the decoder behind the HMAC is fuzzed too.

Properties checked on every example:
  - the receiver never raises;
  - every frame is counted in exactly one counter, and the counter is the one an oracle predicts
    (size first, then the HMAC, then ``wire.decode_message``'s verdict), so the counter deltas
    equal the prediction exactly and sum to the number of frames sent;
  - frames that happen to be valid groups or partial groups (a group's progress) arrive equal to
    what the oracle decodes, and each kind is counted as its own;
  - a valid signed sentinel group sent last arrives intact (the receiver keeps serving).

PUSH/PULL keeps the order of one connection, so once the sentinel is out every earlier frame has
been judged: draining needs no sleeps, only a generous deadline (robust on a loaded 2-core box).
The sockets live in a per-test fixture reused across hypothesis examples; counters are compared
as deltas.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import threading
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_dapo.stream.transport import TAG_BYTES, GroupReceiver, GroupSender, new_secret, producer_credentials
from async_dapo.stream.wire import (
    PARTIAL_SCHEMA,
    SCHEMA,
    SCHEMA_VERSION,
    Group,
    OversizedMessage,
    Partial,
    Progress,
    Sample,
    SchemaMismatch,
    WireError,
    decode_message,
    encode_group,
    encode_partial,
)

from .memprobe import MIB, PeakGrowth
from .rx import recv

MAX_BYTES = 64 * 1024  # payload limit of the fuzzed receivers; hard cap is >1 MiB above it
RECV_MS = 2000  # per recv call; only a failing test ever waits this long
DRAIN_S = 30.0  # deadline for the sentinel to come out
COUNTERS = ("received", "received_partials", "rejected_auth", "rejected_malformed", "rejected_oversized",
            "rejected_schema")
OTHER_KEY = new_secret()  # "another run's" secret
ABSURD_BOUND = 16 * MIB  # measured <= 0.3 MiB: the frames are a few kB; a header taken at its word costs GiBs
FUZZ = settings(
    max_examples=80,
    deadline=None,  # socket round trips on a loaded CI box are not hypothesis' business
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# ------------------------------------------------------------------------------------ sockets
@dataclass
class Link:
    rx: GroupReceiver
    tx: GroupSender  # signs with the receiver's secret (if any)
    secret: bytes | None
    seq: itertools.count


@pytest.fixture(params=["plain", "secret"])
def link(request):
    """One receiver + sender per test function, reused by all its hypothesis examples."""
    secret = new_secret() if request.param == "secret" else None
    rx = GroupReceiver(max_message_bytes=MAX_BYTES, secret=secret)
    tx = None
    try:
        tx = GroupSender(rx.address, secret=secret, linger_ms=0)
        yield Link(rx, tx, secret, itertools.count())
    finally:
        if tx is not None:
            tx.close()
        rx.close()


def sign(key: bytes, payload: bytes) -> bytes:
    """The documented frame layout, built independently of transport.py."""
    return hmac.new(key, payload, hashlib.sha256).digest() + payload


def build_frame(link: Link, payload: bytes, mode: str) -> bytes:
    if link.secret is None or mode == "unsigned":
        return payload
    return sign(link.secret if mode == "signed" else OTHER_KEY, payload)


def oracle(link: Link, frame: bytes, payload: bytes, mode: str) -> tuple[str, Group | Partial | None]:
    """The counter a frame must land in (size, then HMAC, then the decoder's verdict)."""
    overhead = TAG_BYTES if link.secret is not None else 0
    if len(frame) > MAX_BYTES + overhead:
        return "rejected_oversized", None
    if link.secret is not None and mode != "signed":
        return "rejected_auth", None
    try:
        message = decode_message(payload, max_bytes=MAX_BYTES)
        return ("received_partials" if isinstance(message, Partial) else "received"), message
    except OversizedMessage:
        return "rejected_oversized", None
    except SchemaMismatch:
        return "rejected_schema", None
    except WireError:  # anything else escaping the decoder is a wire.py bug: let it fail the test
        return "rejected_malformed", None


def drain_until(rx: GroupReceiver, group_id: str) -> list[Group | Partial]:
    """All valid messages up to and including the group named ``group_id``."""
    got: list[Group | Partial] = []
    deadline = time.monotonic() + DRAIN_S
    while not got or got[-1].group_id != group_id:
        assert time.monotonic() < deadline, f"sentinel {group_id} lost; counters {rx.counters}"
        group = recv(rx, timeout_ms=RECV_MS)
        if group is not None:
            got.append(group)
    return got


def check_frames(link: Link, items: list[tuple[bytes, str]]) -> None:
    """Send the frames, then a sentinel; assert the exact counters and that serving goes on."""
    before = link.rx.counters
    want: Counter[str] = Counter()
    want_groups: list[Group | Partial] = []
    for payload, mode in items:
        frame = build_frame(link, payload, mode)
        counter, group = oracle(link, frame, payload, mode)
        want[counter] += 1
        want_groups += [group] if group is not None else []
        link.tx.send_bytes(frame, timeout_ms=RECV_MS, sign=False)
    sentinel = make_group(f"sentinel-{next(link.seq)}")
    link.tx.send(sentinel, timeout_ms=RECV_MS)  # signed by the sender when there is a secret
    got = drain_until(link.rx, sentinel.group_id)
    assert got[-1] == sentinel
    assert got[:-1] == want_groups
    after = link.rx.counters
    delta = {name: after[name] - before[name] for name in COUNTERS}
    want["received"] += 1  # the sentinel
    assert delta == {name: want[name] for name in COUNTERS}
    assert sum(delta.values()) == len(items) + 1
    if link.secret is not None:  # nothing without the run's key gets past the HMAC
        unsigned = [build_frame(link, p, m) for p, m in items if m != "signed"]
        assert delta["rejected_auth"] == sum(len(f) <= MAX_BYTES + TAG_BYTES for f in unsigned)


# ---------------------------------------------------------------------------------- strategies
def make_group(group_id: str, n_tokens: int = 3) -> Group:
    sample = Sample(
        response_ids=np.arange(1, n_tokens + 1, dtype=np.int32),
        logprobs=np.full(n_tokens, -0.5, dtype=np.float32),
        versions=np.zeros(n_tokens, dtype=np.int32),
        reward=1.0, score=1.0, acc=True, truncated=False, finish_reason="stop", gen_seconds=0.1,
    )
    return Group(group_id=group_id, prompt_index=0, epoch=0, engine_rank=0, prompt_ids=np.array([7, 8], np.int32),
                 ground_truth="1", data_source="t", samples=(sample,), created_at=1.0, admitted_version=0)


finite = st.floats(-1e6, 1e6, allow_nan=False)
i32 = st.integers(0, 2**31 - 1)


@st.composite
def samples(draw) -> Sample:
    n = draw(st.integers(0, 12))
    return Sample(
        response_ids=np.array(draw(st.lists(i32, min_size=n, max_size=n)), np.int32),
        logprobs=np.array(draw(st.lists(st.floats(-30, 0, width=32), min_size=n, max_size=n)), np.float32),
        versions=np.array(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)), np.int32),
        reward=draw(finite), score=draw(finite), acc=draw(st.booleans()), truncated=draw(st.booleans()),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        gen_seconds=draw(st.floats(0, 1e4)),
    )


@st.composite
def groups(draw) -> Group:
    return Group(
        group_id="g-" + draw(st.text(max_size=8)),  # never "sentinel-..."
        prompt_index=draw(i32), epoch=draw(st.integers(0, 100)), engine_rank=draw(st.integers(0, 64)),
        prompt_ids=np.array(draw(st.lists(i32, min_size=1, max_size=16)), np.int32),
        ground_truth=draw(st.text(max_size=8)), data_source=draw(st.text(max_size=8)),
        samples=tuple(draw(st.lists(samples(), min_size=1, max_size=3))),
        created_at=draw(st.floats(0, 2e9)), admitted_version=draw(st.integers(0, 1000)),
    )


@st.composite
def partials(draw) -> Partial:
    def progress() -> Progress:
        n = draw(st.integers(0, 12))
        return Progress(
            response_ids=np.array(draw(st.lists(i32, min_size=n, max_size=n)), np.int32),
            logprobs=np.array(draw(st.lists(st.floats(-30, 0, width=32), min_size=n, max_size=n)), np.float32),
            versions=np.array(draw(st.lists(st.integers(0, 1000), min_size=n, max_size=n)), np.int32),
            finish_reason=draw(st.sampled_from(["", "stop", "length"])), gen_seconds=draw(st.floats(0, 1e4)))

    return Partial(group_id="p-" + draw(st.text(max_size=8)), prompt_index=draw(i32),
                   epoch=draw(st.integers(0, 100)), engine_rank=draw(st.integers(0, 64)),
                   samples=tuple(progress() for _ in range(draw(st.integers(1, 3)))), sent_at=draw(st.floats(0, 2e9)))


# both kinds of message the stream carries: finished groups and partial groups
encoded = st.one_of(groups().map(encode_group), partials().map(encode_partial))

# (a) arbitrary bytes, empty included
random_bytes = st.binary(min_size=0, max_size=2048)


# (b) a valid encoding cut short anywhere
@st.composite
def truncated(draw) -> bytes:
    data = draw(encoded)
    return data[: draw(st.integers(0, len(data) - 1))]


# (c) a valid encoding with bit flips, insertions and deletions
@st.composite
def mutated(draw) -> bytes:
    buf = bytearray(draw(encoded))
    for _ in range(draw(st.integers(1, 8))):
        op = draw(st.sampled_from(["flip", "insert", "delete"]))
        pos = draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            buf.insert(pos, draw(st.integers(0, 255)))
        elif buf:
            del buf[pos]
    return bytes(buf)


# (d) valid msgpack maps with a foreign schema name or an unsupported version
msgpack_int = st.integers(-(2**63), 2**64 - 1)  # everything msgpack can carry
any_value = st.one_of(
    st.none(), st.booleans(), msgpack_int, st.floats(), st.text(max_size=20), st.binary(max_size=20),
    st.lists(msgpack_int, max_size=3),
)


@st.composite
def wrong_schema(draw) -> bytes:
    obj = msgpack.unpackb(draw(encoded), raw=False)
    what = draw(st.sampled_from(["schema", "v", "drop_schema", "drop_v", "both"]))
    if what in ("schema", "both"):
        obj["schema"] = draw(st.one_of(st.text(max_size=30), any_value).filter(
            lambda s: s not in (SCHEMA, PARTIAL_SCHEMA)))
    if what in ("v", "both"):
        obj["v"] = draw(st.one_of(msgpack_int, any_value).filter(lambda v: v != SCHEMA_VERSION))
    if what.startswith("drop_"):
        del obj[what[5:]]
    return msgpack.packb(obj, use_bin_type=True)


# (e) msgpack headers declaring absurd sizes, alone, at the top of a group or deep inside it
HUGE_HEADERS = [
    b"\xdd\xff\xff\xff\xff",  # array32 of 4 G elements
    b"\xdf\xff\xff\xff\xff",  # map32 of 4 G entries
    b"\xc6\xff\xff\xff\xff",  # bin32 of 4 GiB
    b"\xdb\xff\xff\xff\xff",  # str32 of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext32 of 4 GiB
    b"\xdc\xff\xff",  # array16 of 65535
    b"\xde\xff\xff",  # map16 of 65535
    b"\xc5\xff\xff",  # bin16 of 65535
    b"\xda\xff\xff",  # str16 of 65535
]
HUGE_COUNTS = [2**31, 2**32, 2**40, 2**62, 2**64 - 1, -1, -(2**63)]


@st.composite
def absurd(draw) -> bytes:
    kind = draw(st.sampled_from(["header", "top_map", "samples_array", "data_bin", "shape", "nesting"]))
    if kind == "header":
        return draw(st.sampled_from(HUGE_HEADERS)) + draw(st.binary(max_size=64))
    if kind == "nesting":  # deep containers: the unpacker's stack limit, not our recursion
        depth = draw(st.integers(1, 20_000))
        return draw(st.sampled_from([b"\x91", b"\x81\xa1k"])) * depth + b"\xc0"
    data = draw(encoded)
    if kind == "top_map":  # the group's own fixmap header replaced by a huge map32/array32
        return draw(st.sampled_from(HUGE_HEADERS[:2])) + data[1:]
    if kind == "samples_array":  # "samples": [4 G elements]
        at = data.index(b"\xa7samples") + 8
        return data[:at] + HUGE_HEADERS[0] + data[at + 1:]
    if kind == "data_bin":  # one array's "data": bin8 header -> bin32 of 4 GiB
        starts = [i for i in range(len(data)) if data.startswith(b"\xa4data", i)]
        at = draw(st.sampled_from(starts)) + 5
        width = {0xC4: 2, 0xC5: 3, 0xC6: 5}.get(data[at], 1)  # 1: "\xa4data" was inside a user string
        return data[:at] + HUGE_HEADERS[2] + data[at + width:]
    obj = msgpack.unpackb(data, raw=False)  # "shape": [2**40] with only a few bytes of data
    arrays = [obj["prompt_ids"]] if "prompt_ids" in obj else []  # a partial group has no prompt
    arrays += [s[k] for s in obj["samples"] for k in ("response_ids", "logprobs", "versions")]
    draw(st.sampled_from(arrays))["shape"] = [draw(st.sampled_from(HUGE_COUNTS))]
    return msgpack.packb(obj, use_bin_type=True)


KINDS = {
    "random_bytes": random_bytes,
    "truncated": truncated(),
    "mutated": mutated(),
    "wrong_schema": wrong_schema(),
    "absurd": absurd(),
    "valid": encoded,  # so the "signed" path has correct frames to accept, too
}
modes = st.sampled_from(["signed", "unsigned", "foreign_key"])


def frames_of(kind: st.SearchStrategy[bytes]) -> st.SearchStrategy[list[tuple[bytes, str]]]:
    return st.lists(st.tuples(kind, modes), min_size=1, max_size=4)


# ------------------------------------------------------------------------------------- tests
@FUZZ
@given(items=frames_of(random_bytes))
def test_fuzz_random_bytes(link, items):
    check_frames(link, items)


@FUZZ
@given(items=frames_of(KINDS["truncated"]))
def test_fuzz_truncated_groups(link, items):
    check_frames(link, items)


@FUZZ
@given(items=frames_of(KINDS["mutated"]))
def test_fuzz_mutated_groups(link, items):
    check_frames(link, items)


@FUZZ
@given(items=frames_of(KINDS["wrong_schema"]))
def test_fuzz_wrong_schema_or_version(link, items):
    check_frames(link, items)
    assert all(oracle(link, build_frame(link, p, m), p, m)[0] != "received" for p, m in items)


@FUZZ
@given(items=frames_of(KINDS["absurd"]))
def test_fuzz_absurd_sizes(link, items):
    # Memory: a 4 G element header must fail on its length limit, not after allocating. The peak is
    # reset first: a lifetime high-water mark would hide growth below what earlier tests reached.
    with PeakGrowth() as peak:
        check_frames(link, items)
    assert peak.bytes < ABSURD_BOUND, f"peak RSS grew by {peak.bytes / MIB:.1f} MiB"


@settings(FUZZ, max_examples=120)
@given(items=st.lists(st.tuples(st.one_of(*KINDS.values()), modes), min_size=1, max_size=8))
def test_fuzz_mixed_stream(link, items):
    check_frames(link, items)


@settings(FUZZ, max_examples=40)
@given(
    items=st.lists(
        st.tuples(
            st.one_of(st.integers(MAX_BYTES - 40, MAX_BYTES + 40), st.integers(MAX_BYTES, 4 * MAX_BYTES)),
            st.binary(max_size=16),
            modes,
        ),
        min_size=1, max_size=3,
    )
)
def test_fuzz_sizes_around_the_limit(link, items):
    """Frames around the limit, under the hard cap: over it -> rejected_oversized before any HMAC."""
    frames = [((head + bytes(size))[:size], mode) for size, head, mode in items]
    check_frames(link, frames)


def test_oversized_under_hard_cap_counted_exactly():
    secret = new_secret()
    with GroupReceiver(max_message_bytes=MAX_BYTES, secret=secret) as rx, \
            GroupSender(rx.address, secret=secret, linger_ms=0) as tx:
        assert rx.hard_cap_bytes > 2 * MAX_BYTES + TAG_BYTES
        tx.send_bytes(bytes(MAX_BYTES + 1))  # signed, 1 byte over the payload limit
        tx.send_bytes(bytes(2 * MAX_BYTES), sign=False)  # unsigned and over: size is checked first
        tx.send_bytes(bytes(MAX_BYTES + TAG_BYTES), sign=False)  # unsigned, fits: the HMAC says no
        tx.send(make_group("after"))
        assert [g.group_id for g in drain_until(rx, "after")] == ["after"]
        assert rx.counters == {"received": 1, "received_partials": 0, "rejected_auth": 1, "rejected_malformed": 0,
                               "rejected_oversized": 2, "rejected_schema": 0, "rejected_peers": 0,
                               "rejected_handshake": 0}


# ------------------------------------------------------------------------------------- flood
FLOOD_FRAMES = 5000
FLOOD_TOKENS = 1600  # ~19 kB a group: the flood (~95 MB) is about twice the memory bound
LEGIT_GROUPS = 20
MEMORY_BOUND = 50 * MIB


def test_flood_of_unsigned_frames_rejected_memory_bounded_legit_groups_arrive():
    """A PUSH socket floods well-formed unsigned groups while a producer sends signed ones.

    The flooder passed the handshake (it has the run's CURVE keys: without them it would not be heard
    at all, see test_transport_flood.py), so this is the worst a buggy producer can do. Every unsigned
    frame is counted rejected_auth, every legit group arrives (PULL fair-queues across peers), and
    memory stays bounded: rcvhwm (100 messages per peer) and the flooding socket's SNDHWM cap what zmq
    buffers, and the receiver keeps nothing per rejected frame. The flood (~95 MB) is about twice the
    bound, so buffering all of it would fail the test.
    """
    secret = new_secret()
    payload = encode_group(make_group("intruder", n_tokens=FLOOD_TOKENS))
    assert len(payload) * FLOOD_FRAMES > 1.8 * MEMORY_BOUND
    legit = [make_group(f"legit-{i}", n_tokens=i + 1) for i in range(LEGIT_GROUPS)]
    with GroupReceiver(max_message_bytes=MAX_BYTES, secret=secret) as rx, \
            GroupSender(rx.address, secret=secret, linger_ms=0) as tx:
        flood_done, stop = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def flood() -> None:
            # Created, used and closed in this thread: zmq sockets are not thread-safe.
            sock = zmq.Context.instance().socket(zmq.PUSH)
            try:
                sock.setsockopt(zmq.SNDHWM, 100)
                for option, value in producer_credentials(secret).items():
                    sock.setsockopt(option, value)
                sock.connect(rx.address)
                for _ in range(FLOOD_FRAMES):
                    while not sock.poll(100, zmq.POLLOUT):  # blocks on HWM, but never forever
                        if stop.is_set():
                            return
                    sock.send(payload, zmq.NOBLOCK)
                flood_done.set()
                stop.wait(DRAIN_S)  # keep it open: closing early would drop what is still queued
            except BaseException as exc:  # surfaced by the main thread
                errors.append(exc)
            finally:
                sock.close(linger=0)

        tracemalloc.start()
        thread = threading.Thread(target=flood, daemon=True)
        got: list[Group] = []
        deadline = time.monotonic() + 60
        # The peak of this block alone (the mark is reset): receiver and flooder share this process,
        # and the flooder's own queue (SNDHWM 100 x ~19 kB) is part of what is measured.
        with PeakGrowth() as peak:
            thread.start()
            try:
                while len(got) < LEGIT_GROUPS or rx.counters["rejected_auth"] < FLOOD_FRAMES:
                    assert time.monotonic() < deadline, (len(got), rx.counters, errors)
                    assert not errors, errors
                    if legit:  # one per round: each then has to get through the flood (fair queueing)
                        tx.send(legit.pop(0), timeout_ms=RECV_MS)
                    group = recv(rx, timeout_ms=200)
                    got += [group] if group is not None else []
            finally:
                stop.set()
                thread.join(10)
                _, py_peak = tracemalloc.get_traced_memory()
                tracemalloc.stop()
        assert flood_done.is_set() and not errors
        assert got == [make_group(f"legit-{i}", n_tokens=i + 1) for i in range(LEGIT_GROUPS)]
        assert rx.counters == {"received": LEGIT_GROUPS, "received_partials": 0, "rejected_auth": FLOOD_FRAMES, "rejected_malformed": 0,
                               "rejected_oversized": 0, "rejected_schema": 0, "rejected_peers": 0,
                               "rejected_handshake": 0}
        assert peak.bytes < MEMORY_BOUND, f"peak RSS grew by {peak.bytes / MIB:.1f} MiB"
        assert py_peak < 16 * 1024 * 1024, f"Python heap peaked at {py_peak} bytes"
        # And it keeps serving after the flood.
        tx.send(make_group("after-flood"))
        assert recv(rx, RECV_MS * 5) == make_group("after-flood")
