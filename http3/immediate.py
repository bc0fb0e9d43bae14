"""Responses written without the ASGI exchange: the ``respond_now`` hook of an app (issue 16 goal 3).

An ASGI app may offer, beside ``__call__``, a synchronous ``respond_now(method, path, query, scope)`` for requests
without a body. ``scope`` holds the connection's part of an ASGI scope (``type``, ``http_version``, ``client``,
``server``, ``extensions`` with the TLS extension); ``path`` is percent-decoded as ASGI's ``path`` is. It returns
an :class:`Immediate` -- the whole response, known at once -- or None, and then the request goes through the ASGI
exchange as every other. The HTTP/1.1 server (:mod:`http3.tcp_h1`) asks it for keep-alive ``GET`` requests and
writes the answer straight away: no scope, task, receive/send messages or h11 response events for it (the request
head is still parsed, and checked, by h11 as every other). The holder's block GETs take it
(:meth:`kvsp_http.holder_app.BlockResource.respond_now`), with the same answers as its ASGI path, byte for byte.

Bounded: an app answers only with what it holds already, at most :data:`IMMEDIATE_MAX` octets of body (a larger
answer goes the ASGI way, whose writes wait for the transport to drain), and the server asks only while the
transport is not paused, so one connection buffers at most about its write high-water mark plus one answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from http3.asgi_bridge import Buffer, Headers, reason_phrase

IMMEDIATE_MAX = (1 << 20) + (64 << 10)  # the most body octets of an immediate answer: a 1 MiB block and its header


@dataclass(frozen=True, slots=True)
class Immediate:
    """A whole response: *headers* are complete (``content-length`` included) but for ``date`` and ``alt-svc``,
    which the server adds as it does to the responses of the ASGI exchange."""

    status: int
    headers: Headers
    body: Sequence[Buffer]


def h1_head(status: int, headers: Headers) -> bytes:
    """The HTTP/1.1 response head of *status* and *headers*, octet for octet as h11 writes it (names as given)."""
    lines = [b"HTTP/1.1 %d %s\r\n" % (status, reason_phrase(status))]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in headers if name == b"host"]
    lines += [b"%s: %s\r\n" % (name, value) for name, value in headers if name != b"host"]
    lines.append(b"\r\n")
    return b"".join(lines)


__all__ = ["IMMEDIATE_MAX", "Immediate", "h1_head"]
