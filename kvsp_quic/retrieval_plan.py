"""Pure logic of block retrieval (no I/O, no clock of its own): which replica to try first, how an attempt
failed, what to remember about it. ``kvsp_client/retrieval.py`` drives it; it verifies ``Repr-Digest`` with
:mod:`kvsp_quic.repr_digest` (re-exported here).

Spec, "Block Retrieval and Storage": clients MUST verify Repr-Digest, and, when the returned codec is the
replica's, the layer digests of the returned layers and, when all layers were retrieved, the replica digest.
Spec, "Error Handling": a client that receives a block whose digest does not match MUST discard it, SHOULD
withdraw the replica on the holder's behalf if authorized, and continues with another replica or recomputes.

Replica order (:class:`DefaultRanking`, docs/wire.md "Retrieval"):

1. replicas whose holder this client has link information for (the ``links`` of its own Instance Status
   Record), by estimated time ``rtt_us + transfer time of the wanted layers`` with the spec's Placement Inputs
   math (:func:`kvsp_quic.cost.part_cost`: the link rate, reduced to a tier's ``read_mbit_per_s``);
2. then the others, by the slowest tier holding a wanted layer (device, host, remote-memory, local-storage,
   remote-storage), then ``https`` holders before other schemes; ties keep the Index Service's order.

A replica is asked only for layers its residency holds (the holder would answer 404 for others). A block kept
as partial replicas (issue 13) is assembled from several (:func:`next_parts`): one replica holding every wanted
layer first, else the cheapest chain of ranges.

Extension values (issue 13; spec, "KVSP Registries": the registries are extensible, so a lookup answer may carry
values of a newer registry than this client's). Every record of the answer is kept as the Index Service sent it;
the answer is never refused for them. A residency entry with an unknown tier keeps its layers (it covers them)
and ranks after every known tier (:data:`TIER_ORDER`); cost estimates use its ``read_mbit_per_s`` like any
other entry's, so the tier name itself plays no part. A replica whose codec this client cannot decode
(:func:`decodable`) is not a candidate unless the client asks for a codec it can decode (``codec=n``: the
holder transcodes, or answers 406, a miss): fetching it would deliver a container the decoder refuses, counted
as MALFORMED and withdrawn on the holder's behalf -- wrong for a replica that is only newer than this client.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvsp_quic.compat import codec_known
from kvsp_quic.cost import part_cost
from kvsp_quic.records import Link, ReplicaRecord
from kvsp_quic.repr_digest import ReprDigestError, format_repr_digest, parse_repr_digest

LayerRange = tuple[int, int]  # inclusive
UNKNOWN_LAYER_DIGEST = bytes(32)  # a partial replica's layer digest for a layer it does not hold (issue 13)

# Fastest first; a tier outside the registry (a newer registry's, issue 13) sorts last.
TIER_ORDER: Mapping[str, int] = {"device": 0, "host": 1, "remote-memory": 2, "local-storage": 3,
                                 "remote-storage": 4}


# -- how an attempt at one replica ended ------------------------------------------------------------------------


class Failure(enum.Enum):
    """Why one replica did not deliver. Every kind moves on to the next replica."""

    MISS = "miss"  # 404 (kvsp-not-found, kvsp-layers-unavailable) or 406 (no transcoding): the holder lacks it
    REFUSED = "refused"  # 403, 409 or another 4xx: the holder will not serve this client this block
    LEASE_REFUSED = "lease-refused"  # 429 kvsp-lease-quota (or another refusal) answering the lease
    TRANSPORT = "transport"  # connection, TLS, timeout, or a body that broke off
    SERVER_ERROR = "server-error"  # 5xx, or 429 answering the GET
    BAD_RESPONSE = "bad-response"  # a 200 that breaks the protocol: Repr-Digest missing or malformed, wrong type
    CORRUPT = "corrupt"  # a layer, replica or Repr-Digest mismatch
    MALFORMED = "malformed"  # the body is not a valid container, or not the one asked for

    @property
    def remembered(self) -> bool:
        """Whether the holder is skipped for a while (:class:`FailureMemory`) after this failure."""
        return self in _REMEMBERED

    @property
    def withdraws(self) -> bool:
        """Whether the replica is withdrawn on the holder's behalf (the data was shown to be wrong)."""
        return self in (Failure.CORRUPT, Failure.MALFORMED)


