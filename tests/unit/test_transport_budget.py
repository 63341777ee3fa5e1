"""The receiver's memory bound for all peers together: transport.max_peers and transport.receive_budget_bytes.

Real zmq sockets on 127.0.0.1 only. The memory test runs the receiver in a spawned child process
(tests/unit/memprobe.py): its peak RSS is then the receiver's alone (the flooding senders live in this
process) and is reset before the flood, so no earlier test's high-water mark can hide growth.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import zmq

from async_dapo.config import (
    RECEIVE_TAG_BYTES,
    ConfigError,
    load_config,
    receive_budget,
    receive_hard_cap,
    receive_hwm,
)
from async_dapo.stream.transport import TAG_BYTES, GroupReceiver, GroupSender, new_secret, producer_credentials
from async_dapo.stream.wire import Group, Sample

from .memprobe import MIB, ReceiverProcess
from .rx import recv

MAX_BYTES = 64 * 1024
HARD_CAP = max(2 * MAX_BYTES, MAX_BYTES + MIB) + 32  # 1114144, written out: the formula under test
MAX_PEERS = 2
BUDGET = 24 * MIB  # 25165824 // 1114144 = 22 -> rcvhwm (22 - 1) // 2 - 3 = 7
RCVHWM = 7
WORST = (MAX_PEERS * (RCVHWM + 3) + 1) * HARD_CAP  # 21 hard caps = 22.3 MiB
FRAME = HARD_CAP - 64  # over max_message_bytes (counted oversized) but within the hard cap: zmq reads it
SLACK = 2 * MIB  # measured: ~0.5 MiB beyond the frames (zmq's per-connection buffers, allocator)
EXTRA_PEERS = 3
VALID = 5  # valid groups per admitted peer, sent behind its flood
RECV_MS = 1000


def make_group(group_id: str) -> Group:
    sample = Sample(
        response_ids=np.arange(1, 4, dtype=np.int32), logprobs=np.full(3, -0.5, dtype=np.float32),
        versions=np.zeros(3, dtype=np.int32), reward=1.0, score=1.0, acc=True, truncated=False,
        finish_reason="stop", gen_seconds=0.1,
    )
    return Group(group_id=group_id, prompt_index=0, epoch=0, engine_rank=0, prompt_ids=np.array([7, 8], np.int32),
                 ground_truth="1", data_source="t", samples=(sample,), created_at=1.0, admitted_version=0)


def wait_for(condition, what: str, seconds: float = 10.0, interval_s: float = 0.02, required: bool = True):
    """Poll ``condition`` until it holds or a deadline passes (then fail, or with ``required=False``
    return False so that the caller's own assertions say what went wrong)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline or not required, f"not within {seconds} s: {what}"
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)  # poll interval of a bounded wait, not a synchronisation
    return True


# ------------------------------------------------------------------------------ the memory bound
def flood(admitted: list[GroupSender], extra: list[GroupSender], quiet_s: float = 1.0) -> list[int]:
    """Every peer sends frames of ~the hard cap until the admitted ones made no progress for ``quiet_s``
    (their whole pipeline is full); returns how many frames each admitted peer queued."""
    sent = [0] * len(admitted)
    frame = bytes(FRAME)
    deadline = time.monotonic() + 30
    last_progress = time.monotonic()
    while time.monotonic() - last_progress < quiet_s:
        assert time.monotonic() < deadline, f"flood never filled up: {sent}"
        for i, tx in enumerate(admitted):
            try:
                tx.send_bytes(frame, timeout_ms=20, sign=False)
                sent[i] += 1
                last_progress = time.monotonic()
            except TimeoutError:
                pass
        for tx in extra:  # refused: nothing they queue is ever read (libzmq drops it at the refusal)
            try:
                tx.send_bytes(frame, timeout_ms=0, sign=False)
            except TimeoutError:
                pass
    return sent


