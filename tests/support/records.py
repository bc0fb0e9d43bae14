"""The KVSP draft's example records (with its placeholders filled in), as JSON objects."""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

from kvsp_quic import records as r

COMPAT, SCOPE = "cd" * 32, "ef" * 16


def layer_digests(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([i])).digest() for i in range(n)]


def replica_json(**changes: Any) -> dict[str, Any]:
    ld = layer_digests(32)
    obj = {
        "block_key": "ab" * 32, "compat_id": COMPAT, "scope_id": SCOPE, "holder": "https://h1.example/kvsp/",
        "codec": 1, "size": 2097152, "digest": "sha-256:" + hashlib.sha256(b"".join(ld)).hexdigest(),
        "layer_digests": [d.hex() for d in ld],
        "residency": [{"tier": "device", "layers": [0, 15]},
                      {"tier": "host", "layers": [16, 31], "read_mbit_per_s": 400000}],
        "ttl_ms": 600000,
    }
    obj.update(changes)
    return obj


# The spec's example objects (with its placeholders filled in), each must parse and dump back unchanged.
SPEC_EXAMPLES: list[tuple[type[r.Record], dict[str, Any]]] = [
    (r.ReplicaRecord, replica_json()),
    (r.InstanceStatusRecord, {
        "instance": "https://ii7.example/kvsp/", "epoch": 12, "state": "active", "running": 18, "queued": 3,
        "batch_size": 32, "kv_utilization": 0.71, "prefill_tokens_per_s": 42000, "decode_tokens_per_s": 3100,
        "links": [{"holder": "https://h1.example/kvsp/", "mbit_per_s": 200000, "rtt_us": 12}],
        "requested_state": None, "ttl_ms": 3000}),
    (r.SessionCheckpoint, {
        "session": "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11", "epoch": 1, "compat_id": COMPAT, "scope_id": SCOPE,
        "prompt_blocks": ["11" * 32, "22" * 32], "prompt_tail": [374, 264], "generated": [1296, 315, 279],
        "output_offset": 3,
        "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": 3, "deterministic": False}}),
    (r.ShardMap, {"map": "c3f8e1", "version": 4, "shards": [
        {"tokens": [0, 32768], "instance": "https://ii1.example/kvsp/"},
        {"tokens": [32768, 65536], "instance": "https://ii2.example/kvsp/"},
        {"tokens": [65536, 98304], "instance": "https://ii3.example/kvsp/"}]}),
    (r.ReshardPlan, {"map": "c3f8e1", "from": 4, "to": 5, "deadline_ms": 200, "retain": [[0, 32768]],
                     "fetch": [{"tokens": [32768, 49152], "from": "https://ii2.example/kvsp/"}], "release": []}),
    (r.PrefetchDirective, {
        "directive": "a2b7c9e0-1f3d-4c1a-8f5b-6d2e9a7c3b10", "request_ref": "opaque-value-from-PC",
        "scope_id": SCOPE, "compat_id": COMPAT,
        "blocks": [{"block_key": "ab" * 32, "sources": ["https://h1.example/kvsp/"]}],
        "layer_order": "ascending", "deadline_ms": 50, "lease_ms": 2000}),
    (r.LookupRequest, {"scope_id": SCOPE, "compat_id": COMPAT, "block_keys": ["ab" * 32, "cd" * 32],
                       "targets": ["https://ii7.example/kvsp/", "https://ii9.example/kvsp/"]}),
    (r.LookupResponse, {"matched": 1, "blocks": [{"block_key": "ab" * 32, "replicas": [replica_json()]}],
                        "targets": [{"instance": "https://ii7.example/kvsp/", "fetch_us": 5, "recompute_us": 9}]}),
    (r.LeaseRequest, {"compat_id": COMPAT, "scope_id": SCOPE, "block_keys": ["ab" * 32], "ttl_ms": 2000}),
    (r.LeaseResponse, {"lease": str(uuid.UUID(int=5)), "ttl_ms": 2000, "block_keys": ["ab" * 32]}),
    (r.LeaseRenewal, {"ttl_ms": 1000}),
    (r.PrefetchStatus, {"directive": str(uuid.UUID(int=6)), "state": "partial", "loaded": ["ab" * 32]}),
    (r.StateMessage, {"state": "draining"}),
    (r.CheckpointAck, {"session": str(uuid.UUID(int=7)), "epoch": 2, "output_offset": 64}),
    (r.ReshardCommit, {"map": "c3f8e1", "commit": 5}),
    (r.ReshardAbort, {"map": "c3f8e1", "abort": 5}),
]
