"""What a holder checks of a request before it touches its store, shared by the holder
(:mod:`kvsp_quic.roles.holder`) and its worker processes (:mod:`kvsp_quic.roles.holder_worker`): the PUT
preconditions and the layer range a PUT stores, the descriptor of a Compatibility ID, the layer range and codec of
a GET, and the query parameters (``layers``, ``codec``, ``chain`` / ``position``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvsp_quic.auth import Principal, require_scope
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import GeometryMismatch
from kvsp_quic.problems import BadRequest, Incompatible, LayersUnavailable, NotAcceptable, PreconditionRequired
from kvsp_quic.storage.tiers import BlockId, BlockMeta, ChainPosition


def descriptor_of(descriptors: Mapping[bytes, CompatDescriptor], compat_id: bytes) -> CompatDescriptor:
    """The descriptor this holder serves for *compat_id* (409 ``kvsp-incompatible`` when none)."""
    d = descriptors.get(bytes(compat_id))
    if d is None:
        raise Incompatible(f"this holder serves no cache with Compatibility ID {bytes(compat_id).hex()}")
    return d


def check_put(principal: Principal, descriptor_of: Callable[[bytes], CompatDescriptor], compat_id: bytes,
              scope_id: bytes, block_key: bytes, if_none_match: str | None) -> tuple[BlockId, CompatDescriptor]:
    """The checks of a PUT before its body is read, in the order that leaks nothing: the precondition (428), the
    scope (403), the Compatibility ID (409). The holder and its worker processes check existence (412) after."""
    if if_none_match is None or if_none_match.strip() != "*":
        raise PreconditionRequired("storing a block requires If-None-Match: * (blocks are never replaced)")
    require_scope(principal, scope_id)
    descriptor = descriptor_of(compat_id)
    return BlockId(bytes(compat_id), bytes(scope_id), bytes(block_key)), descriptor


def layer_range(meta: BlockMeta, layers: tuple[int, int] | None, codec: int | None) -> tuple[int, int]:
    """The inclusive layer range a read of the block *meta* serves: the codec must be the stored one (406: no
    transcoding), the range inside the layers the replica holds (404 ``kvsp-layers-unavailable``; spec, "Block
    Retrieval and Storage": "a holder that does not hold those layers returns 404"). Without *layers*, the
    stored container: every layer of a complete block, the stored range of a partial replica (it is the
    replica)."""
    if codec is not None and codec != meta.header.codec:
        raise NotAcceptable(f"the replica is stored with codec {meta.header.codec}; this holder does not transcode")
    held = meta.header.first_layer, meta.header.last_layer
    first, last = layers if layers is not None else held
    if first > last:
        raise BadRequest(f"layers {first}-{last}: the first layer is after the last")
    if first < held[0] or last > held[1]:
        raise LayersUnavailable(f"layers {first}-{last} requested; the replica holds layers {held[0]}-{held[1]}")
    return first, last


def check_stored_range(held: tuple[int, int], declared: tuple[int, int] | None) -> None:
    """A PUT stores the inclusive layer range *held* its container's header names (First Layer, Layer Count;
    checked against the descriptor's layers by the decoder): a complete block or any range of its layers (issue
    13). A PUT that names the range too (``?layers=a-b``, optional) must name exactly those layers (else 400)."""
    if declared is not None and declared != held:
        raise GeometryMismatch(f"layers={declared[0]}-{declared[1]} was declared; the container holds layers "
                               f"{held[0]}-{held[1]}")


def parse_layers(text: str) -> tuple[int, int]:
    """The ``layers=a-b`` query parameter: decimal integers without signs or leading zeros, a <= b."""
    first, sep, last = text.partition("-")
    if not sep or not _is_decimal(first) or not _is_decimal(last):
        raise BadRequest(f"layers={text!r}: expected a-b, two decimal layer numbers")
    a, b = int(first), int(last)
    if a > b:
        raise BadRequest(f"layers={text}: the first layer is after the last")
    return a, b


def parse_position(query: dict[str, str], block_key: bytes) -> ChainPosition | None:
    """``chain=<hex32>&position=<i>`` of a block PUT (both or neither): K[0] of the block's token sequence and its
    index i; at position 0 the chain is the block's own key. Anything else is 400."""
    chain, position = query.get("chain"), query.get("position")
    if chain is None and position is None:
        return None
    if chain is None or position is None:
        raise BadRequest("chain and position go together: the Block Key of block 0 and the block's index")
    if len(chain) != 64 or any(ch not in "0123456789abcdef" for ch in chain):
        raise BadRequest(f"chain={chain!r}: expected a Block Key (hex32, lowercase)")
    if not _is_decimal(position) or int(position) > 0xFFFFFFFF:
        raise BadRequest(f"position={position!r}: expected a block index 0-4294967295")
    declared = ChainPosition(bytes.fromhex(chain), int(position))
    if declared.position == 0 and declared.chain != bytes(block_key):
        raise BadRequest("position=0: the chain is named by block 0's own key, which this block's is not")
    return declared


def parse_codec(text: str) -> int:
    if not _is_decimal(text) or int(text) > 0xFFFF or int(text) == 0:
        raise BadRequest(f"codec={text!r}: expected a codec number 1-65535")
    return int(text)


def _is_decimal(text: str) -> bool:
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0")) and len(text) <= 10


__all__ = ["check_put", "check_stored_range", "descriptor_of", "layer_range", "parse_codec", "parse_layers",
           "parse_position"]
