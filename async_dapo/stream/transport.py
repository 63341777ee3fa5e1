"""zmq sockets that carry wire-format groups from rollout actors to the replay queue.

This module moves bytes and counts what it rejects; the message schema lives in
``async_dapo.stream.wire`` and all queue policy (admission, staleness, hand-out) lives in the replay queue.

Why PUSH/PULL (and not DEALER/ROUTER):
  - The stream is many producers -> one consumer, one direction. A PULL socket fair-queues across
    all connected PUSH peers, so no rollout actor can starve the others, and adding an actor is
    just one more ``connect``.
  - Backpressure is built in: a PUSH socket blocks once its high-water mark (``hwm`` messages,
    plus the receiver's ``rcvhwm`` and the TCP buffers) is full, so a stalled queue slows the
    producers down instead of growing memory without bound.
  - No reply is needed on this path: admission control (may I start a prompt?) and version
    changes go over Ray calls to the queue actor, which already gives request/response semantics.
    DEALER/ROUTER would add identity frames, our own acknowledgement protocol and our own
    flow control for nothing.
  - Delivery is at-most-once: messages queued in a socket that is closed after its linger time,
    or cut off by a peer disconnect, are lost. The queue tolerates that (a lost group is a prompt
    that is never trained on, and admission counts running prompts through Ray, not the wire).

Authentication (only the run's own producers are heard):
  - The replay queue creates a per-run secret with ``new_secret()`` and hands it to the rollout
    actors over Ray (the control plane); it never travels over the zmq socket. Two things are derived
    from it: the CURVE keys of the connection handshake, and the key of a per-message HMAC.
  - Handshake (CURVE, RFC 26): the receiver is a CURVE server whose secret key is
    ``HMAC-SHA256(secret, b"async_dapo curve server v1")``; every producer uses the client keypair
    derived the same way (``b"... client v1"``) and the server's public key, and the ZAP handler
    (``_PeerGate``) admits a connection only if its client key is that key (``hmac.compare_digest``).
    Neither key crosses the wire, so a peer without the secret cannot finish the handshake: its HELLO
    does not open, or its key is refused. It never holds a peer slot (see Peers below) and none of its
    frames is ever read; each such handshake counts as ``rejected_handshake``.
  - Why CURVE and not PLAIN: PLAIN would send its token in clear, so anyone who can read the run's
    traffic could take the peer slots with it (the token is per-run and reveals neither the secret nor
    how to sign a message, but that is enough for this attack). CURVE proves knowledge of the keys
    without sending them, and encrypts and authenticates every message on the way (libsodium, in
    pyzmq's wheels: ``zmq.has("curve")``). Its cost: 33 bytes per message on the wire (see the hard
    cap below) and one XSalsa20-Poly1305 pass per message on each side, decrypted in place in zmq's
    I/O thread (measured on a loaded 2-core box: ~1 ms per MiB per side; 1 MiB messages, one
    connection, signing included: 360 MB/s, against 3.7 GB/s unsigned over NULL).
  - Message tag (kept under CURVE, from before it and as a second check): every message is ONE
    frame, a 32-byte tag ``HMAC-SHA256(secret, payload)`` followed by the payload (the msgpack bytes
    of ``async_dapo.stream.wire``). A receiver with a secret checks the tag (``hmac.compare_digest``) before
    it parses a single byte of msgpack; a bad tag counts as ``rejected_auth``. Only a peer that passed
    the handshake, so one holding the secret (in practice, a producer built with the wrong flags or
    a test), can send such a frame. The key labels are not msgpack maps, so no group tag is a key.
  - ``secret=None`` on both ends keeps the NULL mechanism and the unsigned format (unit tests,
    back-compat): no credential, any peer that reaches the port is heard. Both ends must agree: a
    CURVE client cannot talk to a NULL server and vice versa (``rejected_handshake``).
  - CURVE's nonces make a captured message useless on another connection, and the traffic is
    confidential. A group repeated by one of the run's own producers is dropped by the replay queue
    (its ticket was used by the first copy: ``rejected_unexpected``).

Limits on hostile or broken input (the receiver never raises on bad input):
  - Each message is checked in this order and counted under the first reason that applies
    (``GroupReceiver.counters``): frame count (multipart -> ``rejected_malformed``), size
    (``rejected_oversized``), HMAC tag (``rejected_auth``), then msgpack/schema
    (``rejected_malformed`` / ``rejected_schema``); a valid group counts as ``received``, a valid
    partial group (a group's progress, ``wire.Partial``) as ``received_partials``.
  - Payloads larger than ``max_message_bytes`` but within the hard cap are received, dropped
    before the HMAC or unpacking and counted as ``rejected_oversized``. A sender given
    ``max_message_bytes`` raises ``OversizedMessage`` instead of sending such a group, so the
    caller can account for it rather than have it vanish at the receiver.
  - The hard cap H (zmq ``MAXMSGSIZE``, default ``max(2 * max_message_bytes, max_message_bytes +
    1 MiB)``, plus the 32 tag bytes with a secret; ``config.receive_hard_cap``) bounds each message as
    it is on the wire: with a secret, CURVE's box around the frame, 33 bytes more (``CURVE_OVERHEAD``;
    an explicit H must be at least max_message_bytes + 32 + 33, which the default exceeds by 1 MiB):
    zmq refuses to read a larger one and disconnects that peer. That message (and anything else in
    flight on that connection) is lost and is NOT counted, because zmq reports it to no socket
    call; the sender reconnects by itself and later messages flow again.
  - Handshakes: a connection that does not finish its handshake within ``_HANDSHAKE_MS`` (zmq
    HANDSHAKE_IVL, 5 s) is closed by zmq. ``rejected_handshake`` counts each handshake zmq reports as
    failed (no CURVE, a box that does not open, not ZMTP, closed or silent until that timeout; also
    a CURVE box of an admitted peer that does not open, which ends that connection) and each one our
    handler refuses for its key. A hostile peer may make one failure count twice; it is a counter of
    events, not of hosts.
  - Peers: at most ``max_peers`` admitted connections at once (the run's: transport.max_peers, None =
    2 x placement.max_engines). A ZAP handler (``_PeerGate``, one thread per receiver) answers every
    new connection after the greeting (with CURVE: after its key is proven), before any of its message
    frames is read. It refuses a connection without the run's key (above) and, while ``max_peers``
    connections may hold a slot, one with it; each of the latter refusals counts as ``rejected_peers``.
    zmq's monitor does not say which connection a handshake event is about, so the gate counts slots
    conservatively: every connection open longer than the handshake timeout + ``_SETTLE_S`` (nothing
    else survives the timeout), plus, of the younger ones, at most as many as it admitted in that
    window. So connections still in their handshake take a slot only if the gate admitted as many
    recently; a foreign flood, admitted never, takes none. The price: a producer connection that
    closes within that window (~7 s) of its admission may keep a slot until the window passes its
    admission, but only while other young connections are open.
    libzmq does not retry a refused connection and drops what was queued for it; ``GroupSender``
    connects again 0.5-1.5 s later (jittered) from inside its send calls, so a producer gets in once a
    slot frees. A peer on a dead node (no FIN) frees its slot through TCP keepalive (~60 s idle), not
    ZMTP heartbeats: those disconnect a live peer whenever we stop reading for longer than their timeout
    (its PONG waits behind the data we do not read), losing what was in flight.
  - Bytes, all peers together: every peer's receive HWM is ``rcvhwm = min(100, (budget // H - 1) //
    max_peers - 3)`` messages, so zmq holds at most ``worst_case_bytes = (max_peers x (rcvhwm + 3) + 1)
    x H <= receive_budget_bytes`` (``config.receive_hwm``). Per admitted peer: ``rcvhwm`` messages in
    its pipe; one in its decoder (zmq allocates a message's declared size when it reads its header,
    and keeps a complete message it could not queue); two copies of the properties of its handshake
    READY (with CURVE: INITIATE) command, a frame of up to H that zmq keeps for the connection's life.
    Plus the one message ``arecv`` is examining. Measured (peers flooding frames of ~H while we do not
    read): the peak RSS grows by max_peers x (rcvhwm + 1) frames + ~0.5 MiB (the same under CURVE), and
    a hand-made READY carrying a 40 MiB property costs 120 MiB at its peak and keeps 80 MiB (measured
    under NULL). The kernel's TCP buffers (several MiB per
    connection on loopback) hold more, outside the process.
  - Not bounded by the budget: a connection the gate refuses can, before its answer, make zmq read one
    frame of up to H (its READY, with CURVE its INITIATE, ~1 H, freed when zmq closes it at the
    refusal), and the number of connections in their handshake at once is bounded only by the
    file-descriptor limit (each also holds ~8 KiB until the handshake timeout, 5 s). libzmq producers
    send a READY/INITIATE of a few hundred bytes. With CURVE, only a peer with the server's key gets
    past its HELLO (200 bytes, checked before any larger frame), but any peer can make zmq allocate
    the declared size of one frame of up to H before it closes the connection.
  - A flood of frames from an admitted peer (one with the secret) costs CPU (one decryption and one
    HMAC per frame) but not more memory than any peer; PULL fair-queues across peers, so the flood
    cannot starve the other producers. Without a secret (NULL) any host that can reach the port can
    take peer slots: that mode is for tests.
  - Inside msgpack, declared lengths are bounded by the message size (see ``async_dapo.stream.wire``),
    so a header claiming a 4-billion-element array fails at once instead of allocating.
  - The receiver binds 127.0.0.1 unless another host is configured explicitly.

Sockets are not thread-safe: use one sender per thread/actor, and one ``arecv`` at a time on a
receiver.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import random
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from async_dapo.config import (
    RECEIVE_PEER_EXTRA,
    RECEIVE_TAG_BYTES,
    receive_budget,
    receive_hard_cap,
    receive_hwm,
    receive_max_peers,
    receive_min_budget,
)
from async_dapo.stream.wire import (
    Group, OversizedMessage, Partial, SchemaMismatch, WireError, decode_message, encode_message,
)

if TYPE_CHECKING:
    from async_dapo.config import Config

__all__ = [
    "CURVE_OVERHEAD", "DEFAULT_MAX_MESSAGE_BYTES", "TAG_BYTES", "GroupReceiver", "GroupSender", "new_secret",
    "producer_credentials",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # same default as TransportConfig.max_message_bytes
DEFAULT_MAX_PEERS = 8  # a receiver built by hand; the run's comes from the config (receive_max_peers)
_COUNTER_NAMES = (
    "received", "received_partials", "rejected_auth", "rejected_malformed", "rejected_oversized", "rejected_schema",
    "rejected_peers", "rejected_handshake",
)
TAG_BYTES = hashlib.sha256().digest_size  # 32: the HMAC-SHA256 tag that leads a signed frame
assert TAG_BYTES == RECEIVE_TAG_BYTES  # config sizes the run's budget with the same tag
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27), one handler per zmq context
_ZAP_DOMAIN = b"async_dapo"  # any non-empty domain makes libzmq ask the handler, NULL mechanism included
# A CURVE MESSAGE command wraps each frame: its name (8 bytes), a short nonce (8), the box's MAC (16), flags (1).
CURVE_OVERHEAD = 33
_CURVE_LABEL = b"async_dapo curve %s v1"  # HMAC(secret, label) is that role's CURVE secret key
_HANDSHAKE_MS = 5000  # zmq HANDSHAKE_IVL of the receiver: a connection still in its handshake then is closed
_SETTLE_S = 2.0  # + slack for zmq's I/O thread: a connection open longer than both has been admitted
_GATE_POLL_MS = 200  # the gate thread re-checks its stop flag at least this often
_GATE_JOIN_S = 5.0
_REJOIN_AFTER_S = (0.5, 1.5)  # a refused sender connects again this long (uniform) after the refusal ...
_REJOIN_CHECK_MS = 100  # ... noticed within this much of a send call's wait
# A peer on a dead node sends no FIN: the kernel's keepalive probes find it and free its slot (~60 s).
_KEEPALIVE = {zmq.TCP_KEEPALIVE: 1, zmq.TCP_KEEPALIVE_IDLE: 30, zmq.TCP_KEEPALIVE_INTVL: 10,
              zmq.TCP_KEEPALIVE_CNT: 3}
_MIN_SECRET_BYTES = 16  # a shorter key would be the weak link of HMAC-SHA256


def new_secret() -> bytes:
    """A fresh per-run secret; the replay queue makes one and hands it to producers over Ray."""
    return secrets.token_bytes(32)


def _check_secret(secret: bytes | None) -> bytes | None:
    if secret is None:
        return None
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"secret must be bytes, got {type(secret).__name__}")
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"secret must be at least {_MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def _tag(secret: bytes, payload: Any) -> bytes:
    return hmac.digest(secret, payload, "sha256")


def _curve_keypair(secret: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret) z85 CURVE keys of ``role`` ("server" or "client"), derived from the run's secret.

    Any 32 bytes are a Curve25519 secret key. The label is not a msgpack map, so it is never a payload
    whose tag a producer sends (an encoded group always is one): no key is ever on the wire.
    """
    private = z85.encode(hmac.digest(secret, _CURVE_LABEL % role.encode(), "sha256"))
    return zmq.curve_public(private), private


