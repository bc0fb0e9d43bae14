"""An in-memory pair of sessions (client and server) wired back to back: each side's transport actions are the
other side's inputs. For tests of the session and of code built on it (the relay, the KVSP mapping).

    pair = SessionPair(Draft.D18)
    pair.handshake()
    rid = pair.client.fetch(...)
    pair.pump()
    request = pair.server_events.last(FetchRequested)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

from moqt.actions import Action, CloseSession, ResetStream, SendDatagram, SendStreamData, StopSending
from moqt.events import Event, ObjectReceived
from moqt.session import MoqtSession, Role, SessionConfig
from moqt.sessions import new_session
from moqt.types import Draft

E = TypeVar("E")


class EventLog(list[Event]):
    def of(self, cls: type[E]) -> list[E]:
        return [e for e in self if isinstance(e, cls)]

    def last(self, cls: type[E]) -> E:
        found = self.of(cls)
        if not found:
            raise AssertionError(f"no {cls.__name__} among {[type(e).__name__ for e in self]}")
        return found[-1]

    def take(self) -> list[Event]:
        out = list(self)
        self.clear()
        return out


class SessionPair:
    """A client and a server session; ``pump()`` moves actions across until both are quiet.

    *chunk*: split every stream write into pieces of at most this many octets (exercises incremental parsing).
    Object payload pieces are copied out of the (reused) receive buffers into ``payloads`` keyed by
    (request id or track alias, group, object id).
    """

    def __init__(self, draft: Draft, client_config: SessionConfig | None = None,
                 server_config: SessionConfig | None = None, *, chunk: int | None = None) -> None:
        self.client = new_session(draft, Role.CLIENT, client_config)
        self.server = new_session(draft, Role.SERVER, server_config)
        self.client_events = EventLog()
        self.server_events = EventLog()
        self.chunk = chunk
        self.wire: list[tuple[str, Action]] = []  # every action, with the side that produced it
        self.payloads: dict[tuple[int | None, int, int], bytearray] = {}

    def handshake(self) -> None:
        self.client.start()
        self.server.start()
        self.pump()

    def pump(self, max_rounds: int = 10_000) -> None:
        for _ in range(max_rounds):
            moved = False
            for src, dst, log, name in ((self.client, self.server, self.server_events, "client"),
                                        (self.server, self.client, self.client_events, "server")):
                for action in src.take_actions():
                    moved = True
                    self.wire.append((name, action))
                    for event in self._deliver(action, dst):
                        self._record(event)
                        log.append(event)
            if not moved:
                return
        raise AssertionError("the sessions did not go quiet")

    def _deliver(self, action: Action, dst: MoqtSession) -> Iterator[Event]:
        if isinstance(action, SendStreamData):
            data = action.data
            if self.chunk and len(data) > self.chunk:
                view = memoryview(data)
                for i in range(0, len(view), self.chunk):
                    last = i + self.chunk >= len(view)
                    yield from dst.receive_stream_data(action.stream_id, bytes(view[i:i + self.chunk]),
                                                       action.fin and last)
            else:
                yield from dst.receive_stream_data(action.stream_id, bytes(data), action.fin)
        elif isinstance(action, ResetStream):
            yield from dst.receive_stream_reset(action.stream_id, action.error_code)
        elif isinstance(action, StopSending):
            yield from dst.receive_stop_sending(action.stream_id, action.error_code)
        elif isinstance(action, SendDatagram):
            yield from dst.receive_datagram(action.data)
        elif isinstance(action, CloseSession):
            yield from dst.connection_lost(action.error_code, action.reason)

    def _record(self, event: Event) -> None:
        if isinstance(event, ObjectReceived):
            key = (event.request_id if event.request_id is not None else event.track_alias, event.group,
                   event.object_id)
            buf = self.payloads.setdefault(key, bytearray())
            if len(buf) != event.offset:
                raise AssertionError(f"object {key}: piece at offset {event.offset}, {len(buf)} octets so far")
            buf += event.data

    def sent(self, side: str) -> list[Action]:
        return [a for s, a in self.wire if s == side]