_REMEMBERED = frozenset({Failure.TRANSPORT, Failure.SERVER_ERROR, Failure.BAD_RESPONSE, Failure.CORRUPT,
                         Failure.MALFORMED})


class AttemptError(Exception):
    """One attempt at one replica failed; the fetcher moves on to the next replica."""

    def __init__(self, failure: Failure, detail: str, *, unreachable: bool = False) -> None:
        super().__init__(f"{failure.value}: {detail}")
        self.failure = failure
        self.detail = detail
        self.unreachable = unreachable  # the holder is gone (nothing listens at its port, or it went silent)


def failure_for_status(status: int) -> Failure:
    """The failure an HTTP error status from a holder's block resource means."""
    if status in (404, 406, 410):
        return Failure.MISS
    if status == 429 or status >= 500:
        return Failure.SERVER_ERROR
    if 400 <= status < 500:
        return Failure.REFUSED
    return Failure.BAD_RESPONSE  # 1xx/2xx other than 200, 3xx: not what a block GET answers


# -- what the client remembers --------------------------------------------------------------------------------


def endpoint_key(holder: str) -> str:
    """``host:port`` of a holder URI (``https`` or ``moqt``; port 443 when absent): a holder's ``https`` records and
    their ``moqt://`` twins share it (one UDP port serves HTTP/3 and MOQT)."""
    parts = urlsplit(holder)
    return f"{parts.hostname or ''}:{parts.port or 443}"


class FailureMemory:
    """Holders that failed recently (transport errors, server errors, bad or corrupt data) and are skipped
    until *ttl_s* seconds after their last failure. ``ttl_s = 0`` remembers nothing. ``note(holder,
    unreachable=True)`` remembers the holder's endpoint as well (:func:`endpoint_key`): every record at that host
    and port is skipped (a dead holder's ``https`` twin is not worth a connect)."""

    def __init__(self, ttl_s: float = 10.0, *, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = 4096) -> None:
        if ttl_s < 0:
            raise ValueError("ttl_s must not be negative")
        self.ttl_s = ttl_s
        self._clock = clock
        self._max = max_entries
        self._until: dict[str, float] = {}

    def note(self, holder: str, *, unreachable: bool = False) -> None:
        if unreachable:
            self._note(endpoint_key(holder))
        self._note(holder)

    def _note(self, holder: str) -> None:
        if self.ttl_s == 0:
            return
        now = self._clock()
        if len(self._until) >= self._max:
            self._until = {h: t for h, t in self._until.items() if t > now}
            if len(self._until) >= self._max:  # still full: forget the oldest failure
                del self._until[min(self._until, key=self._until.__getitem__)]
        self._until.pop(holder, None)
        self._until[holder] = now + self.ttl_s

    def recent(self, holder: str) -> bool:
        """Whether *holder*, or its endpoint (after an unreachable failure), failed recently."""
        return self._recent(holder) or (bool(self._until) and self._recent(endpoint_key(holder)))

    def _recent(self, holder: str) -> bool:
        until = self._until.get(holder)
        if until is None:
            return False
        if until <= self._clock():
            del self._until[holder]
            return False
        return True

    def forget(self, holder: str) -> None:
        self._until.pop(holder, None)

    def __len__(self) -> int:
        now = self._clock()
        return sum(1 for t in self._until.values() if t > now)


