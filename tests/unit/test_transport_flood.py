"""Foreign peers flooding the receiver's port get no peer slot: the run's producers keep delivering.

Real zmq sockets and plain TCP sockets on 127.0.0.1 only. The foreign peers know the address but not the
run's secret: zmq PUSH sockets with no credential (the NULL mechanism), zmq PUSH sockets with CURVE keys of
their own, and bare TCP connections that never say a word. They reconnect all the time while the producers
send; each must be turned away at its handshake without taking one of the ``max_peers`` slots.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import zmq

from async_dapo.stream import transport
from async_dapo.stream.transport import GroupReceiver, GroupSender, new_secret, producer_credentials
from async_dapo.stream.wire import Group, Sample, encode_group

from .rx import recv

MAX_PEERS = 4
NULL_PEERS = 30  # zmq sockets with no credential at all
CURVE_PEERS = 10  # zmq sockets with CURVE keys that are not the run's
SILENT_PEERS = 20  # TCP connections that never send a byte, re-made all the time
RECONNECT_MS = 20  # the foreign zmq sockets try again this often after each failed handshake
GROUPS_PER_SENDER = 20
DELIVERY_S = 20.0  # every real group arrives within this (a healthy run takes well under 1 s)


def make_group(group_id: str, n_tokens: int) -> Group:
    sample = Sample(
        response_ids=np.arange(1, n_tokens + 1, dtype=np.int32), logprobs=np.full(n_tokens, -0.5, dtype=np.float32),
        versions=np.zeros(n_tokens, dtype=np.int32), reward=1.0, score=1.0, acc=True, truncated=False,
        finish_reason="stop", gen_seconds=0.1,
    )
    return Group(group_id=group_id, prompt_index=n_tokens, epoch=0, engine_rank=0,
                 prompt_ids=np.array([7, 8], np.int32), ground_truth="1", data_source="t", samples=(sample,),
                 created_at=1.0, admitted_version=0)


def wait_for(condition, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.02)  # poll interval of a bounded wait, not a synchronisation


def foreign_zmq_peers(ctx: zmq.Context, address: str) -> list[zmq.Socket]:
    """PUSH sockets without the run's credential, each with a well-formed (unsigned) group queued."""
    payload = encode_group(make_group("intruder", 3))
    socks = []
    for i in range(NULL_PEERS + CURVE_PEERS):
        sock = ctx.socket(zmq.PUSH)
        socks.append(sock)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS)
        if i >= NULL_PEERS:  # CURVE with keys of its own: it cannot know the run's server key
            sock.curve_serverkey = zmq.curve_keypair()[0]
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.connect(address)
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass
    return socks


def silent_tcp_peers(port: int, stop: threading.Event, errors: list[BaseException]) -> None:
    """Keep SILENT_PEERS TCP connections open that never speak, replacing the oldest every few ms."""
    conns: list[socket.socket] = []
    try:
        while not stop.is_set():
            if len(conns) >= SILENT_PEERS:
                conns.pop(0).close()
            try:
                conns.append(socket.create_connection(("127.0.0.1", port), timeout=1.0))
            except OSError:
                pass  # the receiver's backlog is full for a moment: try again
            stop.wait(0.005)
    except BaseException as exc:  # surfaced by the main thread
        errors.append(exc)
    finally:
        for conn in conns:
            conn.close()