def test_peers_beyond_max_peers_refused_and_memory_within_budget_while_flooded():
    secret = new_secret()
    with ReceiverProcess(max_message_bytes=MAX_BYTES, secret=secret, max_peers=MAX_PEERS,
                         receive_budget_bytes=BUDGET) as rx:
        assert (rx.info["hard_cap_bytes"], rx.info["rcvhwm"], rx.info["worst_case_bytes"]) == (HARD_CAP, RCVHWM, WORST)
        senders: list[GroupSender] = []
        try:
            # The admitted peers connect first and hold the slots (a delivered group proves the admission: an
            # open connection may still be in its handshake); the extra ones are then refused at the handshake.
            senders += [GroupSender(rx.info["address"], secret=secret, hwm=2, linger_ms=0) for _ in range(MAX_PEERS)]
            for p, tx in enumerate(senders):
                tx.send(make_group(f"hello{p}"), timeout_ms=10_000)
            hello = rx.call("drain", (MAX_PEERS, 10.0))
            assert sorted(hello["ids"]) == [f"hello{p}" for p in range(MAX_PEERS)], hello
            senders += [GroupSender(rx.info["address"], secret=secret, hwm=2, linger_ms=0) for _ in range(EXTRA_PEERS)]
            # Not required here: with a broken limit, the memory check below reports what it costs.
            wait_for(lambda: rx.call("status")["counters"]["rejected_peers"] >= EXTRA_PEERS, "extra peers refused",
                     seconds=5, required=False)
            admitted, extra = senders[:MAX_PEERS], senders[MAX_PEERS:]

            base = rx.call("reset_peak")  # the child's peak RSS := its RSS now
            sent = flood(admitted, extra)
            during = rx.call("status")
            growth = during["hwm"] - base
            # What zmq holds never exceeds the budget's worst case ...
            assert growth <= WORST + SLACK, (
                f"receiver's peak RSS grew by {growth / MIB:.1f} MiB > worst case {WORST / MIB:.1f} MiB + "
                f"{SLACK / MIB:.0f} MiB slack (rcvhwm {RCVHWM}, {MAX_PEERS} peers; queued {sent}; {during})"
            )
            # ... and the flood did reach it: every admitted peer's pipe (rcvhwm) and decoder (1) are full
            # (measured ~0.88-1.0 of that: the allocator reuses memory the hellos' decoding freed; one peer
            # alone would be 0.5).
            assert growth >= 0.7 * MAX_PEERS * (RCVHWM + 1) * FRAME, (growth, sent)
            assert during["open"] == MAX_PEERS and during["counters"]["received"] == MAX_PEERS  # the hellos
            assert during["counters"]["rejected_peers"] >= EXTRA_PEERS  # each extra, at least once

            # Now read: every admitted peer's valid groups arrive behind its flood; none from the others.
            rx.request("drain", (MAX_PEERS * VALID, 20.0))
            for tx in extra:
                try:
                    tx.send(make_group("from-a-refused-peer"), timeout_ms=0)
                except TimeoutError:
                    pass
            for i in range(VALID):
                for p, tx in enumerate(admitted):
                    tx.send(make_group(f"peer{p}-{i}"), timeout_ms=10_000)
            got = rx.reply(timeout_s=30)
        finally:
            for tx in senders:
                tx.close()
    for p in range(MAX_PEERS):
        assert [g for g in got["ids"] if g.startswith(f"peer{p}-")] == [f"peer{p}-{i}" for i in range(VALID)]
    assert len(got["ids"]) == MAX_PEERS * VALID
    counters = got["counters"]
    assert counters["received"] == MAX_PEERS * (VALID + 1)  # + the hellos
    assert counters["rejected_oversized"] == sum(sent)  # every flood frame of the admitted peers, judged
    assert counters["rejected_auth"] == counters["rejected_malformed"] == counters["rejected_schema"] == 0
    assert counters["rejected_peers"] >= EXTRA_PEERS


# ------------------------------------------------------------------------------ admission
def sends_until(rx: GroupReceiver, tx: GroupSender, condition, seconds: float) -> list[str]:
    """``tx`` keeps sending while ``rx`` reads, until ``condition(ids received)``; the ids."""
    got: list[str] = []
    deadline = time.monotonic() + seconds
    for i in range(10**6):
        if condition(got):
            return got
        assert time.monotonic() < deadline, (got, rx.counters, tx.refusals)
        try:
            tx.send(make_group(f"late-{i}"), timeout_ms=100)
        except TimeoutError:
            pass
        group = recv(rx, timeout_ms=50)
        got += [group.group_id] if group is not None else []
    raise AssertionError("unreachable")


