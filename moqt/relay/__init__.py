"""A generic MOQT relay on the asyncio adapter (:mod:`moqt.aio`), both drafts. What it is told rather than knows
comes in through the small protocols of :mod:`moqt.relay.interfaces` (KVSP's: :mod:`kvsp_moqt.relay_policy`).

One :class:`Relay` (a :class:`~moqt.aio.MoqtApp`, :mod:`moqt.relay.app`) serves every connection of the relay's UDP
port, with the same mutual TLS as every role. docs/moqt.md ("Relay") records the decisions; in short:

* **Publishers** connect and PUBLISH_NAMESPACE; the :class:`~moqt.relay.interfaces.AccessRules` decide who may
  publish what. The relay remembers which session published which namespace (:mod:`moqt.relay.namespaces`).
* **FETCH** (standalone) from an authorized reader is served from the cache when a cached fetch covers its range;
  else it joins an upstream FETCH already running for the same track whose range covers it (**coalescing**: 8
  concurrent FETCHes of a block are one upstream FETCH); else the relay starts one: to the session that published
  the longest prefix of the namespace, or -- for a track nobody published here -- to the upstream the
  :class:`~moqt.relay.interfaces.UpstreamDirectory` names. For a track of one immutable group
  (:class:`~moqt.relay.interfaces.TrackShapes`) the upstream FETCH runs from the first object asked for to the end
  of the group, so that later requests for the rest join it. Every downstream FETCH is written by its own task
  from the shared :class:`~moqt.relay.cache.TrackFetch` as the pieces arrive (**cut-through**: the first object
  leaves before the second has arrived), FETCH_OK as soon as the upstream's is known (objects may precede it: the
  drafts allow a relay to send objects before FETCH_OK). See :mod:`moqt.relay.fetching`.
* **Cache**: completed upstream fetches, LRU within ``cache_bytes`` payload octets (:mod:`moqt.relay.cache`). The
  upstream directory hears of each entry and of its eviction (KVSP: a complete cached block whose layers match
  the publisher's Replica Record is advertised with a record of the relay's own, withdrawn when evicted).
* **SUBSCRIBE** (any track the identity may read) is forwarded to the publishing session; one upstream
  subscription per track serves every downstream subscriber (fan-out), each subgroup stream forwarded object by
  object as it arrives, PUBLISH_DONE once the upstream's streams have ended. Draft 18's RENDEZVOUS_TIMEOUT makes
  a SUBSCRIBE for a track nobody publishes yet wait (bounded) for its publisher, then fail with TIMEOUT. A joining
  FETCH is served as a standalone FETCH up to the Joining Location the relay gave the subscriber. See
  :mod:`moqt.relay.fanout`.
* **SUBSCRIBE_NAMESPACE**: published namespaces under the prefix that the subscriber could read are announced
  (draft 14: PUBLISH_NAMESPACE / _DONE; draft 18: NAMESPACE / NAMESPACE_DONE), now and as they come and go.

* **Per-principal limits** (issue 13; :mod:`moqt.aio.limits`): FETCHes and SUBSCRIBEs of one identity that go
  upstream (``client_max_in_flight`` at once) and the octets of the upstream fetches they started
  (``client_max_buffered_bytes``) are bounded; the excess is refused with EXCESSIVE_LOAD and a Retry Interval
  (draft 14: INTERNAL_ERROR, the hint in the reason phrase), counted as ``limit_refused``. Cache hits are not.
* **Revocation**: after a reload of the policy, a session whose identity lost every right it used here is closed
  with UNAUTHORIZED (:meth:`Relay.recheck`, :mod:`moqt.aio.revocation`), counted as ``sessions_revoked``.

Not relayed: PUBLISH (publisher-initiated subscriptions: the session answers NOT_SUPPORTED), TRACK_STATUS,
datagrams, FETCH end-of-range markers.
"""

from moqt.relay.app import Relay
from moqt.relay.cache import (
    WHOLE,
    MalformedFetch,
    RelayCache,
    RelayObject,
    TrackFetch,
    end_key,
    end_location,
    start_key,
)
from moqt.relay.codes import publish_done_code, request_code, upstream_error, verdict_code
from moqt.relay.fanout import Joined, Subscriptions
from moqt.relay.fetching import Fetches
from moqt.relay.interfaces import (
    ALLOWED,
    AccessRules,
    Decision,
    NoUpstream,
    RelayConfig,
    RelayOptions,
    TrackShapes,
    Upstream,
    UpstreamDirectory,
    Verdict,
    under,
)
from moqt.relay.namespaces import Announcement, Namespaces, NamespaceSubscriber

__all__ = [
    "ALLOWED", "WHOLE", "AccessRules", "Announcement", "Decision", "Fetches", "Joined", "MalformedFetch",
    "NamespaceSubscriber", "Namespaces", "NoUpstream", "Relay", "RelayCache", "RelayConfig", "RelayObject",
    "RelayOptions", "Subscriptions", "TrackFetch", "TrackShapes", "Upstream", "UpstreamDirectory", "Verdict", "end_key",
    "end_location", "publish_done_code", "request_code", "start_key", "under", "upstream_error", "verdict_code",
]
