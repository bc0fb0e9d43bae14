"""The HTTP stack's failures, one vocabulary for the client (:mod:`http3.client`) and its transports (the lean
HTTP/1.1 client :mod:`http3.h1_client`; HTTP/3's :mod:`http3.h3_client` errors become these in the client).

* :class:`TransportError` -- the request could not be completed below HTTP: refused, reset, TLS failure, a
  malformed or truncated response; *unreachable* when nothing listens at the origin's port.
* :class:`RequestTimeout` -- a deadline passed (the response head, or the body's).
* :class:`ConnectTimeout` -- no connection within the connect timeout: the caller goes elsewhere at once.

An answer, whatever its status, is never one of these; what a status means is the caller's (for KVSP:
:mod:`kvsp_client.api`).
"""

from __future__ import annotations


class TransportError(ConnectionError):
    """The request could not be completed: connection refused or reset, TLS failure, a malformed or truncated
    response, a timeout. *unreachable*: nothing listens at the origin's port (ICMP port unreachable ended the QUIC
    connection: :class:`quic.protocol.PeerUnreachable`)."""

    def __init__(self, detail: str, *, unreachable: bool = False) -> None:
        super().__init__(detail)
        self.unreachable = unreachable


class RequestTimeout(TransportError, TimeoutError):
    """A deadline passed: the response head, or the whole body, did not arrive in time (the connection is
    dropped)."""


class ConnectTimeout(RequestTimeout):
    """No connection could be opened within the connect timeout (scaled with the host's RTT when it is known:
    :mod:`quic.rtt`): the peer answers no handshake. Not retried on the same origin; the caller goes elsewhere."""


__all__ = ["ConnectTimeout", "RequestTimeout", "TransportError"]
