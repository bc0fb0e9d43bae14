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

The PC's state lives in a :class:`~kvsp_quic.storage.control_store.ControlStore`, with one code path whether one
process holds it (:class:`~kvsp_quic.storage.memory_control.MemoryControlStore`, the default) or several replicas
share it (:class:`~kvsp_quic.storage.redis_control.RedisControlStore`): every decision reads the stored session
(and the instance statuses) into the role first and writes the result back with a compare-and-set on its version;
a session is placed or migrated under its lease. The role's table of sessions holds the copy this process last read
or wrote of each (what its metrics and the clients' session limits count).

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
from kvsp_quic.roles.controller_admission import SessionsAtLimit
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
from kvsp_quic.storage.memory_control import MemoryControlStore
from kvsp_runtime.controller_link import InstanceLink, Starter
from kvsp_runtime.controller_maps import ShardMaps, why

log = logging.getLogger("kvsp.controller")


# -- the adapter ----------------------------------------------------------------------------------------------


class Superseded(Exception):
    """The session this replica was placing is gone, or another writer (a replica sharing the store) moved it on to
    a higher epoch: this one stands down."""


_CAS_TRIES = 16
_STORE_POLL_S = 0.1  # how often a wait for another replica's change (an active instance, a move) reads the store
_MIN_TICK_S = 0.01  # the failure check runs at most this often
_IDLE_TICK_S = 1.0  # and at least this often with a store only this process writes (else every tick interval)


class ControllerService:
    """The asyncio side of the Placement Controller (see the module docstring). ``role`` answers everything that
    needs no I/O (instances, shard maps, metrics); *store* (default: a :class:`MemoryControlStore` on the role's
    clock) holds the state."""

    def __init__(self, role: PlacementController, link: InstanceLink, *, starter: Starter | None = None,
                 store: ControlStore | None = None, replica: str | None = None) -> None:
        self.role = role
        self.link = link
        self.starter = starter
        self.store: ControlStore = store if store is not None else MemoryControlStore(role.clock)
        self.replica = replica or uuid.uuid4().hex  # this replica's name on the leases it takes
        self._based: dict[uuid.UUID, int] = {}  # per session this replica places: the epoch it last stored
        self._statuses_seen: int | None = None  # the store's revision of the statuses the role's table holds
        self.kick = asyncio.Event()  # set when a report makes a failover likely: the ticker runs at once
        self._activation: asyncio.Event | None = None  # set when an instance becomes active (the hook's waiters)
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[bool]] = set()
        self._migrating: set[uuid.UUID] = set()
        self._closing = False  # aclose() began: no migration starts any more
        self._next_tick = float("inf")  # when the ticker wakes next (role clock): a report due earlier kicks it
        self._migrations_due = False  # the last tick found sessions to migrate (they may wait for an instance)
        self._saved: dict[uuid.UUID, set[asyncio.Event]] = {}  # set when this process stores the session
        self._read_again_at: dict[str, float] = {}  # per identity at its session limit: when it was read again
        self.maps = ShardMaps(role, link, self.store, self.replica)  # the shard maps and their resharding

    # -- the store: read before a decision, write after it --------------------------------------------------------

    async def refresh(self) -> None:
        """Load the stored instance statuses (every replica's reports) into the role's table, unless the store says
        they did not change since the revision the table holds (the table then is the stored view)."""
        snapshot = await self.store.statuses(self._statuses_seen)
        if snapshot is not None:
            load_statuses(self.role, snapshot)
            self._statuses_seen = snapshot.revision

    async def _push_status(self, instance: str) -> None:
        """Write the role's view of *instance* to the store (StaleEpoch when another writer knows a newer run)."""
        status = stored_status(self.role, instance)
        if status is None:
            return
        written = await self.store.put_status(status)
        if written.higher is not None:
            raise StaleEpoch(f"instance {instance!r}: epoch {status.record.epoch} is older than {written.higher}")
        if written.revisions is not None and written.revisions[0] == self._statuses_seen:
            self._statuses_seen = written.revisions[1]  # nobody wrote between: the table holds what is stored

    def _ttl_ms(self, session: PlacedSession) -> int:
        config = self.role.config
        return config.done_ttl_ms if session.state is SessionState.DONE else config.session_ttl_ms

    async def _fetch(self, session_id: uuid.UUID) -> PlacedSession | None:
        """The stored session, put in the role's table for the decision that follows (None: there is none)."""
        stored = await self.store.load(session_id)
        if stored is None:
            self.role.sessions.pop(session_id, None)
            return None
        session = placed_session(stored, self.role.clock())
        self.role.sessions[session_id] = session
        return session

    def _hold(self, session: PlacedSession) -> None:
        """*session* was just stored: it is the copy the role's table holds, unless a newer one was read since."""
        held = self.role.sessions.get(session.id)
        if held is None or held.version <= session.version:
            self.role.sessions[session.id] = session

    async def _save(self, session: PlacedSession) -> bool:
        """Write *session* if nobody wrote it since it was read (its version); True when written."""
        version = await self.store.save(session.id, stored_session(session), self._ttl_ms(session))
        if version is None:
            return False
        session.version = version
        self._hold(session)
        for waiting in self._saved.get(session.id, ()):
            waiting.set()
        return True

    async def _persist(self, session: PlacedSession, *, strict: bool = False) -> None:
        """Write back what the placement of *session* (under its lease) changed. When another writer stored it since
        -- a checkpoint -- that is taken in and the write is tried again; *strict* (an epoch increment decided on
        what was read) or a session gone or moved to another epoch: :class:`Superseded`."""
        for _ in range(_CAS_TRIES):
            if await self._save(session):
                self._based[session.id] = session.epoch
                return
            stored = await self.store.load(session.id)
            if stored is None:
                raise Superseded(f"session {session.id} is gone")
            fresh = placed_session(stored, self.role.clock())
            if strict or fresh.epoch != self._based.get(session.id, fresh.epoch):
                raise Superseded(f"session {session.id} is at epoch {fresh.epoch} at another replica")
            session.adopt(fresh)
        raise Unavailable(f"session {session.id}: too many concurrent writes")

    @contextlib.asynccontextmanager
    async def _leased(self, session_id: uuid.UUID) -> AsyncIterator[bool]:
        """Hold the session's placement lease (renewed) for the block; yields False when another replica holds it
        (this one stands down)."""
        store, ttl_ms = self.store, self.role.config.lease_ms
        if not await store.lease(session_id, self.replica, ttl_ms):
            yield False
            return

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl_ms / 3000)
                try:
                    await store.lease(session_id, self.replica, ttl_ms)
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
                await store.release(session_id, self.replica)

    async def session_info(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """GET sessions/{id}: the stored session, as the role shows it to its creator (404 for anyone else)."""
        await self._fetch(session_id)
        return self.role.session_info(principal, session_id)

    async def checkpoint(self, principal: Principal, session_id: uuid.UUID, cp: SessionCheckpoint, *,
                         done: bool = False) -> CheckpointAck:
        """PUT sessions/{id}/checkpoint: the role judges the stored session and the result is written back only if
        nobody wrote it since (else judged again): the highest checkpoint wins, and a checkpoint of an epoch another
        replica just ended is refused, atomically."""
        for _ in range(_CAS_TRIES):
            session = await self._fetch(session_id)
            ack = self.role.checkpoint(principal, session_id, cp, done=done)
            assert session is not None  # role.checkpoint raised NotFound otherwise
            if await self._save(session):
                return ack
        raise Unavailable(f"session {session_id}: too many concurrent writes")

    async def instances(self, viewer: Principal | None = None) -> list[dict[str, object]]:
        await self.refresh()
        return self.role.instances(viewer)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    async def report_status(self, principal: Principal, instance_id: str,
                            record: InstanceStatusRecord) -> StateMessage:
        """PUT instances/{instance-id}/status: judged by the role on the stored view of the instance (every
        replica's), written through (the store refuses an epoch lower than one any replica accepted); wakes whoever
        waits for it, and the ticker when a failover is likely, an instance became active (migrations waiting for
        one) or the status expires before the ticker's next look."""
        await self.refresh()
        report = self.role.report_status(principal, instance_id, record)
        if report.activated:
            self._activated()
        expires_at = report.expires_at
        if report.failover_due or report.activated or (expires_at is not None and expires_at < self._next_tick):
            self.kick.set()
        await self._push_status(record.instance)
        return report.answer

    async def set_instance_state(self, instance: str, state: InstanceState) -> InstanceState:
        """PUT state on *instance*; the state it answered is held from then on."""
        self.role.check_state_change(instance, state)
        answered = await self.link.set_state(instance, state)
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
        """Until an instance becomes active. A report to this replica sets *waiting*; the report may reach another
        replica sharing the store (the start hook's instance reports to any), so the stored statuses are read every
        ``_STORE_POLL_S`` too: an instance active there that was not active here before counts."""
        before = self._active()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_STORE_POLL_S):
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
        """The role's admission on the stored session, and the new one stored (only once: a concurrent POST of the
        same session at another replica is a retry here)."""
        await self.refresh()
        for _ in range(_CAS_TRIES):
            await self._fetch(request.session)
            try:
                admission = self.role.admit(principal, request)
            except SessionsAtLimit:
                if not await self._read_again(principal.identity):
                    raise
                admission = self.role.admit(principal, request)
            if not isinstance(admission, Admitted):
                return admission.info
            session = admission.session
            try:
                stored = await self._save(session)
            except BaseException:
                self.role.abandon(session)
                raise
            if stored:
                return admission
            self.role.abandon(session)  # another replica stored it meanwhile: the next try finds it (a retry)
        raise Unavailable(f"session {request.session}: too many concurrent writes")

    async def _read_again(self, identity: str) -> bool:
        """*identity* is at its session limit as the role's table holds its sessions: read them from the store again
        (another replica may have seen some end), at most once per ``client_retry_ms`` per identity. True when they
        were read."""
        now, every = time.monotonic(), self.role.config.client_retry_ms / 1000
        last = self._read_again_at.get(identity)
        if last is not None and now - last < every:
            return False
        self._read_again_at = {i: t for i, t in self._read_again_at.items() if now - t < every}
        self._read_again_at[identity] = now
        for session_id in self.role.admission.live(identity, self.role.sessions):
            await self._fetch(session_id)
        return True

    async def create_session(self, principal: Principal, request: SessionRequest) -> tuple[SessionInfo, bool]:
        """POST sessions: place and start the session; (its info, whether it was created now). A retry of a
        session still being placed waits for that placement (:meth:`_placement_of`)."""
        admission = await self._admit(principal, request)
        if not isinstance(admission, Admitted):  # a retry of the same request
            if admission.state is SessionState.PLACING:
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
                with contextlib.suppress(Exception):
                    await self.store.delete(session.id)
                raise
            if not placed:
                problem = self.role.unplaced(session)
                await self.store.delete(session.id)
                raise problem
            info = self.role.placed(session, time.perf_counter() - started)
            await self._persist(session)
            return info

    async def _placement_of(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """A retry of ``POST sessions`` for a session that is being placed (the client's first try timed out or
        failed, e.g. the replica that admitted it died): wait for its placement, or -- once nobody holds the
        session's placement lease -- take the placement over (:meth:`PlacementController.take_over_placement`) and
        place it here. Found by ``kvsp-quic chaos`` (fault is-kill)."""
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
                        return session.info()
                    self._based[session.id] = session.epoch
                    self.role.take_over_placement(session)
                    await self._persist(session, strict=True)
                    if not await self._place(session):
                        problem = self.role.unplaced(session)
                        await self.store.delete(session.id)
                        raise problem
                    self.role.migrated(session)
                    await self._persist(session)
                    return session.info()
            if time.monotonic() > deadline:
                raise Unavailable(f"session {session_id} is still being placed by another replica")

    async def cancel_session(self, principal: Principal, session_id: uuid.UUID) -> None:
        """``DELETE sessions/{id}`` (extension; docs/wire.md, "Cancelling a session"): only the session's creator
        (404 for anyone else); the PC forgets the session (never migrates it) and tells its instance to stop the
        run and free its slot. The instance's answer is not waited for beyond the link's timeout, nor required."""
        await self.session_info(principal, session_id)
        async with self._lock(session_id):
            session = await self._fetch(session_id)
            if session is None:
                return
            instance = session.instance
            self.role.abandon(session)
            await self.store.delete(session_id)
        log.info("session %s cancelled by its creator (instance %s)", session_id, instance)
        if instance is not None:
            try:
                await self.link.cancel(instance, session_id)
            except (Problem, OSError) as exc:
                log.info("session %s: the cancel at %s failed: %s", session_id, instance, exc)

    # -- failures -------------------------------------------------------------------------------------------------

    async def migrate(self, session_id: uuid.UUID, lost_epoch: int | None = None) -> bool:
        """Move the session off its failed instance (the role's ``begin_migration``; with *lost_epoch*, also when
        a verified suspect report found its run of that epoch lost), under the session's lease, on the stored
        session. The epoch increment is a compare-and-set, so of several replicas that decide to migrate it one
        does, and the others stand down. False when no instance took it, or this replica stood down (the next
        tick looks again)."""
        async with self._lock(session_id), self._leased(session_id) as held:
            if not held:
                return False
            session = await self._fetch(session_id)
            if session is None:
                await self.store.forget(session_id)
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
        the store too, so every replica's tick moves its other sessions) and the session is migrated at once,
        without waiting for the status to expire. The answer waits (up to ``suspect_wait_ms``) for the session's
        new instance: ``moved`` with it, else ``migrating``."""
        await self.refresh()
        await self._fetch(session_id)
        step = self.role.suspect(principal, session_id, report)
        session = self.role.sessions[session_id]
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
                if run is not None:
                    await self.store.fail_status(instance, run)
                    await self.refresh()  # every replica's view, without the run (a tick may have read it back)
                self.kick.set()  # the tick moves the run's other sessions
            step = SuspectStep.MIGRATE
        if step is SuspectStep.MIGRATE:
            await self.migrate(session_id, report.epoch)
        return await self._moved(principal, session_id, report.epoch)

    async def _moved(self, principal: Principal, session_id: uuid.UUID, epoch: int) -> SuspectAnswer:
        """The session once it is past *epoch* (``moved``), or as it is after ``suspect_wait_ms`` (``migrating``).
        Read again whenever this process stores the session (its migration), and every ``_STORE_POLL_S`` when
        another replica may move it."""
        deadline = time.monotonic() + self.role.config.suspect_wait_ms / 1000
        while True:
            info = await self.session_info(principal, session_id)
            if info.epoch > epoch or info.state is SessionState.DONE:
                return SuspectAnswer.of(info, Verdict.MOVED)
            left = deadline - time.monotonic()
            if left <= 0:
                return SuspectAnswer.of(info, Verdict.MIGRATING)
            saved = asyncio.Event()
            waiting = self._saved.setdefault(session_id, set())
            waiting.add(saved)
            try:
                async with asyncio.timeout(min(left, _STORE_POLL_S) if self.store.shared else left):
                    await saved.wait()
            except TimeoutError:
                pass
            finally:
                waiting.discard(saved)
                if not waiting and self._saved.get(session_id) is waiting:
                    del self._saved[session_id]

    def _failed_run(self, instance: str, instance_epoch: int) -> bool:
        status = self.role.status
        state = status.state(instance)
        highest = status.highest_epoch(instance)
        return state is None or state is InstanceState.FAILED or (highest is not None and highest > instance_epoch)

    async def tick(self) -> list[asyncio.Task[bool]]:
        """Every replica's statuses, then a migration (each in its own task, returned) for each session of an
        instance run that failed and each waiting for a migration (the store expires old sessions itself; the
        role's table forgets them)."""
        await self.refresh()
        due = await self.store.candidates(self._failed_run)
        self._migrations_due = bool(due)
        self.role.forget_expired()
        if self._closing:
            return []
        started = [self._spawn(i, self.migrate(i)) for i in due if i not in self._migrating]
        for session_id in [i for i, lock in self._locks.items() if i not in self._migrating and not lock.locked()]:
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
        """The failure check: a tick when the role next has something to find (its ``next_due()``: the earliest
        expiry of an instance status), at once on :attr:`kick` (a report of a failure, a restart, an active instance,
        or a status expiring before that), within *interval* seconds while sessions wait for a migration, and at
        least every *interval* seconds when other processes write the store (their reports are seen only by reading
        it), else every ``_IDLE_TICK_S``; never more often than every ``_MIN_TICK_S``."""
        clock = self.role.clock
        while True:
            self.kick.clear()
            try:
                await self.tick()
            except Exception as exc:  # the store is away: the next tick tries again
                log.warning("controller tick failed: %s", why(exc))
            longest = interval if self.store.shared or self._migrations_due else max(interval, _IDLE_TICK_S)
            due = self.role.next_due()
            wait = longest if due is None else min(longest, max(_MIN_TICK_S, due - clock()))
            self._next_tick = clock() + wait
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
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
