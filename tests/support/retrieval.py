"""The retrieval client's servers: one RoleServer serving, below separate base paths, the Index Service (``/is/``), two
real holders (``/h1/``, ``/h2/``) and fake holders that misbehave on purpose (``/bad/``, ``/bad2/``): :class:`Net` (the
``net`` fixture of tests/conftest.py builds it), blocks by number and checks of what was fetched."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
from collections.abc import Sequence
from typing import Any

from http3.client import KvspClient
from http3.server import RoleServer
from kvsp_client.retrieval import BlockFetcher, FetchResult
from kvsp_dev import pki
from kvsp_quic import container as c
from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.keys import holder_id
from kvsp_quic.records import (
    LookupMatch,
    ReplicaRecord,
    ResidencyEntry,
)
from kvsp_quic.retrieval_plan import (
    format_repr_digest,
)
from kvsp_quic.roles.holder import Holder
from kvsp_quic.roles.index import IndexService
from kvsp_quic.samples import random_sections
from quic.tls import TlsFiles
from tests.asgi import Router
from tests.pki import TestPki
from tests.support.descriptors import small_descriptor

SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")
ALICE = "urn:kvsp:client:alice"  # the loading instance / client
ADMIN = Principal("urn:test:admin", frozenset({Role.HOLDER}), ALL, ALL)  # publishes the fake holders' records
LAYERS = 4
COMPAT = small_descriptor(layers=LAYERS).compat_id


def key(n: int) -> bytes:
    return hashlib.sha256(b"block %d" % n).digest()


def sections(d: CompatDescriptor, n: int) -> list[tuple[Any, Any]]:
    return list(random_sections(d, d.block_tokens, 0, d.layers - 1, n))


def block(d: CompatDescriptor, n: int) -> bytes:
    return c.encode(sections(d, n), first_layer=0, token_count=d.block_tokens, descriptor=d).tobytes()


class FakeHolder:
    """A holder that serves the containers it is given, altered by *mode*:

    ``ok`` as is; ``flip`` one byte of layer *flip_layer* flipped, with a Repr-Digest of what is sent; ``repr`` the
    right octets with a wrong Repr-Digest; ``norepr`` no Repr-Digest; ``badrepr`` an unparseable one. The body is
    sent layer by layer (``chunked``) or in one piece; with *gate*, each layer after the first waits until the
    gate is set (the test sets it whenever it receives a layer), so each layer arrives in its own chunk.
    Leases: ``lease_status`` answers POST leases (201 or a problem).
    """

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.blocks: dict[str, bytes] = {}
        self.flip_layer = 2
        self.chunked = True
        self.gate: asyncio.Event | None = None
        self.lease_status = 201

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        method, path = scope["method"], scope["path"]
        if method == "POST" and path.endswith("/leases"):
            if self.lease_status != 201:
                await _problem(send, self.lease_status, "kvsp-lease-quota")
                return
            lease = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"
            await _json(send, 201, {"lease": lease, "ttl_ms": 1000, "block_keys": [key(0).hex()]},
                        [(b"location", b"leases/" + lease.encode())])
            return
        if method == "DELETE":
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        data = self.blocks.get(path.rsplit("/", 1)[1])
        if data is None:
            await _problem(send, 404, "kvsp-not-found")
            return
        query = scope["query_string"].decode()
        if query.startswith("layers="):
            a, b = query.split("&")[0][len("layers="):].split("-")
            data = c.cut(data, int(a), int(b)).tobytes()
        header = c.parse_header(data)
        offsets = [header.size + o for o in header.layer_offsets()]
        body = bytearray(data)
        if self.mode == "flip" and header.first_layer <= self.flip_layer <= header.last_layer:
            body[offsets[self.flip_layer - header.first_layer] + 3] ^= 0x01
        digest = hashlib.sha256(body).digest()
        headers = [(b"content-type", b"application/kvsp-block"), (b"content-length", str(len(body)).encode())]
        if self.mode == "repr":
            headers.append((b"repr-digest", format_repr_digest(hashlib.sha256(b"other").digest()).encode()))
        elif self.mode == "badrepr":
            headers.append((b"repr-digest", b"sha-256=" + base64.b64encode(digest)))  # not a Byte Sequence
        elif self.mode != "norepr":
            headers.append((b"repr-digest", format_repr_digest(digest).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        pieces = [bytes(body[:offsets[1]])] + [bytes(body[offsets[i]:offsets[i + 1]])
                                                for i in range(1, len(offsets) - 1)]
        if not self.chunked:
            pieces = [bytes(body)]
        for i, piece in enumerate(pieces):
            if i and self.gate is not None:  # the next layer only once the caller has the previous one
                await self.gate.wait()
                self.gate.clear()
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _json(send: Any, status: int, obj: Any, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(obj).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/kvsp+json"), *extra]})
    await send({"type": "http.response.body", "body": body})


async def _problem(send: Any, status: int, suffix: str) -> None:
    body = json.dumps({"type": f"https://iana.org/assignments/kvsp#{suffix}", "title": suffix, "status": status})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/problem+json")]})
    await send({"type": "http.response.body", "body": body.encode()})


@dataclasses.dataclass
class Net:
    server: RoleServer
    router: Router
    index: IndexService
    holders: dict[str, Holder]
    fakes: dict[str, FakeHolder]
    client: KvspClient
    d: CompatDescriptor
    certs: TestPki
    alice: Principal

    def uri(self, name: str) -> str:
        return self.server.base_uri(f"/{name}/")

    async def publish(self, record: ReplicaRecord) -> None:
        await self.index.publish(ADMIN, holder_id(record.holder), record.block_key, record)

    async def store(self, name: str, n: int) -> ReplicaRecord:
        """Block *n* stored at real holder *name* and published for it."""
        record = self.holders[name].store(self.alice, self.d.compat_id, SCOPE, key(n), block(self.d, n), "*")
        await self.publish(record)
        return record

    async def fake(self, name: str, n: int, like: ReplicaRecord, tier: str = "device", **changes: Any) -> ReplicaRecord:
        """Fake holder *name* serves block *n* (its genuine octets) and a record like *like* is published for it."""
        self.fakes[name].blocks[key(n).hex()] = block(self.d, n)
        record = dataclasses.replace(like, holder=self.uri(name),
                                     residency=(ResidencyEntry(tier, (0, LAYERS - 1)),), **changes)
        await self.publish(record)
        return record

    def fetcher(self, **kwargs: Any) -> BlockFetcher:
        return BlockFetcher(self.client, self.uri("is"), descriptors=[self.d], **kwargs)

    def holder_files(self, name: str) -> TlsFiles:
        root = self.certs.root
        ca_cert, ca_key = pki.load_pair(root, "ca")
        file_name = f"{name}-{self.server.port}"
        cert, private = pki.issue(ca_cert, ca_key, pki.role(file_name, self.uri(name)), extra_hosts=["127.0.0.1"])
        pki.write_pair(root, file_name, cert, private)
        return self.certs.files(file_name)


def assert_block(result: FetchResult | None, d: CompatDescriptor, n: int) -> FetchResult:
    assert result is not None
    assert result.tobytes() == block(d, n)
    assert [layer.index for layer in result.layers] == list(range(LAYERS))
    return result


async def one_match(fetcher: BlockFetcher, n: int) -> LookupMatch:
    found = await fetcher.lookup(COMPAT, SCOPE, [key(n)])
    assert found.matched == 1
    return found.blocks[0]
