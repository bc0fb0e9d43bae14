"""kvsp_quic.cost: the spec's Placement Inputs, each checked against numbers computed by hand."""

from __future__ import annotations

import hashlib

import pytest

from kvsp_quic import cost
from kvsp_quic.compat import InstanceState
from kvsp_quic.records import InstanceStatusRecord, Link, ReplicaRecord, ResidencyEntry, TargetEstimate

T = "https://ii7.example/kvsp/"
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
H3 = "https://h3.example/kvsp/"
LINKS = (Link(H1, 200_000, 12), Link(H2, 100_000, 5))  # no link to H3
MB2 = 2_000_000  # octets of a full 32-layer replica


def replica(holder: str, *residency: ResidencyEntry, size: int = MB2, key: int = 0,
            layer_digests: int | None = None) -> ReplicaRecord:
    digests = tuple(bytes([i]) * 32 for i in range(layer_digests)) if layer_digests else None
    digest = hashlib.sha256(b"".join(digests)).digest() if digests else bytes(32)
    return ReplicaRecord(bytes([key]) * 32, bytes(32), bytes(16), holder, 1, size, digest,  # type: ignore[arg-type]
                         residency or (ResidencyEntry("device", (0, 31)),), 60_000, digests)


def status(links: tuple[Link, ...] = LINKS, prefill: float | None = 42_000, queued: int = 0) -> InstanceStatusRecord:
    return InstanceStatusRecord(T, 1, InstanceState.ACTIVE, 3000, queued=queued, prefill_tokens_per_s=prefill,
                                links=links)


# -- the formulas -------------------------------------------------------------------------------------------------


def test_transfer_recompute_wait_cost() -> None:
    assert cost.transfer_us(2_000_000, 200_000) == 80.0  # 16e6 bits at 200000 bits/us
    assert cost.recompute_us(32, 42_000) == pytest.approx(761.9047619)  # 1e6 * 32 / 42000
    assert cost.wait_us(3, 1500.0) == 4500.0
    assert cost.cost_us(4500, 165, 1000, 762) == 5262  # 4500 + min(165 + 1000, 762)
    assert cost.cost_us(0, 100, 200, 1000) == 300  # fetching wins
    with pytest.raises(ValueError):
        cost.recompute_us(1, 0)
    with pytest.raises(ValueError):
        cost.transfer_us(1, 0)


def test_one_block_one_source() -> None:
    plan = cost.plan_fetch(T, LINKS, [[replica(H1)]])
    assert plan.fetch_us == 92.0  # 12 + 8 * 2e6 / 200000
    assert plan.blocks == 1 and plan.bytes_from == {H1: MB2} and plan.sources == [[H1]]


def test_rtt_is_paid_once_per_source() -> None:
    plan = cost.plan_fetch(T, LINKS, [[replica(H1, key=0)], [replica(H1, key=1)]])
    assert plan.fetch_us == 172.0  # 12 + 80 + 80


def test_blocks_spread_over_sources_greedily() -> None:
    both = [replica(H1), replica(H2)]
    plan = cost.plan_fetch(T, LINKS, [both, both])
    # block 0: H1 finishes at 92, H2 at 5 + 160 = 165 -> H1; block 1: H1 at 172, H2 at 165 -> H2
    assert plan.sources == [[H1], [H2]]
    assert plan.finish_us == {H1: 92.0, H2: 165.0}
    assert plan.fetch_us == 165.0


def test_storage_tier_reduces_the_rate() -> None:
    r = replica(H1, ResidencyEntry("device", (0, 15)), ResidencyEntry("local-storage", (16, 31), 40_000))
    # 62500 octets per layer: 1e6 octets at 200000 (40 us) + 1e6 octets at min(200000, 40000) (200 us) + RTT 12
    assert cost.plan_fetch(T, LINKS, [[r]]).fetch_us == 252.0


