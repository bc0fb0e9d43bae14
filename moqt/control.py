"""Control message framing, Type (varint) | Length (16) | Payload, in both drafts, and the incremental parser of a
control (or draft 18 request) stream.

A payload that ends before its fields do, or that has octets left after them, is a length mismatch: the drafts
require closing the session with PROTOCOL_VIOLATION. So is an unknown message type.
"""

from __future__ import annotations

from moqt.errors import protocol_violation
from moqt.message import Message
from moqt.messages14 import MESSAGES as MESSAGES14
from moqt.messages18 import MESSAGES as MESSAGES18
from moqt.types import Draft
from moqt.varint import NeedMore, Reader, Writer, encode_varint

TABLES = {Draft.D14: MESSAGES14, Draft.D18: MESSAGES18}
MAX_PAYLOAD = 0xFFFF


def encode_message(msg: Message, draft: Draft) -> bytes:
    """One framed control message."""
    if TABLES[draft].get(msg.TYPE) is not type(msg):
        raise ValueError(f"{type(msg).__name__} is not a draft {draft.value} message")
    w = Writer(draft.vi64)
    msg.encode_body(w)
    if len(w.buf) > MAX_PAYLOAD:
        raise ValueError(f"{msg.NAME} payload of {len(w.buf)} octets exceeds the 16-bit length")
    return encode_varint(msg.TYPE, draft.vi64) + len(w.buf).to_bytes(2, "big") + w.buf


def decode_payload(draft: Draft, mtype: int, payload: memoryview | bytes) -> Message:
    cls = TABLES[draft].get(mtype)
    if cls is None:
        raise protocol_violation(f"unknown control message type 0x{mtype:x}")
    r = Reader(payload, draft.vi64)
    try:
        msg = cls.decode_body(r)
    except NeedMore:
        raise protocol_violation(f"{cls.NAME}: length {len(payload)} is shorter than its fields") from None
    except ValueError as exc:  # a field the message constructor refuses
        raise protocol_violation(f"{cls.NAME}: {exc}") from None
    if not r.at_end():
        raise protocol_violation(f"{cls.NAME}: {r.remaining} octets after its fields (length mismatch)")
    return msg


def decode_message(draft: Draft, data: bytes | memoryview) -> tuple[Message, int]:
    """Decode one whole message at the start of *data*: (message, octets used). Raises NeedMore if incomplete."""
    r = Reader(data, draft.vi64)
    mtype = r.varint()
    if mtype not in TABLES[draft]:
        raise protocol_violation(f"unknown control message type 0x{mtype:x}")
    length = r.uint16()
    payload = r.view(length)
    return decode_payload(draft, mtype, payload), r.pos


class ControlParser:
    """Bytes of a control stream in, whole messages out. Control messages are small: the parser keeps the
    unparsed tail (at most one message, under 64 KiB plus its header) and copies nothing else."""

    __slots__ = ("_buf", "draft")

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self._buf = b""

    @property
    def pending(self) -> int:
        """Octets of an incomplete message held back."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        buf = self._buf + bytes(data) if self._buf else bytes(data)
        out: list[Message] = []
        pos = 0
        while pos < len(buf):
            try:
                msg, used = decode_message(self.draft, memoryview(buf)[pos:])
            except NeedMore:
                break
            out.append(msg)
            pos += used
        self._buf = buf[pos:]
        return out
