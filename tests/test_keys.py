from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp_quic.keys import (
    BLOCK_LABEL,
    ZERO_KEY,
    BlockKeyChain,
    BlockKeyer,
    KeyInputError,
    holder_id,
    pack_tokens,
    parse_scope_key,
    scope_id,
)
from tests import vectors

COMPAT = bytes.fromhex(vectors.COMPAT_ID)


def reference_keys(scope_key: bytes, compat: bytes, tokens: list[int], block: int) -> list[bytes]:
    """The spec's definition, written as plainly as possible with the standard hmac module."""
    prev, out = bytes(32), []
    for i in range(len(tokens) // block):
        chunk = tokens[i * block:(i + 1) * block]
        msg = BLOCK_LABEL + compat + prev + struct.pack(f">{block}I", *chunk)
        prev = hmac.new(scope_key, msg, hashlib.sha256).digest()
        out.append(prev)
    return out


def test_scope_id_matches_the_spec_vector() -> None:
    assert scope_id(vectors.SCOPE_KEY).hex() == vectors.SCOPE_ID


def test_block_keys_match_the_spec_vectors() -> None:
    keyer = BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4)
    assert [k.hex() for k in keyer.keys(vectors.TOKENS)] == [vectors.K0, vectors.K1]
    assert keyer.scope_id.hex() == vectors.SCOPE_ID


def test_only_complete_blocks_have_keys() -> None:
    keyer = BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4)
    assert [k.hex() for k in keyer.keys([*vectors.TOKENS, 1, 2, 3])] == [vectors.K0, vectors.K1]
    assert keyer.keys(vectors.TOKENS[:3]) == []


def test_continuing_a_prompt_does_not_need_the_prefix() -> None:
    keyer = BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4)
    k0 = keyer.keys(vectors.TOKENS[:4])[0]
    assert keyer.keys(vectors.TOKENS[4:], previous=k0)[0].hex() == vectors.K1


def test_chain_appends_tokens_without_rehashing() -> None:
    keyer = BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4)
    chain = BlockKeyChain(keyer, vectors.TOKENS[:3])
    assert chain.keys == [] and chain.pending_tokens == 3
    assert [k.hex() for k in chain.append(vectors.TOKENS[3:6])] == [vectors.K0]
    assert chain.pending_tokens == 2
    assert [k.hex() for k in chain.append(vectors.TOKENS[6:])] == [vectors.K1]
    assert chain.last_key.hex() == vectors.K1 and chain.pending_tokens == 0


@given(st.binary(min_size=32, max_size=200), st.lists(st.integers(0, 2**32 - 1), max_size=70),
       st.integers(1, 9))
def test_matches_the_standard_hmac_for_any_key_and_tokens(key: bytes, tokens: list[int], block: int) -> None:
    # Keys longer than the SHA-256 block (64 octets) are hashed first (RFC 2104); this covers both cases.
    keyer = BlockKeyer(key, COMPAT, block)
    assert keyer.keys(tokens) == reference_keys(key, COMPAT, tokens, block)
    assert keyer.keys(np.array(tokens, dtype=np.uint32)) == keyer.keys(tokens)
    chain = BlockKeyChain(keyer)
    for i in range(0, len(tokens), 5):
        chain.append(tokens[i:i + 5])
    assert chain.keys == keyer.keys(tokens)


def test_pack_tokens_is_big_endian_uint32() -> None:
    assert pack_tokens([1, 0x01020304]) == b"\x00\x00\x00\x01\x01\x02\x03\x04"
    assert pack_tokens(np.array([1, 0x01020304], dtype=np.int64)) == b"\x00\x00\x00\x01\x01\x02\x03\x04"


@pytest.mark.parametrize("tokens", [[-1], [2**32], ["7"], [1.5], np.array([-1]), np.array([2**32]),
                                    np.array([1.0])])
def test_tokens_outside_uint32_are_rejected(tokens: object) -> None:
    with pytest.raises(KeyInputError):
        BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4).keys(tokens)  # type: ignore[arg-type]


def test_bad_keyer_inputs() -> None:
    with pytest.raises(KeyInputError, match="at least 32 octets"):
        BlockKeyer(b"short", COMPAT, 4)
    with pytest.raises(KeyInputError, match="compat_id"):
        BlockKeyer(vectors.SCOPE_KEY, COMPAT[:16], 4)
    with pytest.raises(KeyInputError, match="block_tokens"):
        BlockKeyer(vectors.SCOPE_KEY, COMPAT, 0)
    with pytest.raises(KeyInputError, match="previous"):
        BlockKeyer(vectors.SCOPE_KEY, COMPAT, 4).keys([1, 2, 3, 4], previous=b"\x00")
    with pytest.raises(KeyInputError, match="hex"):
        parse_scope_key("zz")
    with pytest.raises(KeyInputError, match="at least 32"):
        parse_scope_key("00" * 31)
    assert parse_scope_key(vectors.SCOPE_KEY.hex()) == vectors.SCOPE_KEY
    assert bytes(32) == ZERO_KEY


def test_holder_id_is_base64url_of_sha256_of_the_uri() -> None:
    hid = holder_id("https://h1.example/kvsp/")
    assert len(hid) == 43 and "=" not in hid and "+" not in hid and "/" not in hid
    import base64
    assert base64.urlsafe_b64decode(hid + "=") == hashlib.sha256(b"https://h1.example/kvsp/").digest()
    assert holder_id("https://h1.example/kvsp") != hid  # the URI exactly as configured