@dataclass
class RetrievalMetrics:
    """Counters of one fetcher (spec, Operational Considerations: lookup hit ratio, fetched versus recomputed,
    lease rejections, digest failures). ``hits + misses`` counts blocks: a block is a hit when every requested
    layer was delivered and verified, a miss when the caller has to recompute it (no replica, every replica
    failed, or -- in ``load_prefix`` -- an earlier block of the prefix is missing)."""

    lookups: int = 0
    lookup_keys: int = 0
    lookup_matched: int = 0
    lookup_errors: int = 0
    hits: int = 0
    misses: int = 0
    layers: int = 0  # verified layers handed to callers
    attempts: int = 0  # replicas tried
    replica_misses: int = 0  # Failure.MISS
    refused: int = 0  # Failure.REFUSED
    transport_errors: int = 0
    server_errors: int = 0
    bad_responses: int = 0
    digest_failures: int = 0  # Failure.CORRUPT: layer, replica or Repr-Digest mismatch
    malformed: int = 0
    skipped_recent_failures: int = 0  # candidates skipped because their holder failed recently
    skipped_unknown_codec: int = 0  # candidates skipped because this client cannot decode what they would send
    unreachable: int = 0  # failures that showed the holder gone (its endpoint is skipped too)
    failures_reported: int = 0  # holders reported to the Index Service (POST holders/{id}/failures)
    # producer-digest mode (require_producer_digest; kvsp_quic/producer_digests.py): replicas left out because no
    # producer vouches for their digests, and matched blocks recomputed for want of a vouched replica
    producer_mismatches: int = 0
    producer_unverified: int = 0  # blocks (the one that ended the usable prefix and every later matched one)
    producer_lookup_errors: int = 0  # producer-digest lookups that failed (every matched block is recomputed)
    withdrawals: int = 0  # replicas withdrawn on a holder's behalf (204, or 404: already gone)
    withdrawals_denied: int = 0  # the Index Service answered 403
    withdrawal_errors: int = 0
    leases_taken: int = 0
    leases_refused: int = 0
    leases_released: int = 0
    bytes_by_transport: dict[str, int] = field(default_factory=dict)  # body octets by "HTTP/3", "HTTP/1.1", ...

    def add_bytes(self, transport: str, octets: int) -> None:
        self.bytes_by_transport[transport] = self.bytes_by_transport.get(transport, 0) + octets

    def count_failure(self, failure: Failure) -> None:
        name = _FAILURE_COUNTERS[failure]
        setattr(self, name, getattr(self, name) + 1)

    @property
    def hit_ratio(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None

    def snapshot(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "bytes_by_transport"}
        out["bytes_by_transport"] = dict(self.bytes_by_transport)
        return out


_FAILURE_COUNTERS = {
    Failure.MISS: "replica_misses", Failure.REFUSED: "refused", Failure.LEASE_REFUSED: "leases_refused",
    Failure.TRANSPORT: "transport_errors", Failure.SERVER_ERROR: "server_errors",
    Failure.BAD_RESPONSE: "bad_responses", Failure.CORRUPT: "digest_failures", Failure.MALFORMED: "malformed",
}


# -- replica order --------------------------------------------------------------------------------------------


class Ranking(Protocol):
    """Orders the candidate replicas of one block for the inclusive layer range *layers* (best first). It may
    drop replicas it never wants tried; it must not add any."""

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]: ...


def covers(record: ReplicaRecord, layers: LayerRange) -> bool:
    """Whether the replica's residency holds every layer of *layers*."""
    first, last = layers
    need = last - first + 1
    have = sum(max(0, min(last, e.layers[1]) - max(first, e.layers[0]) + 1) for e in record.residency)
    return have == need  # residency ranges never overlap (ReplicaRecord.check)


def held_runs(record: ReplicaRecord) -> list[LayerRange]:
    """The unbroken runs of layers *record* holds, ascending: adjacent residency entries join (a complete replica
    split over two tiers is one run), and a layer whose layer digest is the zero placeholder of a partial replica
    (issue 13: 32 zero octets for a layer not held) is left out whatever the residency says, so that no layer is
    ever asked of a replica, or checked, against a placeholder."""
    runs: list[LayerRange] = []
    for first, last in sorted(e.layers for e in record.residency):
        if runs and first == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], last)
        else:
            runs.append((first, last))
    digests = record.layer_digests
    if digests is None or UNKNOWN_LAYER_DIGEST not in digests:
        return runs
    out: list[LayerRange] = []
    for first, last in runs:
        start = None
        for i in range(first, last + 1):
            held = i < len(digests) and digests[i] != UNKNOWN_LAYER_DIGEST
            if held and start is None:
                start = i
            elif not held and start is not None:
                out.append((start, i - 1))
                start = None
        if start is not None:
            out.append((start, last))
    return out


def held_through(record: ReplicaRecord, layer: int) -> int | None:
    """The last layer of the run of layers *record* holds from *layer* on (:func:`held_runs`), or None when it
    lacks *layer*."""
    return next((last for first, last in held_runs(record) if first <= layer <= last), None)


