"""The MOQT session of a draft: the one place that knows both drafts' sessions,
:class:`~moqt.publishing14.PublishingSession14` (draft 14 with PUBLISH) and
:class:`~moqt.publishing.PublishingSession18` (draft 18 with PUBLISH and SUBSCRIBE_TRACKS); the base
:class:`~moqt.session.MoqtSession` knows neither."""

from __future__ import annotations

from moqt.publishing import PublishingSession18
from moqt.publishing14 import PublishingSession14
from moqt.requests import SessionConfig
from moqt.session import MoqtSession, Role
from moqt.types import Draft


def new_session(draft: Draft, role: Role, config: SessionConfig | None = None) -> MoqtSession:
    """A session speaking *draft* as *role* (not started: call :meth:`~moqt.session.MoqtSession.start`)."""
    return (PublishingSession14 if draft is Draft.D14 else PublishingSession18)(role, config)


def session_for_alpn(alpn: str, role: Role, config: SessionConfig | None = None) -> MoqtSession:
    """The session for the ALPN the handshake chose ("moq-00": draft 14, "moqt-18": draft 18)."""
    return new_session(Draft.from_alpn(alpn), role, config)


__all__ = ["new_session", "session_for_alpn"]
