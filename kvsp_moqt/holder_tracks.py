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
import weakref
from collections.abc import AsyncIterator, Sequence

from kvsp_moqt.tracks import (
    GROUP,
    InvalidRange,
    LayerAssembler,
    check_record,
    does_not_exist,
    fetch_range,
    invalid_range,
    parse_track,
    record_track,
    served_range,
    unauthorized,
)
from kvsp_quic.auth import Policy, Role
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.container import DecodedLayer, EncodedContainer
from kvsp_quic.keys import holder_id as uri_holder_id
from kvsp_quic.problems import Incompatible, LayersUnavailable, NotFound, ScopeDenied
from kvsp_quic.records import ReplicaRecord
from kvsp_quic.roles.holder import Holder
from moqt import events as ev
from moqt.aio import MoqtApp, MoqtConnection, MoqtPool, PeerLimits, moqt_handlers
from moqt.errors import MoqtUsageError
from moqt.events import FetchRequested
from moqt.requests import SessionConfig
from moqt.types import PREFERRED_ALPNS, FilterType, GroupOrder, JoiningFetch, Location, Namespace, ObjectStatus
from quic.listener import HandlerFactory

log = logging.getLogger("kvsp.moqt.holder")

# Who may FETCH blocks: the readers of the HTTP block resource (kvsp_http/holder_app.py RULES, GET).
READERS = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)


