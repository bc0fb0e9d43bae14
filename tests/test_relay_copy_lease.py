"""Leases of ``moqt://`` replicas (kvsp_moqt/source.py, ``LeasingMoqtSource``): MOQT has no leases, so an
instance leases a ``moqt://`` record at its publisher's ``https`` base URI. A relay's copy is served from the relay's
cache whatever its publisher holds now: a lease the publisher refuses (it gave the block up: 404) no longer makes
the instance skip the relay (found by ``kvsp-quic chaos``, fault relay-kill: every relay copy was skipped once the
instances that published the blocks had restarted). At the publisher's own endpoint a refusal still skips it.

Real holders over HTTP/3 on 127.0.0.1 (the net of tests/support/retrieval.py)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("torch", reason="the instance's sources live with the gpu extra (torch)")

from kvsp_client.retrieval import HttpSource
from kvsp_moqt.source import LeasingMoqtSource
from kvsp_moqt.tracks import track_namespace
from kvsp_quic.keys import uri_id
from kvsp_quic.records import LookupMatch, ReplicaRecord, encode_moqt_namespace
from kvsp_quic.retrieval_plan import AttemptError, Failure
from moqt.aio import MoqtPool
from tests.support.retrieval import SCOPE, Net


def twin(record: ReplicaRecord, publisher: str, holder: str) -> ReplicaRecord:
    namespace = track_namespace(record.compat_id, SCOPE, publisher, record.codec)
    return dataclasses.replace(record, holder=holder, moqt_namespace=encode_moqt_namespace(namespace))


async def test_a_relay_copy_is_fetched_without_the_lease_its_publisher_refuses(net: Net) -> None:
    genuine = await net.store("h1", 1)
    h1, h2 = net.uri("h1"), net.uri("h2")  # h2 published a twin of block 1 and gave the block up since
    own = f"moqt://127.0.0.1:{net.server.port}/"  # a holder's moqt:// twin shares its port
    relay = f"moqt://127.0.0.1:{net.server.port + 1}/"  # a relay elsewhere (never dialled: leases are HTTP)
    pool = MoqtPool(net.certs.files("alice"))
    source = LeasingMoqtSource(pool, [net.d], HttpSource(net.client))
    source.note_lookup([LookupMatch(genuine.block_key, (dataclasses.replace(genuine, holder=h), ))
                        for h in (h1, h2)])  # what a lookup listing both publishers' https records teaches it
    assert source.https_of == {uri_id(h1): h1, uri_id(h2): h2}
    try:
        with pytest.raises(AttemptError) as refused:  # at the publisher's own endpoint: a miss, the replica skipped
            await source.lease(twin(genuine, h2, own), 1000)
        assert refused.value.failure is Failure.MISS
        assert await source.lease(twin(genuine, h2, relay), 1000) is None  # the relay's copy: on without a lease
        assert len(net.holders["h2"].leases) == 0
        # where the publisher still holds the block, the relay's copy is leased there as before
        lease = await source.lease(twin(genuine, h1, relay), 1000)
        assert lease is not None and len(net.holders["h1"].leases) == 1
        assert await source.release(lease)
        assert len(net.holders["h1"].leases) == 0
    finally:
        await pool.aclose()
