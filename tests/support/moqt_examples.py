"""MOQT examples of drafts 14 and 18: every control message (as the codec tests round-trip them), fetch streams and
object datagrams -- the codec tests' cases and the fuzzers' seeds."""

from __future__ import annotations

from moqt import messages14 as m14
from moqt import messages18 as m18
from moqt.data import (
    FetchObjectEncoder,
    ObjectDatagram,
    encode_fetch_header,
)
from moqt.errors import RequestErrorCode18
from moqt.message import Message
from moqt.types import (
    AliasType,
    AuthToken,
    Draft,
    FilterType,
    GroupOrder,
    JoiningFetch,
    Location,
    ObjectStatus,
    StandaloneFetch,
    SubscriptionFilter,
)

NS = (b"kvsp-1", b"c0ffee")
SF = StandaloneFetch(NS, b"track", Location(0, 0), Location(1, 0))
FLT = SubscriptionFilter(FilterType.ABSOLUTE_RANGE, Location(3, 1), 7)
TOKEN = AuthToken(AliasType.USE_VALUE, None, 0, b"tok").encode(False)

MESSAGES_14: list[Message] = [
    m14.ClientSetup((0xFF00000E, 0xFF00000D), ((1, b"/moq"), (2, 100), (5, b"example.com:443"), (7, b"kvsp"))),
    m14.ServerSetup(0xFF00000E, ((2, 64),)),
    m14.Goaway(b"moqt://other.example/"), m14.Goaway(),
    m14.MaxRequestId(128), m14.RequestsBlocked(64),
    m14.Subscribe(0, NS, b"t", 10, GroupOrder.DESCENDING, False, FLT, ((2, 5000), (3, TOKEN))),
    m14.Subscribe(2, NS, b"", 128, GroupOrder.PUBLISHER, True),
    m14.SubscribeOk(0, 7, 1000, GroupOrder.ASCENDING, Location(4, 2), ((4, 60000),)),
    m14.SubscribeOk(0, 7), m14.SubscribeError(0, 4, b"no such track"),
    m14.SubscribeUpdate(4, 0, Location(5, 0), 9, 1, True), m14.Unsubscribe(0),
    m14.PublishDone(0, 2, 3, b"track ended"),
    m14.Publish(1, NS, b"t", 9, GroupOrder.DESCENDING, Location(1, 1), False, ((2, 1),)),
    m14.PublishOk(1, True, 5, GroupOrder.ASCENDING, SubscriptionFilter(FilterType.NEXT_GROUP_START)),
    m14.PublishError(1, 4, b"uninterested"),
    m14.Fetch(6, SF, 3, GroupOrder.ASCENDING, ((3, TOKEN),)),
    m14.Fetch(8, JoiningFetch(0, 2), 3), m14.Fetch(10, JoiningFetch(0, 5, absolute=True)),
    m14.FetchOk(6, Location(0, 32), True, GroupOrder.DESCENDING), m14.FetchError(6, 6, b"no objects"),
    m14.FetchCancel(6),
    m14.TrackStatus(12, NS, b"t"), m14.TrackStatusOk(12, 0, 0, GroupOrder.ASCENDING, Location(9, 9)),
    m14.TrackStatusError(12, 4),
    m14.PublishNamespace(14, NS, ((3, TOKEN),)), m14.PublishNamespaceOk(14), m14.PublishNamespaceError(14, 1),
    m14.PublishNamespaceDone(NS), m14.PublishNamespaceCancel(NS, 1, b"expired"),
    m14.SubscribeNamespace(16, NS[:1]), m14.SubscribeNamespaceOk(16), m14.SubscribeNamespaceError(16, 5),
    m14.UnsubscribeNamespace(NS[:1]),
]

