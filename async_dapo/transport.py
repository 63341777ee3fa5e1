"""zmq sockets that carry wire-format groups from rollout actors to the replay queue.

This module moves bytes and counts what it rejects; the message schema lives in
``async_dapo.wire`` and all queue policy (admission, staleness, hand-out) lives in the replay queue.

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
    actors over Ray (the control plane); it never travels over the zmq socket. With a secret, every
    message is ONE frame: a 32-byte tag ``HMAC-SHA256(secret, payload)`` followed by the payload
    (the msgpack bytes of ``async_dapo.wire``).
  - A receiver with a secret checks the tag (``hmac.compare_digest``) before it parses a single
    byte of msgpack, so a foreign sender -- even one that sends well-formed groups -- reaches only
    the HMAC and is counted as ``rejected_auth``; so is a frame signed with another run's secret
    or tampered with in flight.
  - ``secret=None`` on both ends keeps the unsigned format (unit tests, back-compat). Both ends
    must agree: a signed frame at an unsigned receiver is not msgpack, and vice versa.
  - This authenticates, it does not encrypt, and the socket layer has no replay protection:
    someone who can read the run's traffic can re-send a captured frame. It can only repeat a
    group this run produced, and the replay queue drops it (its ticket was used by the first
    copy: ``rejected_unexpected``). Keep the socket on a trusted network for confidentiality.

Limits on hostile or broken input (the receiver never raises on bad input):
  - Each message is checked in this order and counted under the first reason that applies
    (``GroupReceiver.counters``): frame count (multipart -> ``rejected_malformed``), size
    (``rejected_oversized``), HMAC tag (``rejected_auth``), then msgpack/schema
    (``rejected_malformed`` / ``rejected_schema``); a valid group counts as ``received``.
  - Payloads larger than ``max_message_bytes`` but within the hard cap are received, dropped
    before the HMAC or unpacking and counted as ``rejected_oversized``. A sender given
    ``max_message_bytes`` raises ``OversizedMessage`` instead of sending such a group, so the
    caller can account for it rather than have it vanish at the receiver.
  - The hard cap (zmq ``MAXMSGSIZE``, default ``max(2 * max_message_bytes, max_message_bytes +
    1 MiB)``, plus the 32 tag bytes with a secret) bounds memory: zmq refuses to read a larger
    message and disconnects that peer. That message (and anything else in flight on that
    connection) is lost and is NOT counted, because zmq reports it to no socket call; the sender
    reconnects by itself and later messages flow again.
  - Buffering is bounded by ``rcvhwm`` messages per connected peer (each at most the hard cap), so
    a flood from a foreign sender costs CPU (one HMAC per frame) but not unbounded memory;
    PULL fair-queues across peers, so the flood cannot starve the real producers.
  - Inside msgpack, declared lengths are bounded by the message size (see ``async_dapo.wire``),
    so a header claiming a 4-billion-element array fails at once instead of allocating.
  - The receiver binds 127.0.0.1 unless another host is configured explicitly.

Sockets are not thread-safe: use one sender per thread/actor, and on a receiver use either
``recv`` or ``arecv`` at a time (never both concurrently).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from async_dapo.wire import Group, OversizedMessage, SchemaMismatch, WireError, decode_group, encode_group

if TYPE_CHECKING:
    from async_dapo.config import TransportConfig

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "TAG_BYTES", "GroupReceiver", "GroupSender", "new_secret"]

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # same default as TransportConfig.max_message_bytes
_HARD_CAP_HEADROOM = 1024 * 1024
_COUNTER_NAMES = (
    "received", "rejected_auth", "rejected_malformed", "rejected_oversized", "rejected_schema",
)
TAG_BYTES = hashlib.sha256().digest_size  # 32: the HMAC-SHA256 tag that leads a signed frame
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
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        try:
            self._sock.setsockopt(zmq.SNDHWM, hwm)
            self._sock.setsockopt(zmq.LINGER, linger_ms)  # bounded: close() never hangs forever
            self._sock.connect(address)
        except BaseException:
            self._sock.close(linger=0)
            raise

    def send(self, group: Group, timeout_ms: int | None = None) -> None:
        """Encode and send one group; blocks while the high-water mark is reached (backpressure).

        With ``timeout_ms`` it raises ``TimeoutError`` if the group could not be queued in time
        (the group is then not sent). Raises ``OversizedMessage`` (nothing sent) if the encoded
        group exceeds ``max_message_bytes``: the receiver would only drop it.
        """
        payload = encode_group(group)
        limit = self.max_message_bytes
        if limit is not None and len(payload) > limit:
            raise OversizedMessage(
                f"group {group.group_id!r}: {len(payload)} bytes > max_message_bytes {limit}, not sent"
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
        if timeout_ms is None:
            self._sock.send(data, copy=False)
            return
        # poll + NOBLOCK instead of SNDTIMEO: the timeout is per call, not a socket-wide setting.
        if not self._sock.poll(timeout_ms, zmq.POLLOUT):
            raise TimeoutError(f"send to {self.address}: not queued within {timeout_ms} ms (HWM reached)")
        try:
            self._sock.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            raise TimeoutError(f"send to {self.address}: not queued within {timeout_ms} ms") from None

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()

    def __enter__(self) -> GroupSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GroupReceiver:
    """PULL side: the replay queue binds one and receives valid groups from every sender.

    ``recv``/``arecv`` return only valid groups; everything else is dropped and counted in
    ``counters`` (the last reason is in ``last_error``), and neither ever raises on bad input.
    """

    def __init__(
        self,
        bind_host: str = "127.0.0.1",
        port: int = 0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        *,
        secret: bytes | None = None,
        hard_cap_bytes: int | None = None,
        rcvhwm: int = 100,
        context: zmq.Context | None = None,
    ) -> None:
        if max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes  # limit on the payload, tag not included
        self._secret = _check_secret(secret)
        # Frame bytes beyond the payload: a payload of exactly max_message_bytes must still fit.
        self._overhead = TAG_BYTES if self._secret is not None else 0
        default_cap = max(2 * max_message_bytes, max_message_bytes + _HARD_CAP_HEADROOM) + self._overhead
        self.hard_cap_bytes = hard_cap_bytes or default_cap
        if self.hard_cap_bytes < max_message_bytes + self._overhead:
            raise ValueError("hard_cap_bytes must be >= max_message_bytes (+ the HMAC tag with a secret)")
        self._counts = dict.fromkeys(_COUNTER_NAMES, 0)
        self._warned: set[str] = set()
        self.last_error: str | None = None
        self._async_sock: zmq.asyncio.Socket | None = None
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)  # nothing to flush on a PULL socket
            # rcvhwm x peers x message size bounds what zmq buffers on our side.
            self._sock.setsockopt(zmq.RCVHWM, rcvhwm)
            self._sock.setsockopt(zmq.MAXMSGSIZE, self.hard_cap_bytes)
            if ":" in bind_host:
                self._sock.setsockopt(zmq.IPV6, 1)
            if port == 0:
                self.port = self._sock.bind_to_random_port(_tcp_endpoint(bind_host))
            else:
                self._sock.bind(_tcp_endpoint(bind_host, port))
                self.port = port
        except BaseException:
            self._sock.close(linger=0)
            raise
        self.bind_host = bind_host
        self.address = _tcp_endpoint(bind_host, self.port)

    @classmethod
    def from_config(cls, cfg: TransportConfig, **kwargs: Any) -> GroupReceiver:
        return cls(cfg.bind_host, cfg.port, cfg.max_message_bytes, **kwargs)

    @property
    def counters(self) -> dict[str, int]:
        """Copy of the counts: valid groups ``received`` and frames rejected, by reason."""
        return dict(self._counts)

    # -- shared by recv and arecv -------------------------------------------------------------
    def _accept(self, frames: list[Any]) -> Group | None:
        """Decode one zmq message; count it; return the group or None if it was rejected."""
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
            group = decode_group(data, max_bytes=self.max_message_bytes)
        except OversizedMessage as exc:
            return self._reject("rejected_oversized", str(exc))
        except SchemaMismatch as exc:
            return self._reject("rejected_schema", str(exc))
        except WireError as exc:
            return self._reject("rejected_malformed", str(exc))
        except Exception as exc:  # a decoder bug must not kill the queue actor
            log.exception("unexpected error decoding a group")
            return self._reject("rejected_malformed", f"message: internal decode error {type(exc).__name__}")
        self._counts["received"] += 1
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

    # -- blocking ------------------------------------------------------------------------------
    def recv(self, timeout_ms: int | None = None) -> Group | None:
        """Next valid group, or None once ``timeout_ms`` passed (None = wait forever).

        The deadline is strict: after it, at most one more pending frame is examined, so None
        means "nothing valid yet", not "the socket is empty" -- just call again.
        """
        deadline = _deadline(timeout_ms)
        while True:
            remaining = _remaining_ms(deadline)
            if not self._sock.poll(remaining, zmq.POLLIN):
                return None
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            group = self._accept(frames)
            if group is not None or remaining == 0:
                return group

    # -- asyncio -------------------------------------------------------------------------------
    async def arecv(self, timeout_ms: int | None = None) -> Group | None:
        """``recv`` for an asyncio event loop (e.g. an async Ray actor); never blocks the loop."""
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
        if self._async_sock is not None and not self._async_sock.closed:
            self._async_sock.close(linger=0)  # also closes the shared zmq socket
        if not self._sock.closed:
            self._sock.close(linger=0)

    def __enter__(self) -> GroupReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
