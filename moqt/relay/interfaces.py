"""What a relay is told rather than knows: who may publish, read and discover which namespaces
(:class:`AccessRules`), which tracks are one immutable group (:class:`TrackShapes`), and where to fetch a track
nobody published to the relay, and who hears of what the cache keeps (:class:`UpstreamDirectory`). The relay
(:class:`moqt.relay.Relay`) is generic MOQT; an application (KVSP: :mod:`kvsp_moqt.relay_policy`) implements these.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from moqt.types import Namespace

if TYPE_CHECKING:
    from moqt.aio import MoqtConnection
    from moqt.relay.cache import TrackFetch


class Verdict(enum.Enum):
    OK = "ok"
    UNAUTHORIZED = "unauthorized"  # refused with UNAUTHORIZED
    DOES_NOT_EXIST = "does-not-exist"  # refused as if the relay carried nothing there


@dataclass(frozen=True)
class Decision:
    """An :class:`AccessRules` answer; *reason* goes into the refusal's reason phrase."""

    verdict: Verdict
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK


ALLOWED = Decision(Verdict.OK)


class AccessRules(Protocol):
    """Who may do what at the relay, by the peer's verified identity (its certificate's SAN URI)."""

    def publish(self, identity: str | None, namespace: Namespace) -> Decision:
        """May *identity* PUBLISH_NAMESPACE *namespace* to the relay?"""
        ...

    def read(self, identity: str | None, namespace: Namespace) -> Decision:
        """May *identity* FETCH / SUBSCRIBE a track of *namespace*?"""
        ...

    def discover(self, identity: str | None, prefix: Namespace) -> Decision:
        """May *identity* SUBSCRIBE_NAMESPACE *prefix*? (What it then hears is filtered by :meth:`visible`.)"""
        ...

    def visible(self, identity: str | None, namespace: Namespace) -> bool:
        """Is a published *namespace* announced to a namespace subscriber with *identity*?"""
        ...


class TrackShapes(Protocol):
    """What the relay may assume of a track's objects."""

    def single_group(self, namespace: Namespace, track_name: bytes) -> int | None:
        """The one group that holds every object of an immutable track (a FETCH past it ends with it, and an
        upstream FETCH starting in it runs to its end, so that later requests for the rest join it), or None."""
        ...


@dataclass(frozen=True)
class Upstream:
    """A session to FETCH a track from, and what the directory knew of it (kept with the fetch as
    :attr:`TrackFetch.origin <moqt.relay.cache.TrackFetch.origin>`, for the directory's own later use)."""

    conn: MoqtConnection
    origin: object = None


class UpstreamDirectory(Protocol):
    """Upstreams for tracks whose namespace no session published to the relay, and what the cache keeps."""

    async def resolve(self, namespace: Namespace, track_name: bytes) -> Upstream | None:
        """A session that serves the track, or None (the relay then answers DOES_NOT_EXIST)."""
        ...

    async def admit(self, fetch: TrackFetch) -> bool:
        """May a complete upstream fetch enter the cache (its objects are what they should be)? Asked before
        :meth:`cached`; False: the relay forwards what it already forwarded but keeps nothing."""
        ...

    def cached(self, fetch: TrackFetch) -> None:
        """A complete fetch entered the cache."""

    def evicted(self, fetch: TrackFetch) -> None:
        """... and left it (evicted, replaced or dropped)."""


class NoUpstream(LookupError):
    """Nobody publishes the track (no session published its namespace, and no directory names an upstream)."""


def under(namespace: Namespace, prefix: Namespace) -> bool:
    """Is *namespace* *prefix* or below it (field by field)?"""
    return namespace[:len(prefix)] == prefix


@dataclass(frozen=True, kw_only=True)
class RelayOptions:
    """What a relay's operator sets (the ``[relay]`` section of ``kvsp-quic relay``'s file extends these).
    Durations in milliseconds, sizes in octets."""

    cache_bytes: int = 1 << 30  # payload octets of completed fetches kept (LRU)
    upstream_timeout_ms: int = 10_000  # for the upstream's FETCH_OK / next piece, and SUBSCRIBE_OK
    rendezvous_limit_ms: int = 10_000  # the longest a SUBSCRIBE waits for its publisher (draft 18 RENDEZVOUS_TIMEOUT)
    publish_done_grace_ms: int = 2000  # how long PUBLISH_DONE waits for the upstream's data streams to end
    # Per principal (issue 13; moqt.aio.limits): FETCHes and SUBSCRIBEs the cache cannot answer (they make the
    # relay fetch or subscribe upstream) at once, and payload octets of the upstream fetches they started still
    # in flight; over either, a request is refused with EXCESSIVE_LOAD (draft 14: INTERNAL_ERROR) and this hint.
    client_max_in_flight: int = 64
    client_max_buffered_bytes: int = 256 << 20
    client_retry_ms: int = 1000

    def __post_init__(self) -> None:
        if self.cache_bytes < 0:
            raise ValueError("cache_bytes: must not be negative")
        for name in ("upstream_timeout_ms", "rendezvous_limit_ms", "publish_done_grace_ms", "client_max_in_flight",
                     "client_max_buffered_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        if self.client_retry_ms < 0:
            raise ValueError("client_retry_ms: must not be negative")

    @property
    def upstream_timeout_s(self) -> float:
        return self.upstream_timeout_ms / 1000

    @property
    def rendezvous_limit_s(self) -> float:
        return self.rendezvous_limit_ms / 1000

    @property
    def publish_done_grace_s(self) -> float:
        return self.publish_done_grace_ms / 1000


@dataclass(frozen=True, kw_only=True)
class RelayConfig(RelayOptions):
    """A relay's settings: its options and its own ``moqt://host:port/`` (for its records; never an upstream of
    itself), known once it listens."""

    moqt_uri: str | None = None


__all__ = ["ALLOWED", "AccessRules", "Decision", "NoUpstream", "RelayConfig", "RelayOptions", "TrackShapes", "Upstream",
           "UpstreamDirectory", "Verdict", "under"]
