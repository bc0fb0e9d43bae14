"""The one HTTP client every role uses.

HTTP/3 first (pooled connections, concurrent streams, streamed bodies under flow control, mutual TLS); when an
origin cannot be reached over QUIC (UDP blocked, no answer, h3 refused) the client falls back to HTTP/1.1 (or,
with ``fallback_http2``, HTTP/2) over TLS on the same port and remembers that for ``fallback_ttl`` seconds.
``prefer="tcp"`` (for every origin, or per origin) goes to the TCP path first: the faster one for bulk blocks
here. HTTP/1.1 is :mod:`http3.h1_client` (keep-alive pool, bodies decrypted straight into the caller's buffer or
a verifying :class:`~kvsp_quic.container.ContainerDecoder` with :meth:`Response.receive_into`); HTTP/2 is httpx.
Requests time out; only idempotent requests with a replayable body are retried, and only after a transport
failure, never after an HTTP answer nor after a connect that timed out (:class:`ConnectTimeout`). A pooled
HTTP/3 connection on which a request timed out or the connection failed is dropped from the pool at once (its
other streams may finish; it closes after the last), so a dead peer is not handed out again until QUIC's idle
timeout notices it. With a :class:`~http3.h3_client.KeepAlive` (for
every origin: *keepalive*; for one: :meth:`KvspClient.keep_alive`) pooled HTTP/3 connections PING their peer and
end themselves when it stops answering, so a dead or frozen peer is noticed in about a second even between requests.

The typed KVSP operations and their failure semantics (miss / retry elsewhere / refused) are :mod:`kvsp_client.api`'s.

    async with KvspClient(TlsFiles.in_dir("certs", "alice")) as client:
        response = await client.request("GET", "https://127.0.0.1:8443/blocks/...")
        async with client.stream("GET", url) as response:
            async for chunk in response.aiter_bytes(): ...
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlsplit

import httpx

from http3.body_sink import BufferSink, copy_into
from http3.errors import ConnectTimeout as ConnectTimeout
from http3.errors import RequestTimeout as RequestTimeout
from http3.errors import TransportError as TransportError
from http3.h1_client import H1Pool, IntoBuffer
from http3.h3_client import (
    CONTROL_KEEPALIVE,
    H3ClientConnection,
    H3ConnectError,
    H3Pool,
    H3Response,
    H3StreamError,
    KeepAlive,
)
from quic.protocol import peer_unreachable
from quic.rtt import STALL_FLOOR, RttTable, path_timeout
from quic.tls import TlsFiles, TransportSettings, identity_of_der, serves, ssl_client_context

log = logging.getLogger("kvsp.client")

IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
Body = bytes | bytearray | memoryview | AsyncIterable[bytes] | None


class Headers:
    """Response header fields, looked up case-insensitively."""

    def __init__(self, fields: Sequence[tuple[bytes, bytes]], *, lowered: bool = False) -> None:
        # *lowered*: the fields are a list of (lowercased name, value) bytes pairs already (the HTTP/1.1 path's)
        self.raw = fields if lowered and isinstance(fields, list) else [(bytes(k).lower(), bytes(v)) for k, v in fields]

    def get(self, name: str, default: str | None = None) -> str | None:
        key = name.lower().encode()
        values = [v.decode("latin-1") for k, v in self.raw if k == key]
        return ", ".join(values) if values else default

    def __getitem__(self, name: str) -> str:
        value = self.get(name)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


class Response:
    """A response; the body is read with :meth:`aread` or streamed with :meth:`aiter_bytes`."""

    def __init__(self, status: int, headers: Headers, http_version: str, chunks: AsyncIterator[bytes],
                 closer: Callable[[], Any], read_timeout: float | None,
                 on_timeout: Callable[[], None] | None = None,
                 receive_into: Callable[[BufferSink, float | None], Awaitable[int]] | None = None,
                 timed_chunks: Callable[[float | None], AsyncIterator[bytes]] | None = None) -> None:
        self.status = status
        self.headers = headers
        self.http_version = http_version
        self._chunks = chunks
        self._closer = closer
        self._read_timeout = read_timeout
        self._on_timeout = on_timeout  # the connection went silent: the pool drops it
        self._receive_into = receive_into  # the transport delivers the body into a sink itself, timed by itself
        self._timed_chunks = timed_chunks  # the transport streams the body and times each chunk itself
        self.content: bytes | None = None

    @property
    def read_timeout(self) -> float | None:
        """How long the body may go without octets (seconds; the request's timeout unless set shorter, e.g. to
        :meth:`KvspClient.stall_timeout`). When it passes, the read fails with :class:`RequestTimeout` and a pooled
        HTTP/3 connection is dropped."""
        return self._read_timeout

    @read_timeout.setter
    def read_timeout(self, seconds: float | None) -> None:
        self._read_timeout = seconds

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        chunks = self._chunks if self._timed_chunks is None else self._timed_chunks(self._read_timeout)
        while True:
            try:
                if self._timed_chunks is not None:  # the lean HTTP/1.1 path: its deadlines are on one timer
                    chunk = await anext(chunks)
                else:
                    async with asyncio.timeout(self._read_timeout):
                        chunk = await anext(chunks)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if self._on_timeout is not None:
                    self._on_timeout()
                raise RequestTimeout(f"no response data for {self._read_timeout} s") from None
            except (H3StreamError, TransportError, httpx.TransportError) as exc:
                raise TransportError(f"response body broken: {exc}") from None
            yield chunk

    async def readinto(self, buffer: bytes | bytearray | memoryview) -> int:
        """Read the whole body into *buffer* (writable, at least the body's size); the octets read. Over the
        lean HTTP/1.1 path TLS decrypts straight into *buffer*."""
        return await self.receive_into(IntoBuffer(buffer))

    @property
    def delivers_into(self) -> bool:
        """Whether :meth:`receive_into` has the transport deliver into the sink itself, with no copy (the lean
        HTTP/1.1 path: TLS decrypts into the sink's buffers); elsewhere it copies each chunk into the sink."""
        return self._receive_into is not None

    async def receive_into(self, sink: BufferSink) -> int:
        """Deliver the whole body to *sink* (``get_buffer(sizehint)`` / ``buffer_updated(n)``, the shape of
        :class:`kvsp_quic.container.ContainerDecoder`, which verifies each layer as it completes); the octets
        delivered. Over the lean HTTP/1.1 path TLS decrypts straight into the sink's buffers; otherwise each
        chunk is copied in. The whole body must arrive within the read timeout; an exception the sink raises
        (a digest mismatch) comes out as it is."""
        try:
            if self._receive_into is not None:
                try:
                    return await self._receive_into(sink, self._read_timeout)
                except TimeoutError:  # RequestTimeout: the lean HTTP/1.1 path keeps its deadlines on one timer
                    if self._on_timeout is not None:
                        self._on_timeout()
                    raise RequestTimeout(f"the response body did not arrive within {self._read_timeout} s") from None
                except TransportError as exc:
                    raise TransportError(f"response body broken: {exc}") from None
            pos = 0
            async for chunk in self.aiter_bytes():
                pos += copy_into(sink, chunk)
            return pos
        finally:
            await self.aclose()

    async def aread(self) -> bytes:
        if self.content is None:
            length = self.headers.get("content-length") if self._receive_into is not None else None
            if length is not None and length.isdigit():
                buffer = bytearray(int(length))
                n = await self.readinto(buffer)
                self.content = bytes(buffer) if n == len(buffer) else bytes(buffer[:n])
            else:
                self.content = b"".join([chunk async for chunk in self.aiter_bytes()])
            await self.aclose()
        return self.content

    async def aclose(self) -> None:
        result = self._closer()
        if asyncio.iscoroutine(result):
            await result

    def json(self) -> Any:
        import json

        if self.content is None:
            raise RuntimeError("read the body first (await response.aread())")
        return json.loads(self.content)


class KvspClient:
    """*prefer*: the transport to try first -- ``"h3"`` (the default: HTTP/3, falling back to TCP when QUIC cannot
    reach the origin) or ``"tcp"`` (HTTP/1.1 over TLS, or HTTP/2 with *fallback_http2*), for every origin, or a
    mapping from ``"host:port"`` to either, with ``"*"`` for the rest. Where both reach an origin, the TCP path is
    the faster one for bulk blocks on this implementation (``docs/performance.md``); :meth:`prefer_transport`
    changes it for one origin later.

    *connections_per_origin* (K): concurrent HTTP/3 requests to one origin are spread over up to K QUIC
    connections, least-loaded first, a new one opened only while every open one has a request in flight
    (:class:`~http3.h3_client.H3Pool`); 1 (the default) multiplexes them all on one. A holder running several
    workers on one port (``SO_REUSEPORT``) gets each connection on the worker its 4-tuple hashes to, so K > 1
    lets one client's block loads use them all. The HTTP/1.1 path opens one connection per concurrent request
    anyway.

    *rtts*: an RTT table (:class:`quic.rtt.RttTable`; the instance passes the process's :data:`quic.rtt.PEER_RTTS`,
    which its MOQT pool shares): connects to a host whose RTT it knows wait a few RTTs (at least 1 s) rather than
    *connect_timeout*, which stays the most they wait, and all they wait for an unknown host. Without a table every
    connect waits *connect_timeout*. Either way a request whose connect timed out (:class:`ConnectTimeout`: nothing
    answered the handshake) is not retried on the same origin, and a body may be given a stall timeout scaled with
    the RTT (:meth:`stall_timeout`)."""

    def __init__(self, files: TlsFiles, *, settings: TransportSettings = TransportSettings(),
                 connect_timeout: float = 5.0, timeout: float = 30.0, retries: int = 2, h3: bool = True,
                 fallback_ttl: float = 300.0, fallback_http2: bool = False, fallback: bool = True,
                 prefer: str | Mapping[str, str] = "h3", connections_per_origin: int = 1,
                 keepalive: KeepAlive | None = None, clock: Callable[[], float] = time.monotonic,
                 rtts: RttTable | None = None) -> None:
        self.files = files
        self.settings = settings
        self.timeout = timeout
        self.retries = retries
        self.h3_enabled = h3
        self.fallback_ttl = fallback_ttl
        self.fallback = fallback  # False: HTTP/3 or nothing (tests, the interop matrix)
        self._clock = clock
        self._pool = H3Pool(files, settings, connect_timeout, connections_per_origin=connections_per_origin,
                            keepalive=keepalive, rtts=rtts)
        self._no_h3: dict[tuple[str, int], float] = {}  # origin -> when to try HTTP/3 again
        prefs = {"*": prefer} if isinstance(prefer, str) else dict(prefer)
        self._prefer_default = _check_transport(prefs.pop("*", "h3"))
        self._prefer: dict[tuple[str, int], str] = {}
        for origin, transport in prefs.items():
            self.prefer_transport(origin, transport)
        # The TCP path speaks HTTP/1.1 with our lean client (http3.h1_client) unless told otherwise: httpx costs
        # ~5x the CPU per octet, and over httpx HTTP/2 downloads run at a third of HTTP/1.1's speed (httpx keeps a
        # 64 KiB stream window; benchmarks/RESULTS.md). KVSP traffic is bulk.
        # It opens one connection per concurrent request; up to 64 (at least connections_per_origin) stay idle.
        self._h1 = H1Pool(ssl_client_context(files, alpn=("http/1.1",)), connect_timeout=connect_timeout,
                          max_idle=max(64, connections_per_origin), rtts=self._pool.rtts)
        self._tcp: httpx.AsyncClient | None = None
        if fallback_http2:
            self._tcp = httpx.AsyncClient(
                http2=True, verify=ssl_client_context(files, alpn=("h2", "http/1.1")),
                timeout=httpx.Timeout(timeout, connect=connect_timeout), limits=httpx.Limits(max_connections=64))

    def prefer_transport(self, origin: str, transport: str) -> None:
        """Try *transport* (``"h3"`` or ``"tcp"``) first for *origin* (``"host:port"`` or a URL of it)."""
        key = _origin(origin if "://" in origin else f"https://{origin}")
        self._prefer[key] = _check_transport(transport)

    async def __aenter__(self) -> KvspClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._pool.aclose()
        await self._h1.aclose()
        if self._tcp is not None:
            await self._tcp.aclose()

    def keep_alive(self, url: str, keepalive: KeepAlive | None = CONTROL_KEEPALIVE) -> None:
        """PING the HTTP/3 connections to *url*'s origin with *keepalive* (None: stop), so that a dead peer is
        noticed in about ``keepalive.dead_after`` seconds (:class:`~http3.h3_client.KeepAlive`). Cheap to repeat."""
        self._pool.set_keepalive(*_origin(url), keepalive)

    def pooled(self, url: str) -> int:
        """How many pooled HTTP/3 connections to *url*'s origin could take the next request."""
        return self._pool.pooled(*_origin(url))

    def stall_timeout(self, url: str, *, octets: int = 0, ceiling: float | None = None,
                      floor: float = STALL_FLOOR) -> float:
        """How long a response body from *url* may go without octets (for :attr:`Response.read_timeout`): four
        probe timeouts of the RTT measured to its host (:mod:`quic.rtt`) plus the time *octets* take at a slow
        rate (50 MB/s), at least *floor* (1 s), at most *ceiling* (the client's timeout), which is also the
        answer while the host's RTT is unknown."""
        ceiling = self.timeout if ceiling is None else ceiling
        return path_timeout(self._pool.rtt_sample(_origin(url)[0]), floor=min(floor, ceiling), ceiling=ceiling,
                            octets=octets)

    @property
    def connections_per_origin(self) -> int:
        return self._pool.connections_per_origin

    def transport_for(self, url: str) -> str:
        """"h3" or "tcp": what the next request to *url*'s origin will try first."""
        return self._transport_for(_origin(url))

    def _transport_for(self, origin: tuple[str, int]) -> str:
        if not self.h3_enabled or self._no_h3.get(origin, 0.0) > self._clock():
            return "tcp"
        return self._prefer.get(origin, self._prefer_default)

    async def request(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                      content: Body = None, timeout: float | None = None,
                      idempotent: bool | None = None) -> Response:
        """Send a request and read the whole response."""
        async with self.stream(method, url, headers=headers, content=content, timeout=timeout,
                               idempotent=idempotent) as response:
            await response.aread()
        return response

    def stream(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
               content: Body = None, timeout: float | None = None, idempotent: bool | None = None) -> _Streamed:
        """``async with client.stream(...) as response``: :meth:`send`, and the response closed at the end."""
        return _Streamed(functools.partial(self.send, method, url, headers=headers, content=content,
                                           timeout=timeout, idempotent=idempotent))

    async def send(self, method: str, url: str, *, headers: Mapping[str, str] | None = None,
                   content: Body = None, timeout: float | None = None,
                   idempotent: bool | None = None, retries: int | None = None) -> Response:
        """Send a request; the caller reads or closes the returned response.

        *idempotent* says whether the request may be sent again after a transport failure (default: by its
        method, :data:`IDEMPOTENT`); a streamed body is never sent twice. *retries*: how many times at most
        (default: the client's; :class:`kvsp_client.api.KvspApi` passes 0 and retries itself)."""
        method = method.upper()
        timeout = self.timeout if timeout is None else timeout
        if retries is None:
            retries = self.retries
        attempts = 1 + (retries if self.may_retry(method, content, idempotent) else 0)
        loop = asyncio.get_running_loop()
        for attempt in range(attempts):
            used: list[H3ClientConnection] = []  # the pooled connection this attempt went out on
            try:  # each transport keeps the attempt's deadline (the lean HTTP/1.1 path on one timer per pool)
                return await self._send_once(method, url, headers or {}, content, timeout, used,
                                             math.inf if timeout is None else loop.time() + timeout)
            except TransportError as exc:  # RequestTimeout and ConnectTimeout (TimeoutErrors too) included
                error = exc
            except TimeoutError:
                error = RequestTimeout(f"{method} {url}: no response within {timeout} s")
            for conn in used:  # a timeout or a broken connection: never hand this connection out again
                if isinstance(error, RequestTimeout) or conn.closed:
                    self._pool.discard(conn)
            if isinstance(error, ConnectTimeout):  # nothing answers there: the caller tries elsewhere at once
                break
            if attempt + 1 < attempts:
                log.info("%s %s failed (%s); retrying", method, url, error)
                await asyncio.sleep(0.05 * (attempt + 1))
        raise error

    @staticmethod
    def may_retry(method: str, content: Body, idempotent: bool | None) -> bool:
        """The retry rule: a request is sent again after a transport failure only when it is idempotent (by its
        method, :data:`IDEMPOTENT`, unless *idempotent* says otherwise) and its body can be replayed."""
        replayable = content is None or isinstance(content, bytes | bytearray | memoryview)
        return (method.upper() in IDEMPOTENT if idempotent is None else idempotent) and replayable

    async def _send_once(self, method: str, url: str, headers: Mapping[str, str], content: Body,
                         timeout: float, used: list[H3ClientConnection], deadline: float) -> Response:
        parts = urlsplit(url)  # parsed once per request (and cached): the origin and the target come from these
        if parts.scheme != "https":
            raise ValueError(f"KVSP URLs are https://host[:port]/...; got {url!r}")
        origin = _netloc_origin(parts.netloc)
        if origin is None:
            raise ValueError(f"KVSP URLs are https://host[:port]/...; got {url!r}")
        if self._transport_for(origin) == "h3":
            async with asyncio.timeout_at(deadline if deadline < math.inf else None):
                try:
                    conn = await self._pool.get(*origin)
                except H3ConnectError as exc:
                    if not self.fallback:
                        raise TransportError(str(exc), unreachable=peer_unreachable(exc)) from None
                    log.warning("%s; using HTTP/2 or HTTP/1.1 for %s:%d for %.0f s", exc, *origin, self.fallback_ttl)
                    self._no_h3[origin] = self._clock() + self.fallback_ttl
                else:
                    used.append(conn)
                    return await self._send_h3(conn, method, parts, headers, content, timeout)
        if self._tcp is not None or not (content is None or isinstance(content, bytes | bytearray | memoryview)):
            # httpx, or a streamed request body (which the caller's iterator produces at its own pace)
            async with asyncio.timeout_at(deadline if deadline < math.inf else None):
                return await self._send_tcp(method, url, parts, origin, headers, content, timeout)
        return await self._send_tcp(method, url, parts, origin, headers, content, timeout, deadline)

    async def _send_h3(self, conn: H3ClientConnection, method: str, parts: Any, headers: Mapping[str, str],
                       content: Body, timeout: float) -> Response:
        authority = parts.netloc.rsplit("@", 1)[-1]
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        fields = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        if isinstance(content, bytes | bytearray | memoryview) and not any(k == b"content-length" for k, _ in fields):
            fields.append((b"content-length", str(len(content)).encode()))
        try:
            h3: H3Response = await conn.request(method, authority, path, fields, content)
        except H3StreamError as exc:
            raise TransportError(f"{method} {parts.geturl()}: {exc}", unreachable=peer_unreachable(exc)) from None
        return Response(h3.status, Headers(h3.headers), "HTTP/3", h3.aiter_bytes(), h3.aclose, timeout,
                        on_timeout=lambda: self._pool.discard(conn))

    async def _send_tcp(self, method: str, url: str, parts: Any, origin: tuple[str, int],
                        headers: Mapping[str, str], content: Body, timeout: float,
                        deadline: float = math.inf) -> Response:
        if self._tcp is not None:
            return await self._send_httpx(method, url, headers, content, timeout)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if not target.isascii():
            target = quote(target, safe="/?&=%:@!$'()*+,;~-._")
        fields = [(k.lower().encode("ascii"), _field_value(v)) for k, v in headers.items()]
        try:
            h1 = await self._h1.request(*origin, method, target, fields, content, deadline=deadline)
        except ConnectTimeout as exc:  # the lean path's own errors, named with the request
            raise ConnectTimeout(f"{method} {url}: {exc}") from None
        except RequestTimeout:
            raise RequestTimeout(f"{method} {url}: no response within {timeout} s") from None
        except TransportError as exc:
            raise TransportError(f"{method} {url}: {exc}") from None
        return Response(h1.status, Headers(h1.headers, lowered=True), h1.http_version, h1.aiter_bytes(), h1.aclose,
                        timeout, receive_into=h1.receive_into if method != "HEAD" else None,
                        timed_chunks=h1.aiter_bytes)

    async def _send_httpx(self, method: str, url: str, headers: Mapping[str, str], content: Body,
                          timeout: float) -> Response:
        assert self._tcp is not None
        body: Any = bytes(content) if isinstance(content, bytearray | memoryview) else content
        request = self._tcp.build_request(method, url, headers=dict(headers), content=body,
                                          extensions={"trace": _identity_check(url)})
        try:
            response = await self._tcp.send(request, stream=True)
        except httpx.TimeoutException:
            raise RequestTimeout(f"{method} {url}: timed out") from None
        except httpx.TransportError as exc:
            raise TransportError(f"{method} {url}: {exc or type(exc).__name__}") from None
        return Response(response.status_code, Headers(response.headers.raw), response.http_version,
                        response.aiter_raw(), response.aclose, timeout)


def _identity_check(url: str) -> Callable[[str, dict[str, Any]], Awaitable[None]]:
    """The httpx (httpcore) ``trace`` hook of a request to *url* on the HTTP/2 path: when it opens a connection,
    the server certificate's SAN URI must cover the URL (:func:`quic.tls.serves`, as on the HTTP/1.1 and HTTP/3
    paths) before any request octet is sent; else the connection is closed and the request fails with a transport
    error. A pooled connection serves one origin (scheme, host, port), and ``serves`` compares the host and port,
    so the check made when it was opened holds for every later request on it."""
    parts = urlsplit(url)
    host, port, path = parts.hostname or "", parts.port or 443, parts.path or "/"

    async def trace(event: str, info: dict[str, Any]) -> None:
        if event != "connection.start_tls.complete":
            return
        stream = info["return_value"]
        ssl_object = stream.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        problem = serves(identity_of_der(der) if der else None, "https", host, port, path)
        if problem is not None:
            await stream.aclose()
            raise httpx.ConnectError(problem)

    return trace


class _Streamed:
    """What :meth:`KvspClient.stream` returns: an async context manager around :meth:`KvspClient.send` (a plain
    class: ``contextlib.asynccontextmanager`` costs ~8 us a request)."""

    __slots__ = ("_response", "_send")

    def __init__(self, send: Callable[[], Awaitable[Response]]) -> None:
        self._send = send
        self._response: Response | None = None

    async def __aenter__(self) -> Response:
        self._response = await self._send()
        return self._response

    async def __aexit__(self, *exc: object) -> None:
        if self._response is not None:
            await self._response.aclose()


@functools.lru_cache(maxsize=1024)
def _netloc_origin(netloc: str) -> tuple[str, int] | None:
    """(host, port) of an https URL's netloc (``SplitResult.hostname`` / ``.port``, ~5 us a request, cached);
    None without a host. ValueError for a bad port, as ``urlsplit`` gives."""
    parts = urlsplit(f"https://{netloc}/")
    host = parts.hostname
    return (host, parts.port or 443) if host else None


def _check_transport(transport: str) -> str:
    if transport not in ("h3", "tcp"):
        raise ValueError(f"a transport preference is 'h3' or 'tcp', not {transport!r}")
    return transport


def _field_value(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def _origin(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 443
