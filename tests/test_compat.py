from __future__ import annotations

import hashlib
import json

import pytest

from kvsp_quic.compat import (
    ELEMENT_TYPES,
    CompatDescriptor,
    DescriptorError,
    model_digest,
    parse_positional,
    tokenizer_digest,
    weight_files,
)
from tests import vectors


def test_canonical_json_matches_the_spec_vector(spec_descriptor: CompatDescriptor) -> None:
    assert spec_descriptor.canonical_json() == vectors.CANONICAL_JSON


def test_compat_id_matches_the_spec_vector(spec_descriptor: CompatDescriptor) -> None:
    assert spec_descriptor.compat_id.hex() == vectors.COMPAT_ID


def test_compat_id_is_independent_of_member_order_and_whitespace() -> None:
    shuffled = json.dumps(dict(reversed(list(vectors.DESCRIPTOR.items()))), indent=3)
    assert CompatDescriptor.loads(shuffled).compat_id.hex() == vectors.COMPAT_ID


def test_round_trip_and_construction_in_code(spec_descriptor: CompatDescriptor) -> None:
    assert CompatDescriptor.from_json(spec_descriptor.to_json()) == spec_descriptor
    built = CompatDescriptor(model="example-model", model_digest=vectors.DESCRIPTOR["model_digest"],
                             tokenizer_digest=vectors.DESCRIPTOR["tokenizer_digest"], layers=32, kv_heads=8,
                             head_dim=128, kv_dtype="bf16", positional="rope", block_tokens=4)
    assert built.compat_id.hex() == vectors.COMPAT_ID


def test_adapters_change_the_id_and_keep_their_order() -> None:
    a, b = "sha-256:" + "1" * 64, "sha-256:" + "2" * 64
    ab = CompatDescriptor.from_json(dict(vectors.DESCRIPTOR, adapters=[a, b]))
    ba = CompatDescriptor.from_json(dict(vectors.DESCRIPTOR, adapters=[b, a]))
    assert ab.adapters == (a, b)
    assert len({ab.compat_id, ba.compat_id, CompatDescriptor.from_json(vectors.DESCRIPTOR).compat_id}) == 3


def test_unknown_members_are_kept_in_the_identity() -> None:
    extended = CompatDescriptor.from_json(dict(vectors.DESCRIPTOR, x_quant="awq"))
    assert extended.extensions == {"x_quant": "awq"}
    assert extended.compat_id.hex() != vectors.COMPAT_ID
    assert CompatDescriptor.from_json(extended.to_json()) == extended


def test_geometry_helpers(spec_descriptor: CompatDescriptor) -> None:
    assert spec_descriptor.section_length(4) == 8192  # the spec: 4 tokens x 8 heads x 128 x 2 octets
    assert spec_descriptor.block_layer_length() == 16384
    assert {name: e.size for name, e in ELEMENT_TYPES.items()} == {
        "bf16": 2, "fp16": 2, "fp32": 4, "fp8-e4m3": 1, "fp8-e5m2": 1}


BAD = [
    ({"model": None}, "model"),
    ({"model": ""}, "model: must not be empty"),
    ({"model_digest": "sha-256:" + "A" * 64}, "model_digest"),
    ({"model_digest": "sha-512:" + "a" * 64}, "model_digest: must start with"),
    ({"tokenizer_digest": "sha-256:abc"}, "tokenizer_digest"),
    ({"adapters": []}, "adapters: must be absent"),
    ({"adapters": ["sha-256:zz"]}, "adapters[0]"),
    ({"adapters": "sha-256:" + "a" * 64}, "adapters: must be an array"),
    ({"layers": 0}, "layers: must be >= 1"),
    ({"layers": True}, "layers: must be an integer"),
    ({"kv_heads": 2.0}, "kv_heads: must be an integer"),
    ({"head_dim": -1}, "head_dim"),
    ({"block_tokens": 1 << 32}, "block_tokens: must be <="),
    ({"kv_dtype": "int8"}, "Element Types registry"),
    ({"positional": "alibi"}, "Positional Encodings registry"),
    ({"positional": "rope;"}, "must be followed by parameters"),
    ({"positional": "rope;theta=0500000"}, "invalid value"),
    ({"positional": "rope;scaling=yarn,theta=5"}, "in the order"),
    ({"positional": "rope;theta=5,theta=6"}, "in the order"),
    ({"positional": "rope;base=5"}, "unknown parameter"),
    ({"positional": "none;theta=5"}, "takes no parameters"),
    ({"layout": "kvsp-layout-2"}, "layout"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_invalid_members_are_rejected_with_a_typed_error(change: dict[str, object], message: str) -> None:
    obj = dict(vectors.DESCRIPTOR)
    for key, value in change.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    with pytest.raises(DescriptorError) as info:
        CompatDescriptor.from_json(obj)
    assert message in info.value.detail
    assert info.value.status == 400


def test_constructor_validates_too() -> None:
    with pytest.raises(DescriptorError, match="adapters"):
        CompatDescriptor(**{**CompatDescriptor.from_json(vectors.DESCRIPTOR).__dict__, "adapters": ()})


@pytest.mark.parametrize("text", ["rope", "none", "rope;theta=500000", "rope;theta=500000,scaling=yarn",
                                  "rope;scaling=llama3"])
def test_registered_positional_syntax_is_accepted(text: str) -> None:
    name, params = parse_positional(text)
    assert name == text.split(";")[0]
    assert CompatDescriptor.from_json(dict(vectors.DESCRIPTOR, positional=text)).positional == text
    if "theta" in text:
        assert params["theta"] == "500000"


def test_bad_json_and_missing_file(tmp_path) -> None:
    with pytest.raises(DescriptorError, match="not valid JSON"):
        CompatDescriptor.loads(b"{")
    with pytest.raises(DescriptorError, match="duplicate member"):
        CompatDescriptor.loads(b'{"model": "a", "model": "b"}')
    with pytest.raises(DescriptorError, match="cannot read descriptor"):
        CompatDescriptor.load(tmp_path / "nope.json")


def test_model_digest_concatenates_files_in_byte_order_of_names(tmp_path) -> None:
    # "B" (0x42) sorts before "a" (0x61) in byte order, unlike a case-insensitive sort.
    files = {"a.safetensors": b"first-" * 1000, "B.safetensors": b"second" * 300_000, "notes.txt": b"ignored"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    expected = hashlib.sha256(files["B.safetensors"] + files["a.safetensors"]).hexdigest()
    assert [p.name for p in weight_files(tmp_path)] == ["B.safetensors", "a.safetensors"]
    assert model_digest(tmp_path) == "sha-256:" + expected
    tok = tmp_path / "tokenizer.json"
    tok.write_bytes(b'{"model": {}}')
    assert tokenizer_digest(tok) == "sha-256:" + hashlib.sha256(b'{"model": {}}').hexdigest()


def test_model_digest_errors(tmp_path) -> None:
    with pytest.raises(DescriptorError, match="no weight files"):
        model_digest(tmp_path)
    with pytest.raises(DescriptorError, match="does not exist"):
        model_digest(tmp_path / "missing")
    with pytest.raises(DescriptorError, match="cannot read"):
        tokenizer_digest(tmp_path / "missing.json")
