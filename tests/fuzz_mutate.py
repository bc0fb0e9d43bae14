"""A fast, deterministic, structure-aware mutation generator for the million-input fuzz runs (issue 13, point 4).

Hypothesis explores well but costs a millisecond or more per example; a million inputs per parser needs a few
microseconds of overhead per input. :class:`Mutator` starts from valid encodings (the seeds) and applies one to
four mutations drawn from a fixed menu, with a :class:`random.Random` seeded by the caller, so a run is
reproducible from ``(seed, index)`` alone:

- octets: bit flips, interesting octets (0x00, 0x3f, 0x40, 0x7f, 0x80, 0xc0, 0xff), truncation, deletion,
  insertion of random octets, duplication of a span, splices with another seed;
- numbers: QUIC / MOQT varints and 2-, 4- and 8-octet big-endian integers at their boundaries (0, 63, 64, 16383,
  16384, 2**30 - 1, 2**30, 2**62 - 1, 2**32 - 1, 2**64 - 1), overwritten or inserted where a length field may be;
- JSON (``kind="json"``): a path into the parsed seed is replaced by an edge value (huge, negative and fractional
  numbers, 10**400, 1e308, booleans and null where a number is expected, empty / long / unicode edge-case strings,
  lone surrogates, deep nesting just under, at and far over the depth limit), members are dropped, added, or
  duplicated in the text, and the text is mutated as octets;
- TOML (``kind="toml"``): a value is replaced by an edge value (huge integers, ``nan``, ``inf``, dates, nested
  arrays and inline tables, control characters), lines are dropped, duplicated or swapped, tables repeated, and the
  text is mutated as characters.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any

INTERESTING_OCTETS = (0x00, 0x01, 0x3F, 0x40, 0x7F, 0x80, 0xBF, 0xC0, 0xFE, 0xFF)
BOUNDARIES = (0, 1, 63, 64, 255, 256, 16383, 16384, 65535, 65536, 2**30 - 1, 2**30, 2**31, 2**32 - 1, 2**32,
              2**53, 2**62 - 1, 2**63, 2**64 - 1)


def quic_varint(value: int, size: int | None = None) -> bytes:
    """*value* (< 2**62) as a QUIC varint, minimal or forced to *size* octets (1, 2, 4, 8) when it fits."""
    if size is None:
        size = 1 if value < 64 else 2 if value < 16384 else 4 if value < 2**30 else 8
    prefix = {1: 0, 2: 1, 4: 2, 8: 3}[size]
    return ((prefix << (8 * size - 2)) | value).to_bytes(size, "big")


def _varint_pool() -> tuple[bytes, ...]:
    out: list[bytes] = []
    for v in BOUNDARIES:
        for size in (1, 2, 4, 8):
            if v < 2 ** (8 * size - 2):
                out.append(quic_varint(v, size))
    out += [b"\xff" * 8, b"\xc0", b"\x80\x00", b"\x40"]  # the largest varint, and prefixes cut short
    return tuple(out)


VARINTS = _varint_pool()
FIXED_INTS = tuple(v.to_bytes(n, "big") for n in (2, 4, 8) for v in BOUNDARIES if v < 2 ** (8 * n))

# JSON edge values: what a peer may send where a member of another kind is expected.
_DEEP_OK = "[" * 60 + "]" * 60
MAX_JSON_INPUT = 1 << 20  # octets: a generated document is cut here (shared subtrees can grow one quickly)
JSON_EDGES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**400,
    0.5, -0.0, 1e308, 5e-324, 1.0, "", "a", "0", "-1", "ab" * 32, "AB" * 32, "ab" * 31, "ab" * 16, "zz" * 32,
    "\x00", "\ud800", "\udfff", "\u202e", "\ufeff", "é", "\U0001f600", "ｈｔｔｐｓ://x/", "https://h.example/kvsp/",
    "https://[::1]:443/", "moqt://relay.example:4443/", "https://user@h/", "http://h/", "https://h", "x" * 5000,
    "00000000-0000-0000-0000-000000000000", "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11", "sha-256:" + "ab" * 32,
    "sha-256:", "active", "draining", "device", "host", "ascending", "top-p", [], {}, [0], [0, 0], [1, 0], [0, 2**32],
    [[0, 1]], [[1, 0]], ["ab" * 32], [None], [{}], {"": None}, {"a": [1, {"b": None}]},
)
JSON_TEXT_EDGES: tuple[bytes, ...] = (
    b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"9" * 5000, b"1" * 4301, b"0.0000000001e-400",
    b"01", b"-", b'"\\ud800"', b'"\\udc00\\ud800"', b'"\\u0000"', b'"\xff"', b'"\xc3"', b'"\xed\xa0\x80"',
    _DEEP_OK.encode(), ("[" * 64 + "]" * 64).encode(), ("[" * 65 + "]" * 65).encode(), b"[" * 5000,
    b'{"a":' * 3000, ('{"a":' * 70 + "1" + "}" * 70).encode(), b'"' + b"\\" * 7 + b'"',
)
TOML_EDGES: tuple[str, ...] = (
    "0", "-1", "1", "9223372036854775807", "9223372036854775808", "-9223372036854775809", "99999999999999999999999",
    "0x7fffffff", "0o777", "0b1", "1e400", "nan", "-inf", "inf", "0.5", "-0.0", "true", "false", '""', '"x"',
    "''", '"\\u0000"', '"\\ud800"', '"\\U0010ffff"', '"' + "x" * 3000 + '"', '"~nobody/x"', '"/"', '"."', '"*"',
    "[]", '["*"]', "[1, 2]", '["a", "a"]', "[[1]]", "[" * 200 + "]" * 200, "{}", "{ a = 1 }", "{ a = { b = 2 } }",
    "1979-05-27T07:32:00Z", "1979-05-27", "07:32:00", '"127.0.0.1:0"', '"127.0.0.1:65536"', '"[::1]:443"',
    '"https://h.example/kvsp/"', '"urn:kvsp:user:x"', '"http://h/"', '"ab"', '"' + "ab" * 16 + '"',
)
_TOML_VALUE_RE = re.compile(r"^([^=\n\[]+=\s*)(.*)$", re.MULTILINE)
_UNICODE_EDGES = ("\x00", "\x7f", "\x1b", "\ud800", "\u202e", "\ufeff", "\U0001f600", "\u0301", "\u2028", "é")


class Mutator:
    """Deterministic inputs derived from *seeds* (bytes for ``binary`` and ``json``, str for ``toml``)."""

    def __init__(self, seeds: Sequence[bytes | str], seed: int, *, kind: str = "binary") -> None:
        if not seeds:
            raise ValueError("a mutator needs at least one valid seed")
        self.kind = kind
        self.rng = random.Random(seed)
        self.seeds = list(seeds)
        self.trees = [json.loads(s) for s in self.seeds] if kind == "json" else []

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self.next()

    def next(self) -> Any:
        rng = self.rng
        i = rng.randrange(len(self.seeds))
        if self.kind == "json":
            if rng.random() < 0.7:
                tree = self.trees[i]
                for _ in range(rng.randint(1, 3)):
                    tree = self._mutate_tree(tree, 0)
                data = self._dump(tree)
                if rng.random() < 0.15:
                    data = self._octets(bytearray(data), 1)
                return data
            return self._json_text(self.seeds[i])  # type: ignore[arg-type]
        if self.kind == "toml":
            return self._toml(self.seeds[i])  # type: ignore[arg-type]
        seed = self.seeds[i]
        assert isinstance(seed, bytes)
        return self._octets(bytearray(seed), rng.randint(1, 4))

    # -- octets -----------------------------------------------------------------------------------------------

    def _octets(self, data: bytearray, rounds: int) -> bytes:
        rng = self.rng
        for _ in range(rounds):
            n = len(data)
            op = rng.randrange(11)
            i = rng.randrange(n + 1)
            if op == 0 and n:  # flip a bit
                data[i % n] ^= 1 << rng.randrange(8)
            elif op == 1 and n:  # an interesting octet
                data[i % n] = rng.choice(INTERESTING_OCTETS)
            elif op == 2:  # truncate
                del data[i:]
            elif op == 3:  # delete a span
                del data[i:i + rng.randint(1, 16)]
            elif op == 4:  # insert random octets
                data[i:i] = rng.randbytes(rng.randint(1, 8))
            elif op == 5:  # duplicate a span
                data[i:i] = data[i:i + rng.randint(1, 64)]
            elif op == 6:  # splice another seed's tail (or head) in
                other = self.seeds[rng.randrange(len(self.seeds))]
                raw = other if isinstance(other, bytes) else other.encode("utf-8", "surrogatepass")
                j = rng.randrange(len(raw) + 1)
                data[i:] = raw[j:] if rng.random() < 0.5 else raw[:j]
            elif op == 7:  # overwrite with a boundary varint
                v = rng.choice(VARINTS)
                data[i:i + len(v)] = v
            elif op == 8:  # insert a boundary varint (a length field that was not there)
                data[i:i] = rng.choice(VARINTS)
            elif op == 9:  # overwrite a fixed-width integer with a boundary value
                v = rng.choice(FIXED_INTS)
                data[i:i + len(v)] = v
            else:  # set a run to one octet
                data[i:i + rng.randint(1, 8)] = bytes([rng.choice(INTERESTING_OCTETS)]) * rng.randint(1, 8)
        return bytes(data)

    # -- JSON -----------------------------------------------------------------------------------------------------

    def _mutate_tree(self, node: Any, depth: int) -> Any:
        """A copy of *node* with one change somewhere below it (only the path to the change is copied)."""
        rng = self.rng
        if isinstance(node, dict) and node and rng.random() < 0.8:
            key = rng.choice(list(node))
            out = dict(node)
            r = rng.random()
            if r < 0.6:
                out[key] = self._mutate_tree(node[key], depth + 1)
            elif r < 0.75:
                del out[key]
            elif r < 0.85:
                out[rng.choice(("x-future", key + "_", "", "\ud800", key.upper()))] = rng.choice(JSON_EDGES)
            else:
                out = {k: out[k] for k in rng.sample(list(out), len(out))}  # member order
            return out
        if isinstance(node, list) and node and rng.random() < 0.8:
            out_list = list(node)
            j = rng.randrange(len(out_list))
            r = rng.random()
            if r < 0.6:
                out_list[j] = self._mutate_tree(out_list[j], depth + 1)
            elif r < 0.75:
                del out_list[j]
            elif r < 0.9:
                out_list.insert(j, out_list[j] if rng.random() < 0.5 else rng.choice(JSON_EDGES))
            elif len(out_list) <= 8 and not any(isinstance(x, list | dict) for x in out_list):
                out_list *= rng.choice((2, 16, 300))  # many items (of scalars only: the size stays bounded)
            return out_list
        r = rng.random()
        if r < 0.75:
            return rng.choice(JSON_EDGES)
        if isinstance(node, int) and not isinstance(node, bool):
            return node + rng.choice((-1, 1, 2**32, -(2**32), 2**64))
        if isinstance(node, str) and node:
            k = rng.randrange(len(node))
            return node[:k] + rng.choice((*_UNICODE_EDGES, "A", "g", "-", "/", "%", "\\")) + node[k + 1:]
        depth_wanted = rng.choice((1, 8, 59, 63, 64, 65, 200, 1500))
        for _ in range(depth_wanted):
            node = [node] if rng.random() < 0.5 else {"a": node}
        return node

    def _dump(self, tree: Any) -> bytes:
        try:
            text = json.dumps(tree, ensure_ascii=self.rng.random() < 0.5, separators=(",", ":"))
        except (ValueError, RecursionError):  # json.dumps of a tree nested past the recursion limit
            return b"[" * 2000
        return text.encode("utf-8", "surrogatepass")[:MAX_JSON_INPUT]

    def _json_text(self, seed: bytes) -> bytes:
        rng = self.rng
        data = bytearray(seed)
        r = rng.random()
        if r < 0.35:  # an edge token where a value starts
            starts = [m.start() for m in re.finditer(rb'(?<=[:\[,])', data)] or [0]
            at = rng.choice(starts)
            end = at
            while end < len(data) and data[end] not in b",]}":
                end += 1
            data[at:end] = rng.choice(JSON_TEXT_EDGES)
            return bytes(data)
        if r < 0.5 and data[:1] == b"{":  # a duplicate member
            m = re.search(rb'"[^"\\]*":', data)
            if m is not None:
                data[1:1] = m.group(0) + b"0,"
                return bytes(data)
        if r < 0.6:  # the document nested in arrays
            k = rng.choice((63, 64, 65, 1000))
            return b"[" * k + bytes(data) + b"]" * k
        return self._octets(data, rng.randint(1, 4))

    # -- TOML -----------------------------------------------------------------------------------------------------

    def _toml(self, seed: str) -> str:
        rng = self.rng
        text = seed
        for _ in range(rng.randint(1, 3)):
            r = rng.random()
            if r < 0.45:  # a value replaced by an edge value
                matches = list(_TOML_VALUE_RE.finditer(text))
                if matches:
                    m = rng.choice(matches)
                    text = text[:m.start(2)] + rng.choice(TOML_EDGES) + text[m.end(2):]
                    continue
            lines = text.split("\n")
            if r < 0.55 and lines:  # drop a line
                del lines[rng.randrange(len(lines))]
            elif r < 0.65 and lines:  # duplicate a line (a repeated key or table)
                j = rng.randrange(len(lines))
                lines.insert(rng.randrange(len(lines) + 1), lines[j])
            elif r < 0.72 and len(lines) > 1:  # swap two lines (a key moves to another table)
                a, b = rng.randrange(len(lines)), rng.randrange(len(lines))
                lines[a], lines[b] = lines[b], lines[a]
            elif r < 0.8:  # a new key, or an unknown table
                lines.insert(rng.randrange(len(lines) + 1),
                             rng.choice(("x = 1", "[x]", "[[x]]", "[server.x]", "a.b.c = 1", '"" = 1',
                                         "[principal]", "[[principal]]")))
            else:  # characters
                text = "\n".join(lines)
                k = rng.randrange(len(text) + 1)
                c = rng.random()
                if c < 0.3:
                    text = text[:k] + rng.choice((*_UNICODE_EDGES, "=", "[", "]", '"', "'", "#", "\\", "\r")) + text[k:]
                elif c < 0.6:
                    text = text[:k] + text[k + rng.randint(1, 12):]
                else:
                    text = text[:k]
                continue
            text = "\n".join(lines)
        return text


__all__ = ["BOUNDARIES", "JSON_EDGES", "TOML_EDGES", "VARINTS", "Mutator", "quic_varint"]
