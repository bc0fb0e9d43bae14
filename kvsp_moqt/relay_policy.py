"""KVSP at the generic MOQT relay (:mod:`moqt.relay`): the implementations of its protocols
(:mod:`moqt.relay.interfaces`), and :func:`kvsp_relay`, which composes a relay from them.

* the access rules are :class:`kvsp_moqt.relay_rules.RelayRules` (KVSP namespaces by holder-id and scope, open
  prefixes for generic traffic); :class:`KvspTrackShapes` -- the track shapes (a KVSP track is one block: group 0,
  immutable, so an upstream FETCH runs to the end of the block and later requests for the rest join it);
* :class:`KvspUpstreams` -- upstreams for KVSP tracks nobody published to the relay, found through the Index
  Service (:class:`kvsp_moqt.index_link.IndexLink`), which admits a block to the cache only once its layers match
  the publisher's Replica Record, advertises the blocks the relay caches, and withdraws them when they leave it.
"""

from __future__ import annotations

from kvsp_moqt.index_link import IndexLink
from kvsp_moqt.relay_rules import RelayRules
from kvsp_moqt.tracks import GROUP, parse_track
from moqt.relay import Relay, RelayConfig, TrackFetch, Upstream
from moqt.types import Namespace


class KvspTrackShapes:
    """:class:`~moqt.relay.interfaces.TrackShapes` for KVSP: a KVSP track is one block."""

    def single_group(self, namespace: Namespace, track_name: bytes) -> int | None:
        """A block's layers are the objects of group 0, and a block is immutable."""
        return GROUP if parse_track(namespace, track_name) is not None else None


class KvspUpstreams:
    """:class:`~moqt.relay.interfaces.UpstreamDirectory` for KVSP tracks, through the Index Service link; other
    tracks have no upstream but their publishing session, and nothing is advertised for them."""

    def __init__(self, link: IndexLink) -> None:
        self.link = link

    async def resolve(self, namespace: Namespace, track_name: bytes) -> Upstream | None:
        track = parse_track(namespace, track_name)
        if track is None:
            return None
        found = await self.link.resolve(track, namespace)
        if found is None:
            return None
        conn, record = found
        return Upstream(conn, record)

    async def admit(self, fetch: TrackFetch) -> bool:
        """A KVSP block is cached only once its layers match a record from the Index Service; other tracks are."""
        if parse_track(fetch.namespace, fetch.track_name) is None:
            return True
        return await self.link.admit(fetch)

    def cached(self, fetch: TrackFetch) -> None:
        if parse_track(fetch.namespace, fetch.track_name) is not None:
            self.link.cached(fetch)

    def evicted(self, fetch: TrackFetch) -> None:
        if parse_track(fetch.namespace, fetch.track_name) is not None:
            self.link.evicted(fetch)


def kvsp_relay(rules: RelayRules, config: RelayConfig | None = None, *, link: IndexLink | None = None) -> Relay:
    """A relay for KVSP tracks (and *rules*' open prefixes); with *link*, tracks nobody published to it are
    fetched from the holders the Index Service names, and what it caches is advertised there (a cached block
    whose layers do not match the publisher's record never enters the cache)."""
    return Relay(rules, config, tracks=KvspTrackShapes(), upstreams=KvspUpstreams(link) if link is not None else None)


__all__ = ["KvspTrackShapes", "KvspUpstreams", "kvsp_relay"]
