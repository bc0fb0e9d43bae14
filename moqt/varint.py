"""Integers on the wire: the two variable-length encodings, and a Reader / Writer pair over octets.

Draft 14 uses the QUIC variable-length integer (RFC 9000 section 16): a 2-bit length prefix, 1/2/4/8 octets,
values up to 2^62-1. Draft 18 replaces it with "vi64": the number of leading 1 bits of the first octet gives the
length (1 to 9 octets), values up to 2^64-1, and non-minimal encodings are valid.

``Reader`` raises :class:`NeedMore` when the octets run out (the one "not enough bytes yet" exception, caught by the
incremental parsers) and never anything else on short input; malformed values are :class:`~moqt.errors.MoqtError`.
"""

from __future__ import annotations

from typing import Final

from moqt.errors import MoqtError, SessionErrorCode

QUIC_MAX: Final = (1 << 62) - 1
VI64_MAX: Final = (1 << 64) - 1


class NeedMore(Exception):
    """The buffer ends before the value does; feed more octets and try again."""


def _vi64_length(first: int) -> int:
    n = 1
    while n < 9 and first & (0x80 >> (n - 1)):
        n += 1
    return n


_VI64_LEN: Final = bytes(_vi64_length(b) for b in range(256))
_VI64_MASK: Final = tuple((0xFF >> n) if n < 8 else 0 for n in _VI64_LEN)


def encode_quic(value: int) -> bytes:
    if value < 0x40:
        if value < 0:
            raise ValueError(f"varint {value} is negative")
        return bytes((value,))
    if value < 0x4000:
        return (value | 0x4000).to_bytes(2, "big")
    if value < 0x4000_0000:
        return (value | 0x8000_0000).to_bytes(4, "big")
    if value <= QUIC_MAX:
        return (value | 0xC000_0000_0000_0000).to_bytes(8, "big")
    raise ValueError(f"varint {value} exceeds 2^62-1")


def encode_vi64(value: int) -> bytes:
    if value < 0x80:
        if value < 0:
            raise ValueError(f"varint {value} is negative")
        return bytes((value,))
    for n in range(2, 9):
        if value < 1 << (7 * n):
            prefix = (0xFF << (9 - n)) & 0xFF
            out = value.to_bytes(n, "big")
            return bytes((out[0] | prefix,)) + out[1:]
    if value <= VI64_MAX:
        return b"\xff" + value.to_bytes(8, "big")
    raise ValueError(f"varint {value} exceeds 2^64-1")


def encode_varint(value: int, vi64: bool) -> bytes:
    return encode_vi64(value) if vi64 else encode_quic(value)


def varint_max(vi64: bool) -> int:
    return VI64_MAX if vi64 else QUIC_MAX


class Reader:
    """Reads fields from ``buf[pos:end]``; ``pos`` advances. Short input raises :class:`NeedMore`."""

    __slots__ = ("buf", "end", "pos", "vi64")

    def __init__(self, buf: memoryview | bytes | bytearray, vi64: bool, pos: int = 0, end: int | None = None) -> None:
        self.buf = buf if isinstance(buf, memoryview) else memoryview(buf)
        self.vi64 = vi64
        self.pos = pos
        self.end = len(self.buf) if end is None else end

    @property
    def remaining(self) -> int:
        return self.end - self.pos

    def at_end(self) -> bool:
        return self.pos >= self.end

    def varint(self) -> int:
        pos = self.pos
        if pos >= self.end:
            raise NeedMore
        first = self.buf[pos]
        if self.vi64:
            n = _VI64_LEN[first]
            if pos + n > self.end:
                raise NeedMore
            value = first & _VI64_MASK[first]
            for b in self.buf[pos + 1:pos + n]:
                value = (value << 8) | b
        else:
            n = 1 << (first >> 6)
            if pos + n > self.end:
                raise NeedMore
            value = first & 0x3F
            for b in self.buf[pos + 1:pos + n]:
                value = (value << 8) | b
        self.pos = pos + n
        return value

    def uint8(self) -> int:
        if self.pos >= self.end:
            raise NeedMore
        value = self.buf[self.pos]
        self.pos += 1
        return value

    def uint16(self) -> int:
        if self.pos + 2 > self.end:
            raise NeedMore
        value = (self.buf[self.pos] << 8) | self.buf[self.pos + 1]
        self.pos += 2
        return value

    def view(self, n: int) -> memoryview:
        """The next *n* octets as a view (no copy)."""
        if n > self.end - self.pos:
            raise NeedMore
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def octets(self, n: int) -> bytes:
        return bytes(self.view(n))

    def length_prefixed(self, limit: int, what: str) -> bytes:
        """A varint length, then that many octets; a length above *limit* is a PROTOCOL_VIOLATION."""
        n = self.varint()
        if n > limit:
            raise MoqtError(SessionErrorCode.PROTOCOL_VIOLATION, f"{what} of {n} octets exceeds {limit}")
        return self.octets(n)


class Writer:
    """Accumulates a message; ``varint`` uses the draft's encoding."""

    __slots__ = ("buf", "vi64")

    def __init__(self, vi64: bool) -> None:
        self.buf = bytearray()
        self.vi64 = vi64

    def varint(self, value: int) -> None:
        self.buf += encode_vi64(value) if self.vi64 else encode_quic(value)

    def uint8(self, value: int) -> None:
        if not 0 <= value <= 0xFF:
            raise ValueError(f"{value} does not fit 8 bits")
        self.buf.append(value)

    def uint16(self, value: int) -> None:
        if not 0 <= value <= 0xFFFF:
            raise ValueError(f"{value} does not fit 16 bits")
        self.buf += value.to_bytes(2, "big")

    def octets(self, data: bytes | bytearray | memoryview) -> None:
        self.buf += data

    def length_prefixed(self, data: bytes | bytearray | memoryview) -> None:
        self.varint(len(data))
        self.buf += data

    def getvalue(self) -> bytes:
        return bytes(self.buf)
