"""Transport-independent ASGI plumbing: the scope, the request body queue, the response state machine, lifespan.

A transport (HTTP/1.1 with h11, HTTP/2 with h2, possibly HTTP/3) parses requests itself and hands each one to an
:class:`Exchange`, which runs the ASGI app with ``receive``/``send`` callables. The transport supplies

* a :class:`RequestBody`, fed with body chunks as they arrive; it reports every chunk the app takes back to
  the transport (``on_consumed``), which is where backpressure happens (resume reading, or acknowledge HTTP/2
  flow-control credit), so a request body is never buffered whole;
* a :class:`ResponseSink`, whose coroutines return only once the transport can take more data, so a response
  body never queues up unbounded.

The exchange adds ``date``, ``alt-svc`` and, where the whole body is known, ``content-length``; drops bodies of
HEAD responses; answers 500 (problem+json) when the app fails before anything went on the wire and resets the
stream when it fails after.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import unquote

from http3.asgi_types import ASGIApp, Message, Scope
from http3.body_sink import BufferSink, copy_into
from quic.tls import TransportSettings

log = logging.getLogger("http3.asgi")

Headers = list[tuple[bytes, bytes]]
Buffer = bytes | bytearray | memoryview

PROBLEM_TYPE = b"application/problem+json"
_NO_BODY_STATUS = frozenset({204, 304})


class ClientDisconnected(OSError):
    """``send()`` after the peer went away or the stream was reset (ASGI: an OSError subclass)."""


@dataclass
class AsgiContext:
    """What every connection of one server shares."""

    app: ASGIApp
    settings: TransportSettings
    alt_svc: bytes | None  # the Alt-Svc value every response gets unless the app sets one
    state: dict[str, Any] = field(default_factory=dict)  # lifespan state, shallow-copied into each request
    peak_body_buffered: int = 0  # the most request-body octets one request ever held unread (tests, metrics)
    # the app's respond_now hook, if it offers one (http3.immediate: answers written without the ASGI exchange)
    respond_now: Callable[[str, str, bytes, dict[str, Any]], Any] | None = None


# -- scope -------------------------------------------------------------------------------------------------------


def split_target(target: bytes) -> tuple[bytes, bytes]:
    """(raw_path, query_string) of a request target; absolute-form targets keep only their path."""
    path, _, query = target.partition(b"?")
    if not path.startswith(b"/") and path != b"*":
        scheme_end = path.find(b"://")
        if scheme_end > 0:
            slash = path.find(b"/", scheme_end + 3)
            path = path[slash:] if slash >= 0 else b"/"
    return path, query


def http_scope(ctx: AsgiContext, *, http_version: str, method: str, target: bytes, headers: Headers,
               client: tuple[str, int] | None, server: tuple[str, int] | None,
               tls: dict[str, Any] | None) -> Scope:
    raw_path, query = split_target(target)
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": http_version,
        "method": method,
        "scheme": "https",
        "path": unquote(raw_path.decode("ascii", "replace")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": client,
        "server": server,
        "state": dict(ctx.state),
        "extensions": {"tls": dict(tls)} if tls is not None else {},
    }


def address(sockaddr: Any) -> tuple[str, int] | None:
    if isinstance(sockaddr, tuple) and len(sockaddr) >= 2:
        return str(sockaddr[0]), int(sockaddr[1])
    return None


# -- headers -----------------------------------------------------------------------------------------------------


def problem(status: int, title: str | None = None) -> tuple[Headers, bytes]:
    """Headers and body of an ``about:blank`` problem response (RFC 9457)."""
    title = title or HTTPStatus(status).phrase
    body = json.dumps({"type": "about:blank", "title": title, "status": status}, separators=(",", ":")).encode()
    return [(b"content-type", PROBLEM_TYPE), (b"cache-control", b"no-store"),
            (b"content-length", str(len(body)).encode("ascii"))], body


def alt_svc_h3(port: int) -> bytes:
    return b'h3=":%d"; ma=86400' % port


_date_cache: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode("ascii"))
    return _date_cache[1]


def reason_phrase(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        return b""


# -- request body ------------------------------------------------------------------------------------------------


class RequestBody:
    """Body chunks between the transport and the app, with credit handed back as the app takes them.

    ``feed(data, credit)``: *credit* is what the transport must release when the app takes the chunk (the
    flow-controlled length in HTTP/2, which counts padding; the length of the data otherwise).

    Besides ``receive()``, an app may take the rest of the body with :meth:`receive_into` (the ASGI extension
    ``kvsp.receive_into`` of every request's scope): the octets go straight to a :class:`~http3.body_sink.
    BufferSink` as they arrive -- copied once by :meth:`feed`, or, where the transport reads into the sink's own
    buffer (HTTP/1.1: TLS decrypts into it, :meth:`sink_buffer` / :meth:`sink_updated`), not copied at all --
    with no chunk queued and no task switch per chunk. The holder receives block uploads this way.
    """

    def __init__(self, ctx: AsgiContext, on_consumed: Callable[[int], None] | None = None,
                 on_wait: Callable[[], None] | None = None) -> None:
        self._ctx = ctx
        self._on_consumed = on_consumed
        self._on_wait = on_wait  # called when the app waits for body data (HTTP/1.1: 100 Continue)
        self._chunks: deque[tuple[Buffer, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.buffered = 0  # octets held and not yet taken by the app
        self.received = 0  # body octets received so far
        self.complete = False  # the peer sent the whole body
        self.disconnected = False
        self._final_sent = False
        self.sink: BufferSink | None = None  # receive_into(): where body octets go as they arrive
        self._sunk = 0  # octets delivered to the sink
        self._sink_error: BaseException | None = None  # what the sink raised (the app's receive_into raises it)

    def feed(self, data: Buffer, credit: int | None = None) -> None:
        if self.disconnected or self.complete:
            if credit and self._on_consumed:
                self._on_consumed(credit)
            return
        n = len(data)
        self.received += n
        if not n and not credit:
            return
        if self.sink is not None:
            try:
                self._sunk += copy_into(self.sink, data)
            except Exception as exc:  # the sink refuses the body (e.g. a malformed container)
                self._sink_failed(exc)
            if self._on_consumed:  # taken at once: the transport may grant its flow-control credit again
                self._on_consumed(n if credit is None else credit)
            return
        self._chunks.append((data, n if credit is None else credit))
        self.buffered += n
        if self.buffered > self._ctx.peak_body_buffered:
            self._ctx.peak_body_buffered = self.buffered
        self._wake()

    def finish(self) -> None:
        self.complete = True
        self._wake()

    # -- receive_into: the body straight into a sink ------------------------------------------------------------

    async def receive_into(self, sink: BufferSink) -> int | None:
        """Deliver the rest of the body to *sink* as it arrives; the octets delivered, or None when the peer went
        away first. An exception of the sink propagates here (the rest of the body is then dropped by the
        exchange's end, as for an app that stops reading). After it, ``receive()`` gives one empty final body
        message, as at the end of any body."""
        n = 0
        while self._chunks:  # what arrived before the app asked
            data, credit = self._chunks.popleft()
            self.buffered -= len(data)
            if credit and self._on_consumed:
                self._on_consumed(credit)
            n += copy_into(sink, data)
        self.buffered = 0
        self.sink, self._sunk, self._sink_error = sink, 0, None
        try:
            while not (self.complete or self.disconnected or self._sink_error is not None):
                await self._wait()
        finally:
            self.sink = None
            n += self._sunk
        if self._sink_error is not None:
            raise self._sink_error
        return n if self.complete else None

    def sink_buffer(self, limit: int) -> memoryview | None:
        """For a transport that reads into the sink itself: where up to *limit* next octets go, or None when there
        is no sink (or it just failed) and the transport reads as usual."""
        sink = self.sink
        if sink is None:
            return None
        try:
            view = sink.get_buffer(limit)
        except Exception as exc:
            self._sink_failed(exc)
            return None
        return view[:limit] if len(view) > limit else view

    def sink_updated(self, nbytes: int) -> None:
        """*nbytes* octets landed in the view :meth:`sink_buffer` returned."""
        self.received += nbytes
        sink = self.sink
        if sink is None:  # the app stopped (or failed) in between: the octets are dropped
            return
        try:
            sink.buffer_updated(nbytes)
        except Exception as exc:
            self._sink_failed(exc)
            return
        self._sunk += nbytes

    def _sink_failed(self, exc: BaseException) -> None:
        self._sink_error = exc
        self.sink = None
        self._wake()

    def disconnect(self) -> None:
        """The peer went away, the stream was reset, or the exchange is over: receive() says http.disconnect."""
        if self.disconnected:
            return
        self.disconnected = True
        self.sink = None
        credit = sum(c for _, c in self._chunks)
        self._chunks.clear()
        self.buffered = 0
        if credit and self._on_consumed:
            self._on_consumed(credit)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def receive(self) -> Message:
        while True:
            if self._chunks:  # (disconnect() drops them)
                if len(self._chunks) == 1:
                    data, credit = self._chunks.popleft()
                    body = data if type(data) is bytes else bytes(data)
                else:
                    body = b"".join([d for d, _ in self._chunks])
                    credit = sum(c for _, c in self._chunks)
                    self._chunks.clear()
                self.buffered = 0
                more = not self.complete
                self._final_sent = not more
                if credit and self._on_consumed:
                    self._on_consumed(credit)
                return {"type": "http.request", "body": body, "more_body": more}
            if self.complete and not self._final_sent:
                self._final_sent = True
                return {"type": "http.request", "body": b"", "more_body": False}
            if self.disconnected:
                return {"type": "http.disconnect"}
            await self._wait()

    async def _wait(self) -> None:
        """Until the transport feeds, finishes or disconnects the body (HTTP/1.1: 100 Continue goes out first)."""
        if self._on_wait is not None:
            self._on_wait()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


# -- response ----------------------------------------------------------------------------------------------------


class ResponseSink(Protocol):
    """The transport side of one response."""

    @property
    def closed(self) -> bool:
        """The peer is gone or the stream was reset: nothing more can be sent."""
        ...

    async def send_head(self, status: int, headers: Headers, body: Buffer, end: bool) -> None:
        """Status and headers, then *body* (may be empty); *end* ends the response."""
        ...

    async def send_data(self, data: Buffer, end: bool) -> None:
        ...

    def reset(self) -> None:
        """Abort the response (HTTP/2: RST_STREAM; HTTP/1.1: close the connection)."""
        ...


class Exchange:
    """One request/response: runs the app, enforces the ASGI response state machine, renders failures."""

    def __init__(self, ctx: AsgiContext, scope: Scope, body: RequestBody, sink: ResponseSink) -> None:
        self.ctx = ctx
        self.scope = scope
        self.body = body
        self.sink = sink
        self.head = scope["method"] == "HEAD"
        scope["extensions"]["kvsp.receive_into"] = body.receive_into
        self._status: int | None = None
        self._headers: Headers = []
        self.head_sent = False  # something of the response went on the wire
        self.finished = False  # the whole response went on the wire
        self.rejected = False  # the server answered instead of the app (413, 400)

    async def run(self) -> None:
        try:
            await self.ctx.app(self.scope, self.receive, self.send)
        except Exception as exc:
            if self.rejected or self.sink.closed or isinstance(exc, ClientDisconnected):
                log.debug("ASGI app failed after the request was rejected or the peer left: %r", exc)
            else:
                log.exception("ASGI app failed on %s %s", self.scope["method"], self.scope["path"])
            await self._fail()
            return
        if not self.finished and not self.rejected:
            if self._status is None and not self.sink.closed:
                log.error("ASGI app returned without a response for %s %s", self.scope["method"], self.scope["path"])
            await self._fail()

    async def _fail(self) -> None:
        if self.finished or self.rejected:
            return
        if not self.head_sent and not self.sink.closed:
            await self._respond(500)
        else:
            self.sink.reset()
            self.finished = True

    async def receive(self) -> Message:
        return await self.body.receive()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if self.rejected or self.sink.closed:
            raise ClientDisconnected("the response can no longer be sent")
        if kind == "http.response.start":
            if self._status is not None:
                raise RuntimeError("ASGI: http.response.start sent twice")
            status = int(message["status"])
            if not 200 <= status <= 999:
                raise RuntimeError(f"ASGI: invalid response status {status}")
            self._headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            self._status = status
        elif kind == "http.response.body":
            if self._status is None:
                raise RuntimeError("ASGI: http.response.body before http.response.start")
            if self.finished:
                raise RuntimeError("ASGI: http.response.body after the response ended")
            data: Buffer = message.get("body", b"")
            more = bool(message.get("more_body", False))
            if self.head or self._status in _NO_BODY_STATUS:
                data = b""
            if not more:
                self.finished = True
            if not self.head_sent:
                self.head_sent = True
                await self.sink.send_head(self._status, self._final_headers(data, more), data, not more)
            elif data or not more:
                await self.sink.send_data(data, not more)
            if not more:
                self.body.disconnect()  # the exchange is over: a later receive() says http.disconnect
        else:
            raise RuntimeError(f"ASGI: unsupported message type {kind!r}")

    def _final_headers(self, body: Buffer, more: bool) -> Headers:
        headers = self._headers
        names = {name for name, _ in headers}
        extra: Headers = []
        if b"date" not in names:
            extra.append((b"date", http_date()))
        if self.ctx.alt_svc is not None and b"alt-svc" not in names:
            extra.append((b"alt-svc", self.ctx.alt_svc))
        if (not more and not self.head and b"content-length" not in names and b"transfer-encoding" not in names
                and self._status not in _NO_BODY_STATUS):
            extra.append((b"content-length", b"%d" % len(body)))
        return headers + extra if extra else headers

    def reject(self, status: int, title: str | None = None) -> asyncio.Task[None] | None:
        """The server answers instead of the app (request too large, malformed): the app's receive() says
        http.disconnect and its sends fail. Returns the task sending the problem response, if one could be sent."""
        if self.rejected or self.finished:
            return None
        self.rejected = True
        self.body.disconnect()
        if self.head_sent or self.sink.closed:
            self.sink.reset()
            return None
        return asyncio.get_running_loop().create_task(self._respond(status, title))

    async def _respond(self, status: int, title: str | None = None) -> None:
        headers, body = problem(status, title)
        self.head_sent = self.finished = True
        self.body.disconnect()
        self._headers, self._status = headers, status
        with contextlib.suppress(ClientDisconnected):
            await self.sink.send_head(status, self._final_headers(body, False), body, True)


# -- lifespan ----------------------------------------------------------------------------------------------------


class LifespanFailure(Exception):
    """The app answered lifespan.startup.failed."""


class Lifespan:
    """ASGI lifespan: startup before serving, shutdown after; an app without lifespan support is tolerated."""

    def __init__(self, app: ASGIApp, timeout: float = 60.0) -> None:
        self.app = app
        self.timeout = timeout
        self.state: dict[str, Any] = {}
        self._queue: asyncio.Queue[Message] = asyncio.Queue()
        self._replies: asyncio.Queue[Message] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.supported = False

    async def _run(self) -> None:
        scope: Scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": self.state}
        try:
            await self.app(scope, self._queue.get, self._send)
        except Exception as exc:
            if self.supported:
                log.exception("ASGI lifespan failed")
            else:
                log.debug("ASGI app does not support lifespan: %r", exc)
        finally:
            await self._replies.put({"type": "lifespan.exited"})

    async def _send(self, message: Message) -> None:
        self.supported = True
        await self._replies.put(message)

    async def startup(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self._queue.put({"type": "lifespan.startup"})
        reply = await asyncio.wait_for(self._replies.get(), self.timeout)
        if reply["type"] == "lifespan.startup.failed":
            await self._stop()
            raise LifespanFailure(reply.get("message", "") or "lifespan startup failed")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._queue.put({"type": "lifespan.shutdown"})
        try:
            reply = await asyncio.wait_for(self._replies.get(), self.timeout)
        except TimeoutError:
            log.warning("ASGI lifespan shutdown timed out")
        else:
            if reply["type"] == "lifespan.shutdown.failed":
                log.error("ASGI lifespan shutdown failed: %s", reply.get("message", ""))
        await self._stop()

    async def _stop(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            except TimeoutError:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def tls_cipher_code(name: str | None) -> int | None:
    """The IANA code of a TLS 1.3 cipher suite named as OpenSSL names it."""
    return _TLS13_SUITES.get(name or "")


_TLS13_SUITES = {
    "TLS_AES_128_GCM_SHA256": 0x1301,
    "TLS_AES_256_GCM_SHA384": 0x1302,
    "TLS_CHACHA20_POLY1305_SHA256": 0x1303,
    "TLS_AES_128_CCM_SHA256": 0x1304,
    "TLS_AES_128_CCM_8_SHA256": 0x1305,
}
