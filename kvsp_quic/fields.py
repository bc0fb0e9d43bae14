"""Strict readers for the JSON members of KVSP objects, shared by the descriptor and the records.

Each reader takes the value and a *path* (``"residency[1].layers"``) and returns the typed value or raises
:class:`RecordError` naming the path. JSON ``true`` is never an integer here, hex is lowercase only, and
UUIDs must be in the canonical 8-4-4-4-12 form.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
import struct
import uuid
from collections.abc import Callable, Mapping
from typing import Any, NewType, TypeVar
from urllib.parse import urlsplit

from kvsp_quic.problems import BadRequest

T = TypeVar("T")

BlockKey = NewType("BlockKey", bytes)  # 32 octets
CompatId = NewType("CompatId", bytes)  # 32 octets
ScopeId = NewType("ScopeId", bytes)  # 16 octets

UINT32_MAX = 0xFFFFFFFF
_HEX_RE = re.compile(r"[0-9a-f]*")
_UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DIGEST_PREFIX = "sha-256:"


class RecordError(BadRequest):
    """A JSON object of the protocol is malformed; the detail names the offending member."""


def fail(path: str, message: str) -> RecordError:
    return RecordError(f"{path}: {message}" if path else message)


MAX_JSON_DEPTH = 64  # nested arrays and objects in a peer's JSON body; no KVSP object needs more than 5


def loads_json(body: bytes | str, path: str = "", *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a JSON document from a peer: any value, nested at most *max_depth* arrays or objects deep.

    Duplicate members, NaN and Infinity are rejected. Deeper nesting is a :class:`RecordError` (400), checked
    before parsing (the standard library's parser recurses once per level, and would raise ``RecursionError`` --
    a 500 -- near 1000 levels)."""
    too_deep = _depth_over(body, max_depth)
    if too_deep:
        raise fail(path, f"not valid JSON here: nested more than {max_depth} arrays or objects deep")
    text, raw = _unicode(body, path)
    # Integers of up to 18 digits are in range: only a document with a longer run of digits has its integers checked
    # one by one (a Python call per integer would triple the cost of a long token list).
    parse_int = _bounded_int if raw.translate(_DIGITS).find(_LONG_RUN) >= 0 else None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants,
                          parse_float=_finite_float, parse_int=parse_int)
    except RecordError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise fail(path, f"not valid JSON ({exc})") from None
    except RecursionError:  # (unreachable after the check above; kept as the last line of defence)
        raise fail(path, "not valid JSON here: nested too deeply") from None


_STRUCTURE_RE = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[{]|[\]}]', re.DOTALL)


def _depth_over(body: bytes | str, max_depth: int) -> bool:
    """Whether *body* opens more than *max_depth* arrays or objects at once (strings skipped; linear time). Only
    documents with more than *max_depth* opening brackets are scanned at all."""
    raw = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else bytes(body)
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for m in _STRUCTURE_RE.finditer(raw):
        c = raw[m.start()]
        if c in b"[{":
            depth += 1
            if depth > max_depth:
                return True
        elif c in b"]}":
            depth -= 1
    return False


# Numbers a peer may send: integers our encoder (orjson) can write back, 64-bit signed or unsigned, and finite
# numbers. Python's parser reads any integer (up to 4300 digits) and turns 1e400 into infinity; either would be
# accepted and then fail -- a 500 -- when the record is written again (a replica record in a lookup answer).
JSON_INT_MIN, JSON_INT_MAX = -(1 << 63), (1 << 64) - 1
_DIGITS = bytes(0x39 if 0x30 <= i <= 0x39 else 0x20 for i in range(256))  # every digit -> "9", the rest -> " "
_LONG_RUN = b"9" * 19


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= 21 else None
    if value is None or not JSON_INT_MIN <= value <= JSON_INT_MAX:
        raise fail("", f"the number {text[:24]}{'...' if len(text) > 24 else ''} is out of range "
                       f"(integers are 64-bit)")
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (math.inf, -math.inf):
        raise fail("", f"the number {text[:24]}{'...' if len(text) > 24 else ''} is out of range")
    return value


