from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp_quic import container as c
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.problems import DigestMismatch, LayersUnavailable
from kvsp_quic.samples import random_sections
from tests import vectors
from tests.support.descriptors import small_descriptor


def make(descriptor: CompatDescriptor, first: int = 0, last: int | None = None, seed: int = 1,
         tokens: int | None = None) -> tuple[c.EncodedContainer, bytes]:
    last = descriptor.layers - 1 if last is None else last
    tokens = descriptor.block_tokens if tokens is None else tokens
    enc = c.encode(random_sections(descriptor, tokens, first, last, seed), first_layer=first, token_count=tokens,
                   descriptor=descriptor)
    return enc, enc.tobytes()


def test_header_matches_the_spec_vector(spec_descriptor: CompatDescriptor) -> None:
    sections = [(os.urandom(8192), os.urandom(8192)) for _ in range(2)]
    enc = c.encode(sections, first_layer=0, token_count=4, descriptor=spec_descriptor)
    assert enc.header_bytes == vectors.CONTAINER_HEADER
    assert c.parse_header(vectors.CONTAINER_HEADER) == enc.header
    assert len(enc) == len(vectors.CONTAINER_HEADER) + 4 * 8192


def test_digests_follow_the_spec(spec_descriptor: CompatDescriptor) -> None:
    enc, blob = make(spec_descriptor)
    assert enc.layer_digests is not None
    for i, digest in enumerate(enc.layer_digests):
        k, v = enc.sections[2 * i], enc.sections[2 * i + 1]
        assert digest == hashlib.sha256(bytes(k) + bytes(v)).digest()
    assert enc.replica_digest(spec_descriptor) == hashlib.sha256(b"".join(enc.layer_digests)).digest()
    assert enc.repr_digest() == hashlib.sha256(blob).digest()
    partial, _ = make(spec_descriptor, 0, 3)
    assert partial.replica_digest(spec_descriptor) is None  # not every layer


def test_encode_copies_nothing(spec_descriptor: CompatDescriptor) -> None:
    k, v = bytearray(8192), bytearray(8192)
    enc = c.encode([(k, v)], first_layer=5, token_count=4, descriptor=spec_descriptor, digests=False)
    k[0] = 7
    assert enc.sections[0][0] == 7 and enc.layer_digests is None


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp16", "fp32", "fp8-e4m3", "fp8-e5m2"])
def test_round_trip_for_every_element_type(kv_dtype: str) -> None:
    d = small_descriptor(kv_dtype=kv_dtype)
    sections = random_sections(d, 4, 0, 3, seed=3)
    enc = c.encode(sections, first_layer=0, token_count=4, descriptor=d)
    header, layers = c.decode(enc.tobytes(), d, expected_layer_digests=enc.layer_digests,
                              expected_replica_digest=enc.replica_digest(d))
    assert header == enc.header
    assert header.lengths[0] == (d.section_length(4),) * 2
    for layer, (k, v) in zip(layers, sections, strict=True):
        assert bytes(layer.k) == np.ascontiguousarray(k).tobytes()
        assert bytes(layer.v) == np.ascontiguousarray(v).tobytes()


def test_numpy_sections_are_little_endian_row_major() -> None:
    d = small_descriptor(kv_dtype="fp32", layers=1, kv_heads=1, head_dim=2, block_tokens=2)
    k = np.array([[[1.0, 2.0]], [[3.0, 4.0]]], dtype=">f4")  # big-endian input is converted
    v = np.zeros((2, 1, 2), dtype="<f4")
    enc = c.encode([(k, v)], first_layer=0, token_count=2, descriptor=d)
    assert bytes(enc.sections[0]) == np.array([1, 2, 3, 4], dtype="<f4").tobytes()


def test_bad_section_arrays() -> None:
    d = small_descriptor(kv_dtype="fp16")
    good = np.zeros((4, 2, 8), dtype=np.float16)
    with pytest.raises(c.BadRequest, match="cannot be a fp16 section"):
        c.encode([(good.astype(np.float32), good)], first_layer=0, token_count=4, descriptor=d)
    with pytest.raises(c.BadRequest, match="C-contiguous"):
        c.encode([(np.zeros((8, 2, 4), np.float16).transpose(2, 1, 0), good)], first_layer=0, token_count=4,
                 descriptor=d)
    with pytest.raises(c.BadRequest, match="bytes-like"):
        c.encode([("text", good)], first_layer=0, token_count=4)