def test_refused_sender_connects_again_and_gets_in_once_a_slot_frees():
    with GroupReceiver(max_message_bytes=4096, max_peers=1) as rx, GroupSender(rx.address, linger_ms=0) as holder:
        holder.send(make_group("holder"))
        assert recv(rx, RECV_MS).group_id == "holder"
        with GroupSender(rx.address, linger_ms=0) as late:
            wait_for(lambda: rx.counters["rejected_peers"] >= 1, "the late sender refused at its handshake")
            # While the slot is held, the late sender keeps connecting again (refused each time) and nothing
            # it queued arrives: its messages die with each refused connection.
            # (it waits for both counts it asserts: the receiver may count a reconnection before the sender's
            # next send notices the refusal)
            got = sends_until(rx, late, lambda _: rx.counters["rejected_peers"] >= 3 and late.refusals >= 2,
                              seconds=10)
            assert got == [] and late.refusals >= 2
            holder.close()
            got = sends_until(rx, late, lambda got: got, seconds=10)
            assert got[0].startswith("late-") and rx.open_connections == 1


@pytest.mark.parametrize("secret", [None, new_secret()], ids=["null", "curve"])
def test_a_burst_beyond_max_peers_settles_to_exactly_max_peers(secret):
    # All connect at once: the first max_peers handshakes are admitted, the others refused; the jittered
    # retries of the refused never get in while those stay, and never more than max_peers are heard.
    n, limit = 8, 3
    with GroupReceiver(max_message_bytes=4096, max_peers=limit, secret=secret) as rx:
        senders = [GroupSender(rx.address, linger_ms=0, secret=secret) for _ in range(n)]
        heard: set[str] = set()

        def pump() -> None:  # every sender offers one group, the receiver takes what came
            for i, tx in enumerate(senders):
                try:
                    tx.send(make_group(f"s{i}"), timeout_ms=0)
                except TimeoutError:
                    pass
            group = recv(rx, timeout_ms=50)
            heard.update({group.group_id} if group is not None else set())

        try:
            deadline = time.monotonic() + 15
            while len(heard) < limit:
                assert time.monotonic() < deadline, (heard, rx.counters)
                pump()
            for _ in range(40):  # settled: the same peers keep delivering, no one else gets in
                pump()
            assert len(heard) == limit and rx.open_connections <= limit + 1  # + one being refused, maybe
            assert rx.counters["rejected_peers"] >= n - limit
        finally:
            for tx in senders:
                tx.close()


def test_socket_options_follow_the_budget():
    with GroupReceiver(max_message_bytes=MAX_BYTES, secret=new_secret(), max_peers=MAX_PEERS,
                       receive_budget_bytes=BUDGET) as rx:
        sock = rx._sock
        assert (rx.hard_cap_bytes, rx.rcvhwm, rx.worst_case_bytes) == (HARD_CAP, RCVHWM, WORST)
        assert sock.getsockopt(zmq.RCVHWM) == RCVHWM and sock.getsockopt(zmq.MAXMSGSIZE) == HARD_CAP
        assert sock.getsockopt(zmq.ZAP_DOMAIN) == b"async_dapo"
        # A peer on a dead node sends no FIN: keepalive probes find it (30 s idle + 3 x 10 s).
        assert [sock.getsockopt(o) for o in (zmq.TCP_KEEPALIVE, zmq.TCP_KEEPALIVE_IDLE, zmq.TCP_KEEPALIVE_INTVL,
                                             zmq.TCP_KEEPALIVE_CNT)] == [1, 30, 10, 3]
    # Unsigned: no tag in the hard cap.
    with GroupReceiver(max_message_bytes=MAX_BYTES, max_peers=8) as rx:
        assert rx.hard_cap_bytes == HARD_CAP - 32
        assert rx.receive_budget_bytes == 4 * 1024**3 and rx.rcvhwm == 100  # the cap of 100 binds


def test_budget_too_small_for_the_peers_is_refused():
    minimum = (4 * MAX_PEERS + 1) * HARD_CAP
    with GroupReceiver(max_message_bytes=MAX_BYTES, secret=new_secret(), max_peers=MAX_PEERS,
                       receive_budget_bytes=minimum) as rx:
        assert rx.rcvhwm == 1 and rx.worst_case_bytes == minimum
    with pytest.raises(ValueError, match=rf"receive_budget_bytes \({minimum - 1}\) must be >= .* = {minimum}"):
        GroupReceiver(max_message_bytes=MAX_BYTES, secret=new_secret(), max_peers=MAX_PEERS,
                      receive_budget_bytes=minimum - 1)
    with pytest.raises(ValueError, match="max_peers must be >= 1"):
        GroupReceiver(max_peers=0)