# An escaped backslash, a surrogate pair, or one surrogate alone (the only match of six characters).
_ESCAPE_RE = re.compile(r"\\\\|\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                        r"|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _unicode(body: bytes | str, path: str) -> tuple[str, bytes]:
    """The text of *body*: UTF-8 (RFC 8259, 8.1; a leading BOM is ignored) with no lone surrogate, raw or escaped
    (``"\\ud800"``), and its octets. Python's parser takes both (it decodes octets with ``surrogatepass``, and guesses
    UTF-16 and UTF-32 too) and makes strings no UTF-8 encoder writes back: a record holding one could not be sent
    again."""
    if isinstance(body, str):
        text = body
        try:
            raw = text.encode("utf-8")
        except UnicodeEncodeError:
            raise fail(path, "not valid JSON here: a string holds a lone UTF-16 surrogate") from None
    else:
        raw = bytes(body)
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise fail(path, f"not valid JSON here: not UTF-8 ({exc.reason} at octet {exc.start})") from None
    if "\\u" in text and any(m.end() - m.start() == 6 for m in _ESCAPE_RE.finditer(text)):
        raise fail(path, "not valid JSON here: a string holds a lone UTF-16 surrogate (RFC 8259, 8.2)")
    return text, raw


def loads_object(body: bytes | str, path: str = "") -> dict[str, Any]:
    """Parse a JSON document that must be an object (:func:`loads_json`: duplicate members, NaN, Infinity and
    nesting deeper than :data:`MAX_JSON_DEPTH` are rejected)."""
    return as_object(loads_json(body, path), path)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise fail("", f"duplicate member {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> Any:
    raise fail("", f"{name} is not valid JSON")


def as_object(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise fail(path, "must be a JSON object")
    return dict(value)


def member(obj: Mapping[str, Any], name: str, reader: Callable[[Any, str], T], path: str = "") -> T:
    """A required member read with *reader*."""
    where = f"{path}.{name}" if path else name
    if name not in obj:
        raise fail(where, "required member is missing")
    return reader(obj[name], where)


def optional(obj: Mapping[str, Any], name: str, reader: Callable[[Any, str], T], default: T,
             path: str = "") -> T:
    """An optional member; absent or JSON null gives *default*."""
    where = f"{path}.{name}" if path else name
    value = obj.get(name)
    return default if value is None else reader(value, where)


def integer(value: Any, path: str, *, minimum: int = 0, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(path, f"must be an integer, not {_json_kind(value)}")
    if value < minimum:
        raise fail(path, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise fail(path, f"must be <= {maximum}, got {value}")
    return value


def uint(value: Any, path: str) -> int:
    return integer(value, path, minimum=0)


def positive(value: Any, path: str) -> int:
    return integer(value, path, minimum=1)


def uint32(value: Any, path: str) -> int:
    return integer(value, path, minimum=0, maximum=UINT32_MAX)


def number(value: Any, path: str, *, minimum: float = 0.0, maximum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise fail(path, f"must be a number, not {_json_kind(value)}")
    if value != value or value in (float("inf"), float("-inf")):
        raise fail(path, "must be a finite number")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"[{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise fail(path, f"must be in {bound}, got {value}")
    return value


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise fail(path, f"must be true or false, not {_json_kind(value)}")
    return value


def string(value: Any, path: str, *, nonempty: bool = True) -> str:
    if not isinstance(value, str):
        raise fail(path, f"must be a string, not {_json_kind(value)}")
    if nonempty and not value:
        raise fail(path, "must not be empty")
    return value


def array(value: Any, path: str, item: Callable[[Any, str], T], *, nonempty: bool = False) -> tuple[T, ...]:
    if not isinstance(value, list | tuple):
        raise fail(path, f"must be an array, not {_json_kind(value)}")
    if nonempty and not value:
        raise fail(path, "must not be empty")
    return tuple(item(v, f"{path}[{i}]") for i, v in enumerate(value))


def hex_octets(value: Any, path: str, size: int) -> bytes:
    if value.__class__ is str and len(value) == 2 * size:  # the fast path: decode, then insist on the exact text
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raw = b""
        if raw.hex() == value:  # lowercase only, no whitespace (fromhex skips it)
            return raw
    text = string(value, path)
    if len(text) != 2 * size or not _HEX_RE.fullmatch(text):
        raise fail(path, f"must be {2 * size} lowercase hex characters")
    return bytes.fromhex(text)  # a str subclass


def hex_array(value: Any, path: str, size: int, *, nonempty: bool = False) -> tuple[bytes, ...]:
    """An array of *size*-octet lowercase hex strings (Block Keys, layer digests), validated in one pass: the
    same result and the same errors as ``array(value, path, lambda v, p: hex_octets(v, p, size))``."""
    if value.__class__ is list and value:
        width = 2 * size
        try:
            joined = "".join(value)
        except TypeError:  # an item is not a string
            joined = ""
        if len(joined) == width * len(value) and set(map(len, value)) == {width}:
            try:
                raw = bytes.fromhex(joined)
            except ValueError:
                raw = b""
            if raw.hex() == joined:
                return split_octets(raw, size)
    return array(value, path, lambda v, p: hex_octets(v, p, size), nonempty=nonempty)


_SPLIT_RUN = 64


def split_octets(raw: bytes, size: int) -> tuple[bytes, ...]:
    """*raw* cut into ``bytes`` of *size* octets (its length a multiple of *size*), with struct: four times faster
    than slicing. Runs of 64, so that the compiled structs stay few and small whatever the count."""
    count = len(raw) // size
    if count <= _SPLIT_RUN:
        return _splitter(size, count).unpack(raw)
    full = count - count % _SPLIT_RUN
    out = tuple(itertools.chain.from_iterable(_splitter(size, _SPLIT_RUN).iter_unpack(memoryview(raw)[:full * size])))
    if full < count:
        out += _splitter(size, count - full).unpack_from(raw, full * size)
    return out


@functools.lru_cache(maxsize=256)
def _splitter(size: int, count: int) -> struct.Struct:
    return struct.Struct(f"{size}s" * count)


def hex32(value: Any, path: str) -> bytes:
    return hex_octets(value, path, 32)


def hex16(value: Any, path: str) -> bytes:
    return hex_octets(value, path, 16)


def block_key(value: Any, path: str) -> BlockKey:
    return BlockKey(hex32(value, path))


def compat_id(value: Any, path: str) -> CompatId:
    return CompatId(hex32(value, path))


def scope_id(value: Any, path: str) -> ScopeId:
    return ScopeId(hex16(value, path))


def sha256_digest(value: Any, path: str) -> bytes:
    """``"sha-256:" + 64 lowercase hex`` -> the 32 raw octets."""
    text = string(value, path)
    if not text.startswith(DIGEST_PREFIX):
        raise fail(path, f"must start with {DIGEST_PREFIX!r}")
    return hex32(text[len(DIGEST_PREFIX):], path)


def format_digest(raw: bytes) -> str:
    return DIGEST_PREFIX + raw.hex()


def uuid_string(value: Any, path: str) -> uuid.UUID:
    text = string(value, path)
    if not _UUID_RE.fullmatch(text):
        raise fail(path, "must be a UUID in lowercase 8-4-4-4-12 form")
    return uuid.UUID(text)


def base_uri(value: Any, path: str, *, schemes: tuple[str, ...] = ("https",)) -> str:
    """An absolute base URI with one of *schemes*, a host, no query or fragment, ending with "/"."""
    text = string(value, path)
    problem = _base_uri_problem(text, schemes)
    if problem is not None:
        raise fail(path, problem)
    return text


BASE_URIS = "one or more base URIs"  # the marker of an Annotated list field that TOML may give as one string


def base_uris(value: Any, path: str, *, schemes: tuple[str, ...] = ("https",)) -> list[str]:
    """The base URIs of one service, each checked as :func:`base_uri`: a list, or one URI (a string, as earlier
    releases wrote it), or None (none). Each entry must be exactly one URI: ``"https://a/,https://b/"`` is refused
    (name the option twice, or write a list), as is a URI given twice."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise fail(path, f"must be a list of base URIs, not {_json_kind(value)}")
    out: list[str] = []
    for i, item in enumerate(items):
        where = f"{path}[{i}]" if not isinstance(value, str) else path
        text = string(item, where)
        if any(c in text for c in ", \t\n;") or text.count("://") != 1:
            raise fail(where, f"{text!r} is not exactly one base URI (for several, repeat the option or write a "
                              f"list)")
        base_uri(text, where, schemes=schemes)
        if text in out:
            raise fail(where, f"{text!r} is listed twice")
        out.append(text)
    return out


@functools.lru_cache(maxsize=4096)
def _base_uri_problem(text: str, schemes: tuple[str, ...]) -> str | None:
    """What is wrong with *text* as a base URI, or None. Cached: a control plane sees the same few holder URIs
    in every record."""
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        return f"not a valid URI ({exc})"
    if parts.scheme not in schemes:
        return f"scheme must be {' or '.join(schemes)}, got {parts.scheme or 'none'!r}"
    if not parts.hostname:
        return "URI has no host"
    if parts.query or parts.fragment or "#" in text or "?" in text:
        return "a base URI has no query or fragment"
    if not parts.path.endswith("/"):
        return "a base URI must end with '/'"
    if port == 0:
        return "port 0 is not valid"
    return None


def https_uri(value: Any, path: str) -> str:
    return base_uri(value, path, schemes=("https",))


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "an object"
    return type(value).__name__
