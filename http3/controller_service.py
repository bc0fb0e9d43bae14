"""The Placement Controller's asyncio adapter: carries out what the role decides.

:class:`ControllerService` wraps a :class:`~kvsp_quic.roles.controller.PlacementController` (the rules, no I/O) and
does its I/O: lookups on the Index Service, the requests to instances through an :class:`InstanceLink`, the start
hook (a :class:`Starter`; :class:`CommandStarter` runs a command), waiting for an instance to become active, one
lock per session, the tick loop that starts migrations (at once when a report says an instance failed or
restarted), the reshard fan-out with its deadline, and the placement timing. It holds no protocol rules: every
result goes back to the role, which judges it (the outcome types of :mod:`kvsp_quic.roles.controller_sessions`).

    controller = PlacementController(service, clock=clock, metrics=registry)
    pc = ControllerService(controller, HttpInstanceLink(client), starter=CommandStarter(argv, pc_uri=base_uri))
    app = controller_app(service, pc, policy, base_path="/kvsp/")
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvsp_quic.auth import Principal
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import BadRequest, Problem
from kvsp_quic.records import InstanceStatusRecord, LookupResponse, PrefetchDirective, ShardMap, StateMessage
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_records import SessionInfo, SessionRequest, SessionResume, SessionStart
from kvsp_quic.roles.controller_reshard import ReshardMessage, ReshardOutcome
from kvsp_quic.roles.controller_sessions import (
    Admitted,
    Assignment,
    CapacityAction,
    PlacedSession,
    StartOutcome,
)
from kvsp_quic.roles.placement import Choice

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


# -- the adapter ----------------------------------------------------------------------------------------------


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ControllerService:
    """The asyncio side of the Placement Controller (see the module docstring). ``role`` answers everything that
    needs no I/O (session info, checkpoints, instances, shard maps, metrics)."""

    def __init__(self, role: PlacementController, link: InstanceLink, *, starter: Starter | None = None) -> None:
        self.role = role
        self.link = link
        self.starter = starter
        self.kick = asyncio.Event()  # set when a report makes a failover likely: the ticker runs at once
        self._activation: asyncio.Event | None = None  # set when an instance becomes active (the hook's waiters)
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[bool]] = set()
        self._migrating: set[uuid.UUID] = set()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def report_status(self, principal: Principal, instance_id: str, record: InstanceStatusRecord) -> StateMessage:
        """PUT instances/{instance-id}/status, through the role; wakes whoever waits for it."""
        report = self.role.report_status(principal, instance_id, record)
        if report.activated:
            self._activated()
        if report.failover_due:
            self.kick.set()
        return report.answer

    async def set_instance_state(self, instance: str, state: InstanceState) -> InstanceState:
        """PUT state on *instance*; the state it answered is held from then on."""
        self.role.check_state_change(instance, state)
        answered = await self.link.set_state(instance, state)
        if self.role.state_answered(instance, answered):
            self._activated()
        return answered

    def _activated(self) -> None:
        waiting, self._activation = self._activation, None
        if waiting is not None:
            waiting.set()

    # -- placement ------------------------------------------------------------------------------------------------

    async def _rank(self, session: PlacedSession, exclude: set[str]) -> tuple[list[Choice], LookupResponse | None]:
        query = self.role.placement_query(session, exclude)
        if query is None:
            return [], None
        found = None
        if query.lookup is not None:
            found = await self.role.index.lookup(self.role.principal, query.lookup)
        return self.role.rank(session, query, found), found

    async def _more_capacity(self, reason: str, scope_id: bytes | None = None) -> bool:
        """Wake a sleeping instance (of *scope_id*, when given), or run the start hook and wait for an instance to
        become active. True when an instance became active."""
        for instance in self.role.sleeping(scope_id):
            try:
                answered = await self.set_instance_state(instance, InstanceState.ACTIVE)
            except (Problem, OSError) as exc:
                log.warning("waking %s failed: %s", instance, exc)
                continue
            if self.role.woke(instance, answered, reason):
                return True
        if self.starter is None:
            return False
        step = self.role.capacity_step()
        if step.action is CapacityAction.NONE:
            return False
        if step.action is CapacityAction.RUN_HOOK:
            try:
                await self.starter.start(reason)
            except Exception as exc:  # a broken hook must not fail the request; it is placed on what exists
                log.error("the start hook failed: %s", exc)
                return False
            self.role.hook_ran()
            self._activation = asyncio.Event()
        waiting = self._activation = self._activation or asyncio.Event()
        try:
            async with asyncio.timeout(step.wait_s):
                await waiting.wait()
        except TimeoutError:
            log.warning("no instance became active within %d ms of the start hook",
                        self.role.config.start_timeout_ms)
            return False
        return True

    async def _send(self, assignment: Assignment, session: uuid.UUID) -> None:
        message = assignment.message
        if isinstance(message, SessionResume):
            await self.link.resume(assignment.instance, session, message)
        else:
            await self.link.start(assignment.instance, message)

    async def _try(self, session: PlacedSession, choices: list[Choice], found: LookupResponse | None,
                   exclude: set[str]) -> bool:
        """Prefetch and start (or resume) *session* on the first choice that takes it."""
        for choice in choices:
            entry = self.role.still_active(choice.instance, session.request.scope_id)
            if entry is None:
                continue
            directive = self.role.directive(session, choice, found)
            if directive is not None:
                error: Problem | OSError | None = None
                try:
                    await self.link.prefetch(choice.instance, directive)
                except (Problem, OSError) as exc:
                    error = exc
                if self.role.prefetch_outcome(choice.instance, error).next_instance:
                    exclude.add(choice.instance)
                    continue
            assignment = self.role.assign(session, entry, found)
            error = None
            try:
                await self._send(assignment, session.id)
            except (Problem, OSError) as exc:
                error = exc
            if isinstance(error, BadRequest) and isinstance(assignment.message, SessionStart):
                # The instance refused the request itself (a token id beyond the vocabulary, a prompt too long):
                # every instance of the model would, so it is the caller's 400, not tried elsewhere.
                self.role.start_outcome(session, assignment, error, choice, found)
                raise error
            if self.role.start_outcome(session, assignment, error, choice, found) is StartOutcome.OK:
                return True
            exclude.add(choice.instance)
        return False

    async def _place(self, session: PlacedSession) -> bool:
        """Assign *session* (its epoch already fresh): rank, look for capacity when nothing is acceptable, try."""
        exclude: set[str] = set()
        scope = session.request.scope_id
        choices, found = await self._rank(session, exclude)
        if not self.role.acceptable(choices) and await self._more_capacity(f"session {session.id}", scope):
            choices, found = await self._rank(session, exclude)
        if await self._try(session, choices, found, exclude):
            return True
        if choices and await self._more_capacity(f"session {session.id}: every candidate refused", scope):
            choices, found = await self._rank(session, exclude)
            return await self._try(session, choices, found, exclude)
        return False

    def _lock(self, session_id: uuid.UUID) -> asyncio.Lock:
        return self._locks.setdefault(session_id, asyncio.Lock())

    async def create_session(self, principal: Principal, request: SessionRequest) -> tuple[SessionInfo, bool]:
        """POST sessions: place and start the session; (its info, whether it was created now)."""
        admission = self.role.admit(principal, request)
        if not isinstance(admission, Admitted):
            return admission.info, False  # a retry of the same request
        session = admission.session
        started = time.perf_counter()
        async with self._lock(session.id):
            try:
                placed = await self._place(session)
            except BaseException:
                self.role.abandon(session)
                raise
            if not placed:
                raise self.role.unplaced(session)
            return self.role.placed(session, time.perf_counter() - started), True

    async def cancel_session(self, principal: Principal, session_id: uuid.UUID) -> None:
        """``DELETE sessions/{id}`` (extension; docs/wire.md, "Cancelling a session"): only the session's creator
        (404 for anyone else); the PC forgets the session (never migrates it) and tells its instance to stop the
        run and free its slot. The instance's answer is not waited for beyond the link's timeout, nor required."""
        self.role.session_info(principal, session_id)
        async with self._lock(session_id):
            session = self.role.sessions.get(session_id)
            if session is None:
                return
            instance = session.instance
            self.role.abandon(session)
        log.info("session %s cancelled by its creator (instance %s)", session_id, instance)
        if instance is not None:
            try:
                await self.link.cancel(instance, session_id)
            except (Problem, OSError) as exc:
                log.info("session %s: the cancel at %s failed: %s", session_id, instance, exc)

    # -- failures -------------------------------------------------------------------------------------------------

    async def migrate(self, session: PlacedSession) -> bool:
        """Move *session* off its failed instance (see the role's ``begin_migration``). False when no instance took
        it (retried at the next tick)."""
        async with self._lock(session.id):
            if not self.role.needs_migration(session):
                return True
            self.role.begin_migration(session)
            if not await self._place(session):
                return False
            self.role.migrated(session)
            return True

    def tick(self) -> list[asyncio.Task[bool]]:
        """Start the migrations that are due (each in its own task, returned) and forget old sessions."""
        started = [self._spawn_migration(s) for s in self.role.tick() if s.id not in self._migrating]
        for session_id in [i for i, lock in self._locks.items() if i not in self.role.sessions and not lock.locked()]:
            del self._locks[session_id]
        return started

    def _spawn_migration(self, session: PlacedSession) -> asyncio.Task[bool]:
        self._migrating.add(session.id)
        task = asyncio.create_task(self.migrate(session))
        self._tasks.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._tasks.discard(t)
            self._migrating.discard(session.id)
            if not t.cancelled() and t.exception() is not None:
                log.error("migrating session %s failed", session.id, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def run(self, interval: float) -> None:
        """Tick every *interval* seconds, and at once when a report says an instance failed or restarted."""
        while True:
            self.kick.clear()
            self.tick()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.kick.wait()

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # -- resharding -----------------------------------------------------------------------------------------------

    def put_map(self, shard_map: ShardMap) -> ReshardOutcome:
        return self.role.register_map(shard_map)

    async def reshard(self, new: ShardMap, deadline_ms: int | None = None) -> ReshardOutcome:
        """Move a map from version v to v+1 = ``new.version``: send every member its plan; when all acknowledged
        (200, after loading their fetch ranges) within the deadline, commit to all members, otherwise abort to
        all members (the role decides, and keeps the authoritative version)."""
        round_ = self.role.begin_reshard(new, deadline_ms)
        everyone = round_.members
        acknowledged: list[str] = []
        failed: dict[str, str] = {}
        undelivered: dict[str, str] = {}
        try:
            deadline = round_.deadline_s
            tasks = {asyncio.create_task(self.link.reshard(i, round_.plans[i], deadline)): i for i in everyone}
            done, pending = await asyncio.wait(tasks, timeout=deadline, return_when=asyncio.FIRST_EXCEPTION)
            for task in pending:
                task.cancel()
                failed[tasks[task]] = f"no acknowledgement within {round_.deadline_ms} ms"
            for task in done:
                exc = task.exception()
                if exc is None:
                    acknowledged.append(tasks[task])
                else:
                    failed[tasks[task]] = _why(exc)
            if pending:
                await asyncio.wait(pending)
                for task in pending:
                    if not task.cancelled():
                        task.exception()  # retrieved: it is reported in failed already
            message = self.role.decide_reshard(round_, failed)
            results = await asyncio.gather(*(self.link.reshard(i, message) for i in everyone),
                                           return_exceptions=True)
            for instance, result in zip(everyone, results, strict=True):
                if isinstance(result, BaseException):
                    undelivered[instance] = _why(result)
        finally:
            self.role.end_reshard(round_)
        return self.role.reshard_outcome(round_, acknowledged, failed, undelivered)


__all__ = ["CommandStarter", "ControllerService", "InstanceLink", "Starter"]