def test_close_stops_the_gate_thread():
    def gates() -> int:
        return sum(t.name == "zmq-peer-gate" and t.is_alive() for t in threading.enumerate())

    before = gates()
    receivers = [GroupReceiver(max_message_bytes=4096) for _ in range(3)]
    assert gates() == before + 3
    start = time.monotonic()
    for rx in receivers:
        rx.close()
        rx.close()  # idempotent
    assert gates() == before and time.monotonic() - start < 2.0


# ------------------------------------------------------------------------------ config rule
DEFAULT_CAP = 2 * 64 * MIB + 32  # the default max_message_bytes (64 MiB), signed


def test_config_too_small_budget_is_a_config_error_naming_the_fields():
    minimum = (4 * 2 + 1) * DEFAULT_CAP  # default num_engines 1 -> max_peers 2
    cfg = load_config(None, [f"transport.receive_budget_bytes={minimum}"])
    assert cfg.transport.receive_budget_bytes == minimum
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"transport.receive_budget_bytes={minimum - 1}"])
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"transport.receive_budget_bytes ({minimum - 1}) must be >= {minimum} = "
                              f"(4 x transport.max_peers 2 + 1) x hard cap {DEFAULT_CAP}")
    assert "transport.max_message_bytes 67108864" in message


@pytest.mark.parametrize(("overrides", "peers"), [
    ([], 2), (["placement.num_engines=3"], 6), (["transport.max_peers=5"], 5),
    (["placement.num_engines=3", "transport.max_peers=1"], 1),
    (["placement.max_engines=2"], 4),  # room for the engines the run may be scaled to
])
def test_config_max_peers_resolution_reaches_the_receiver(overrides, peers):
    cfg = load_config(None, overrides)
    with GroupReceiver.from_config(cfg) as rx:
        assert rx.max_peers == peers and rx.address.startswith("tcp://127.0.0.1:")
        assert rx.receive_budget_bytes == 4 * 1024**3  # None: the 4 GiB floor covers these few peers
        assert rx.rcvhwm == (4 * 1024**3 // (2 * 64 * MIB) - 1) // peers - 3  # no secret here: no tag in the cap
    too_small = (4 * peers + 1) * DEFAULT_CAP - 1
    with pytest.raises(ConfigError, match=rf"max_peers {peers} \+ 1"):
        load_config(None, [*overrides, f"transport.receive_budget_bytes={too_small}"])


def test_default_budget_grows_to_fit_many_peers():
    # 16 engines -> 32 peers: (4 x 32 + 1) hard caps = 16.1 GiB > the 4 GiB floor, one message each.
    cap = receive_hard_cap(64 * MIB)
    assert cap == DEFAULT_CAP and RECEIVE_TAG_BYTES == TAG_BYTES == 32
    assert receive_budget(None, 32, cap) == 129 * cap
    assert receive_hwm(129 * cap, 32, cap) == 1 and receive_hwm(129 * cap - 1, 32, cap) == 0
    assert receive_budget(None, 2, cap) == 4 * 1024**3 and receive_hwm(4 * 1024**3, 2, cap) == 12


def test_replay_queue_stats_count_refused_peers():
    from async_dapo.replay.queue import ReplayQueue

    async def main() -> tuple[int, dict]:
        svc = ReplayQueue(load_config(None))  # num_engines 1 -> max_peers 2
        socks = []
        try:
            for want_open in (1, 2, 2):  # one at a time: the third finds both slots taken
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                for option, value in producer_credentials(svc.secret).items():  # the run's own producers
                    sock.setsockopt(option, value)
                sock.connect(svc.receiver.address)
                socks.append(sock)
                deadline = time.monotonic() + 10
                while svc.receiver.open_connections != want_open and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)  # poll interval of a bounded wait
            while svc.receiver.counters["rejected_peers"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            return svc.receiver.max_peers, await svc.stats()
        finally:
            for sock in socks:
                sock.close(linger=0)
            await svc.close()

    peers, stats = asyncio.run(main())
    assert peers == 2 and stats["rejected_peers"] == 1