def test_executor_gives_the_same_digests(spec_descriptor: CompatDescriptor) -> None:
    sections = random_sections(spec_descriptor, 4, 0, 31, seed=9)
    serial = c.encode(sections, first_layer=0, token_count=4, descriptor=spec_descriptor)
    with ThreadPoolExecutor(2) as pool:
        parallel = c.encode(sections, first_layer=0, token_count=4, descriptor=spec_descriptor, executor=pool)
    assert parallel.layer_digests == serial.layer_digests


# -- incremental decoding ----------------------------------------------------------------------------------


def test_each_layer_is_yielded_as_soon_as_it_is_complete() -> None:
    d = small_descriptor()
    enc, blob = make(d)
    ends = [enc.header.size + off for off in enc.header.layer_offsets()[1:]]
    dec = c.ContainerDecoder(d, expected_layer_digests=enc.layer_digests)
    pos = 0
    for layer, end in enumerate(ends):
        assert dec.feed(blob[pos:end - 1]) == []  # one octet short of the layer: nothing yet
        got = dec.feed(blob[end - 1:end])
        assert [g.index for g in got] == [layer]
        assert got[0].digest == enc.layer_digests[layer]  # type: ignore[index]
        pos = end
    assert dec.done and dec.finish() == enc.header


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_chunking_gives_the_same_layers(data: st.DataObject) -> None:
    d = small_descriptor(layers=6)
    first = data.draw(st.integers(0, 5))
    last = data.draw(st.integers(first, 5))
    enc, blob = make(d, first, last, seed=data.draw(st.integers(0, 1000)))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(blob)), max_size=12)))
    assemble = data.draw(st.booleans())
    dec = c.ContainerDecoder(d, expected_layer_digests=[b"\x00" * 32] * first + list(enc.layer_digests or ()),
                             repr_digest=True, assemble=assemble)
    layers: list[c.DecodedLayer] = []
    for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True):
        layers += dec.feed(blob[a:b])
    dec.finish()
    if assemble:
        assert all(len(layer.k_parts) == len(layer.v_parts) == 1 for layer in layers)
    assert [layer.index for layer in layers] == list(range(first, last + 1))
    assert b"".join(bytes(layer.k) + bytes(layer.v) for layer in layers) == b"".join(
        bytes(s) for s in enc.sections)
    assert dec.repr_digest == hashlib.sha256(blob).digest()
    assert dec.layer_digests == list(enc.layer_digests or ())


def test_receive_straight_into_the_decoder_buffer() -> None:
    d = small_descriptor()
    enc, blob = make(d)
    arena = bytearray(1 << 16)
    dec = c.ContainerDecoder(d, allocate=lambda n: memoryview(arena)[:n])
    src = memoryview(blob)
    layers = []
    while len(src):
        buf = dec.get_buffer()
        n = min(len(buf), len(src), 100)
        buf[:n] = src[:n]  # what sock.recv_into(buf) would do
        src = src[n:]
        layers += dec.buffer_updated(n)
    assert len(layers) == 4 and layers[0].k.obj is not None
    assert bytes(arena[:len(blob) - enc.header.size]) == b"".join(bytes(s) for s in enc.sections)


def test_segment_mode_copies_nothing() -> None:
    d = small_descriptor()
    enc, blob = make(d)
    chunks = [blob[i:i + 100] for i in range(0, len(blob), 100)]
    dec = c.ContainerDecoder(d, assemble=False, expected_layer_digests=enc.layer_digests)
    layers = [layer for chunk in chunks for layer in dec.feed(chunk)]
    dec.finish()
    assert len(layers) == 4
    for layer in layers:
        for part in layer.k_parts + layer.v_parts:
            assert any(part.obj is chunk for chunk in chunks)  # a view of a chunk the caller fed
    assert layers[1].k_length == 128 and len(layers[1].k_parts) >= 2  # 128 octets cannot fit in one 100-chunk
    assert bytes(layers[1].k) == bytes(enc.sections[2]) and bytes(layers[3].v) == bytes(enc.sections[7])


