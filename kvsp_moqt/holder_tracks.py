"""The KVSP mapping over the asyncio adapter: a holder serving its replicas as MOQT tracks, and the client that
fetches a replica's layers and verifies each as it arrives. Names and rules: :mod:`kvsp_moqt.tracks`; docs/moqt.md
("KVSP over MOQT").

Holder side (next to ``holder_app`` on the same RoleServer, hence the same UDP port and mutual TLS)::

    server = RoleServer(holder_app(holder, policy), files, quic_handlers=holder_moqt_handlers(holder, policy))

Client side::

    async with MoqtPool(files) as pool:
        async for layer in fetch_replica(pool, record, layers=(0, 15), descriptor=d):   # record: moqt:// holder
            place(layer.index, layer.k_parts, layer.v_parts)                            # verified, ascending
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator, Sequence

from kvsp_moqt.tracks import (
    InvalidRange,
    LayerAssembler,
    check_record,
    does_not_exist,
    fetch_range,
    invalid_range,
    not_supported,
    parse_track,
    record_track,
    served_range,
    unauthorized,
)
from kvsp_quic.auth import Policy, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import DecodedLayer
from kvsp_quic.keys import holder_id as uri_holder_id
from kvsp_quic.problems import Incompatible, LayersUnavailable, NotFound, ScopeDenied
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder
from moqt.aio import MoqtApp, MoqtConnection, MoqtPool, moqt_handlers
from moqt.events import FetchRequested
from moqt.requests import SessionConfig
from moqt.types import PREFERRED_ALPNS, Location, StandaloneFetch
from quic.listener import HandlerFactory

log = logging.getLogger("kvsp.moqt.holder")

# Who may FETCH blocks: the readers of the HTTP block resource (http3/holder_app.py RULES, GET).
READERS = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)


class HolderTracks(MoqtApp):
    """Serves a :class:`~kvsp_quic.roles.holder.Holder`'s replicas as KVSP tracks: standalone FETCHes of group 0.

    Each FETCH is authorized like ``GET blocks/...``: the peer's identity must be in *policy* with a reader role
    (else UNAUTHORIZED) and authorized for the scope in the namespace (UNAUTHORIZED, checked before anything
    about the block is looked at); a track this holder does not publish -- another holder-id, a compat_id,
    block or codec it does not hold, a name that is no KVSP track -- is TRACK_DOES_NOT_EXIST (draft 14) /
    DOES_NOT_EXIST (draft 18); a range outside the block is INVALID_RANGE. The objects are written from views of
    the stored container (K then V of each layer; nothing joined), ascending, with send backpressure.
    """

    def __init__(self, holder: Holder, policy: Policy, *, readers: Sequence[Role] = READERS) -> None:
        self.holder = holder
        self.policy = policy
        self.readers = tuple(readers)
        self.holder_id = uri_holder_id(holder.base_uri)
        self.metrics: collections.Counter[str] = collections.Counter()

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        draft, rid = conn.draft, request.request_id

        def refuse(code: int, reason: str, counter: str) -> None:
            self.metrics[counter] += 1
            conn.reject(rid, code, reason.encode())

        target = request.target
        if not isinstance(target, StandaloneFetch):
            refuse(not_supported(draft), "KVSP tracks are retrieved with a standalone FETCH", "unsupported")
            return
        principal = self.policy.principal(conn.peer_identity)
        if principal is None or not principal.has_role(*self.readers):
            refuse(unauthorized(draft), f"identity {conn.peer_identity!r} may not read blocks", "unauthorized")
            return
        track = parse_track(request.namespace, request.track_name)
        if track is None or track.holder_id != self.holder_id:
            refuse(does_not_exist(draft), "no such track at this publisher", "not_found")
            return
        if not principal.has_scope(track.scope_id):
            refuse(unauthorized(draft), f"identity {principal.identity!r} is not authorized for scope "
                                        f"{track.scope_id.hex()}", "unauthorized")
            return
        try:
            container = self.holder.read(principal, track.compat_id, track.scope_id, track.block_key)
        except ScopeDenied as exc:
            refuse(unauthorized(draft), exc.detail, "unauthorized")
            return
        except (NotFound, Incompatible, LayersUnavailable) as exc:
            refuse(does_not_exist(draft), exc.detail, "not_found")
            return
        header = container.header
        if header.codec != track.codec:
            refuse(does_not_exist(draft), f"the replica is stored with codec {header.codec}", "not_found")
            return
        try:
            first, last = served_range(target, header.layer_count)
        except InvalidRange as exc:
            refuse(invalid_range(draft), str(exc), "invalid_range")
            return
        served = conn.accept_fetch(rid, Location(0, last + 1), end_of_track=last == header.layer_count - 1)
        sections = container.sections  # K0, V0, K1, V1, ... of layers 0..n-1
        try:
            for layer in range(first, last + 1):
                await served.write_object(layer, (sections[2 * layer], sections[2 * layer + 1]))
            served.finish()
        except BaseException:
            if conn.closed is None:
                served.reset()
            raise
        self.metrics["fetches"] += 1
        self.metrics["layers"] += last - first + 1


def holder_moqt_handlers(holder: Holder, policy: Policy, *, config: SessionConfig | None = None,
                         alpns: Sequence[str] = PREFERRED_ALPNS) -> dict[str, HandlerFactory]:
    """The ``quic_handlers`` of a holder's RoleServer: both MOQT drafts (newest first, or *alpns*' order), served
    by :class:`HolderTracks`."""
    return moqt_handlers(HolderTracks(holder, policy), config=config, alpns=alpns)


# -- the receiving side ---------------------------------------------------------------------------------------


async def fetch_layers(conn: MoqtConnection, record: ReplicaRecord, layers: tuple[int, int] | None = None, *,
                       descriptor: CompatDescriptor | None = None, stall_timeout: float | None = 10.0,
                       verify: bool = True) -> AsyncIterator[DecodedLayer]:
    """FETCH the layers of a ``moqt://`` replica (all, or the inclusive range *layers*) on *conn*; yield each one
    as soon as it is complete and its SHA-256 matched ``record.layer_digests``, in ascending order.

    The namespace comes from the record's ``moqt_namespace``, the track name from its block key. K and V are split
    by *descriptor*'s section length, or in halves (codec raw) without one. Raises (and cancels the fetch):
    :class:`~kvsp_quic.container.LayerDigestMismatch` on a mismatch, :class:`~kvsp_moqt.tracks.MalformedTrack` or
    :class:`~kvsp_quic.container.Truncated` when the objects are not the layers asked for,
    :class:`~moqt.aio.MoqtRequestError` when the FETCH is refused, :class:`~moqt.aio.MoqtStalled` when nothing
    arrives for *stall_timeout* seconds, :class:`~moqt.aio.MoqtStreamError` / :class:`~moqt.aio.MoqtSessionClosed`
    when the transfer breaks off.
    """
    first, last = check_record(record, layers)
    namespace, name = record_track(record)
    assembler = LayerAssembler(record, first, last, descriptor=descriptor, verify=verify)
    start, end = fetch_range(first, last)
    async with conn.fetch(namespace, name, start, end, stall_timeout=stall_timeout) as fetch:
        while (piece := await fetch.next_piece()) is not None:
            for layer in assembler.feed(piece):
                yield layer
        assembler.finish()


async def fetch_replica(pool: MoqtPool, record: ReplicaRecord, layers: tuple[int, int] | None = None, *,
                        descriptor: CompatDescriptor | None = None,
                        stall_timeout: float | None = 10.0) -> AsyncIterator[DecodedLayer]:
    """:func:`fetch_layers` on the pool's connection to the record's ``moqt://`` holder (connecting if needed:
    :class:`~moqt.aio.MoqtConnectError` when that fails)."""
    conn = await pool.get(record.holder)
    async for layer in fetch_layers(conn, record, layers, descriptor=descriptor, stall_timeout=stall_timeout):
        yield layer


__all__ = ["READERS", "HolderTracks", "fetch_layers", "fetch_replica", "holder_moqt_handlers"]
