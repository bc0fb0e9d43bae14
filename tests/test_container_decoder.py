"""ContainerDecoder as a receive sink in segment mode (``assemble=False``), the mode the retrieval client's lean
HTTP/1.1 path delivers into (issue 16): a buffer handed out and only partly filled is handed out again for the next
octets, so small deliveries (``copy_into`` of small chunks) fill one buffer and never a layer's octets twice."""

from __future__ import annotations

import pytest

from http3.body_sink import copy_into
from kvsp_quic import container as c
from tests.support.descriptors import small_descriptor


def make(layers: int = 4) -> tuple[c.EncodedContainer, bytes]:
    d = small_descriptor(layers=layers)
    sections = [(bytes([i]) * d.section_length(d.block_tokens), bytes([100 + i]) * d.section_length(d.block_tokens))
                for i in range(layers)]
    enc = c.encode(sections, first_layer=0, token_count=d.block_tokens, descriptor=d)
    return enc, enc.tobytes()


def test_small_deliveries_fill_one_fresh_buffer_and_layers_keep_their_octets() -> None:
    enc, blob = make()
    d = small_descriptor()
    dec = c.ContainerDecoder(d, assemble=False, chunk_size=1 << 20, expected_layer_digests=enc.layer_digests)
    layers: list[c.DecodedLayer] = []
    handed: list[memoryview] = []
    for i in range(0, len(blob), 7):  # 7-octet deliveries, as a transport copying small chunks would make
        piece = memoryview(blob)[i:i + 7]
        while len(piece):
            buf = dec.get_buffer(len(piece))
            if dec.header is not None:
                handed.append(buf)
            n = min(len(buf), len(piece))
            buf[:n] = piece[:n]
            piece = piece[n:]
            layers += dec.buffer_updated(n)
            if len(layers) < 4 and dec.header is not None:
                dec.get_buffer()[:1] = b"\xff"  # scribble on what comes next: it must not be a delivered octet
    dec.finish()
    assert dec.done and [layer.index for layer in layers] == [0, 1, 2, 3]
    assert {id(part.obj) for layer in layers for part in layer.k_parts + layer.v_parts} == {id(handed[0].obj)}
    assert all(len(layer.k_parts) == 1 and len(layer.v_parts) == 1 for layer in layers)  # one buffer: one part each
    for layer, (k, v) in zip(layers, zip(enc.sections[::2], enc.sections[1::2], strict=True), strict=True):
        assert bytes(layer.k) == bytes(k) and bytes(layer.v) == bytes(v)


def test_the_same_chunks_through_copy_into_and_feed_give_the_same_layers() -> None:
    enc, blob = make(8)
    d = small_descriptor(layers=8)
    fed = c.ContainerDecoder(d, assemble=False, expected_layer_digests=enc.layer_digests)
    sunk = c.ContainerDecoder(d, assemble=False, expected_layer_digests=enc.layer_digests, chunk_size=100)
    chunks = [blob[i:i + 33] for i in range(0, len(blob), 33)]
    a = [layer for chunk in chunks for layer in fed.feed(chunk)]
    b: list[c.DecodedLayer] = []
    for chunk in chunks:
        src = memoryview(chunk)
        while len(src):  # copy_into, keeping the layers each delivery completes
            room = sunk.get_buffer(len(src))
            take = min(len(room), len(src))
            room[:take] = src[:take]
            src = src[take:]
            b += sunk.buffer_updated(take)
    assert fed.finish() == sunk.finish()
    assert [(x.index, bytes(x.k), bytes(x.v), x.digest) for x in a] == \
        [(x.index, bytes(x.k), bytes(x.v), x.digest) for x in b]
    assert all(len(part) <= 100 for x in b for part in x.k_parts + x.v_parts)  # bounded by chunk_size


def done(dec: c.ContainerDecoder) -> bool:
    return dec.done


@pytest.mark.parametrize("assemble", [True, False])
def test_done_and_trailing_octets(assemble: bool) -> None:
    enc, blob = make()
    dec = c.ContainerDecoder(small_descriptor(), assemble=assemble)
    assert not done(dec)
    n = copy_into(dec, blob[:-1])
    assert n == len(blob) - 1 and not done(dec)
    copy_into(dec, blob[-1:])
    assert done(dec) and dec.finish() == enc.header
    with pytest.raises(c.TrailingBytes):
        copy_into(dec, b"x")
    with pytest.raises(c.TrailingBytes):  # the failure sticks
        dec.finish()
