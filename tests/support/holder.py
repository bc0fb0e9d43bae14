"""The holder role's tests in process: its base URI, scope and principals, blocks by number."""

from __future__ import annotations

import hashlib
from typing import Any

from kvsp_quic import container as c
from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.samples import random_sections

BASE = "https://h1.example/kvsp/"
SCOPE = bytes.fromhex("6d1c6481cd428737da312c089db3832a")


def principal(name: str = "ii", scopes: Any = ALL) -> Principal:
    return Principal(f"urn:kvsp:client:{name}", frozenset({Role.INSTANCE}), scopes)


ALICE = principal("alice")
BOB = principal("bob")


def key(n: int) -> bytes:
    return hashlib.sha256(b"key%d" % n).digest()


def body(d: CompatDescriptor, n: int) -> bytes:
    enc = c.encode(random_sections(d, d.block_tokens, 0, d.layers - 1, n), first_layer=0,
                   token_count=d.block_tokens, descriptor=d)
    return enc.tobytes()
