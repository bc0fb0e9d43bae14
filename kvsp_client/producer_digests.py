"""Producer digests over HTTP (docs/wire.md, "Producer digests"; the records: :mod:`kvsp_quic.producer_digests`).

* :class:`ProducerDigestApi` -- ``POST {is}producer-digests`` (publish, instances only) and ``POST
  {is}producer-digests/lookup`` (consumers), with :class:`~kvsp_client.api.KvspApi`'s failure semantics;
* :class:`ProducerCheck` -- a consumer's screening of a lookup's matches (``BlockFetcher(require_producer_digest=
  True)``);
* :class:`ProducerDigestPublisher` -- an instance's background sender of the digests of the blocks it computed:
  batched (up to 64 records a request), never on the request path, retried with backoff after a transport failure
  or a 5xx; an Index Service without the extension (404/405) is logged once and the records are dropped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Sequence

from http3.client import KvspClient, TransportError
from kvsp_client.api import KvspApi, RetryElsewhere, ServiceEndpoints
from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import Problem
from kvsp_quic.producer_digests import (
    ProducerDigest,
    ProducerDigestQuery,
    ProducerDigests,
    Screened,
    by_block,
    screen,
)
from kvsp_quic.records import LookupMatch
from kvsp_quic.retrieval_plan import RetrievalMetrics

log = logging.getLogger("kvsp.producer_digests")

BATCH = 64
# The TTL a producer asks for: the Index Service caps it (its max_ttl_ms, ten minutes by default). Not refreshed: a
# block whose producer digest expired is recomputed by consumers in the mode, which then publish a fresh one.
PRODUCER_DIGEST_TTL_MS = 600_000


class ProducerDigestApi(KvspApi):
    """The two producer-digest resources of the Index Service."""

    async def publish_producer_digests(self, index: str | ServiceEndpoints, records: Sequence[ProducerDigest], *,
                                       timeout: float | None = None) -> ProducerDigests:
        """``POST {index}producer-digests``: the records as stored (``producer`` = this client's identity, the
        granted ``ttl_ms``). Idempotent: publishing a record again replaces it."""
        body = ProducerDigests(tuple(records))
        return await self._at(index, lambda base: self._json(
            "POST", self.url(base, "producer-digests"), ProducerDigests, body=body, idempotent=True,
            timeout=timeout), safe=True)

    async def lookup_producer_digests(self, index: str | ServiceEndpoints, compat_id: bytes, scope_id: bytes,
                                      block_keys: Sequence[bytes], *,
                                      timeout: float | None = None) -> tuple[ProducerDigest, ...]:
        """``POST {index}producer-digests/lookup``: the unexpired producer digests of *block_keys* (a query)."""
        query = ProducerDigestQuery(CompatId(bytes(compat_id)), ScopeId(bytes(scope_id)),
                                    tuple(BlockKey(bytes(k)) for k in block_keys))
        found = await self._at(index, lambda base: self._json(
            "POST", self.url(base, "producer-digests/lookup"), ProducerDigests, body=query, idempotent=True,
            timeout=timeout), safe=True)
        return found.digests


class ProducerCheck:
    """The consumer's side of the mode (``BlockFetcher(require_producer_digest=True)``): a lookup's matched prefix is
    cut to the replicas a producer vouches for (:func:`~kvsp_quic.producer_digests.screen`). A block without a
    producer digest, or whose replicas all differ from its producers', ends the prefix and is recomputed with every
    later one (counted in ``producer_unverified``, logged at INFO once per block); replicas left out are counted
    in ``producer_mismatches``. When the producer digests cannot be read (an Index Service without the extension,
    a failure) nothing is vouched for: every matched block is recomputed (``producer_lookup_errors``)."""

    def __init__(self, client: KvspClient, *, timeout: float | None = None, max_keys: int = 8192,
                 max_logged: int = 4096) -> None:
        self.api = ProducerDigestApi(client, timeout=timeout)
        self.max_keys = max_keys
        self.max_logged = max_logged
        self._logged: set[bytes] = set()

    async def vouched(self, index: str | ServiceEndpoints, compat_id: bytes, scope_id: bytes,
                      blocks: Sequence[LookupMatch], metrics: RetrievalMetrics) -> list[LookupMatch]:
        if not blocks:
            return []
        keys = [bytes(m.block_key) for m in blocks]
        digests: list[ProducerDigest] = []
        try:
            for start in range(0, len(keys), self.max_keys):
                digests += await self.api.lookup_producer_digests(index, compat_id, scope_id,
                                                                  keys[start:start + self.max_keys])
        except (TransportError, Problem) as exc:
            metrics.producer_lookup_errors += 1
            metrics.producer_unverified += len(blocks)
            log.warning("producer-digest lookup failed (%s): %d matched blocks are recomputed", exc, len(blocks))
            return []
        screened = screen(blocks, by_block(digests))
        metrics.producer_mismatches += screened.refused
        if screened.ended_at is not None:
            metrics.producer_unverified += len(blocks) - len(screened.blocks)
            self._log(screened)
        return list(screened.blocks)

    def _log(self, screened: Screened) -> None:
        key = screened.ended_at
        if key is None or key in self._logged:
            return
        if len(self._logged) >= self.max_logged:
            self._logged.clear()
        self._logged.add(key)
        why = "no producer digest" if screened.unvouched else "no replica whose digests equal the producer's"
        log.info("block %s: %s; recomputed (and the matched blocks after it)", key.hex(), why)


class ProducerDigestPublisher:
    """Sends the producer digests :meth:`add` is given to the Index Service *index*, in the background."""

    def __init__(self, client: KvspClient, index: str | Sequence[str] | ServiceEndpoints, *,
                 timeout: float | None = 10.0, batch: int = BATCH, max_pending: int = 65536,
                 min_backoff: float = 0.5, max_backoff: float = 30.0) -> None:
        self.api = ProducerDigestApi(client, timeout=timeout)
        self.index = ServiceEndpoints.of(index, "index")
        self.batch = batch
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self._pending: collections.deque[ProducerDigest] = collections.deque(maxlen=max_pending)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._unsupported_logged = False
        self.published = 0  # records the Index Service stored
        self.dropped = 0  # records given up (refused, or an Index Service without the extension)

    def add(self, record: ProducerDigest) -> None:
        self._pending.append(record)
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="producer-digests")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        backoff = self.min_backoff
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            records = [self._pending.popleft() for _ in range(min(self.batch, len(self._pending)))]
            try:
                stored = await self.api.publish_producer_digests(self.index, records)
            except (RetryElsewhere, TransportError) as exc:  # try again later, these first
                self._pending.extendleft(reversed(records))
                log.info("publishing %d producer digests failed: %s; again in %.1f s", len(records), exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.max_backoff)
                continue
            except Problem as exc:
                self.dropped += len(records)
                if exc.status in (404, 405):
                    if not self._unsupported_logged:
                        self._unsupported_logged = True
                        log.warning("the Index Service has no producer-digest resource (%s): producer digests are "
                                    "not published; consumers that require them recompute these blocks", exc)
                else:
                    log.warning("the Index Service refused %d producer digests: %s", len(records), exc)
                continue
            backoff = self.min_backoff
            self.published += len(stored.digests)


__all__ = ["BATCH", "PRODUCER_DIGEST_TTL_MS", "ProducerCheck", "ProducerDigestApi", "ProducerDigestPublisher"]
