"""The base of every control message class and the decode helpers both drafts' message modules share."""

from __future__ import annotations

from typing import ClassVar, Self

from moqt.errors import protocol_violation
from moqt.types import GroupOrder, KeyValuePairs
from moqt.varint import Reader, Writer


class Message:
    """A control message: ``TYPE`` is its wire code; the body is everything after Type and Length."""

    TYPE: ClassVar[int]
    NAME: ClassVar[str]

    def encode_body(self, w: Writer) -> None:
        raise NotImplementedError

    @classmethod
    def decode_body(cls, r: Reader) -> Self:
        raise NotImplementedError


def read_flag(r: Reader, what: str) -> bool:
    """An 8-bit field that must be 0 or 1 (Forward, Content Exists, End Of Track)."""
    value = r.uint8()
    if value > 1:
        raise protocol_violation(f"{what} is {value}, not 0 or 1")
    return value == 1


def read_group_order(r: Reader, *, allow_publisher: bool) -> GroupOrder:
    value = r.uint8()
    if value > 2 or (value == 0 and not allow_publisher):
        raise protocol_violation(f"group order {value} is not allowed here")
    return GroupOrder(value)


def check_no_duplicates(params: KeyValuePairs, single: frozenset[int], what: str) -> None:
    """Known parameters that may appear once must not repeat (PROTOCOL_VIOLATION); unknown ones may."""
    seen: set[int] = set()
    for ptype, _ in params:
        if ptype in single:
            if ptype in seen:
                raise protocol_violation(f"{what}: parameter 0x{ptype:x} repeated")
            seen.add(ptype)