def producer_credentials(secret: bytes) -> dict[int, bytes]:
    """Socket options that make a zmq socket one of the run's producers at the handshake (CURVE keys).

    ``GroupSender`` sets them; tests use them on bare sockets. Set them before ``connect``.
    """
    secret = _check_secret(secret)
    server_public, _ = _curve_keypair(secret, "server")
    public, private = _curve_keypair(secret, "client")
    return {zmq.CURVE_SERVERKEY: server_public, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: private}


def _tcp_endpoint(host: str, port: int | None = None) -> str:
    # zmq wants IPv6 literals in brackets ("tcp://[::1]:5555").
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{shown}" if port is None else f"tcp://{shown}:{port}"


def _deadline(timeout_ms: int | None) -> float | None:
    return None if timeout_ms is None else time.monotonic() + max(0, timeout_ms) / 1000


def _remaining_ms(deadline: float | None) -> int | None:
    return None if deadline is None else max(0, round((deadline - time.monotonic()) * 1000))


class GroupSender:
    """PUSH side: one per rollout actor; connects to the queue's receiver and streams groups.

    ``connect`` does not wait for the receiver: messages queue locally (up to ``hwm``) and flow
    once it is reachable. ``close`` waits at most ``linger_ms`` for unsent messages, then drops them.
    With ``secret`` every message is signed (see the module docstring); with ``max_message_bytes``
    ``send`` refuses a group whose encoding is larger, before anything is sent.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: bytes | None = None,
        max_message_bytes: int | None = None,
        hwm: int = 1000,
        linger_ms: int = 1000,
        context: zmq.Context | None = None,
    ) -> None:
        if max_message_bytes is not None and max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.address = address
        self.max_message_bytes = max_message_bytes
        self._secret = _check_secret(secret)
        self._rejoin_at: float | None = None  # set when the receiver refused us (too many peers)
        self.refusals = 0  # handshakes the receiver refused
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._monitor: zmq.Socket | None = None
        try:
            self._sock.setsockopt(zmq.SNDHWM, hwm)
            self._sock.setsockopt(zmq.LINGER, linger_ms)  # bounded: close() never hangs forever
            if self._secret is not None:
                for option, value in producer_credentials(self._secret).items():
                    self._sock.setsockopt(option, value)
            # Read only in this sender's own calls: a refused handshake ends libzmq's endpoint for good.
            self._monitor = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
            self._sock.connect(address)
        except BaseException:
            self.close()
            raise

    def send(self, group: Group | Partial, timeout_ms: int | None = None) -> None:
        """Encode and send one group (or a group's progress); blocks while the high-water mark is reached
        (backpressure).

        With ``timeout_ms`` it raises ``TimeoutError`` if the group could not be queued in time
        (the group is then not sent). Raises ``OversizedMessage`` (nothing sent) if the encoded
        group exceeds ``max_message_bytes``: the receiver would only drop it.
        """
        payload = encode_message(group)
        limit = self.max_message_bytes
        if limit is not None and len(payload) > limit:
            kind = "partial group" if isinstance(group, Partial) else "group"
            raise OversizedMessage(
                f"{kind} {group.group_id!r}: {len(payload)} bytes > max_message_bytes {limit}, not sent"
            )
        self.send_bytes(payload, timeout_ms=timeout_ms)

    def send_bytes(self, data: bytes, timeout_ms: int | None = None, *, sign: bool = True) -> None:
        """Send one raw single-frame message, signed if the sender has a secret and ``sign``.

        No size check here: tests use this to inject malformed, oversized or unsigned frames.
        """
        if sign and self._secret is not None:
            data = _tag(self._secret, data) + data  # one frame: the receiver rejects multipart
        self._send_frame(data, timeout_ms)

    def _send_frame(self, data: bytes, timeout_ms: int | None) -> None:
        # poll + NOBLOCK instead of SNDTIMEO: the timeout is per call, not a socket-wide setting; the
        # poll is sliced so a refused connection is re-made while we wait.
        deadline = _deadline(timeout_ms)
        while True:
            self._rejoin_if_refused()
            remaining = _remaining_ms(deadline)
            wait = _REJOIN_CHECK_MS if remaining is None else min(remaining, _REJOIN_CHECK_MS)
            if self._sock.poll(wait, zmq.POLLOUT):
                try:
                    self._sock.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
            if remaining is not None and remaining <= wait:
                refused = " (refused by the receiver: too many peers)" if self._rejoin_at is not None else ""
                raise TimeoutError(
                    f"send to {self.address}: not queued within {timeout_ms} ms (HWM reached){refused}"
                )

    def _rejoin_if_refused(self) -> None:
        """Connect again 0.5-1.5 s (``_REJOIN_AFTER_S``) after the receiver refused our handshake.

        A refused (ZAP 400) connection is not retried by libzmq, and the messages queued for it are
        dropped (at-most-once, as on any disconnect); the receiver counts each refusal.
        """
        while True:
            try:
                recv_monitor_message(self._monitor, zmq.NOBLOCK)  # only HANDSHAKE_FAILED_AUTH is subscribed
            except zmq.Again:
                break
            if self._rejoin_at is None:
                # Jittered: senders refused together (a burst of connections) must not retry together.
                delay = random.uniform(*_REJOIN_AFTER_S)
                self._rejoin_at = time.monotonic() + delay
                self.refusals += 1
                level = logging.WARNING if self.refusals == 1 else logging.DEBUG  # it retries every second
                log.log(level, "receiver %s refused this sender (too many peers, or not the run's key); "
                        "connecting again in %.1f s", self.address, delay)
        if self._rejoin_at is not None and time.monotonic() >= self._rejoin_at:
            self._rejoin_at = None
            self._sock.connect(self.address)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()  # stops the monitor too
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.close(linger=0)

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PeerGate:
    """ZAP handler of one receiver: admits a connection with the run's key while fewer than ``max_peers``
    connections may hold a slot.

    libzmq asks it (over ``inproc://zeromq.zap.01`` of the receiver's own context) about every new
    connection after the greeting (with CURVE: once the client proved its key) and before any message
    frame is read; "400" makes libzmq send the ZMTP ERROR command and close the connection (the peer's
    libzmq then gives that endpoint up: see ``GroupSender._rejoin_if_refused``). ``pyzmq.auth``
    authenticators only know address allow/deny lists and credentials, no count.

    Slots. The socket monitor tells which connections are open, by fd (ACCEPTED / DISCONNECTED; libzmq
    emits DISCONNECTED for every engine that ends, refused ones included), but not which of them were
    admitted: its handshake events carry no fd. So at each request the gate counts as holding a slot
    every connection open for longer than the handshake timeout + ``_SETTLE_S`` ("settled": zmq closes
    any other), plus, of the younger ones (the asking one left out), no more than it admitted within
    that window. Every admitted connection is counted: settled, or young with its admission in the
    window (it was admitted after the gate saw it open). So admitted <= counted <= max_peers at every
    admission, and connections the gate never admitted (foreign ones, still in their handshake or
    refused) are counted only where recent admissions make up for them.

    One daemon thread owns both sockets after ``start``; it stops when the monitored socket closes
    (MONITOR_STOPPED) or on ``stop``, and never blocks longer than ``_GATE_POLL_MS`` per poll.
    """

    _FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL

    def __init__(self, ctx: zmq.Context, pull: zmq.Socket, max_peers: int, counts: dict[str, int],
                 client_key: bytes | None, settle_s: float) -> None:
        self.max_peers = max_peers
        self._counts = counts  # this thread is the only writer of rejected_peers and rejected_handshake
        self._client_key = client_key  # the run's CURVE client public key (32 bytes); None: NULL, no check
        self._settle_s = settle_s
        self._open: dict[int, float] = {}  # fd -> when the gate saw it accepted (monotonic)
        self._admitted: collections.deque[float] = collections.deque()  # when, within the last settle_s
        self._stop = threading.Event()
        self._warned: set[str] = set()
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        try:
            self._zap.bind(_ZAP_ENDPOINT)  # before the PULL binds: no connection may skip the gate
            events = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_MONITOR_STOPPED | self._FAILED
            self._monitor = pull.get_monitor_socket(events)
        except BaseException:
            self._zap.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="zmq-peer-gate", daemon=True)

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self._thread.start()  # hands both sockets to the thread (Thread.start is a memory barrier)

    def stop(self) -> bool:
        """Ask the thread to end and wait (bounded); True once it has closed its sockets."""
        self._stop.set()
        if self._thread.ident is None:  # never started: the sockets are still this thread's
            self._monitor.close(linger=0)
            self._zap.close(linger=0)
            return True
        self._thread.join(_GATE_JOIN_S)
        return not self._thread.is_alive()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_GATE_POLL_MS))
                if self._monitor in ready and not self._track():
                    return  # the receiver's socket is closed
                if self._zap in ready:
                    self._answer(self._zap.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError as exc:  # only a context torn down under us; nothing to serve any more
            log.debug("peer gate stopped: %s", exc)
        finally:
            self._monitor.close(linger=0)
            self._zap.close(linger=0)

    def _track(self) -> bool:
        """Apply every queued monitor event; False once the monitor stopped."""
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return True
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._open[event["value"]] = time.monotonic()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._open.pop(event["value"], None)
            elif event["event"] & self._FAILED:
                self._count("rejected_handshake", "a handshake failed (no CURVE or not the run's server key, "
                            "not ZMTP, or closed/silent until the handshake timeout)")
            elif event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return False

    def _answer(self, request: list[bytes]) -> None:
        # The asking connection's ACCEPTED was queued before its engine started (one I/O thread), so
        # draining the monitor first makes it one of the open (and young) connections.
        self._track()
        if len(request) < 6 or request[0] != b"1.0":
            status, text = b"400", b"malformed ZAP request"
        elif not self._has_key(request):
            status, text = b"400", b"not the run's key"
            self._count("rejected_handshake", f"refused a connection from {request[3].decode(errors='replace')}: "
                        f"{request[5].decode(errors='replace')} without the run's key")
        elif self._held() < self.max_peers:
            status, text = b"200", b"OK"
            self._admitted.append(time.monotonic())
        else:
            status, text = b"400", b"too many peers"
            self._count("rejected_peers", f"refused a connection from {request[3].decode(errors='replace')}: "
                        f"{self._held()} slots held, max_peers {self.max_peers}")
        request_id = request[1] if len(request) > 1 else b""
        self._zap.send_multipart([b"1.0", request_id, status, text, b"", b""])

    def _has_key(self, request: list[bytes]) -> bool:
        if self._client_key is None:
            return True  # no secret: the NULL mechanism, nothing to check
        # Frames 5, 6: mechanism and (CURVE) the client's long-term public key, which it has proven to hold.
        return request[5] == b"CURVE" and len(request) == 7 and hmac.compare_digest(request[6], self._client_key)

    def _held(self) -> int:
        """Slots that connections may hold, never fewer than admitted ones do (see the class docstring)."""
        settled_before = time.monotonic() - self._settle_s
        while self._admitted and self._admitted[0] <= settled_before:
            self._admitted.popleft()
        young = sum(seen > settled_before for seen in self._open.values())
        return len(self._open) - young + min(max(young - 1, 0), len(self._admitted))

    def _count(self, counter: str, reason: str) -> None:
        self._counts[counter] += 1
        # One warning per kind, then debug: a refused GroupSender connects again every 0.5-1.5 s while it
        # sends, and a flood of foreign connections must not flood the logs too.
        level = logging.DEBUG if counter in self._warned else logging.WARNING
        self._warned.add(counter)
        log.log(level, "%s: %s", counter, reason)


class GroupReceiver:
    """PULL side: the replay queue binds one and receives valid groups from every sender.

    ``arecv`` returns only valid groups; everything else is dropped and counted in ``counters``
    (the last reason is in ``last_error``), and it never raises on bad input. With ``secret`` it is a
    CURVE server that admits only the run's producers (``producer_credentials``); handshakes it refuses
    are counted too (``rejected_handshake``, ``rejected_peers``). At most ``max_peers`` connections are
    admitted; zmq buffers at most ``worst_case_bytes`` for all of them together (<=
    ``receive_budget_bytes``, see the module docstring). Each receiver owns its zmq context: the ZAP
    handler that enforces ``max_peers`` is one per context.
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        secret: bytes | None = None,
        hard_cap_bytes: int | None = None,
        max_peers: int = DEFAULT_MAX_PEERS,
        receive_budget_bytes: int | None = None,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes  # limit on the payload, tag not included
        self._secret = _check_secret(secret)
        # Frame bytes beyond the payload: a payload of exactly max_message_bytes must still fit.
        self._overhead = TAG_BYTES if self._secret is not None else 0
        self.hard_cap_bytes = hard_cap_bytes or receive_hard_cap(max_message_bytes, self._overhead)
        # The cap is on the frame as zmq reads it: with a secret, inside CURVE's box.
        wire_overhead = self._overhead + (CURVE_OVERHEAD if self._secret is not None else 0)
        if self.hard_cap_bytes < max_message_bytes + wire_overhead:
            raise ValueError("hard_cap_bytes must be >= max_message_bytes (+ the HMAC tag and CURVE's "
                             f"{CURVE_OVERHEAD} bytes with a secret)")
        self._size_buffers(max_peers, receive_budget_bytes)
        self._counts = dict.fromkeys(_COUNTER_NAMES, 0)
        self._warned: set[str] = set()
        self.last_error: str | None = None
        self._async_sock: zmq.asyncio.Socket | None = None
        self._gate: _PeerGate | None = None
        self._ctx = zmq.Context()  # one I/O thread: the gate relies on its event order
        self._sock = self._ctx.socket(zmq.PULL)
        try:
            self._configure()
            client_key = None if self._secret is None else z85.decode(_curve_keypair(self._secret, "client")[0])
            self._gate = _PeerGate(self._ctx, self._sock, max_peers, self._counts, client_key,
                                   settle_s=_HANDSHAKE_MS / 1000 + _SETTLE_S)
            self._gate.start()
            self.port = self._bind(bind_host, port)
        except BaseException:
            self.close()
            raise
        self.bind_host = bind_host
        self.address = _tcp_endpoint(bind_host, self.port)

    def _size_buffers(self, max_peers: int, budget: int | None) -> None:
        """Per-peer receive HWM from the budget (see the module docstring for what zmq holds)."""
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        cap = self.hard_cap_bytes
        self.max_peers = max_peers
        self.receive_budget_bytes = receive_budget(budget, max_peers, cap)
        self.rcvhwm = receive_hwm(self.receive_budget_bytes, max_peers, cap)
        if self.rcvhwm < 1:
            raise ValueError(
                f"receive_budget_bytes ({self.receive_budget_bytes}) must be >= (4 x max_peers {max_peers} + 1) x "
                f"hard cap {cap} = {receive_min_budget(max_peers, cap)}"
            )
        # Per peer: its pipe, its decoder, its handshake properties; + the message arecv is examining.
        self.worst_case_bytes = (max_peers * (self.rcvhwm + RECEIVE_PEER_EXTRA) + 1) * cap

    def _configure(self) -> None:
        sock = self._sock
        sock.setsockopt(zmq.LINGER, 0)  # nothing to flush on a PULL socket
        sock.setsockopt(zmq.RCVHWM, self.rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.hard_cap_bytes)
        sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        # Refuse (rather than admit unchecked) if the gate's handler were ever missing.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)  # the gate's slot count relies on it (_PeerGate)
        if self._secret is not None:  # a CURVE server: only a peer with the run's keys gets through
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, _curve_keypair(self._secret, "server")[1])
        for option, value in _KEEPALIVE.items():
            sock.setsockopt(option, value)

    def _bind(self, bind_host: str, port: int) -> int:
        if ":" in bind_host:
            self._sock.setsockopt(zmq.IPV6, 1)
        if port == 0:
            return self._sock.bind_to_random_port(_tcp_endpoint(bind_host))
        self._sock.bind(_tcp_endpoint(bind_host, port))
        return port

    @classmethod
    def from_config(cls, cfg: Config, bind_host: str | None = None, **kwargs: Any) -> GroupReceiver:
        """The run's receiver: transport.* with max_peers resolved (None = 2 x placement.max_engines) and
        ``bind_host`` (default transport.bind_host) an address already resolved by the caller."""
        t = cfg.transport
        return cls(bind_host or t.bind_host, t.port, t.max_message_bytes,
                   max_peers=receive_max_peers(t.max_peers, cfg.placement.max_engines or cfg.placement.num_engines),
                   receive_budget_bytes=t.receive_budget_bytes, **kwargs)

    @property
    def open_connections(self) -> int:
        """TCP connections now open (admitted, or still in their handshake: foreign ones included)."""
        return self._gate.open_connections

    @property
    def counters(self) -> dict[str, int]:
        """Copy of the counts: valid groups ``received`` and frames rejected, by reason."""
        return dict(self._counts)

    # -- receiving --------------------------------------------------------------------------
    def _accept(self, frames: list[Any]) -> Group | Partial | None:
        """Decode one zmq message; count it; return the group (or partial group) or None if it was rejected."""
        if len(frames) != 1:
            return self._reject("rejected_malformed", f"message: {len(frames)} frames, expected 1")
        frame = frames[0]
        data = frame.buffer if isinstance(frame, zmq.Frame) else frame
        if len(data) > self.max_message_bytes + self._overhead:
            # Before the HMAC: hashing a huge frame would be work done for the sender.
            return self._reject(
                "rejected_oversized", f"message: {len(data) - self._overhead} bytes > "
                f"max_message_bytes {self.max_message_bytes}"
            )
        if self._secret is not None:
            data = self._authenticated_payload(data)
            if data is None:
                return None
        try:
            group = decode_message(data, max_bytes=self.max_message_bytes)
        except OversizedMessage as exc:
            return self._reject("rejected_oversized", str(exc))
        except SchemaMismatch as exc:
            return self._reject("rejected_schema", str(exc))
        except WireError as exc:
            return self._reject("rejected_malformed", str(exc))
        except Exception as exc:  # a decoder bug must not kill the queue actor
            log.exception("unexpected error decoding a group")
            return self._reject("rejected_malformed", f"message: internal decode error {type(exc).__name__}")
        self._counts["received_partials" if isinstance(group, Partial) else "received"] += 1
        return group

    def _authenticated_payload(self, data: memoryview | bytes) -> memoryview | None:
        """The payload behind a valid tag, else None (counted); no msgpack is parsed before this."""
        view = memoryview(data)
        if len(view) < TAG_BYTES:
            return self._reject("rejected_auth", f"message: {len(view)} bytes, shorter than the HMAC tag")
        payload = view[TAG_BYTES:]
        # compare_digest: constant time, so a forger learns nothing from how fast we say no.
        if not hmac.compare_digest(view[:TAG_BYTES], _tag(self._secret, payload)):
            return self._reject("rejected_auth", "message: HMAC tag mismatch (unsigned, foreign or tampered)")
        return payload

    def _reject(self, counter: str, reason: str) -> None:
        self._counts[counter] += 1
        self.last_error = reason
        # One warning per kind, then debug: a flood of garbage must not flood the logs too.
        level = logging.DEBUG if counter in self._warned else logging.WARNING
        self._warned.add(counter)
        log.log(level, "dropped message (%s): %s", counter, reason)
        return None

    # -- asyncio -------------------------------------------------------------------------------
    async def arecv(self, timeout_ms: int | None = None) -> Group | Partial | None:
        """Next valid group (or partial group), or None once ``timeout_ms`` passed (None = wait forever); never blocks the loop.

        The deadline is strict: after it, at most one more pending frame is examined, so None
        means "nothing valid yet", not "the socket is empty" -- just call again.
        """
        if self._async_sock is None:
            # A shadow of the same zmq socket: same bind, same counters; pyzmq re-registers it
            # if it is later awaited from a different event loop.
            self._async_sock = zmq.asyncio.Socket.from_socket(self._sock)
        sock = self._async_sock
        deadline = _deadline(timeout_ms)
        while True:
            remaining = _remaining_ms(deadline)
            if not await sock.poll(remaining, zmq.POLLIN):
                return None
            try:
                frames = await sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            group = self._accept(frames)
            if group is not None or remaining == 0:
                return group

    def close(self) -> None:
        if self._ctx.closed:
            return
        if self._async_sock is not None and not self._async_sock.closed:
            self._async_sock.close(linger=0)  # also closes the shared zmq socket
        if not self._sock.closed:
            self._sock.close(linger=0)  # the monitor reports MONITOR_STOPPED: the gate thread ends
        if self._gate is None or self._gate.stop():
            self._ctx.term()  # every socket of it is closed: returns at once
        else:  # term() would wait for the gate's sockets forever
            log.error("zmq peer gate thread did not stop within %.0f s; its context is left open", _GATE_JOIN_S)

    def __enter__(self) -> GroupReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
