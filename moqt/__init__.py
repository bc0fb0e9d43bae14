"""Media over QUIC Transport, sans I/O: codecs and a session state machine for draft 14 (ALPN "moq-00") and
draft 18 (ALPN "moqt-18"). See docs/moqt.md.

    session = session_for_alpn(alpn, Role.CLIENT, SessionConfig(path=b"/"))
    session.start()
    rid = session.fetch(namespace, track_name, Location(0, 0), Location(1, 0))
    for action in session.take_actions(): ...          # hand to the transport
    for event in session.receive_stream_data(stream_id, data, fin): ...   # moqt.events.*
"""

from moqt import events
from moqt.actions import Action, CloseSession, OpenStream, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.errors import (
    MoqtError,
    MoqtUsageError,
    PublishDoneCode14,
    PublishDoneCode18,
    RequestErrorCode14,
    RequestErrorCode18,
    SessionErrorCode,
    StreamResetCode,
)
from moqt.events import Event
from moqt.messages18 import Params18, Redirect
from moqt.requests import Role, SessionConfig
from moqt.session import MoqtSession
from moqt.sessions import new_session, session_for_alpn
from moqt.types import (
    ALPNS,
    PREFERRED_ALPNS,
    AuthToken,
    Draft,
    FetchType,
    FilterType,
    GroupOrder,
    JoiningFetch,
    Location,
    Namespace,
    ObjectStatus,
    StandaloneFetch,
    SubscriptionFilter,
    alpn_order,
    parse_name,
    render_name,
)
from moqt.writers import FetchStreamWriter, SubgroupWriter

__all__ = [
    "ALPNS",
    "PREFERRED_ALPNS",
    "Action",
    "AuthToken",
    "CloseSession",
    "Draft",
    "Event",
    "FetchStreamWriter",
    "FetchType",
    "FilterType",
    "GroupOrder",
    "JoiningFetch",
    "Location",
    "MoqtError",
    "MoqtSession",
    "MoqtUsageError",
    "Namespace",
    "ObjectStatus",
    "OpenStream",
    "Params18",
    "PublishDoneCode14",
    "PublishDoneCode18",
    "Redirect",
    "RequestErrorCode14",
    "RequestErrorCode18",
    "ResetStream",
    "Role",
    "SendDatagram",
    "SendStreamData",
    "SessionConfig",
    "SessionErrorCode",
    "StandaloneFetch",
    "StopSending",
    "StreamResetCode",
    "SubgroupWriter",
    "SubscriptionFilter",
    "alpn_order",
    "events",
    "new_session",
    "parse_name",
    "render_name",
    "session_for_alpn",
]
