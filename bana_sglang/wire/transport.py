"""The one ZMQ request/reply transport of every bana_sglang channel.

:class:`Server` owns a ROUTER socket. For each request it decodes the frame
with its :class:`~.envelope.Channel` (a malformed, unknown, wrong-version or
stale request is answered with the channel's :class:`~.envelope.Error` and
never executed), hands it to the handler registered for its type, and sends
exactly one reply. A handler that raises is a bug: it is logged with its
traceback and answered ``internal``; the server keeps serving. It runs on a
thread of its own (:meth:`Server.start`) or is polled without blocking from
someone else's loop (:meth:`Server.poll`: the migration agent answers between
SGLang batches).

:class:`Client` owns a DEALER socket. A call sends one request (``id`` from a
counter, ``deadline`` = now + timeout) and waits for the reply with that id;
replies to earlier, timed-out requests are skipped, and so are undecodable
ones. On timeout the socket is dropped (late replies go with it) and
:class:`ChannelError` is raised: the one exception of the transport, which
each channel's own client may turn into its domain's (``IndexUnavailable``, ...).

Frames: one frame per message. A channel that carries bulk bytes inline (the
KV-block host's queries) sends them as extra frames after the message; its
server is built with ``extra_frames=True``, its handlers take the frames and
may return ``(reply, *frames)``. Every socket caps inbound messages at
``max_message_bytes`` (ZMQ drops a peer that sends more).

Authentication: with a cluster secret (``BANA_CLUSTER_SECRET_FILE``, see
:mod:`.security`) every server is a CurveZMQ server that admits only clients
holding the secret, and every client connects with the cluster's keys; a
client without them gets no reply (:class:`ChannelError`), and its request
never reaches a handler. ``keys=`` overrides the process's keys (``None``:
plain ZMQ).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec
import zmq

from bana_sglang.wire import security
from bana_sglang.wire.envelope import Channel, Error, encode
from bana_sglang.wire.security import CurveKeys

logger = logging.getLogger(__name__)

#: Default inbound size cap of every socket, per frame.
MAX_MESSAGE_BYTES = 64 << 20

#: How long a server waits for its named port to come free (see :func:`_bind`).
BIND_WAIT_S = 2.0

Handler = Callable[..., Any]

#: ``keys=`` default: the keys of this process's cluster secret, if it has one
FROM_ENV: Any = object()


def _keys(keys: Any) -> CurveKeys | None:
    return security.process_keys() if keys is FROM_ENV else keys


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    """Bind ``endpoint``, waiting up to :data:`BIND_WAIT_S` for a named port in use.

    A server that comes back on its old port (a restarted process, a restarted
    thread) can find it briefly taken: ZMQ closes the previous socket's listener
    on its I/O thread after ``close`` returns, and a peer's reconnect to the free
    port may, on Linux, get that very port as its own source port and hold it
    for a moment. Either passes within milliseconds; a port another server holds
    still fails, after the wait.
    """
    deadline = time.monotonic() + BIND_WAIT_S
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE or endpoint.endswith(":*"):
                raise
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.02)


class ChannelError(RuntimeError):
    """A request got no reply: nothing came back before its deadline, or it could not be sent."""

    def __init__(self, channel: str, endpoint: str, detail: str):
        self.channel, self.endpoint, self.detail = channel, endpoint, detail
        super().__init__(f"{channel} at {endpoint}: {detail}")


class Server:
    """A ROUTER socket answering one channel's requests (see the module docstring).

    ``handlers`` maps each request struct class to the function that answers it
    (``handler(req)``, or ``handler(req, frames)`` with ``extra_frames``); a
    request type with no handler is answered ``unknown_type``. ``bind`` is a ZMQ
    endpoint; ``tcp://HOST:*`` picks a free port (:attr:`endpoint` says which).
    ``on_reject(error)`` sees every request refused before a handler ran.
    """

    def __init__(
        self,
        channel: Channel,
        handlers: Mapping[type, Handler],
        bind: str,
        *,
        extra_frames: bool = False,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        on_reject: Callable[[Error], None] | None = None,
        ctx: zmq.Context | None = None,
        keys: CurveKeys | None = FROM_ENV,
    ):
        self.channel = channel
        self.handlers = dict(handlers)
        unknown = [cls.__name__ for cls in self.handlers if cls not in channel.request_classes]
        if unknown:
            raise ValueError(
                f"{channel.name}: handlers for types it does not carry: {', '.join(unknown)}"
            )
        self.extra_frames = extra_frames
        self.on_reject = on_reject
        ctx = ctx or zmq.Context.instance()
        self.keys = _keys(keys)
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            if self.keys is not None:
                security.secure_server(self._sock, ctx, self.keys)
            _bind(self._sock, bind)
        except zmq.ZMQError:
            self._sock.close(0)
            raise
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- serving
    def poll(self, max_requests: int = 64) -> int:
        """Answer the requests waiting now (at most ``max_requests``); never blocks."""
        n = 0
        while n < max_requests:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if len(frames) < 2:  # nothing to answer to
                continue
            n += 1
            self._answer(frames)
        return n

    @property
    def socket(self) -> zmq.Socket:
        """The listening socket, for an owner that waits on it among others (a poller);
        only :meth:`poll` receives from it."""
        return self._sock

    def wait(self, timeout_ms: int) -> bool:
        """Block until a request is waiting (True) or ``timeout_ms`` passed (False):
        for an owner that answers with :meth:`poll` and has its own work between bursts."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def serve(self, stop: threading.Event | None = None, poll_ms: int = 100) -> None:
        """Answer requests on the calling thread until ``stop`` (or :meth:`close`) is set."""
        stop = stop or self._stop
        while not stop.is_set() and not self._stop.is_set():
            if self.wait(poll_ms):
                self.poll()

    def start(self, name: str) -> Server:
        """Serve on a daemon thread called ``name``; :meth:`close` stops it."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.serve()
        finally:
            self._sock.close(0)

    def close(self, timeout_s: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None:
            if self._thread is not threading.current_thread():
                self._thread.join(timeout_s)
        else:
            self._sock.close(0)

    # -- one request
    def _answer(self, frames: Sequence[zmq.Frame]) -> None:
        ident, extra = frames[0].bytes, list(frames[2:])
        out: list = []
        if extra and not self.extra_frames:
            reply: Any = Error(
                id=0,
                reason="malformed",
                detail=f"expected one frame per request, got {len(frames) - 1}",
            )
            self._rejected(reply)
        else:
            req = self.channel.decode_request(frames[1].bytes)
            if isinstance(req, Error):
                reply = req
                self._rejected(reply)
            else:
                reply = self._dispatch(req, extra)
                if isinstance(reply, tuple):
                    reply, *out = reply
        self._sock.send_multipart([ident, encode(reply), *out], copy=False)

    def _dispatch(self, req: Any, extra: list) -> Any:
        handler = self.handlers.get(type(req))
        if handler is None:
            return Error(
                id=req.id,
                reason="unknown_type",
                detail=f"{self.channel.name} has no handler for {type(req).__name__}",
            )
        try:
            if self.extra_frames:
                return handler(req, [f.buffer for f in extra])
            return handler(req)
        except Exception as e:  # a bug: answer it, log it, keep serving
            logger.exception("%s: %s failed", self.channel.name, type(req).__name__)
            return Error(id=req.id, reason="internal", detail=f"{type(e).__name__}: {e}")

    def _rejected(self, err: Error) -> None:
        logger.info("%s refused a request: %s (%s)", self.channel.name, err.reason, err.detail)
        if self.on_reject is not None:
            self.on_reject(err)


class Client:
    """A DEALER socket calling one server of ``channel`` (see the module docstring).

    Thread-safe (one call at a time). The socket is opened on first use and
    again after a timeout. ``linger_ms``: how long requests still queued at
    :meth:`close` keep being sent (0: dropped)."""

    def __init__(
        self,
        endpoint: str,
        channel: Channel,
        *,
        timeout_s: float = 5.0,
        linger_ms: int = 0,
        send_hwm: int | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        ctx: zmq.Context | None = None,
        keys: CurveKeys | None = FROM_ENV,
    ):
        self.endpoint = endpoint
        self.keys = _keys(keys)
        self.channel = channel
        self.timeout_s = timeout_s
        self._linger_ms = linger_ms
        self._send_hwm = send_hwm
        self._max_bytes = max_message_bytes
        self._ctx = ctx or zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        #: extra frames of the last reply (a channel with inline bytes)
        self.frames: list[zmq.Frame] = []

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, self._linger_ms)
            s.setsockopt(zmq.MAXMSGSIZE, self._max_bytes)
            if self._send_hwm is not None:
                s.setsockopt(zmq.SNDHWM, self._send_hwm)
            if self.keys is not None:
                security.secure_client(s, self.keys)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def next_id(self) -> int:
        return next(self._ids)

    def deadline(self, timeout_s: float | None = None) -> float:
        return time.time() + (self.timeout_s if timeout_s is None else timeout_s)

    def request(
        self,
        make: Callable[..., msgspec.Struct],
        *frames: Any,
        timeout_s: float | None = None,
        **fields: Any,
    ) -> Any:
        """Build ``make(id=, deadline=, **fields)``, send it, return its reply."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            req = make(id=self.next_id(), deadline=time.time() + timeout, **fields)
            return self.call(req, *frames, timeout_s=timeout)

    def call(self, req: msgspec.Struct, *frames: Any, timeout_s: float | None = None) -> Any:
        """Send a built request (and any extra frames), return its reply."""
        with self._lock:
            self.post(req, *frames)
            return self.wait(req.id, timeout_s)  # type: ignore[attr-defined]

    def post(self, req: msgspec.Struct, *frames: Any) -> int:
        """Send without waiting (a later :meth:`wait` takes the reply); the request's id."""
        with self._lock:
            try:
                self._socket().send_multipart([encode(req), *frames], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.close()
                raise ChannelError(self.channel.name, self.endpoint, "send queue full") from None
            return req.id  # type: ignore[attr-defined]

    def wait(self, rid: int, timeout_s: float | None = None) -> Any:
        """The reply to request ``rid`` (its extra frames in :attr:`frames`)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            sock = self._socket()
            end = time.monotonic() + timeout
            while (left := end - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart(copy=False)
                try:
                    reply = self.channel.decode_reply(frames[0].bytes)
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    logger.warning(
                        "%s at %s: undecodable reply: %s", self.channel.name, self.endpoint, e
                    )
                    continue
                # an Error with id 0 answers a request the server could not read
                if reply.id == rid or (isinstance(reply, Error) and reply.id == 0):
                    self.frames = list(frames[1:])
                    return reply
                # else: a late reply to an earlier, timed-out request
            self.close()
            raise ChannelError(self.channel.name, self.endpoint, f"no reply within {timeout:.2f}s")

    def send_raw(self, *frames: bytes, timeout_s: float | None = None) -> Any:
        """Send arbitrary frames (tests of malformed input); the first reply that decodes."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            sock = self._socket()
            sock.send_multipart(list(frames))
            if not sock.poll(int(timeout * 1000) + 1, zmq.POLLIN):
                self.close()
                raise ChannelError(
                    self.channel.name, self.endpoint, f"no reply within {timeout:.2f}s"
                )
            return self.channel.decode_reply(sock.recv_multipart()[0])
