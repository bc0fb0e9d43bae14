"""What the Placement Controller sends to instances (:class:`InstanceLink`) and how it starts them
(:class:`Starter`; :class:`CommandStarter` runs the operator's start hook), and those requests over HTTP
(:class:`HttpInstanceLink`).

:class:`HttpInstanceLink` sends the PC's directives with the typed KVSP client :class:`~kvsp_client.api.KvspApi`:
``POST prefetch``, ``POST sessions/{id}/start``, ``POST sessions/{id}/resume``, ``PUT state`` and ``POST reshard``,
and the probe of a suspect report (``GET sessions/{id}`` once, with a short timeout).
Failures follow the client's semantics: a refusal raises its :class:`~kvsp_quic.problems.Problem`; no answer, a
timeout or a 5xx raises :class:`~kvsp_client.api.RetryElsewhere` (an ``OSError``); none of these requests is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Protocol

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import problem_from_json
from kvsp_quic.records import PrefetchDirective
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.controller_reshard import ReshardMessage

log = logging.getLogger("kvsp.controller")

# -- what the controller sends, and how it starts instances ---------------------------------------------------


class InstanceLink(Protocol):
    """The PC's requests to instances. Each raises the :class:`~kvsp_quic.problems.Problem` the instance answered
    (any status other than 2xx), or ``OSError`` (``ConnectionError``, ``TimeoutError``) when it did not answer."""

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None: ...

    async def start(self, instance: str, start: SessionStart) -> None: ...

    async def resume(self, instance: str, session: uuid.UUID, resume: SessionResume) -> None: ...

    async def set_state(self, instance: str, state: InstanceState) -> InstanceState: ...

    async def reshard(self, instance: str, message: ReshardMessage, timeout: float | None = None) -> None: ...

    async def cancel(self, instance: str, session: uuid.UUID) -> None: ...

    async def probe(self, instance: str, session: uuid.UUID, timeout: float) -> None:
        """``GET sessions/{id}`` at *instance*, sent once, answered within *timeout* seconds or raising."""
        ...


class Starter(Protocol):
    """Starts a new inference instance (the start hook). Returns once the start is under way; the instance joins
    by reporting its status."""

    async def start(self, reason: str) -> None: ...


class CommandStarter:
    """The start hook as a command: ``argv`` is run (not through a shell) with ``KVSP_PC_URI`` (the PC's base
    URI) and ``KVSP_START_REASON`` in its environment. The PC does not wait for it, read its output or stop it:
    the command either starts the instance and exits, or is the instance. Its exit status is logged."""

    def __init__(self, argv: Sequence[str], *, pc_uri: str, env: Mapping[str, str] | None = None) -> None:
        if not argv:
            raise ValueError("the start hook needs a command")
        self.argv = list(argv)
        self.pc_uri = pc_uri
        self.env = dict(env) if env is not None else None
        self.started = 0
        self._waiters: set[asyncio.Task[None]] = set()

    async def start(self, reason: str) -> None:
        env = dict(os.environ if self.env is None else self.env)
        env.update(KVSP_PC_URI=self.pc_uri, KVSP_START_REASON=reason)
        proc = await asyncio.create_subprocess_exec(*self.argv, env=env, stdin=asyncio.subprocess.DEVNULL)
        self.started += 1
        log.info("start hook %r running (pid %d): %s", self.argv[0], proc.pid, reason)
        task = asyncio.create_task(self._reap(proc))
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        (log.info if code == 0 else log.warning)("start hook %r (pid %d) exited with %d", self.argv[0], proc.pid,
                                                 code)

    async def settle(self, timeout: float) -> None:
        """Wait (up to *timeout* seconds) for the hook processes started so far to exit."""
        if self._waiters:
            await asyncio.wait(list(self._waiters), timeout=timeout)

    async def aclose(self) -> None:
        """Stop waiting for hook processes (they keep running)."""
        for task in list(self._waiters):
            task.cancel()
        for task in list(self._waiters):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class HttpInstanceLink:
    """:class:`InstanceLink` over HTTP (the PC's client certificate must give it the
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


__all__ = ["CommandStarter", "HttpInstanceLink", "InstanceLink", "Starter"]