class HolderTracks(MoqtApp):
    """Serves a :class:`~kvsp_quic.roles.holder.Holder`'s replicas as KVSP tracks: FETCHes of group 0 (standalone,
    or joining a subscription), and SUBSCRIBE answered as for a track whose content is all in the past
    (:meth:`request`).

    Each FETCH (and SUBSCRIBE) is authorized like ``GET blocks/...``: the peer's identity must be in *policy* with
    a reader role (else UNAUTHORIZED) and authorized for the scope in the namespace (UNAUTHORIZED, checked before
    anything about the block is looked at); a track this holder does not publish -- another holder-id, a compat_id,
    block or codec it does not hold, a name that is no KVSP track -- is TRACK_DOES_NOT_EXIST (draft 14) /
    DOES_NOT_EXIST (draft 18); a range outside the layers held is INVALID_RANGE (a replica of a layer range -- issue
    13 -- has the objects of those layers only, with their layer numbers as object ids; its SUBSCRIBE_OK's Largest
    Location is its last layer, and the End of Group marker is sent only when that is the block's last). The
    objects are written from views of the stored container (K then V of each layer; nothing joined), ascending,
    with send backpressure.

    Issue 13: at most *max_in_flight* FETCHes of one principal are served at once (each can hold a send buffer of
    octets); more are refused with EXCESSIVE_LOAD and a retry hint (:mod:`moqt.aio.limits`). After a reload of
    the policy, a session whose identity lost the reader role, or every scope it read, is closed (:meth:`recheck`).
    """

    def __init__(self, holder: Holder, policy: Policy, *, readers: Sequence[Role] = READERS,
                 max_in_flight: int = 256) -> None:
        self.holder = holder
        self.policy = policy
        self.readers = tuple(readers)
        self.holder_id = uri_holder_id(holder.base_uri)
        self.metrics: collections.Counter[str] = collections.Counter()
        self.limits = PeerLimits(max_in_flight=max_in_flight)
        self._scopes: weakref.WeakKeyDictionary[MoqtConnection, set[bytes]] = weakref.WeakKeyDictionary()

    def recheck(self, conn: MoqtConnection) -> str | None:
        principal = self.policy.principal(conn.peer_identity)
        if principal is None or not principal.has_role(*self.readers):
            return f"identity {conn.peer_identity!r} may not read blocks any more"
        scopes = self._scopes.get(conn)
        if scopes and not any(principal.has_scope(scope) for scope in scopes):
            return f"identity {principal.identity!r} lost every scope it read"
        return None

    async def fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        slot = self.limits.acquire(conn)
        if slot is None:
            self.metrics["limit_refused"] += 1
            self.limits.refuse(conn, request.request_id, "FETCH")
            return
        try:
            await self._fetch(conn, request)
        finally:
            slot.release()

    async def _fetch(self, conn: MoqtConnection, request: FetchRequested) -> None:
        draft, rid = conn.draft, request.request_id
        target = request.target
        found = self._replica(conn, rid, request.namespace, request.track_name)
        if found is None:
            return
        container, block_layers = found
        header = container.header  # the layers held: the whole block, or a layer range of it (issue 13)
        if isinstance(target, JoiningFetch):
            # A joining FETCH of one of our subscriptions (the session names its track): from its start group to
            # the Joining Location, the SUBSCRIBE_OK's Largest Location (0, last layer held) -- all we hold.
            if target.absolute and target.start > GROUP:
                self._refuse(conn, rid, invalid_range(draft), "a KVSP track has group 0 only", "invalid_range")
                return
            first, last = header.first_layer, header.last_layer
        else:
            try:
                first, last = served_range(target, block_layers)
                if first < header.first_layer or last > header.last_layer:  # never a layer not held here
                    raise InvalidRange(f"this publisher holds layers {header.first_layer}-{header.last_layer} of "
                                       f"the block; the fetch asks for {first}-{last}")
            except InvalidRange as exc:
                self._refuse(conn, rid, invalid_range(draft), str(exc), "invalid_range")
                return
        served = conn.accept_fetch(rid, Location(0, last + 1), end_of_track=last == block_layers - 1)
        sections = container.sections  # K, V of each layer held, from header.first_layer on
        try:
            for layer in range(first, last + 1):
                i = layer - header.first_layer
                await served.write_object(layer, (sections[2 * i], sections[2 * i + 1]))
            served.finish()
        except BaseException:
            if conn.closed is None:
                served.reset()
            raise
        self.metrics["fetches"] += 1
        self.metrics["layers"] += last - first + 1

    def request(self, conn: MoqtConnection, request: ev.Event) -> None:
        """SUBSCRIBE to a KVSP track (docs/moqt.md, "SUBSCRIBE to a KVSP track"). A block is immutable and complete:
        all of it is in the past, and "Subscribe only delivers newly published or received Objects. Objects from
        the past are retrieved using FETCH" (drafts 14 and 18, SUBSCRIBE). So a SUBSCRIBE -- authorized and
        resolved as a FETCH is -- is accepted with SUBSCRIBE_OK carrying the Largest Location (group 0, the last
        layer: draft 14 Content Exists 1; draft 18 LARGEST_OBJECT, which "the Publisher MUST include" once objects
        were published), and delivers no object ever: one subgroup stream of group 0 carries only the End of Group
        status at (0, layers) ("Object ID is one greater than the largest Object produced in the Group", draft 14;
        "no objects with the specified Group ID and the Object ID that is greater than or equal to the one
        specified exist", draft 18), so that a subscriber knows group 0 is whole. The subscription stays open until
        the subscriber ends it (no PUBLISH_DONE: a subscriber that FETCHes after subscribing, as moq-rs does,
        would see its track end first). An AbsoluteRange filter asks for a range whose "entire End Group has
        already been published": INVALID_RANGE (draft 18 "Subscription Filters"; draft 14 SUBSCRIBE). Other
        requests: NOT_SUPPORTED."""
        if not isinstance(request, ev.SubscribeRequested):
            super().request(conn, request)
            return
        draft, rid = conn.draft, request.request_id
        found = self._replica(conn, rid, request.namespace, request.track_name)
        if found is None:
            return
        container, block_layers = found
        flt = request.filter
        if flt is not None and flt.type is FilterType.ABSOLUTE_RANGE:
            self._refuse(conn, rid, invalid_range(draft), "a KVSP track is one group, published "
                         "entirely: nothing in a range can still arrive (FETCH it)", "invalid_range")
            return
        last = container.header.last_layer
        try:
            conn.session.accept_subscribe(rid, largest=Location(GROUP, last), group_order=GroupOrder.ASCENDING)
        except MoqtUsageError:  # cancelled meanwhile
            return
        if last == block_layers - 1:  # (a replica of layers before the block's last: the group has more objects)
            try:  # the End of Group marker: nothing at or past (0, layers) will ever exist in the group
                marker = conn.session.open_subgroup(rid, GROUP, 0, priority=128)
                marker.begin_object(block_layers, 0, status=ObjectStatus.END_OF_GROUP)
                marker.finish()
            finally:
                conn.flush()
        self.metrics["subscriptions"] += 1

    def _refuse(self, conn: MoqtConnection, rid: int, code: int, reason: str, counter: str) -> None:
        self.metrics[counter] += 1
        conn.reject(rid, code, reason.encode())

    def _replica(self, conn: MoqtConnection, rid: int, namespace: Namespace,
                 name: bytes) -> tuple[EncodedContainer, int] | None:
        """The stored container a FETCH or SUBSCRIBE of (*namespace*, *name*) by *conn*'s peer reads (all the
        layers this holder has of the block) and the block's layer count, or None once the request is refused
        (see the class docstring)."""
        draft = conn.draft
        principal = self.policy.principal(conn.peer_identity)
        if principal is None or not principal.has_role(*self.readers):
            self._refuse(conn, rid, unauthorized(draft), f"identity {conn.peer_identity!r} may not read blocks",
                         "unauthorized")
            return None
        track = parse_track(namespace, name)
        if track is None or track.holder_id != self.holder_id:
            self._refuse(conn, rid, does_not_exist(draft), "no such track at this publisher", "not_found")
            return None
        if not principal.has_scope(track.scope_id):
            self._refuse(conn, rid, unauthorized(draft), f"identity {principal.identity!r} is not authorized for "
                                                         f"scope {track.scope_id.hex()}", "unauthorized")
            return None
        try:
            container = self.holder.read(principal, track.compat_id, track.scope_id, track.block_key)
            block_layers = self.holder.descriptor(track.compat_id).layers
        except ScopeDenied as exc:
            self._refuse(conn, rid, unauthorized(draft), exc.detail, "unauthorized")
            return None
        except (NotFound, Incompatible, LayersUnavailable) as exc:
            self._refuse(conn, rid, does_not_exist(draft), exc.detail, "not_found")
            return None
        if container.header.codec != track.codec:
            self._refuse(conn, rid, does_not_exist(draft), f"the replica is stored with codec "
                                                           f"{container.header.codec}", "not_found")
            return None
        self._scopes.setdefault(conn, set()).add(track.scope_id)
        return container, block_layers


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