def test_segment_mode_receive_into_fresh_buffers() -> None:
    d = small_descriptor()
    enc, blob = make(d)
    dec = c.ContainerDecoder(d, assemble=False, chunk_size=50)
    src = memoryview(blob)
    layers = []
    while len(src):
        buf = dec.get_buffer()
        if dec.header is not None:
            assert len(buf) <= 50  # data reads are bounded by chunk_size
        n = min(len(buf), len(src))
        buf[:n] = src[:n]
        src = src[n:]
        layers += dec.buffer_updated(n)
    dec.finish()
    assert b"".join(bytes(x.k) + bytes(x.v) for x in layers) == b"".join(bytes(s) for s in enc.sections)


# -- layer-range cut -------------------------------------------------------------------------------------------


def test_cut_rewrites_only_the_header() -> None:
    d = small_descriptor(layers=8)
    enc, blob = make(d, 2, 7)
    sub = c.cut(blob, 4, 5, layer_digests=[b"x" * 32] * 2 + list(enc.layer_digests or ()))
    assert sub.header.first_layer == 4 and sub.header.layer_count == 2
    assert sub.layer_digests == enc.layer_digests[2:4]  # type: ignore[index]
    assert all(s.obj is blob for s in sub.sections)  # views of the input, not copies
    _header, layers = c.decode(sub.tobytes(), d, expected_layer_digests=[b"x" * 32] * 2 + list(
        enc.layer_digests or ()))
    assert [x.index for x in layers] == [4, 5]
    assert bytes(layers[0].k) == bytes(enc.sections[4])


@pytest.mark.parametrize(("first", "last"), [(1, 3), (3, 8), (5, 4)])
def test_cut_outside_the_container_is_layers_unavailable(first: int, last: int) -> None:
    d = small_descriptor(layers=8)
    _, blob = make(d, 2, 7)
    with pytest.raises(LayersUnavailable):
        c.cut(blob, first, last)


# -- malformed input: one test per kind, each with its typed error --------------------------------------------


def patched(blob: bytes, offset: int, value: bytes) -> bytes:
    return blob[:offset] + value + blob[offset + len(value):]


def decode_both_ways(blob: bytes, d: CompatDescriptor | None, **kw: object) -> list[Exception]:
    """Decode whole, and incrementally one octet at a time in both data modes; return the errors."""
    errors: list[Exception] = []
    try:
        c.decode(blob, d, **kw)  # type: ignore[arg-type]
    except Exception as exc:
        errors.append(exc)
    for assemble in (True, False):
        dec = c.ContainerDecoder(d, assemble=assemble, **kw)  # type: ignore[arg-type]
        try:
            for i in range(len(blob)):
                dec.feed(blob[i:i + 1])
            dec.finish()
        except Exception as exc:
            errors.append(exc)
            with pytest.raises(type(exc)):  # a failed decoder stays failed
                dec.feed(b"\x00")
    return errors


@pytest.fixture
def sample() -> tuple[CompatDescriptor, bytes]:
    d = small_descriptor()
    return d, make(d, 0, 1)[1]


CASES = [
    ("bad magic", lambda b: patched(b, 0, b"KVB2"), c.BadMagic),
    ("version", lambda b: patched(b, 4, b"\x02"), c.UnsupportedVersion),
    ("flags", lambda b: patched(b, 5, b"\x80"), c.ReservedFlags),
    ("reserved codec 0", lambda b: patched(b, 6, b"\x00\x00"), c.UnknownCodec),
    ("unregistered codec", lambda b: patched(b, 6, b"\x00\x02"), c.UnknownCodec),
    ("layer count zero", lambda b: patched(b, 12, b"\x00\x00\x00\x00")[:20], c.GeometryMismatch),
    ("layers beyond descriptor", lambda b: patched(b, 8, b"\x00\x00\x00\x03"), c.GeometryMismatch),
    ("token count", lambda b: patched(b, 16, b"\x00\x00\x00\x03"), c.GeometryMismatch),
    ("section length", lambda b: patched(b, 20, (127).to_bytes(8, "big")), c.GeometryMismatch),
    ("truncated header", lambda b: b[:30], c.Truncated),
    ("truncated data", lambda b: b[:-1], c.Truncated),
    ("trailing bytes", lambda b: b + b"\x00", c.TrailingBytes),
    ("empty", lambda b: b"", c.Truncated),
]