def test_a_read_rate_above_the_link_does_not_raise_it() -> None:
    r = replica(H1, ResidencyEntry("device", (0, 15)), ResidencyEntry("host", (16, 31), 400_000))
    assert cost.plan_fetch(T, LINKS, [[r]]).fetch_us == 92.0
    entry = ResidencyEntry("remote-storage", (0, 1))  # a storage tier without a stated rate: the link
    assert cost.entry_rate(entry, 200_000) == 200_000


def test_layers_resident_at_the_target_are_not_fetched() -> None:
    local = replica(T, ResidencyEntry("host", (0, 15)), size=1_000_000)
    plan = cost.plan_fetch(T, LINKS, [[local, replica(H1)]])
    assert plan.fetch_us == 52.0  # layers 16-31 only: 1e6 octets -> 12 + 40
    assert plan.bytes_from == {H1: 1_000_000}
    whole = cost.plan_fetch(T, LINKS, [[replica(T), replica(H1)]])
    assert whole.fetch_us == 0.0 and whole.blocks == 1 and whole.sources == [[]]


def test_a_block_split_over_two_partial_replicas() -> None:
    low = replica(H1, ResidencyEntry("device", (0, 15)), size=1_000_000)
    high = replica(H2, ResidencyEntry("device", (16, 31)), size=1_000_000)
    plan = cost.plan_fetch(T, LINKS, [[low, high]], layers=32)
    # no single source holds all 32 layers: H1 (16 layers, done at 52) then H2 (16 layers, 5 + 80 = 85)
    assert plan.sources == [[H1, H2]]
    assert plan.fetch_us == 85.0


def test_unusable_sources_end_the_fetchable_prefix() -> None:
    blocks = [[replica(H1, key=0)], [replica(H3, key=1)], [replica(H1, key=2)]]
    plan = cost.plan_fetch(T, LINKS, blocks)
    assert plan.blocks == 1 and plan.fetch_us == 92.0
    est = cost.estimate(T, status(), blocks, block_tokens=16)
    # fetch_us: 92 + recompute of blocks 1-2 (32 tokens: 761.9) = 853.9 -> 854; recompute of 48 tokens: 1142.9
    assert est == TargetEstimate(T, 854, 1143)
    partial = cost.plan_fetch(T, LINKS, [[replica(H1, ResidencyEntry("device", (0, 15)))]], layers=32)
    assert partial.blocks == 0  # layers 16-31 are nowhere


def test_estimate() -> None:
    both = [replica(H1), replica(H2)]
    assert cost.estimate(T, status(), [both, both], block_tokens=16) == TargetEstimate(T, 165, 762)
    assert cost.estimate(T, status(), [], block_tokens=16) == TargetEstimate(T, 0, 0)
    assert cost.estimate(T, status(prefill=None), [both], block_tokens=16) is None
    assert cost.estimate(T, status(prefill=0), [both], block_tokens=16) is None
    assert cost.estimate(T, status(links=()), [both], block_tokens=16) == TargetEstimate(T, 381, 381)


def test_layer_count_of_a_block() -> None:
    assert cost.block_layer_count([replica(H1, ResidencyEntry("device", (0, 1)), layer_digests=4)]) == 4
    assert cost.block_layer_count([replica(H1, ResidencyEntry("device", (2, 5)))]) == 6
    assert cost.block_layer_count([replica(H1)], layers=40) == 40
    assert cost.held_layers(replica(H1, ResidencyEntry("device", (0, 3)), ResidencyEntry("host", (8, 9)))) == 6


def test_bytes_scale_with_the_layers_needed() -> None:
    r = replica(H1, ResidencyEntry("device", (0, 3)), size=4000)
    octets, us, covered = cost.part_cost(r, {1, 2}, Link(H1, 1000, 0))
    assert (octets, us, covered) == (2000.0, 16.0, {1, 2})  # 1000 octets per layer; 16000 bits at 1000 bits/us
