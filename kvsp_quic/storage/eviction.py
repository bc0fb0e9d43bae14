"""Eviction policies of a holder's storage tiers (``kvsp_quic.storage.tiers``): each orders one tier's blocks as
eviction candidates, chosen by name from :data:`EVICTION_POLICIES`.

The default, :class:`PrefixPolicy` (``"prefix"``), is prefix-aware: a block is worth keeping only with the blocks
before it (spec, "Block Keys": K[i] covers K[i-1]; a lookup stops at the first key without a replica), so the
deepest blocks of the coldest chains go first and what remains of a chain is always a leading run. A block's place
in its chain is what its producer declared when storing it (:class:`ChainPosition`; docs/wire.md, "Holder"):
Block Keys are an HMAC chain under the scope key and the container header carries no position, so the holder
cannot derive it. ``lru``, ``fifo`` and ``lfu`` stay selectable by name.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable, Iterator
from typing import NamedTuple, Protocol

from kvsp_quic.policy_registry import PolicyRegistry


class BlockId(NamedTuple):
    """A stored block's identity: Compatibility ID (32 octets), Scope ID (16), Block Key (32)."""

    compat_id: bytes
    scope_id: bytes
    block_key: bytes

    def __str__(self) -> str:
        return f"{self.compat_id.hex()[:8]}/{self.scope_id.hex()[:8]}/{self.block_key.hex()}"


class ChainPosition(NamedTuple):
    """Where a block sits in its token sequence, as the client that stored it declared it (``PUT
    blocks/...?chain=<hex32>&position=<i>``, docs/wire.md "Holder"): the Block Key of block 0 of the sequence
    (K[0]) and the block's index i (it is K[i]). Blocks of one Compatibility ID and scope that share K[0] form one
    chain (a tree, when sequences share a prefix and then differ)."""

    chain: bytes  # 32 octets: K[0]
    position: int  # i

    def to_text(self) -> str:
        return f"{self.chain.hex()}:{self.position}"

    @classmethod
    def from_text(cls, text: str) -> ChainPosition:
        chain, sep, position = text.partition(":")
        if not sep or len(chain) != 64 or not position.isdigit():
            raise ValueError(f"not a chain position: {text!r}")
        return cls(bytes.fromhex(chain), int(position))


class EvictionPolicy(Protocol):
    """Orders one tier's blocks as eviction candidates. Told about every insertion, read and removal.

    ``inserted`` is called with the block alone when its chain position is unknown, and with its
    :class:`ChainPosition` as a second argument otherwise; a policy that ignores chains may omit the parameter
    only if no block is ever stored with a position."""

    def inserted(self, block: BlockId, position: ChainPosition | None = None) -> None: ...

    def accessed(self, block: BlockId) -> None: ...

    def removed(self, block: BlockId) -> None: ...

    def victims(self) -> Iterator[BlockId]:
        """Every block of the tier, the best victim first. The caller does not change the tier while iterating."""
        ...


class LruPolicy:
    """Least recently used (inserted or read) first."""

    def __init__(self) -> None:
        self._order: collections.OrderedDict[BlockId, None] = collections.OrderedDict()

    def inserted(self, block: BlockId, position: ChainPosition | None = None) -> None:
        self._order[block] = None
        self._order.move_to_end(block)

    def accessed(self, block: BlockId) -> None:
        if block in self._order:
            self._order.move_to_end(block)

    def removed(self, block: BlockId) -> None:
        self._order.pop(block, None)

    def victims(self) -> Iterator[BlockId]:
        return iter(self._order)


class FifoPolicy(LruPolicy):
    """First in, first out: reads do not change the order."""

    def accessed(self, block: BlockId) -> None:
        pass


class LfuPolicy:
    """Least frequently read first; ties go to the block inserted first."""

    def __init__(self) -> None:
        self._counts: dict[BlockId, int] = {}

    def inserted(self, block: BlockId, position: ChainPosition | None = None) -> None:
        self._counts.pop(block, None)
        self._counts[block] = 0

    def accessed(self, block: BlockId) -> None:
        if block in self._counts:
            self._counts[block] += 1

    def removed(self, block: BlockId) -> None:
        self._counts.pop(block, None)

    def victims(self) -> Iterator[BlockId]:
        order = {b: i for i, b in enumerate(self._counts)}
        return iter(sorted(self._counts, key=lambda b: (self._counts[b], order[b])))


class _Chain:
    """The blocks of one chain in a tier, deepest first (ties: the one inserted first)."""

    __slots__ = ("blocks", "keys", "seq")

    def __init__(self) -> None:
        self.keys: list[tuple[int, int]] = []  # (-position, insertion number), ascending
        self.blocks: list[BlockId] = []  # in the order of keys
        self.seq = 0


class PrefixPolicy:
    """Prefix-aware eviction: chains from the coldest (least recently stored or read, any block of the chain
    counting for the whole chain) to the hottest; within a chain, the deepest block first. Evicting in this order
    only ever takes the last block a chain has left, so what remains of every chain is a leading run.

    A chain is the blocks of one Compatibility ID and scope whose declared :class:`ChainPosition` names the same
    K[0]; a block stored without a position is a chain of its own (among such blocks the order is LRU)."""

    def __init__(self) -> None:
        self._chains: collections.OrderedDict[BlockId, _Chain] = collections.OrderedDict()  # coldest first
        self._where: dict[BlockId, tuple[BlockId, tuple[int, int]]] = {}  # block -> (its chain, its key there)

    def inserted(self, block: BlockId, position: ChainPosition | None = None) -> None:
        self.removed(block)
        if position is None:
            chain_id, depth = block, 0
        else:
            chain_id, depth = BlockId(block.compat_id, block.scope_id, bytes(position.chain)), position.position
        chain = self._chains.get(chain_id)
        if chain is None:
            chain = self._chains[chain_id] = _Chain()
        key = (-depth, chain.seq)
        chain.seq += 1
        i = bisect.bisect_left(chain.keys, key)
        chain.keys.insert(i, key)
        chain.blocks.insert(i, block)
        self._where[block] = (chain_id, key)
        self._chains.move_to_end(chain_id)

    def accessed(self, block: BlockId) -> None:
        where = self._where.get(block)
        if where is not None:
            self._chains.move_to_end(where[0])

    def removed(self, block: BlockId) -> None:
        where = self._where.pop(block, None)
        if where is None:
            return
        chain_id, key = where
        chain = self._chains[chain_id]
        i = bisect.bisect_left(chain.keys, key)
        del chain.keys[i], chain.blocks[i]
        if not chain.blocks:
            del self._chains[chain_id]

    def victims(self) -> Iterator[BlockId]:
        for chain in self._chains.values():
            yield from chain.blocks


EVICTION_POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "prefix": PrefixPolicy, "lru": LruPolicy, "fifo": FifoPolicy, "lfu": LfuPolicy,
}
_EVICTION = PolicyRegistry("eviction", EVICTION_POLICIES)


def register_eviction_policy(name: str, factory: Callable[[], EvictionPolicy]) -> None:
    """Make a policy available by *name* (lowercase) to configurations."""
    _EVICTION.register(name, factory)


def eviction_policy(name: str) -> EvictionPolicy:
    """A new instance of the policy registered as *name*; ``ValueError`` naming the known ones otherwise."""
    return _EVICTION.create(name)


__all__ = [
    "EVICTION_POLICIES", "BlockId", "ChainPosition", "EvictionPolicy", "FifoPolicy", "LfuPolicy", "LruPolicy",
    "PrefixPolicy", "eviction_policy", "register_eviction_policy",
]
