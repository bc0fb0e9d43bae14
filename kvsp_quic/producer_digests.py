"""Producer digests: the producing instance vouches for a block's digests (issue 13, "the producer-digest mode").

Spec, "Security Considerations", Cache poisoning: "Digests in replica records and Repr-Digest detect corruption in
transit and at honest holders but not a holder that publishes a wrong digest. [...] Where stronger assurance is
needed, the producing instance can publish the digest itself, and consumers accept only replicas whose digest
matches that of the producer." The spec does not say how; this is our wire decision (docs/wire.md, "Producer
digests"):

* the instance that computed a block publishes a **Producer Digest** record to the Index Service,
  ``POST {is}producer-digests`` ``{"digests": [ProducerDigest, ...]}`` (extension; role ``instance`` only, with the
  scope of every record). The Index Service stamps ``producer`` with the authenticated identity -- a holder cannot
  publish one, and an instance cannot publish one in another's name;
* consumers in the mode ask for them, ``POST {is}producer-digests/lookup`` ``{"compat_id", "scope_id",
  "block_keys"}`` -> ``{"digests": [ProducerDigest, ...]}`` (the unexpired ones of the keys, with their remaining
  TTL), and keep only the replicas whose ``digest`` and ``layer_digests`` equal a producer's
  (:func:`screen`). A block without a producer digest, or none of whose replicas matches one, ends the usable
  prefix: it is recomputed.

Pure: the typed records and the consumer's rule. The Index Service's side is :mod:`kvsp_quic.roles.producer_digests`,
its stores :mod:`kvsp_quic.storage.producer_digests`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsp_quic import fields as f
from kvsp_quic.fields import BlockKey, CompatId, RecordError, ScopeId
from kvsp_quic.records import LookupMatch, Record, ReplicaRecord, wire

MAX_BATCH = 1024  # records in one publish request (a 32-layer record is ~2.4 KB: 1 MiB bodies hold ~400)


def _layer_digests(value: Any, path: str) -> tuple[bytes, ...]:
    return f.hex_array(value, path, 32, nonempty=True)


def _producer(value: Any, path: str) -> str:
    return f.string(value, path)


_UNKNOWN_LAYER = bytes(32)  # a partial replica's layer digest of a layer it does not hold

@dataclass(frozen=True)
class ProducerDigest(Record):
    """``{"block_key", "compat_id", "scope_id", "producer", "digest", "layer_digests", "ttl_ms"}``: the digests of a
    block as the instance that computed it states them. ``producer`` (the producer's authenticated identity, its base
    URI) is set by the Index Service; a publisher may leave it out (if present it must be the publisher's
    identity). ``digest`` is ``sha-256:`` + hex of SHA-256 over the raw layer digests, as in a Replica Record."""

    block_key: BlockKey = wire(f.block_key)
    compat_id: CompatId = wire(f.compat_id)
    scope_id: ScopeId = wire(f.scope_id)
    digest: bytes = wire(f.sha256_digest, writer=f.format_digest)
    layer_digests: tuple[bytes, ...] = wire(_layer_digests)
    ttl_ms: int = wire(f.positive)
    producer: str | None = wire(_producer, default=None)

    def check(self) -> None:
        if not self.layer_digests:
            raise RecordError("layer_digests: must list every layer's digest")
        if hashlib.sha256(b"".join(self.layer_digests)).digest() != bytes(self.digest):
            raise RecordError("digest: not the SHA-256 of the concatenated layer digests")

    @classmethod
    def of_replica(cls, record: ReplicaRecord, *, ttl_ms: int | None = None) -> ProducerDigest:
        """The producer digest of the block *record* describes (its producer's own replica)."""
        if record.layer_digests is None:
            raise ValueError("a producer digest needs the block's layer digests")
        return cls(record.block_key, record.compat_id, record.scope_id, bytes(record.digest),
                   tuple(bytes(x) for x in record.layer_digests), ttl_ms if ttl_ms is not None else record.ttl_ms)

    def vouches_for(self, record: ReplicaRecord) -> bool:
        """Whether *record* describes the octets this producer computed: the same block, scope, compat_id, replica
        digest and (when the record lists them) layer digests."""
        if bytes(record.block_key) != bytes(self.block_key):
            return False
        if bytes(record.scope_id) != bytes(self.scope_id) or bytes(record.compat_id) != bytes(self.compat_id):
            return False
        listed = record.layer_digests
        if bytes(record.digest) == bytes(self.digest):
            return listed is None or [bytes(x) for x in listed] == [bytes(x) for x in self.layer_digests]
        # A partial (layer-range) replica: its digest covers its own layers, with 32 zero octets standing for the
        # layers it does not hold (docs/wire.md, "Layer ranges"), so it never equals the producer's. It is vouched
        # for when every layer it holds carries the producer's layer digest (the consumer checks each layer it
        # receives against that digest) and every other entry is the placeholder.
        if listed is None or len(listed) != len(self.layer_digests) or not record.residency:
            return False
        held = {n for entry in record.residency for n in range(entry.layers[0], entry.layers[1] + 1)}
        return all(bytes(mine) == bytes(theirs) if n in held else bytes(mine) == _UNKNOWN_LAYER
                   for n, (mine, theirs) in enumerate(zip(listed, self.layer_digests, strict=True)))


def _digest_list(value: Any, path: str) -> tuple[ProducerDigest, ...]:
    return f.array(value, path, ProducerDigest.read)


@dataclass(frozen=True)
class ProducerDigests(Record):
    """``{"digests": [ProducerDigest, ...]}``: the body of a publish, and the answer of a producer-digest lookup."""

    digests: tuple[ProducerDigest, ...] = wire(_digest_list)


def _key_list(value: Any, path: str) -> tuple[BlockKey, ...]:
    return tuple(BlockKey(k) for k in f.hex_array(value, path, 32, nonempty=True))


@dataclass(frozen=True)
class ProducerDigestQuery(Record):
    """``{"compat_id", "scope_id", "block_keys"}``: the body of ``POST producer-digests/lookup``."""

    compat_id: CompatId = wire(f.compat_id)
    scope_id: ScopeId = wire(f.scope_id)
    block_keys: tuple[BlockKey, ...] = wire(_key_list)


# -- the consumer's rule --------------------------------------------------------------------------------------------


def by_block(digests: Iterable[ProducerDigest]) -> dict[bytes, list[ProducerDigest]]:
    out: dict[bytes, list[ProducerDigest]] = {}
    for d in digests:
        out.setdefault(bytes(d.block_key), []).append(d)
    return out


@dataclass(frozen=True)
class Screened:
    """What :func:`screen` kept: the usable prefix of matches, and why it ended there (if it did)."""

    blocks: tuple[LookupMatch, ...]
    refused: int  # replicas left out of the kept blocks and of the block that ended the prefix (digest differs)
    ended_at: bytes | None = None  # the Block Key whose replicas no producer vouches for (None: every match kept)
    unvouched: bool = False  # ended_at has no producer digest at all (else: every replica differs from it)


def screen(matches: Sequence[LookupMatch], digests: Mapping[bytes, Sequence[ProducerDigest]]) -> Screened:
    """The matches (a lookup's prefix, in order) cut to the replicas some producer vouches for; the prefix ends at
    the first block without a producer digest or whose replicas all differ from its producers' (it is
    recomputed, and so is every later one: Block Keys are chained)."""
    kept: list[LookupMatch] = []
    refused = 0
    for match in matches:
        mine = digests.get(bytes(match.block_key), ())
        good = tuple(r for r in match.replicas if any(d.vouches_for(r) for d in mine))
        refused += len(match.replicas) - len(good)
        if not good:
            return Screened(tuple(kept), refused, bytes(match.block_key), not mine)
        kept.append(match if len(good) == len(match.replicas) else LookupMatch(match.block_key, good))
    return Screened(tuple(kept), refused)


__all__ = ["MAX_BATCH", "ProducerDigest", "ProducerDigestQuery", "ProducerDigests", "Screened", "by_block",
           "screen"]
