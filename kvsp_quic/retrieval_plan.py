"""Pure logic of block retrieval (no I/O, no clock of its own): which replica to try first, how an attempt
failed, what to remember about it. ``http3/retrieval.py`` drives it; it verifies ``Repr-Digest`` with
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

Replicas whose residency does not cover the wanted layers are not candidates (the holder would answer 404).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from kvsp_quic.cost import part_cost
from kvsp_quic.records import Link, ReplicaRecord
from kvsp_quic.repr_digest import ReprDigestError, format_repr_digest, parse_repr_digest

LayerRange = tuple[int, int]  # inclusive

# Fastest first; a tier outside the registry sorts last.
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
    unreachable: int = 0  # failures that showed the holder gone (its endpoint is skipped too)
    failures_reported: int = 0  # holders reported to the Index Service (POST holders/{id}/failures)
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
    "TIER_ORDER", "AttemptError", "DefaultRanking", "Failure", "FailureMemory", "LayerRange", "Ranking",
    "ReprDigestError", "RetrievalMetrics", "covers", "endpoint_key", "estimated_us", "failure_for_status",
    "format_repr_digest", "parse_repr_digest", "tier_rank",
]
