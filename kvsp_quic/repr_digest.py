"""The ``Repr-Digest`` field (RFC 9530) that carries a block's SHA-256: its strict reader and its writer.

Spec, "Block Retrieval and Storage": clients MUST verify Repr-Digest. The field value is a Structured Fields
Dictionary (RFC 8941, now RFC 9651), parsed by ``http_sf`` (Mark Nottingham's implementation of RFC 9651): members
of other algorithms, and parameters, are parsed and ignored; the ``sha-256`` member must be a Byte Sequence of 32
octets.
"""

from __future__ import annotations

import base64

from http_sf import StructuredFieldError, parse


class ReprDigestError(ValueError):
    """The Repr-Digest field is missing, not a valid Structured Fields Dictionary, or has no usable sha-256."""


def parse_repr_digest(value: str | None) -> bytes:
    """The SHA-256 digest carried by a ``Repr-Digest`` field value, strictly parsed (module docstring).

    Anything but a valid Dictionary whose ``sha-256`` member is a Byte Sequence of 32 octets raises
    :class:`ReprDigestError`. When a key repeats, the last member wins (RFC 9651, section 4.2.2).
    """
    if value is None:
        raise ReprDigestError("the response has no Repr-Digest field")
    if not value.isascii():
        raise ReprDigestError(f"Repr-Digest {value!r}: not ASCII")
    try:
        members = parse(value.encode("ascii"), tltype="dictionary")
    except StructuredFieldError as e:
        raise ReprDigestError(f"Repr-Digest {value!r}: {e}") from None
    assert isinstance(members, dict)  # tltype="dictionary"
    if "sha-256" not in members:
        raise ReprDigestError(f"Repr-Digest {value!r} has no sha-256 member")
    member = members["sha-256"]
    digest = member[0] if isinstance(member, tuple) else member  # (value, parameters)
    if not isinstance(digest, bytes):
        raise ReprDigestError("Repr-Digest: the sha-256 member is not a Byte Sequence")
    if len(digest) != 32:
        raise ReprDigestError(f"Repr-Digest: the sha-256 member has {len(digest)} octets, not 32")
    return digest


def format_repr_digest(digest: bytes) -> str:
    """The ``Repr-Digest`` field value for a SHA-256 *digest*."""
    return f"sha-256=:{base64.b64encode(digest).decode('ascii')}:"


__all__ = ["ReprDigestError", "format_repr_digest", "parse_repr_digest"]