def next_parts(replicas: Sequence[ReplicaRecord], layers: LayerRange,
               ranking: Ranking) -> list[tuple[ReplicaRecord, LayerRange]]:
    """The replicas to try next for the inclusive range *layers*, best first, each with the part of the range it
    would give (from ``layers[0]`` to the end of its run, at most ``layers[1]``): partial replicas (issue 13) are
    assembled into the range. The order (docs/wire.md, "Retrieval", layer ranges from several replicas):

    1. replicas that give the whole range (one request), in *ranking*'s order;
    2. else replicas that start the cheapest chain of parts: the fewest parts (one request and round trip each;
       the octets are the same whichever replicas give them), then the longest first part, each group in
       *ranking*'s order for its part.

    Empty when no chain of *replicas* covers the range: nothing is fetched for a block that cannot be completed.
    The caller fetches the first part, and asks again from the layer after the last one delivered (after a
    failure, without the replica that failed: the failover to another replica of the same range).
    """
    first, last = layers
    runs = [(record, held_runs(record)) for record in replicas]
    whole = [record for record, spans in runs if any(a <= first and last <= b for a, b in spans)]
    if whole:
        return [(record, layers) for record in ranking(whole, layers)]
    ends: dict[int, list[tuple[ReplicaRecord, int]]] = {}  # position -> (replica, end of its part from there)
    for record, spans in runs:
        for a, b in spans:
            for layer in range(max(a, first), min(b, last) + 1):
                ends.setdefault(layer, []).append((record, min(b, last)))
    hops: dict[int, float] = {last + 1: 0}  # fewest parts to cover position..last
    for layer in range(last, first - 1, -1):
        hops[layer] = min((1 + hops[end + 1] for _r, end in ends.get(layer, ())), default=math.inf)
    if math.isinf(hops[first]):
        return []
    groups: dict[int, list[ReplicaRecord]] = {}
    for record, end in ends.get(first, ()):
        if 1 + hops[end + 1] == hops[first]:  # on a cheapest chain
            groups.setdefault(end, []).append(record)
    out: list[tuple[ReplicaRecord, LayerRange]] = []
    for end in sorted(groups, reverse=True):
        out += [(record, (first, end)) for record in ranking(groups[end], (first, end))]
    return out


def decodable(record: ReplicaRecord, codec: int | None = None) -> bool:
    """Whether this client can decode what *record*'s holder would send: the stored codec when *codec* (the
    codec the client asks for) is None, else *codec* (the holder transcodes, or refuses with 406)."""
    return codec_known(record.codec if codec is None else codec)


def tier_rank(record: ReplicaRecord, layers: LayerRange) -> int:
    """The rank (:data:`TIER_ORDER`) of the slowest tier holding a layer of *layers*."""
    first, last = layers
    ranks = [TIER_ORDER.get(e.tier, len(TIER_ORDER)) for e in record.residency
             if e.layers[0] <= last and e.layers[1] >= first]
    return max(ranks, default=len(TIER_ORDER))


def estimated_us(record: ReplicaRecord, layers: LayerRange, link: Link) -> float | None:
    """``rtt_us`` + the transfer time of *layers* from *record* over *link*; None if it lacks some of them."""
    wanted = set(range(layers[0], layers[1] + 1))
    _octets, us, got = part_cost(record, wanted, link)
    if len(got) != len(wanted):
        return None
    return link.rtt_us + us


class DefaultRanking:
    """The default order (module docstring): link estimates first, then tier, then https before other schemes."""

    def __init__(self, links: Iterable[Link] | Mapping[str, Link] | None = None) -> None:
        if links is None:
            self.links: dict[str, Link] = {}
        elif isinstance(links, Mapping):
            self.links = dict(links)
        else:
            self.links = {link.holder: link for link in links}

    def __call__(self, replicas: Sequence[ReplicaRecord], layers: LayerRange) -> list[ReplicaRecord]:
        keyed: list[tuple[tuple[int, float, int, int, int], ReplicaRecord]] = []
        for i, record in enumerate(replicas):
            link = self.links.get(record.holder)
            estimate = estimated_us(record, layers, link) if link is not None else None
            scheme = 0 if record.holder.startswith("https:") else 1
            if estimate is not None:
                keyed.append(((0, estimate, 0, scheme, i), record))
            else:
                keyed.append(((1, 0.0, tier_rank(record, layers), scheme, i), record))
        keyed.sort(key=lambda item: item[0])
        return [record for _key, record in keyed]


__all__ = [
    "TIER_ORDER", "UNKNOWN_LAYER_DIGEST", "AttemptError", "DefaultRanking", "Failure", "FailureMemory", "LayerRange",
    "Ranking", "ReprDigestError", "RetrievalMetrics", "covers", "decodable", "endpoint_key", "estimated_us",
    "failure_for_status", "format_repr_digest", "held_runs", "held_through", "next_parts", "parse_repr_digest",
    "tier_rank",
]
