"""The Placement Controller's asyncio adapter: carries out what the role decides.

:class:`ControllerService` wraps a :class:`~kvsp_quic.roles.controller.PlacementController` (the rules, no I/O) and
does its I/O: lookups on the Index Service, the requests to instances through an :class:`InstanceLink`, the start
hook (a :class:`Starter`; :class:`CommandStarter` runs a command), waiting for an instance to become active, one
lock per session, the tick loop that starts migrations (at once when a report says an instance failed or
restarted), suspect reports (a probe of the run, then a migration at once: docs/wire.md, "Suspect reports"), the
reshard fan-out with its deadline (:mod:`kvsp_runtime.controller_maps`), and the placement timing. It holds no protocol
rules: every result goes back to the role, which judges it (the outcome types of
:mod:`kvsp_quic.roles.controller_sessions`). A placement is the role's
:class:`~kvsp_quic.roles.controller_placement.PlacementPlan`: the steps it yields (lookup, wake, start hook, wait
for an instance, prefetch, store, start) are performed here (:meth:`ControllerService._carry_out`), in its order.

    controller = PlacementController(service, clock=clock, metrics=registry)
    pc = ControllerService(controller, HttpInstanceLink(client), starter=CommandStarter(argv, pc_uri=base_uri))
    app = controller_app(service, pc, policy, base_path="/kvsp/")
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from kvsp_quic.auth import Principal
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import NotFound, Problem, StaleEpoch, Unavailable
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    SessionCheckpoint,
    ShardMap,
    StateMessage,
)
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_placement import (
    AwaitInstanceStep,
    LookupStep,
    PlacementPlan,
    PlacementStep,
    PrefetchStep,
    StartHookStep,
    StoreStep,
    WakeStep,
)
from kvsp_quic.roles.controller_records import (
    SessionInfo,
    SessionRequest,
    SessionResume,
    SessionState,
    SuspectAnswer,
    SuspectReport,
    Verdict,
)
from kvsp_quic.roles.controller_reshard import ReshardContext, ReshardOutcome
from kvsp_quic.roles.controller_sessions import (
    Admitted,
    Assignment,
    PlacedSession,
    RunHealth,
    SuspectStep,
)
from kvsp_quic.roles.controller_store import load_statuses, placed_session, stored_session, stored_status
from kvsp_quic.storage.control_store import ControlStore
from kvsp_runtime.controller_link import InstanceLink, Starter
from kvsp_runtime.controller_maps import ShardMaps, why

log = logging.getLogger("kvsp.controller")


# -- the adapter ----------------------------------------------------------------------------------------------


class Superseded(Exception):
    """With a shared store: the session this replica was placing is gone, or another replica moved it on (a
    higher epoch): this one stands down."""


_CAS_TRIES = 16
_ACTIVATION_POLL_S = 0.1  # with a shared store: how often a wait for an active instance reads the stored statuses


class ControllerService:
    """The asyncio side of the Placement Controller (see the module docstring). ``role`` answers everything that
    needs no I/O (session info, checkpoints, instances, shard maps, metrics)."""

    def __init__(self, role: PlacementController, link: InstanceLink, *, starter: Starter | None = None,
                 shared: ControlStore | None = None, replica: str | None = None) -> None:
        self.role = role
        self.link = link
        self.starter = starter
        # With a shared store the PC's state lives there (several replicas); without, in the role (one process).
        self.shared = shared
        self.replica = replica or uuid.uuid4().hex  # this replica's name on the leases it takes
        self._based: dict[uuid.UUID, int] = {}  # per session this replica places: the epoch it last stored
        self.kick = asyncio.Event()  # set when a report makes a failover likely: the ticker runs at once
        self._activation: asyncio.Event | None = None  # set when an instance becomes active (the hook's waiters)
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[bool]] = set()
        self._migrating: set[uuid.UUID] = set()
        self._closing = False  # aclose() began: no migration starts any more
        self.maps = ShardMaps(role, link, shared, self.replica)  # the shard maps and their resharding

    # -- the shared store (several replicas): read before a decision, write after it ------------------------------

    async def refresh(self) -> None:
        """With a shared store: load every replica's instance statuses into the role's table."""
        if self.shared is not None:
            load_statuses(self.role, await self.shared.statuses())

    async def _push_status(self, instance: str) -> None:
        if self.shared is None:
            return
        status = stored_status(self.role, instance)
        if status is None:
            return
        higher = await self.shared.put_status(status)
        if higher is not None:
            raise StaleEpoch(f"instance {instance!r}: epoch {status.record.epoch} is older than {higher}")

    def _ttl_ms(self, session: PlacedSession) -> int:
        config = self.role.config
        return config.done_ttl_ms if session.state is SessionState.DONE else config.session_ttl_ms

    async def _fetch(self, session_id: uuid.UUID) -> PlacedSession | None:
        """With a shared store: the stored session, put in the role's table for the decision that follows."""
        assert self.shared is not None
        stored = await self.shared.load(session_id)
        if stored is None:
            self.role.sessions.pop(session_id, None)
            return None
        session = placed_session(stored, self.role.clock())
        self.role.sessions[session_id] = session
        return session

    def _evict(self, session_id: uuid.UUID) -> None:
        """With a shared store the role's table is a cache of the decision under way: drop the entry."""
        if self.shared is not None:
            self.role.sessions.pop(session_id, None)

    async def _persist(self, session: PlacedSession, *, strict: bool = False) -> None:
        """With a shared store: write back what the placement of *session* (under its lease) changed. When another
        replica wrote it since -- a checkpoint -- that is taken in and the write is tried again; *strict* (an
        epoch increment decided on what was read) or a session gone or moved to another epoch: :class:`Superseded`.
        """
        if self.shared is None:
            return
        for _ in range(_CAS_TRIES):
            version = await self.shared.save(session.id, stored_session(session), self._ttl_ms(session))
            if version is not None:
                session.version = version
                self._based[session.id] = session.epoch
                return
            stored = await self.shared.load(session.id)
            if stored is None:
                raise Superseded(f"session {session.id} is gone")
            fresh = placed_session(stored, self.role.clock())
            if strict or fresh.epoch != self._based.get(session.id, fresh.epoch):
                raise Superseded(f"session {session.id} is at epoch {fresh.epoch} at another replica")
            session.adopt(fresh)
        raise Unavailable(f"session {session.id}: too many concurrent writes")

    @contextlib.asynccontextmanager
    async def _leased(self, session_id: uuid.UUID) -> AsyncIterator[bool]:
        """With a shared store: hold the session's placement lease (renewed) for the block; yields False when
        another replica holds it (this one stands down). Without: yields True."""
        if self.shared is None:
            yield True
            return
        shared, ttl_ms = self.shared, self.role.config.lease_ms
        if not await shared.lease(session_id, self.replica, ttl_ms):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl_ms / 3000)
                try:
                    await shared.lease(session_id, self.replica, ttl_ms)
                except Exception as exc:  # the store is away: the next renewal tries again
                    log.warning("renewing the lease of session %s failed: %s", session_id, exc)

        renewal = asyncio.create_task(renew())
        try:
            yield True
        finally:
            renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewal
            self._based.pop(session_id, None)
            with contextlib.suppress(Exception):
                await shared.release(session_id, self.replica)

    async def session_info(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """GET sessions/{id} (through the shared store when there is one)."""
        if self.shared is None:
            return self.role.session_info(principal, session_id)
        await self._fetch(session_id)
        try:
            return self.role.session_info(principal, session_id)
        finally:
            self._evict(session_id)

    async def checkpoint(self, principal: Principal, session_id: uuid.UUID, cp: SessionCheckpoint, *,
                         done: bool = False) -> CheckpointAck:
        """PUT sessions/{id}/checkpoint. With a shared store the role judges the stored session and the result is
        written back only if nobody wrote it since (else judged again): the highest checkpoint wins, and a
        checkpoint of an epoch another replica just ended is refused, atomically."""
        if self.shared is None:
            return self.role.checkpoint(principal, session_id, cp, done=done)
        for _ in range(_CAS_TRIES):
            session = await self._fetch(session_id)
            try:
                ack = self.role.checkpoint(principal, session_id, cp, done=done)
            finally:
                self._evict(session_id)
            assert session is not None  # role.checkpoint raised NotFound otherwise
            if await self.shared.save(session_id, stored_session(session), self._ttl_ms(session)) is not None:
                return ack
        raise Unavailable(f"session {session_id}: too many concurrent writes")

    async def instances(self, viewer: Principal | None = None) -> list[dict[str, object]]:
        await self.refresh()
        return self.role.instances(viewer)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    async def report_status_shared(self, principal: Principal, instance_id: str,
                                   record: InstanceStatusRecord) -> StateMessage:
        """PUT instances/{instance-id}/status with a shared store: judged on every replica's view of the instance,
        written through (the store refuses an epoch lower than one any replica accepted)."""
        await self.refresh()
        answer = self.report_status(principal, instance_id, record)
        await self._push_status(record.instance)
        return answer

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
        if self.shared is not None:
            await self.refresh()
        if self.role.state_answered(instance, answered):
            self._activated()
        await self._push_status(instance)
        return answered

    def _activated(self) -> None:
        waiting, self._activation = self._activation, None
        if waiting is not None:
            waiting.set()

    # -- placement ------------------------------------------------------------------------------------------------

    async def _place(self, session: PlacedSession) -> bool:
        """Place *session* (its epoch already fresh): carry out the role's :class:`PlacementPlan` step by step."""
        plan = PlacementPlan(self.role, session, can_start=self.starter is not None)
        for step in plan:
            await self._carry_out(step, session)
        return plan.placed

    async def _carry_out(self, step: PlacementStep, session: PlacedSession) -> None:
        """The I/O of one step of a placement, its result written into the step for the plan to judge."""
        if isinstance(step, LookupStep):
            step.found = await self.role.index.lookup(self.role.principal, step.request)
        elif isinstance(step, WakeStep):
            try:
                step.answered = await self.set_instance_state(step.instance, InstanceState.ACTIVE)
            except (Problem, OSError) as exc:
                log.warning("waking %s failed: %s", step.instance, exc)
        elif isinstance(step, StartHookStep):
            assert self.starter is not None  # the plan runs the hook only when there is one
            try:
                await self.starter.start(step.reason)
            except Exception as exc:  # a broken hook must not fail the request; it is placed on what exists
                log.error("the start hook failed: %s", exc)
                return
            step.ran = True
            self._activation = asyncio.Event()  # for the hook's instance: set when an instance becomes active
        elif isinstance(step, AwaitInstanceStep):
            step.activated = await self._await_instance(step.wait_s)
        elif isinstance(step, PrefetchStep):
            try:
                await self.link.prefetch(step.instance, step.directive)
            except (Problem, OSError) as exc:
                step.error = exc
        elif isinstance(step, StoreStep):
            await self._persist(session)
        else:
            try:
                await self._send(step.assignment, session)
            except (Problem, OSError) as exc:
                step.error = exc

    async def _await_instance(self, wait_s: float) -> bool:
        """Whether an instance becomes active within *wait_s* seconds (the start hook's, or any)."""
        waiting = self._activation = self._activation or asyncio.Event()
        try:
            async with asyncio.timeout(wait_s):
                await self._until_activated(waiting)
        except TimeoutError:
            log.warning("no instance became active within %d ms of the start hook",
                        self.role.config.start_timeout_ms)
            return False
        return True

    def _active(self) -> set[str]:
        return {i for i in self.role.known_instances() if self.role.status.state(i) is InstanceState.ACTIVE}

    async def _until_activated(self, waiting: asyncio.Event) -> None:
        """Until an instance becomes active. A report to this replica sets *waiting*; with a shared store the report
        may reach another replica (the start hook's instance reports to any), so the stored statuses are read every
        ``_ACTIVATION_POLL_S`` too: an instance active there that was not active here before counts."""
        if self.shared is None:
            await waiting.wait()
            return
        before = self._active()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_ACTIVATION_POLL_S):
                    await waiting.wait()
            if waiting.is_set():
                return
            try:
                await self.refresh()
            except Exception as exc:  # the store is away: look again at the next poll
                log.warning("reading the instance statuses failed: %s", why(exc))
                continue
            if self._active() - before:
                self.role.activated_elsewhere()
                self._activated()
                return

    async def _send(self, assignment: Assignment, session: PlacedSession) -> None:
        # The session's owner goes with every start and resume, so the instance serves the session's token stream
        # and state only to it (and the PC): docs/wire.md, "Session owner" (extension).
        message = dataclasses.replace(assignment.message, owner=session.owner)
        if isinstance(message, SessionResume):
            await self.link.resume(assignment.instance, session.id, message)
        else:
            await self.link.start(assignment.instance, message)

    def _lock(self, session_id: uuid.UUID) -> asyncio.Lock:
        return self._locks.setdefault(session_id, asyncio.Lock())

    async def _admit(self, principal: Principal, request: SessionRequest) -> Admitted | SessionInfo:
        """The role's admission; with a shared store, on the stored session, and the new one stored (only once:
        a concurrent POST of the same session at another replica is a retry here)."""
        if self.shared is None:
            admission = self.role.admit(principal, request)
            return admission if isinstance(admission, Admitted) else admission.info
        await self.refresh()
        for _ in range(_CAS_TRIES):
            await self._fetch(request.session)
            try:
                admission = self.role.admit(principal, request)
            finally:
                self._evict(request.session)
            if not isinstance(admission, Admitted):
                return admission.info
            session = admission.session
            try:
                version = await self.shared.save(session.id, stored_session(session), self._ttl_ms(session))
            except BaseException:
                self.role.abandon(session)
                raise
            if version is not None:
                session.version = version
                return admission
            self.role.abandon(session)  # another replica stored it meanwhile: the next try finds it (a retry)
        raise Unavailable(f"session {request.session}: too many concurrent writes")

    async def create_session(self, principal: Principal, request: SessionRequest) -> tuple[SessionInfo, bool]:
        """POST sessions: place and start the session; (its info, whether it was created now)."""
        admission = await self._admit(principal, request)
        if not isinstance(admission, Admitted):  # a retry of the same request
            if self.shared is not None and admission.state is SessionState.PLACING:
                return await self._placement_of(principal, request.session), False
            return admission, False
        session = admission.session
        try:
            return await self._place_admitted(session), True
        finally:  # however it ended (a store that went away too): no longer one of its owner's placements
            self.role.admission.ended(session)

    async def _place_admitted(self, session: PlacedSession) -> SessionInfo:
        started = time.perf_counter()
        async with self._lock(session.id), self._leased(session.id) as held:
            if not held:  # another replica took it over already (it cannot, unless this one stalled)
                raise Unavailable(f"session {session.id} is being placed by another replica")
            self._based[session.id] = session.epoch
            try:
                placed = await self._place(session)
            except BaseException:
                self.role.abandon(session)
                if self.shared is not None:
                    with contextlib.suppress(Exception):
                        await self.shared.delete(session.id)
                raise
            if not placed:
                problem = self.role.unplaced(session)
                if self.shared is not None:
                    await self.shared.delete(session.id)
                raise problem
            info = self.role.placed(session, time.perf_counter() - started)
            await self._persist(session)
            self._evict(session.id)
            return info

    async def _placement_of(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """A retry of ``POST sessions`` for a session another replica admitted and is placing (the client's first
        try timed out or failed, e.g. that replica died): wait for its placement, or -- once that replica no longer
        holds the session's placement lease -- take the placement over (:meth:`PlacementController.
        take_over_placement`) and place it here. Found by ``kvsp-quic chaos`` (fault is-kill)."""
        assert self.shared is not None
        deadline = time.monotonic() + (2 * self.role.config.lease_ms + self.role.config.start_timeout_ms) / 1000
        while True:
            await asyncio.sleep(0.1)  # the admitting replica takes the lease right after it stored the session
            try:
                info = await self.session_info(principal, session_id)
            except NotFound:  # its placement failed meanwhile (the session is forgotten)
                raise Unavailable(f"no active instance took the session {session_id}") from None
            if info.state is not SessionState.PLACING:
                return info
            async with self._lock(session_id), self._leased(session_id) as held:
                if held:
                    session = await self._fetch(session_id)
                    if session is None:
                        raise Unavailable(f"no active instance took the session {session_id}")
                    if session.state is not SessionState.PLACING:
                        self._evict(session_id)
                        return session.info()
                    self._based[session.id] = session.epoch
                    self.role.take_over_placement(session)
                    try:
                        await self._persist(session, strict=True)
                        placed = await self._place(session)
                    except BaseException:
                        self._evict(session_id)
                        raise
                    if not placed:
                        problem = self.role.unplaced(session)
                        await self.shared.delete(session.id)
                        raise problem
                    self.role.migrated(session)
                    await self._persist(session)
                    self._evict(session.id)
                    return session.info()
            if time.monotonic() > deadline:
                raise Unavailable(f"session {session_id} is still being placed by another replica")

    async def cancel_session(self, principal: Principal, session_id: uuid.UUID) -> None:
        """``DELETE sessions/{id}`` (extension; docs/wire.md, "Cancelling a session"): only the session's creator
        (404 for anyone else); the PC forgets the session (never migrates it) and tells its instance to stop the
        run and free its slot. The instance's answer is not waited for beyond the link's timeout, nor required."""
        await self.session_info(principal, session_id)
        async with self._lock(session_id):
            session = self.role.sessions.get(session_id) if self.shared is None else await self._fetch(session_id)
            if session is None:
                return
            instance = session.instance
            self.role.abandon(session)
            if self.shared is not None:
                await self.shared.delete(session_id)
        log.info("session %s cancelled by its creator (instance %s)", session_id, instance)
        if instance is not None:
            try:
                await self.link.cancel(instance, session_id)
            except (Problem, OSError) as exc:
                log.info("session %s: the cancel at %s failed: %s", session_id, instance, exc)

    # -- failures -------------------------------------------------------------------------------------------------

    async def migrate(self, session: PlacedSession, lost_epoch: int | None = None) -> bool:
        """Move *session* off its failed instance (see the role's ``begin_migration``; with *lost_epoch*, also when
        a verified suspect report found its run of that epoch lost). False when no instance took it (retried at
        the next tick)."""
        async with self._lock(session.id):
            if not (self.role.needs_migration(session) or self.role.lost(session, lost_epoch)):
                return True
            self.role.begin_migration(session)
            if not await self._place(session):
                return False
            self.role.migrated(session)
            return True

    async def migrate_shared(self, session_id: uuid.UUID, lost_epoch: int | None = None) -> bool:
        """:meth:`migrate` with a shared store: under the session's lease, on the stored session; the epoch
        increment is a compare-and-set, so of several replicas that decide to migrate it one does, and the others
        stand down (False, as when no instance took it: the next tick looks again)."""
        assert self.shared is not None
        async with self._lock(session_id), self._leased(session_id) as held:
            if not held:
                return False
            session = await self._fetch(session_id)
            self._evict(session_id)
            if session is None:
                await self.shared.forget(session_id)
                return True
            if not (self.role.needs_migration(session) or self.role.lost(session, lost_epoch)):
                return True
            self._based[session_id] = session.epoch
            try:
                self.role.begin_migration(session)
                await self._persist(session, strict=True)
                if not await self._place(session):
                    return False
                self.role.migrated(session)
                await self._persist(session)
            except Superseded as exc:
                log.info("migration of session %s: standing down (%s)", session_id, exc)
                return False
            return True

    # -- suspect reports (extension: docs/wire.md, "Suspect reports") -------------------------------------------

    async def suspect(self, principal: Principal, session_id: uuid.UUID, report: SuspectReport) -> SuspectAnswer:
        """``POST sessions/{id}/suspect``: the session's creator saw its token stream break or stall. The PC never
        moves a session on that word alone: it probes the run (``GET sessions/{id}`` at the instance, within
        ``suspect_probe_ms``, and once more within twice that after a timeout: the client drops a connection that
        timed out, so the second goes afresh); an answer is a false alarm (``healthy``); none holds the run failed (in
        the shared store too, so every replica's tick moves its other sessions) and the session is migrated at
        once, without waiting for the status to expire. The answer waits (up to ``suspect_wait_ms``) for the
        session's new instance: ``moved`` with it, else ``migrating``."""
        if self.shared is not None:
            await self.refresh()
            await self._fetch(session_id)
        try:
            step = self.role.suspect(principal, session_id, report)
            session = self.role.sessions[session_id]
        finally:
            self._evict(session_id)
        if step is SuspectStep.PROBE:
            assert session.instance is not None
            instance, run = session.instance, session.instance_epoch
            first = self.role.config.suspect_probe_ms / 1000
            health = RunHealth.SILENT
            for timeout, last in ((first, False), (2 * first, True)):  # silence once: again, longer, afresh
                error: Problem | OSError | None = None
                try:
                    await self.link.probe(instance, session_id, timeout)
                except (Problem, OSError) as exc:
                    error = exc
                health = self.role.probe_outcome(session, error, last=last)
                if health is not RunHealth.SILENT:
                    break
            if health is RunHealth.ALIVE:
                return SuspectAnswer.of(await self.session_info(principal, session_id), Verdict.HEALTHY)
            if health is RunHealth.DEAD:
                if self.shared is not None and run is not None:
                    await self.shared.fail_status(instance, run)
                    await self.refresh()  # every replica's view, without the run (a tick may have read it back)
                self.kick.set()  # the tick moves the run's other sessions
            step = SuspectStep.MIGRATE
        if step is SuspectStep.MIGRATE:
            if self.shared is None:
                if self.role.sessions.get(session_id) is session:  # not cancelled meanwhile
                    await self.migrate(session, report.epoch)
            else:
                await self.migrate_shared(session_id, report.epoch)
        return await self._moved(principal, session_id, report.epoch)

    async def _moved(self, principal: Principal, session_id: uuid.UUID, epoch: int) -> SuspectAnswer:
        """The session once it is past *epoch* (``moved``), or as it is after ``suspect_wait_ms`` (``migrating``)."""
        deadline = time.monotonic() + self.role.config.suspect_wait_ms / 1000
        while True:
            info = await self.session_info(principal, session_id)
            if info.epoch > epoch or info.state is SessionState.DONE:
                return SuspectAnswer.of(info, Verdict.MOVED)
            if time.monotonic() >= deadline:
                return SuspectAnswer.of(info, Verdict.MIGRATING)
            await asyncio.sleep(0.02)

    def _failed_run(self, instance: str, instance_epoch: int) -> bool:
        status = self.role.status
        state = status.state(instance)
        highest = status.highest_epoch(instance)
        return state is None or state is InstanceState.FAILED or (highest is not None and highest > instance_epoch)

    async def tick_shared(self) -> list[asyncio.Task[bool]]:
        """:meth:`tick` with a shared store: every replica's statuses, then the sessions of the instance runs that
        failed and those waiting for a migration (the store expires old sessions itself)."""
        assert self.shared is not None
        await self.refresh()
        due = await self.shared.candidates(self._failed_run)
        if self._closing:
            return []
        started = [self._spawn(i, self.migrate_shared(i)) for i in due if i not in self._migrating]
        for session_id in [i for i, lock in self._locks.items() if i not in self._migrating and not lock.locked()]:
            del self._locks[session_id]
        return started

    def tick(self) -> list[asyncio.Task[bool]]:
        """Start the migrations that are due (each in its own task, returned) and forget old sessions."""
        if self._closing:
            return []
        started = [self._spawn(s.id, self.migrate(s)) for s in self.role.tick() if s.id not in self._migrating]
        for session_id in [i for i, lock in self._locks.items() if i not in self.role.sessions and not lock.locked()]:
            del self._locks[session_id]
        return started

    def _spawn(self, session_id: uuid.UUID, work: Coroutine[Any, Any, bool]) -> asyncio.Task[bool]:
        self._migrating.add(session_id)
        task = asyncio.create_task(work)
        self._tasks.add(task)

        def done(t: asyncio.Task[bool]) -> None:
            self._tasks.discard(t)
            self._migrating.discard(session_id)
            if not t.cancelled() and t.exception() is not None:
                log.error("migrating session %s failed", session_id, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def run(self, interval: float) -> None:
        """Tick every *interval* seconds, and at once when a report says an instance failed or restarted."""
        while True:
            self.kick.clear()
            if self.shared is None:
                self.tick()
            else:
                try:
                    await self.tick_shared()
                except Exception as exc:  # the store is away: the next tick tries again
                    log.warning("controller tick failed: %s", why(exc))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.kick.wait()

    async def aclose(self) -> None:
        """Stop: no migration starts from now on (a replica that is going away must not begin one it cannot
        finish), and those under way are cancelled and awaited."""
        self._closing = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    # -- resharding (kvsp_runtime/controller_maps.py) -----------------------------------------------------------------

    async def get_map(self, map_id: str) -> ShardMap:
        return await self.maps.get_map(map_id)

    async def has_map(self, map_id: str) -> bool:
        return await self.maps.has_map(map_id)

    async def put_map(self, shard_map: ShardMap, context: ReshardContext | None = None) -> ReshardOutcome:
        return await self.maps.put_map(shard_map, context)

    async def reshard(self, new: ShardMap, deadline_ms: int | None = None,
                      context: ReshardContext | None = None) -> ReshardOutcome:
        return await self.maps.reshard(new, deadline_ms, context)


__all__ = ["ControllerService", "Superseded"]
