"""The Placement Controller's requests to instances over HTTP (an :class:`~http3.controller_service.InstanceLink`).

:class:`HttpInstanceLink` sends the PC's directives with the typed KVSP client :class:`~http3.api.KvspApi`:
``POST prefetch``, ``POST sessions/{id}/start``, ``POST sessions/{id}/resume``, ``PUT state`` and ``POST reshard``,
and the probe of a suspect report (``GET sessions/{id}`` once, with a short timeout).
Failures follow the client's semantics: a refusal raises its :class:`~kvsp_quic.problems.Problem`; no answer, a
timeout or a 5xx raises :class:`~http3.api.RetryElsewhere` (an ``OSError``); none of these requests is retried.
"""

from __future__ import annotations

import asyncio
import uuid

from http3.api import KvspApi
from http3.client import KvspClient
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import problem_from_json
from kvsp_quic.records import PrefetchDirective
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.controller_reshard import ReshardMessage


class HttpInstanceLink:
    """:class:`~http3.controller_service.InstanceLink` over HTTP (the PC's client certificate must give it the
    ``controller`` role in the instances' policies)."""

    def __init__(self, client: KvspClient, *, timeout: float | None = None) -> None:
        self.api = KvspApi(client, timeout=timeout)

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        await self.api.prefetch(instance, directive)

    async def start(self, instance: str, start: SessionStart) -> None:
        await self.api.start_session(instance, start)

    async def resume(self, instance: str, session: uuid.UUID, resume: SessionResume) -> None:
        await self.api.resume_session(instance, session, resume)

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState:
        return await self.api.set_state(instance, state)

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None:
        await self.api.reshard(instance, message, timeout=timeout)

    async def cancel(self, instance: str, session: uuid.UUID) -> None:
        """``DELETE {instance}sessions/{id}`` (extension, docs/wire.md "Cancelling a session"): 204, or 404 when the
        instance no longer has the session; anything else raises its Problem."""
        response = await self.api.client.request("DELETE", self.api.url(instance, f"sessions/{session}"))
        if response.status not in (204, 404):
            raise problem_from_json(response.status, response.content or b"")

    async def probe(self, instance: str, session: uuid.UUID, timeout: float) -> None:
        """``GET {instance}sessions/{id}`` once, answered within *timeout* seconds or not at all (a suspect report's
        probe, docs/wire.md "Suspect reports"): returns on 200; raises the Problem of another answer, or an
        ``OSError`` (``TimeoutError``, a transport error) when none came."""
        async with asyncio.timeout(timeout):
            response = await self.api.client.send("GET", self.api.url(instance, f"sessions/{session}"),
                                                  timeout=timeout, retries=0)
            try:
                body = await response.aread()
            finally:
                await response.aclose()
        if response.status != 200:
            raise problem_from_json(response.status, body)


__all__ = ["HttpInstanceLink"]