def test_foreign_peers_flooding_the_port_get_no_slot_and_every_real_group_arrives():
    secret = new_secret()
    sent = {f"tx{s}-{i}": make_group(f"tx{s}-{i}", n_tokens=i + 1) for s in range(2) for i in range(GROUPS_PER_SENDER)}
    ctx = zmq.Context()
    stop = threading.Event()
    errors: list[BaseException] = []
    foreign: list[zmq.Socket] = []
    senders: list[GroupSender] = []
    flood = None
    with GroupReceiver(max_message_bytes=4096, secret=secret, max_peers=MAX_PEERS) as rx:
        try:
            flood = threading.Thread(target=silent_tcp_peers, args=(rx.port, stop, errors), daemon=True)
            flood.start()
            foreign = foreign_zmq_peers(ctx, rx.address)
            # The flood is under way before the producers connect: more foreign connections than slots.
            wait_for(lambda: rx.open_connections > MAX_PEERS, "the foreign peers connected")
            senders = [GroupSender(rx.address, secret=secret, linger_ms=0) for _ in range(2)]
            for i in range(GROUPS_PER_SENDER):
                for s, tx in enumerate(senders):
                    tx.send(sent[f"tx{s}-{i}"], timeout_ms=1000)
            got: dict[str, Group] = {}
            deadline = time.monotonic() + DELIVERY_S
            while len(got) < len(sent) and time.monotonic() < deadline:
                group = recv(rx, timeout_ms=100)
                if group is not None:
                    assert group.group_id not in got, f"{group.group_id} arrived twice"
                    got[group.group_id] = group
            assert not errors, errors
            counters = rx.counters
            state = f"{len(got)} of {len(sent)} arrived; {counters}; refusals {[tx.refusals for tx in senders]}"
            assert sorted(got) == sorted(sent), state
            assert all(got[k] == sent[k] for k in sent)  # content, not only ids
            # The producers were never refused (no foreign peer held a slot) and nothing foreign was read:
            # no frame of theirs reached the HMAC check.
            assert [tx.refusals for tx in senders] == [0, 0], state
            assert counters["received"] == len(sent), state
            assert counters["rejected_auth"] == counters["rejected_peers"] == counters["rejected_malformed"] == 0, state
            wait_for(lambda: rx.counters["rejected_handshake"] >= NULL_PEERS + CURVE_PEERS,
                     "a failed handshake of each foreign zmq peer counted")
        finally:
            stop.set()
            if flood is not None:
                flood.join(10)
            for tx in senders:
                tx.close()
            for sock in foreign:
                sock.close(linger=0)
            ctx.term()


def test_a_peer_with_the_server_key_but_not_the_run_client_key_is_refused_by_the_gate():
    # It knows the server's public key (a leaked config, say), so its CURVE handshake gets as far as the
    # ZAP handler: the handler refuses its client key, it gets no slot and nothing of it is read.
    secret = new_secret()
    with GroupReceiver(max_message_bytes=4096, secret=secret, max_peers=1) as rx:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.curve_serverkey = producer_credentials(secret)[zmq.CURVE_SERVERKEY]
            sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
            sock.connect(rx.address)
            sock.send(encode_group(make_group("intruder", 3)))
            assert monitor.poll(5000), "the peer was not told it was refused"
            wait_for(lambda: rx.counters["rejected_handshake"] >= 1, "the refusal counted")
            with GroupSender(rx.address, secret=secret, linger_ms=0) as tx:  # the one slot is free
                tx.send(make_group("legit", 2), timeout_ms=1000)
                assert recv(rx, timeout_ms=5000) == make_group("legit", 2)
                assert tx.refusals == 0
            counters = rx.counters
            assert counters["received"] == 1 and counters["rejected_auth"] == counters["rejected_peers"] == 0
        finally:
            monitor.close(linger=0)
            sock.close(linger=0)


def test_silent_connections_are_closed_at_the_handshake_timeout_and_hold_no_slot(monkeypatch):
    monkeypatch.setattr(transport, "_HANDSHAKE_MS", 300)  # read when the receiver is made
    monkeypatch.setattr(transport, "_SETTLE_S", 0.2)
    secret = new_secret()
    conns: list[socket.socket] = []
    with GroupReceiver(max_message_bytes=4096, secret=secret, max_peers=1) as rx:
        try:
            conns = [socket.create_connection(("127.0.0.1", rx.port), timeout=1.0) for _ in range(3)]
            wait_for(lambda: rx.open_connections == 3, "the silent connections accepted")
            with GroupSender(rx.address, secret=secret, linger_ms=0) as tx:  # admitted past them
                tx.send(make_group("legit", 2), timeout_ms=1000)
                assert recv(rx, timeout_ms=5000) == make_group("legit", 2)
                # zmq closes each silent one at the handshake timeout; the producer stays.
                wait_for(lambda: rx.open_connections == 1, "the silent connections closed", seconds=5)
                assert rx.counters["rejected_handshake"] == 3 and tx.refusals == 0
        finally:
            for conn in conns:
                conn.close()