@pytest.mark.parametrize(("name", "mutate", "error"), CASES, ids=[x[0] for x in CASES])
def test_malformed_containers(sample: tuple[CompatDescriptor, bytes], name: str, mutate, error) -> None:
    d, blob = sample
    errors = decode_both_ways(mutate(blob), d)
    assert len(errors) == 3, name
    for exc in errors:
        assert isinstance(exc, error), (name, exc)
        assert exc.status == 400 and exc.detail  # type: ignore[attr-defined]


def test_bad_magic_is_detected_from_the_first_octet() -> None:
    dec = c.ContainerDecoder()
    with pytest.raises(c.BadMagic):
        dec.feed(b"X")


def test_raw_sections_without_a_descriptor_must_be_equal_rows(sample) -> None:
    _, blob = sample
    assert c.decode(blob)[0].layer_count == 2  # fine without a descriptor
    uneven = patched(blob, 28, (8 * 64 + 1).to_bytes(8, "big"))
    assert all(isinstance(e, c.GeometryMismatch) for e in decode_both_ways(uneven, None))


def test_private_use_codec_skips_raw_geometry(sample) -> None:
    d, blob = sample
    private = patched(patched(blob, 6, b"\xff\x00"), 20, (64).to_bytes(8, "big"))
    private = private[:52 + 64] + private[52 + 128:]  # header 52 octets; layer 0 K shrinks from 128 to 64
    header, layers = c.decode(private, d)
    assert header.codec == 0xFF00 and len(layers[0].k) == 64


def test_layer_digest_mismatch(sample) -> None:
    d, blob = sample
    good = c.decode(blob, d)[1]
    expected = [layer.digest for layer in good] + [b"\x00" * 32] * 2
    corrupt = blob[:-1] + bytes([blob[-1] ^ 1])
    errors = decode_both_ways(corrupt, d, expected_layer_digests=expected)
    assert len(errors) == 3 and all(isinstance(e, c.LayerDigestMismatch) for e in errors)
    assert all(isinstance(e, DigestMismatch) and e.status == 422 for e in errors)
    assert "layer 1" in errors[0].detail  # type: ignore[attr-defined]


def test_replica_digest_mismatch(sample) -> None:
    d, blob = sample
    errors = decode_both_ways(blob, d, expected_replica_digest=b"\x01" * 32)
    assert len(errors) == 3 and all(isinstance(e, c.LayerDigestMismatch) for e in errors)


def test_too_few_expected_digests(sample) -> None:
    d, blob = sample
    with pytest.raises(c.GeometryMismatch, match="layer digests"):
        c.decode(blob, d, expected_layer_digests=[b"\x00" * 32])


def test_decoder_limits() -> None:
    huge = c.ContainerHeader(codec=1, first_layer=0, token_count=1, lengths=((1 << 40, 1 << 40),)).pack()
    with pytest.raises(c.ContainerError, match="exceeds the limit"):
        c.ContainerDecoder().feed(huge)
    many = patched(huge, 12, (1 << 20).to_bytes(4, "big"))[:20]
    with pytest.raises(c.GeometryMismatch, match="layer count"):
        c.ContainerDecoder().feed(many)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_arbitrary_octets_only_raise_container_errors(data: bytes, chunk: int) -> None:
    d = small_descriptor(kv_heads=1, head_dim=2)
    blob = b"KVB1\x01\x00\x00\x01" + data if data[:1] == b"\x00" else data  # steer half the cases past the magic
    dec = c.ContainerDecoder(d, assemble=chunk % 2 == 0)
    try:
        for i in range(0, len(blob), chunk):
            dec.feed(blob[i:i + chunk])
        dec.finish()
    except (c.ContainerError, DigestMismatch):
        pass
    with contextlib.suppress(c.ContainerError, DigestMismatch):
        c.decode(blob, d)