P18 = m18.Params18
MESSAGES_18: list[Message] = [
    m18.Setup(((1, b"/moq"), (5, b"example.com"), (7, b"kvsp-quic"), (0x9D, b"grease"))), m18.Setup(),
    m18.Goaway(b"moqt://other/", 5000, 7), m18.Goaway(),
    m18.Subscribe(0, NS, b"t", P18(subscriber_priority=1, group_order=GroupOrder.DESCENDING, forward=False,
                                   subscription_filter=FLT, auth_tokens=(TOKEN, TOKEN), object_delivery_timeout=10,
                                   subgroup_delivery_timeout=20, rendezvous_timeout=30, new_group_request=0)),
    m18.Subscribe(2, (), b"", P18()),
    m18.SubscribeOk(5, P18(expires=100, largest_object=Location(3, 4)), ((0x22, 2), (0x3B, b"app"))),
    m18.RequestUpdate(4, P18(subscription_filter=SubscriptionFilter(FilterType.ABSOLUTE_START, Location(9, 0)),
                             forward=True, track_namespace_prefix=(b"a", b"b"))),
    m18.Publish(1, NS, b"t", 3, P18(largest_object=Location(0, 1), expires=9), ((0x0E, 64),)),
    m18.PublishDone(0x12, 2**62 - 1, b"malformed"),
    m18.Fetch(6, SF, P18(fill_timeout=0, group_order=GroupOrder.DESCENDING, subscriber_priority=7)),
    m18.Fetch(8, JoiningFetch(0, 1)), m18.Fetch(10, JoiningFetch(0, 2, absolute=True)),
    m18.FetchOk(Location(0, 32), True, P18(), ((0x04, 1000),)),
    m18.TrackStatus(12, NS, b"t", P18(auth_tokens=(TOKEN,))),
    m18.PublishNamespace(14, NS), m18.SubscribeNamespace(16, ()), m18.SubscribeTracks(18, NS[:1], P18(forward=False)),
    m18.NamespaceMsg(NS[1:]), m18.NamespaceDone(()), m18.PublishBlocked(NS[1:], b"t"),
    m18.RequestOk(), m18.RequestOk(P18(largest_object=Location(1, 2), expires=5), ((0x30, 1),)),
    m18.RequestError(RequestErrorCode18.DOES_NOT_EXIST, 0, b"nope"),
    m18.RequestError(RequestErrorCode18.REDIRECT, 1001, b"", m18.Redirect(b"moqt://relay/", NS, b"t2")),
]


FETCH_OBJECTS = [  # group, object, subgroup, priority, payload, status, extensions
    (0, 0, 0, 128, b"layer0", ObjectStatus.NORMAL, ((8, 1000),)),
    (0, 1, 0, 128, b"layer1", ObjectStatus.NORMAL, ()),
    (0, 3, 1, 128, b"", ObjectStatus.NORMAL, ()),
    (0, 4, 2, 9, b"x", ObjectStatus.NORMAL, ()),
    (0, 5, 7, 9, b"", ObjectStatus.END_OF_GROUP, ()),
    (2, 0, 0, 9, b"g2", ObjectStatus.NORMAL, ((13, b"prop"),)),
    (5, 1, 7, 9, b"g5", ObjectStatus.NORMAL, ()),
    (5, 2, None, 9, b"dgram", ObjectStatus.NORMAL, ()),
]


def fetch_stream(draft: Draft, order: GroupOrder, items: list[tuple]) -> bytes:  # type: ignore[type-arg]
    enc = FetchObjectEncoder(draft, order)
    wire = encode_fetch_header(draft, 4)
    for group, obj, sub, prio, payload, status, ext in items:
        wire += enc.encode(group, obj, len(payload), subgroup=sub, priority=prio, status=status, extensions=ext)
        wire += payload
    return wire


DATAGRAMS = [
    ObjectDatagram(1, 2, 3, b"payload"), ObjectDatagram(1, 2, 0, b"zero id"),
    ObjectDatagram(1, 2, 3, b"p", extensions=((2, 5),)), ObjectDatagram(1, 2, 3, b"p", end_of_group=True),
    ObjectDatagram(1, 2, 0, b"p", extensions=((3, b"x"),), end_of_group=True),
    ObjectDatagram(1, 2, 3, b"", status=ObjectStatus.END_OF_TRACK),
    ObjectDatagram(1, 2, 3, b"", status=ObjectStatus.NORMAL, extensions=((2, 1),)),
]
