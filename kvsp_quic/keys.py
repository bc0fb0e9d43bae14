"""Scope IDs, Block Keys, and holder / instance identifiers.

Spec, "Scopes and Block Keys":
    scope_id = first 16 octets of SHA-256( "KVSP-SCOPE-1" || 0x00 || scope_key )
    K[-1]    = 32 zero octets
    K[i]     = HMAC-SHA-256( scope_key, "KVSP-BLOCK-1" || 0x00 || compat_id || K[i-1]
                             || uint32(t[i*B]) || ... || uint32(t[i*B+B-1]) )
Only complete blocks have keys. Spec, "HTTP Usage": {holder-id} and {instance-id} are base64url without padding
of SHA-256 of the base URI.

HMAC is computed per RFC 2104 from two SHA-256 states that have already absorbed ``key XOR ipad`` (plus the
constant ``"KVSP-BLOCK-1" || 0x00 || compat_id``) and ``key XOR opad``; each block then costs two state copies,
and the tokens are packed to big-endian once for the whole prompt. tests/test_keys.py checks this against
``hmac.new`` and the spec's vectors.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import Any

from kvsp_quic.fields import BlockKey, CompatId, ScopeId
from kvsp_quic.problems import BadRequest

SCOPE_LABEL = b"KVSP-SCOPE-1\x00"
BLOCK_LABEL = b"KVSP-BLOCK-1\x00"
ZERO_KEY = BlockKey(bytes(32))
MIN_SCOPE_KEY_OCTETS = 32
_SHA256_BLOCK = 64


class KeyInputError(BadRequest):
    """Bad input to key computation: a short scope key, a token outside uint32, a misaligned continuation."""


def check_scope_key(scope_key: bytes) -> bytes:
    if not isinstance(scope_key, bytes | bytearray):
        raise KeyInputError("a scope key is bytes")
    if len(scope_key) < MIN_SCOPE_KEY_OCTETS:
        raise KeyInputError(f"a scope key has at least {MIN_SCOPE_KEY_OCTETS} octets, got {len(scope_key)}")
    return bytes(scope_key)


def parse_scope_key(text: str) -> bytes:
    """A scope key written as hex (as on the command line and in configuration files)."""
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise KeyInputError("the scope key must be hex") from None
    return check_scope_key(raw)


def scope_key_of_file(raw: bytes) -> bytes:
    """A scope key file's content: hex text (64 or more hex digits, whitespace ignored), or 32 or more raw octets
    (the format ``kvsp-quic instance --dev`` writes as DIR/scope.key)."""
    text = b"".join(raw.split())
    if len(text) >= 64 and len(text) % 2 == 0:
        try:
            return check_scope_key(bytes.fromhex(text.decode("ascii")))
        except (UnicodeDecodeError, ValueError):
            pass
    if len(raw) >= MIN_SCOPE_KEY_OCTETS:
        return bytes(raw)
    raise KeyInputError(f"expected a scope key of at least {MIN_SCOPE_KEY_OCTETS} octets (raw) or "
                        f"{2 * MIN_SCOPE_KEY_OCTETS} hex characters")


def scope_id(scope_key: bytes) -> ScopeId:
    return ScopeId(hashlib.sha256(SCOPE_LABEL + check_scope_key(scope_key)).digest()[:16])


def uri_id(base_uri: str) -> str:
    """holder-id / instance-id: base64url without padding of SHA-256 of the base URI exactly as configured."""
    digest = hashlib.sha256(base_uri.encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


holder_id = uri_id
instance_id = uri_id


def pack_tokens(tokens: Sequence[int] | Any) -> bytes:
    """Tokens as consecutive uint32 in network byte order. Accepts a sequence of ints or an integer ndarray."""
    if hasattr(tokens, "dtype") and hasattr(tokens, "astype"):  # numpy without importing it here
        arr: Any = tokens
        kind = arr.dtype.kind
        if kind not in "iu":
            raise KeyInputError(f"tokens must be integers, got an array of {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
            raise KeyInputError("every token must fit in uint32 (0 .. 4294967295)")
        return bytes(arr.astype(">u4", copy=False).tobytes())
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError):
        raise KeyInputError("every token must be an integer in uint32 (0 .. 4294967295)") from None
    if packed.itemsize != 4:  # pragma: no cover - no platform CPython supports has a 2- or 8-octet "I"
        raise KeyInputError("platform has no 4-octet unsigned int array type")
    if sys.byteorder == "little":
        packed.byteswap()
    return packed.tobytes()


class BlockKeyer:
    """Computes Block Keys for one (scope key, compat_id, block size); reuse it across prompts."""

    __slots__ = ("_inner", "_outer", "block_tokens", "compat_id", "scope_id")

    def __init__(self, scope_key: bytes, compat_id: bytes, block_tokens: int) -> None:
        key = check_scope_key(scope_key)
        if len(compat_id) != 32:
            raise KeyInputError("compat_id is 32 octets")
        if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
            raise KeyInputError("block_tokens is a positive integer")
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        key = key.ljust(_SHA256_BLOCK, b"\x00")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key) + BLOCK_LABEL + bytes(compat_id))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))
        self.compat_id = CompatId(bytes(compat_id))
        self.scope_id = scope_id(scope_key)
        self.block_tokens = block_tokens

    def keys(self, tokens: Sequence[int] | Any, previous: bytes = ZERO_KEY) -> list[BlockKey]:
        """The keys of the complete blocks of *tokens*; tokens after the last complete block have none.

        To continue a prompt that extends an earlier one, pass the tokens that follow the earlier prompt's last
        complete block and that block's key as *previous*: the prefix is not hashed again.
        """
        return self.keys_of_packed(pack_tokens(tokens), previous)

    def keys_of_packed(self, packed: bytes, previous: bytes = ZERO_KEY) -> list[BlockKey]:
        """Like :meth:`keys` for tokens already packed by :func:`pack_tokens`."""
        if len(previous) != 32:
            raise KeyInputError("the previous Block Key is 32 octets")
        step = 4 * self.block_tokens
        end = len(packed) - len(packed) % step
        inner, outer = self._inner.copy, self._outer.copy
        prev = bytes(previous)
        out: list[BlockKey] = []
        append = out.append
        for offset in range(0, end, step):
            h = inner()
            h.update(prev)
            h.update(packed[offset:offset + step])
            o = outer()
            o.update(h.digest())
            prev = o.digest()
            append(prev)  # type: ignore[arg-type]  # BlockKey is bytes at run time
        return out


class BlockKeyChain:
    """The keys of a token sequence that grows, such as a prompt followed by generated tokens.

    :meth:`append` returns the keys of the blocks the new tokens complete; the prefix is never rehashed.
    """

    def __init__(self, keyer: BlockKeyer, tokens: Iterable[int] = (), previous: bytes = ZERO_KEY) -> None:
        self.keyer = keyer
        self.keys: list[BlockKey] = []
        self._last = bytes(previous)
        self._pending = b""
        self.append(list(tokens))

    @property
    def last_key(self) -> bytes:
        return self._last

    @property
    def pending_tokens(self) -> int:
        """Tokens after the last complete block (they have no key yet)."""
        return len(self._pending) // 4

    def append(self, tokens: Sequence[int] | Any) -> list[BlockKey]:
        packed = self._pending + pack_tokens(tokens)
        new = self.keyer.keys_of_packed(packed, self._last)
        if new:
            self._last = new[-1]
            self.keys.extend(new)
        self._pending = packed[len(new) * 4 * self.keyer.block_tokens:]
        return new
