"""The Placement Controller role (spec: "Instance Status and Lifecycle", "Placement Inputs", "Prefetch
Directives", "Session Checkpoints and Migration", "Sequence-Sharded Caches and Resharding").

Protocol rules only: no HTTP, no asyncio, no processes. :class:`PlacementController` holds the PC's state
(sessions, shard maps, sessions assigned since the last reports, the start hook's timing) and decides; its asyncio
adapter, ``kvsp_runtime.controller_service.ControllerService``, carries out what it decides (lookups on the Index
Service, requests to instances, the start hook, the tick loop, the reshard fan-out) and reports the results back,
which the role judges (the outcome types of :mod:`kvsp_quic.roles.controller_sessions`). It runs in the Index Service's
process (the spec allows combining them; docs/wire.md, "Placement Controller") and reads instance states from the
:class:`~kvsp_quic.roles.status.StatusTable`; the clock (monotonic seconds) and identifiers are injected.

* **Lifecycle**: status reports go through :meth:`PlacementController.report_status` (epochs, expiry -> failed,
  sleep requests: :class:`~kvsp_quic.roles.status.LifecyclePolicy`).
* **Admission**: ``POST sessions`` for a new session passes the PC's and the client's limits
  (:class:`~kvsp_quic.roles.controller_admission.SessionAdmission`: 429 with ``retry_after_s``, 503); a retry of a
  session its principal created is answered, never refused (:meth:`~PlacementController.admit`). The settings are
  :class:`~kvsp_quic.roles.controller_config.ControllerConfig`, the ``[controller]`` section.
* **Placement**: a lookup of the prompt's Block Keys with every alive *active* instance of the session's scope as
  a target (:meth:`~PlacementController.placement_query`), ranked by the configured placement policy
  (:mod:`kvsp_quic.roles.placement`; default: the spec's cost). Only active instances whose principal holds the
  session's scope are ever candidates (the scopes of the principal that reported each instance's status,
  :meth:`~PlacementController.serves_scope`; docs/wire.md, "Placement Controller"), and each is re-checked right
  before a directive or a start is sent to it (:meth:`~PlacementController.still_active`). The sequence of a
  placement (rank, capacity, rank again, try) is :class:`~kvsp_quic.roles.controller_placement.PlacementPlan`'s,
  which yields the I/O steps the adapter carries out.
* **Prefetch**: before the session starts, the chosen instance gets ``POST prefetch`` for the matched blocks it
  does not hold (when loading beats recomputing, :meth:`~PlacementController.directive`).
* **Capacity**: when no active instance has acceptable cost or capacity, a sleeping instance is woken, else the
  start hook is run (at most once per ``start_interval_ms``) and the request waits for an instance to become
  active (:meth:`~PlacementController.capacity_step`).
* **Sessions**: checkpoints keep the highest ``output_offset``; a lower epoch is 409 ``kvsp-stale-epoch``, a
  checkpoint from another instance than the session's current one 403. When the instance fails (its status
  expired, it reported ``failed``, it restarted with a higher epoch, or a start was not answered) the session's
  epoch is incremented first -- fencing the old instance -- and it is resumed on the next instance by the policy.
* **Suspect reports** *(extension, docs/wire.md "Suspect reports")*: a front end reports a session whose token
  stream broke or stalled (:meth:`~PlacementController.suspect`); the adapter probes the instance, the role judges
  the probe (:meth:`~PlacementController.probe_outcome`): a dead run is held failed as if its status had expired,
  and the session migrates at once (:meth:`~PlacementController.lost`) instead of at the status expiry.
* **Resharding**: plans from :func:`~kvsp_quic.roles.controller_reshard.plan_reshard` to every member
  (:meth:`~PlacementController.begin_reshard`), commit after every acknowledgement, abort when one is missing at
  ``deadline_ms`` (:meth:`~PlacementController.decide_reshard`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvsp_quic.auth import ALL, Principal, Role, Scopes, require_scope
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import BlockKey
from kvsp_quic.metrics import KvspMetrics, Registry
from kvsp_quic.problems import (
    BadRequest,
    Forbidden,
    Incompatible,
    InvalidState,
    NotFound,
    PlanConflict,
    Problem,
    ScopeDenied,
    StaleEpoch,
    Unavailable,
)
from kvsp_quic.records import (
    CheckpointAck,
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
    ReshardAbort,
    ReshardCommit,
    SessionCheckpoint,
    ShardMap,
)
from kvsp_quic.roles.controller_admission import SessionAdmission
from kvsp_quic.roles.controller_config import ControllerConfig
from kvsp_quic.roles.controller_lifecycle import SessionEvent
from kvsp_quic.roles.controller_records import (
    SessionInfo,
    SessionRequest,
    SessionResume,
    SessionStart,
    SessionState,
    SuspectReport,
)
from kvsp_quic.roles.controller_reshard import (
    ReshardMessage,
    ReshardOutcome,
    ReshardResult,
    ReshardRound,
    plan_reshard,
)
from kvsp_quic.roles.controller_sessions import (
    Admission,
    Admitted,
    Assignment,
    CapacityAction,
    CapacityStep,
    PlacedSession,
    PlacementQuery,
    PrefetchOutcome,
    Repeated,
    RunHealth,
    StartOutcome,
    StatusReport,
    SuspectStep,
    engines_agree,
    fail_run,
    judge_probe,
)
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.placement import Choice, PlacementInput, placement_policy, rank
from kvsp_quic.roles.status import InstanceStatus, StatusTable

log = logging.getLogger("kvsp.controller")

Clock = Callable[[], float]


_REFUSALS = (InvalidState, Incompatible)  # the instance definitely did not take the session


class PlacementController:
    """See the module docstring. ``index.status`` should use a :class:`~kvsp_quic.roles.status.LifecyclePolicy`
    (it decides sleep requests; with the default echo policy every sleep request is refused)."""

    def __init__(self, index: IndexService, *, clock: Clock, config: ControllerConfig | None = None,
                 metrics: Registry | None = None, identity: str = "urn:kvsp:controller",
                 new_id: Callable[[], uuid.UUID] = uuid.uuid4) -> None:
        self.index = index
        self.status: StatusTable = index.status
        self.clock = clock
        self.config = config or ControllerConfig()
        self.policy = placement_policy(self.config.placement_policy)
        self.admission = SessionAdmission(self.config)
        self.new_id = new_id
        # Lookups are made on the front end's behalf after its scope was checked: the PC's own principal.
        self.principal = Principal(identity, frozenset({Role.CONTROLLER}), ALL)
        # The sessions and maps the decisions are taken on: the adapter reads each from the control store before a
        # decision and keeps the copy it last read or wrote (what the metrics and the admission count).
        self.sessions: dict[uuid.UUID, PlacedSession] = {}
        self.maps: dict[str, ShardMap] = {}
        self._resharding: set[str] = set()
        self._pending: dict[str, int] = {}  # sessions assigned since the instance's last report
        self._scopes: dict[str, Scopes] = {}  # per instance: the scopes of the principal that reported its status
        self._start_wait_until: float | None = None  # a hook run's instance is awaited until then
        self._last_start: float | None = None
        self.registry = metrics or Registry()
        self._init_metrics()

    # -- metrics --------------------------------------------------------------------------------------------------

    def _init_metrics(self) -> None:
        reg = self.registry
        self.kvsp = KvspMetrics(reg)
        self.m_sessions = reg.counter("kvsp_controller_sessions_total", "Sessions asked for, by outcome",
                                      ("outcome",))
        self.m_prefetch = reg.counter("kvsp_prefetch_directives_total", "Prefetch directives sent, by outcome",
                                      ("outcome",))
        self.m_checkpoints = reg.counter("kvsp_checkpoints_total", "Checkpoints received, by outcome",
                                         ("outcome",))
        self.m_status = reg.counter("kvsp_status_reports_total", "Instance status reports, by outcome",
                                    ("outcome",))
        self.m_starts = reg.counter("kvsp_session_starts_total", "Session starts and resumes sent, by outcome",
                                    ("kind", "outcome"))
        self.m_reshards = reg.counter("kvsp_reshards_total", "Reshards, by outcome", ("outcome",))
        self.m_placement_tokens = reg.counter(
            "kvsp_placement_tokens_total", "Prompt tokens of placed sessions by what placement planned: loaded from "
            "the cache or recomputed", ("source",))
        self.m_hooks = reg.counter("kvsp_instance_starts_total", "Start hook runs and wake-ups", ("kind",))
        self.m_placement_seconds = reg.histogram("kvsp_placement_seconds", "Time to place a session (lookup, "
                                                 "prefetch, start)")
        self.m_migration_seconds = reg.histogram("kvsp_migration_seconds", "From detecting an instance failure to "
                                                 "the session resumed elsewhere",
                                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.m_suspects = reg.counter("kvsp_suspect_reports_total", "Suspect reports of sessions (extension), by "
                                      "reason", ("reason",))
        self.m_probes = reg.counter("kvsp_suspect_probes_total", "Probes of suspected instance runs, by outcome",
                                    ("outcome",))
        reg.gauge("kvsp_sessions", "Sessions the PC holds, by state", ("state",)).collect(self._session_states)
        reg.gauge("kvsp_instances", "Instances by the state the PC holds (failed: expired or reported)",
                  ("state",)).collect(self._instance_states)
        policy = self.status.policy
        if hasattr(policy, "sleep_accepted"):
            reg.counter("kvsp_sleep_requests_total", "Sleep requests, by answer", ("answer",)).collect(
                lambda: [({"answer": "draining"}, getattr(policy, "sleep_accepted", 0)),
                         ({"answer": "active"}, getattr(policy, "sleep_refused", 0))])

    def _session_states(self) -> list[tuple[dict[str, str], float]]:
        counts = dict.fromkeys(SessionState, 0)
        for s in list(self.sessions.values()):
            counts[s.state] += 1
        return [({"state": k.value}, float(v)) for k, v in counts.items()]

    def _instance_states(self) -> list[tuple[dict[str, str], float]]:
        counts = dict.fromkeys(InstanceState, 0)
        for instance in self.known_instances():
            state = self.status.state(instance)
            if state is not None:
                counts[state] += 1
        return [({"state": k.value}, float(v)) for k, v in counts.items()]

    def known_instances(self) -> list[str]:
        return self.status.instances()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def report_status(self, principal: Principal, instance_id: str, record: InstanceStatusRecord) -> StatusReport:
        """PUT instances/{instance-id}/status (the Index Service checks who may report)."""
        before = self.status.state(record.instance)
        previous_epoch = self.status.highest_epoch(record.instance)
        try:
            answer = self.index.report_status(principal, instance_id, record)
        except StaleEpoch:
            self.m_status.labels(outcome="stale").inc()
            raise
        self.m_status.labels(outcome="accepted").inc()
        self._scopes[record.instance] = principal.scopes  # the reporter is the instance (checked by the IS)
        self._pending.pop(record.instance, None)  # its running / queued now include what we assigned
        activated = answer.state is InstanceState.ACTIVE and before is not InstanceState.ACTIVE
        if activated:
            self._activated()
        restarted = previous_epoch is not None and record.epoch > previous_epoch
        entry = self.status.get(record.instance)
        return StatusReport(answer, activated, restarted or answer.state is InstanceState.FAILED,
                            entry.expires_at if entry is not None else None)

    def check_state_change(self, instance: str, state: InstanceState) -> None:
        """Raise unless the PC may send ``PUT state`` *state* to *instance* (a live one; never ``failed``)."""
        if self.status.get(instance) is None:
            raise NotFound(f"no live status of instance {instance!r}")
        if state is InstanceState.FAILED:
            raise BadRequest("the PC does not set instances to failed")

    def state_answered(self, instance: str, answered: InstanceState) -> bool:
        """*instance* answered ``PUT state`` with *answered*: held from then on (spec: "The PC can also change the
        state of an instance with PUT state on the instance"). True when it is active now."""
        self.status.set_state(instance, answered)
        if answered is InstanceState.ACTIVE:
            self._activated()
            return True
        return False

    def instances(self, viewer: Principal | None = None) -> list[dict[str, Any]]:
        """Every instance the PC has heard of: its held state, epoch and last reported load. With *viewer*, only
        those it may see (:meth:`visible_to`)."""
        out = []
        for instance in self.known_instances():
            if viewer is not None and not self.visible_to(viewer, instance):
                continue
            entry = self.status.get(instance)
            item: dict[str, Any] = {"instance": instance, "epoch": self.status.highest_epoch(instance),
                                    "state": (self.status.state(instance) or InstanceState.FAILED).value}
            if entry is not None:
                r = entry.record
                item.update(running=r.running, queued=r.queued, reported_state=r.state.value,
                            ttl_ms=max(1, int((entry.expires_at - self.clock()) * 1000)))
            out.append(item)
        return out

    def visible_to(self, viewer: Principal, instance: str) -> bool:
        """Whether *viewer* may see *instance* in ``GET instances`` (issue 13: the list disclosed every tenant's
        instances and load to any client): a controller (an operator) sees every instance; anyone else those whose
        reporter holds one of its scopes -- the instances a session of its scopes could be placed on."""
        if viewer.has_role(Role.CONTROLLER):
            return True
        scopes = self.instance_scopes(instance)
        if scopes is None:
            return False
        return scopes is ALL or viewer.scopes is ALL or not frozenset(viewer.scopes).isdisjoint(scopes)

    def instance_scopes(self, instance: str) -> Scopes | None:
        """The scopes of the principal that reported *instance*'s status (None: none reported)."""
        return self._scopes.get(instance)

    def set_instance_scopes(self, instance: str, scopes: Scopes) -> None:
        """Hold *scopes* for *instance* (as another replica of the PC took them from its reporter)."""
        self._scopes[instance] = scopes

    def serves_scope(self, instance: str, scope_id: bytes | None) -> bool:
        """Whether *instance* may be given work of *scope_id*: its principal -- the identity that reported its
        status, as the policy knew it then -- holds the scope. An instance whose status reached the table any other
        way holds none. ``scope_id=None`` asks about no scope (operators' views): always True."""
        if scope_id is None:
            return True
        scopes = self._scopes.get(instance)
        return scopes is not None and (scopes is ALL or bytes(scope_id) in scopes)

    def active(self, exclude: Iterable[str] = (), scope_id: bytes | None = None) -> list[InstanceStatus]:
        """The live active instances not in *exclude*; with *scope_id*, only those whose principal holds it."""
        skip = set(exclude)
        return [e for e in self.status.live() if e.state is InstanceState.ACTIVE and e.instance not in skip
                and self.serves_scope(e.instance, scope_id)]

    def sleeping(self, scope_id: bytes | None = None) -> list[str]:
        """The live sleeping instances (of *scope_id*, when given): the first ones to wake for capacity."""
        return [e.instance for e in self.status.live() if e.state is InstanceState.SLEEPING
                and self.serves_scope(e.instance, scope_id)]

    # -- placement ------------------------------------------------------------------------------------------------

    def _block_tokens(self, compat_id: bytes) -> int | None:
        geometry = self.index.config.geometry.get(bytes(compat_id))
        return geometry.block_tokens if geometry is not None else None

    def placement_query(self, session: PlacedSession, exclude: Iterable[str]) -> PlacementQuery | None:
        """The candidates for *session* -- active instances of its scope -- and the lookup to rank them by; None
        when no such instance is left."""
        candidates = self.active(exclude, session.request.scope_id)
        if not candidates:
            return None
        request, cp = session.request, session.checkpoint
        keys: Sequence[BlockKey] = cp.prompt_blocks if cp is not None else request.block_keys
        lookup = None
        if keys:
            config = self.index.config
            targets = tuple(e.instance for e in candidates[:config.max_lookup_targets])
            lookup = LookupRequest(request.scope_id, request.compat_id, tuple(keys[:config.max_lookup_keys]),
                                   targets)
        return PlacementQuery(tuple(candidates), lookup)

    def rank(self, session: PlacedSession, query: PlacementQuery, found: LookupResponse | None) -> list[Choice]:
        """The query's candidates in the order the placement policy prefers, given the lookup's answer."""
        if query.lookup is not None and found is not None:
            self.kvsp.lookup("controller", len(query.lookup.block_keys), found.matched)
        request, cp = session.request, session.checkpoint
        offset = cp.output_offset if cp is not None else 0
        return self.policy.rank(PlacementInput(query.candidates, found, len(request.prompt) + offset,
                                               max(request.max_tokens - offset, 1),
                                               self._block_tokens(request.compat_id), dict(self._pending)))

    def acceptable(self, choices: Iterable[Choice]) -> bool:
        """Whether a choice has capacity and a cost within ``max_cost_us``; if not, the PC looks for more."""
        limit = self.config.max_cost_us
        return any(c.has_capacity and (limit is None or (c.cost_us is not None and c.cost_us <= limit))
                   for c in choices)

    def still_active(self, instance: str, scope_id: bytes | None = None) -> InstanceStatus | None:
        """*instance*'s live status if it is active right now and (given *scope_id*) serves that scope: never a
        directive to an instance that is not."""
        entry = self.status.get(instance)
        if entry is None or entry.state is not InstanceState.ACTIVE or not self.serves_scope(instance, scope_id):
            return None
        return entry

    def directive(self, session: PlacedSession, choice: Choice, found: LookupResponse | None
                  ) -> PrefetchDirective | None:
        """The prefetch directive for *choice* before *session* starts there: the matched blocks it does not hold,
        when loading beats recomputing; None when there is nothing to prefetch."""
        if found is None or not choice.use_cache:
            return None
        blocks = []
        for match in found.blocks:
            if any(r.holder == choice.instance for r in match.replicas):
                continue  # resident at the instance (its own tiers)
            sources = tuple(dict.fromkeys(r.holder for r in match.replicas))
            blocks.append(PrefetchBlock(match.block_key, sources))
        if not blocks:
            return None
        r = session.request
        return PrefetchDirective(self.new_id(), r.scope_id, r.compat_id, tuple(blocks),
                                 self.config.prefetch_deadline_ms, self.config.prefetch_lease_ms,
                                 request_ref=str(session.id))

    def prefetch_outcome(self, instance: str, error: Problem | OSError | None) -> PrefetchOutcome:
        """Judge the answer to a prefetch directive: *error* is what the request raised (None: accepted)."""
        if error is None:
            outcome = PrefetchOutcome.ACCEPTED
        elif isinstance(error, InvalidState):
            outcome = PrefetchOutcome.REFUSED
        elif isinstance(error, Problem):
            outcome = PrefetchOutcome.FAILED
            log.info("prefetch directive to %s refused: %s", instance, error)
        else:
            outcome = PrefetchOutcome.UNREACHABLE
            log.warning("prefetch directive to %s failed: %s", instance, error)
        self.m_prefetch.labels(outcome=outcome.value).inc()
        return outcome

    def assign(self, session: PlacedSession, entry: InstanceStatus, found: LookupResponse | None) -> Assignment:
        """Make *entry*'s instance the session's (the instance may checkpoint before its answer arrives) and build
        the start, or the resume with the latest checkpoint, to send it."""
        if not self.serves_scope(entry.instance, session.request.scope_id):  # never: candidates are of the scope
            raise ScopeDenied(f"instance {entry.instance!r} is not authorized for the session's scope")
        session.instance, session.instance_epoch = entry.instance, entry.record.epoch
        request = session.request
        deterministic = self.deterministic(request.compat_id, request.scope_id)
        if session.checkpoint is not None:
            cp = session.checkpoint
            if cp.sampler.deterministic and not deterministic:
                cp = replace(cp, sampler=replace(cp.sampler, deterministic=False))
            return Assignment(entry.instance, SessionResume(session.epoch, cp, request.max_tokens, request.prompt))
        if request.sampler.deterministic and not deterministic:
            request = replace(request, sampler=replace(request.sampler, deterministic=False))
        matched = tuple(PrefetchBlock(m.block_key, tuple(dict.fromkeys(r.holder for r in m.replicas)))
                        for m in found.blocks) if found is not None else ()
        return Assignment(entry.instance, SessionStart.of(request, session.epoch, matched))

    def deterministic(self, compat_id: bytes, scope_id: bytes) -> bool:
        """Whether a session of *compat_id* in *scope_id* may run with a deterministic sampler: every live instance
        of the scope that could resume it reports the same engine and build (:func:`engines_agree`). Checked at
        each start and resume; the PC only ever clears the front end's (or checkpoint's) ``deterministic``."""
        eligible = (e for e in self.status.live()
                    if e.state is not InstanceState.FAILED and self.serves_scope(e.instance, scope_id))
        return engines_agree(eligible, compat_id)

    def start_outcome(self, session: PlacedSession, assignment: Assignment, error: Problem | OSError | None,
                      choice: Choice, found: LookupResponse | None) -> StartOutcome:
        """Judge the answer to a start or resume: *error* is what the request raised (None: taken). A definite
        refusal keeps the epoch; any other failure may have started the session, so the epoch is fenced."""
        kind, instance = assignment.kind.value, assignment.instance
        if error is None:
            outcome = StartOutcome.OK
            session.served = session.epoch
            self._pending[instance] = self._pending.get(instance, 0) + 1
            self._count_tokens(session, choice, found)
        elif isinstance(error, _REFUSALS):
            outcome = StartOutcome.REFUSED
            log.info("%s of session %s refused by %s: %s", kind, session.id, instance, error)
            session.instance = session.instance_epoch = None
        else:
            outcome = StartOutcome.FAILED
            log.warning("%s of session %s on %s failed (%s); epoch %d -> %d", kind, session.id, instance, error,
                        session.epoch, session.epoch + 1)
            session.instance = session.instance_epoch = None
            session.epoch += 1
        self.m_starts.labels(kind=kind, outcome=outcome.value).inc()
        return outcome

    def _count_tokens(self, session: PlacedSession, choice: Choice, found: LookupResponse | None) -> None:
        tokens = len(session.request.prompt)
        block_tokens = self._block_tokens(session.request.compat_id)
        cached = 0
        if choice.use_cache and found is not None and block_tokens is not None:
            cached = min(tokens, found.matched * block_tokens)
        self.m_placement_tokens.labels(source="cache").inc(cached)
        self.m_placement_tokens.labels(source="recompute").inc(tokens - cached)

    # -- capacity -------------------------------------------------------------------------------------------------

    def woke(self, instance: str, answered: InstanceState, reason: str) -> bool:
        """A sleeping *instance* answered a wake-up (``PUT state`` active) with *answered*: True when it is active."""
        if answered is not InstanceState.ACTIVE:
            return False
        self.m_hooks.labels(kind="wake").inc()
        log.info("woke %s (%s)", instance, reason)
        return True

    def capacity_step(self) -> CapacityStep:
        """No active instance is acceptable and none woke: run the start hook (at most once per
        ``start_interval_ms``), wait for the instance of a run under way, or place on what exists."""
        now = self.clock()
        until = self._start_wait_until
        if until is not None and now < until:
            return CapacityStep(CapacityAction.WAIT, until - now)
        if self._last_start is not None and now - self._last_start < self.config.start_interval_ms / 1000:
            return CapacityStep(CapacityAction.NONE)  # the hook ran recently and its instance came (or never will)
        self._last_start = now
        return CapacityStep(CapacityAction.RUN_HOOK, self.config.start_timeout_ms / 1000)

    def hook_ran(self) -> None:
        """The start hook of the last :attr:`CapacityAction.RUN_HOOK` is under way: requests wait for its instance
        until ``start_timeout_ms`` after the decision (or until an instance becomes active)."""
        assert self._last_start is not None
        self.m_hooks.labels(kind="hook").inc()
        self._start_wait_until = self._last_start + self.config.start_timeout_ms / 1000

    def _activated(self) -> None:
        self._start_wait_until = None  # whoever waited for the hook's instance goes on; the next need runs it again

    def activated_elsewhere(self) -> None:
        """With a shared store: an instance became active by a report to another replica (seen in the stored
        statuses), as :meth:`report_status` notes one reported here."""
        self._activated()

    # -- sessions -------------------------------------------------------------------------------------------------

    def _session(self, session_id: uuid.UUID) -> PlacedSession:
        session = self.sessions.get(session_id)
        if session is None:
            raise NotFound(f"no session {session_id}")
        return session

    def admit(self, principal: Principal, request: SessionRequest) -> Admission:
        """POST sessions: hold a new session (to be placed), or recognize a retry of the same request (never
        refused). A new one must pass :attr:`admission` (429 with ``retry_after_s`` beyond a client's limits, 503
        beyond the PC's); it counts as being placed until :meth:`placed`, :meth:`unplaced` or :meth:`abandon`."""
        require_scope(principal, request.scope_id)
        existing = self.sessions.get(request.session)
        if existing is not None:
            if existing.owner != principal.identity or existing.request != request:
                raise Problem(f"session {request.session} exists", status=409)
            return Repeated(existing.info())
        self.admission.check(principal.identity, self.sessions)
        now = self.clock()
        session = PlacedSession(request, principal.identity, now, now)
        self.sessions[request.session] = session
        self.admission.began(session)
        return Admitted(session)

    def placed(self, session: PlacedSession, seconds: float) -> SessionInfo:
        """The first placement of *session* succeeded after *seconds*: it runs (or it is done already: its instance
        reported the last token before it answered the start)."""
        session.apply(SessionEvent.PLACED)
        self.admission.ended(session)
        self.m_sessions.labels(outcome="placed").inc()
        self.m_placement_seconds.observe(seconds)
        return session.info()

    def unplaced(self, session: PlacedSession) -> Unavailable:
        """No instance took *session*: it is forgotten; the problem to answer (503 either way: whether any instance
        of the scope exists is not the client's to learn beyond "none took it")."""
        self.sessions.pop(session.id, None)
        self.admission.ended(session)
        self.m_sessions.labels(outcome="unplaced").inc()
        return Unavailable(f"no active instance of scope {bytes(session.request.scope_id).hex()} took the session")

    def abandon(self, session: PlacedSession) -> None:
        """The placement of *session* was interrupted (an error, a cancellation, another replica's write): forget
        it."""
        self.sessions.pop(session.id, None)
        self.admission.ended(session)

    def session_info(self, principal: Principal, session_id: uuid.UUID) -> SessionInfo:
        """GET sessions/{id}: only for the identity that created the session (others: 404, as if unknown)."""
        session = self.sessions.get(session_id)
        if session is None or session.owner != principal.identity:
            raise NotFound(f"no session {session_id}")
        return session.info()

    def checkpoint(self, principal: Principal, session_id: uuid.UUID, cp: SessionCheckpoint, *,
                   done: bool = False) -> CheckpointAck:
        """PUT sessions/{id}/checkpoint (spec, "Session Checkpoints and Migration")."""
        session = self._session(session_id)
        if cp.session != session_id:
            raise BadRequest(f"session: the checkpoint names {cp.session}, the path {session_id}")
        if cp.epoch < session.epoch:
            self.m_checkpoints.labels(outcome="stale").inc()
            raise StaleEpoch(f"session {session_id} is at epoch {session.epoch}; the checkpoint has {cp.epoch}")
        if cp.epoch > session.epoch:
            self.m_checkpoints.labels(outcome="rejected").inc()
            raise BadRequest(f"session {session_id} is at epoch {session.epoch}; epoch {cp.epoch} was never "
                             f"assigned")
        if session.instance is None or principal.identity != session.instance:
            self.m_checkpoints.labels(outcome="forbidden").inc()
            raise Forbidden(f"{principal.identity!r} does not serve session {session_id} in epoch {session.epoch}")
        request = session.request
        if cp.compat_id != request.compat_id:
            raise Incompatible("compat_id: not the session's")
        if cp.scope_id != request.scope_id:
            raise BadRequest("scope_id: not the session's")
        if cp.output_offset > request.max_tokens:
            raise BadRequest(f"output_offset: {cp.output_offset} exceeds max_tokens {request.max_tokens}")
        held = session.checkpoint
        if held is not None:
            n = min(held.output_offset, cp.output_offset)
            if cp.generated[:n] != held.generated[:n]:
                self.m_checkpoints.labels(outcome="rejected").inc()
                raise Problem(f"the checkpoint contradicts the acknowledged output of session {session_id} "
                              f"before index {n}", status=409)
        if held is None or cp.output_offset > held.output_offset or (
                cp.output_offset == held.output_offset and cp.epoch > held.epoch):
            session.checkpoint = cp
        session.touched = self.clock()
        if done or session.output_offset >= request.max_tokens:
            session.apply(SessionEvent.FINISHED)
        self.m_checkpoints.labels(outcome="accepted").inc()
        return CheckpointAck(session_id, session.epoch, session.output_offset)

    # -- failures -------------------------------------------------------------------------------------------------

    def _instance_failed(self, session: PlacedSession) -> bool:
        instance = session.instance
        if instance is None:
            return False
        state = self.status.state(instance)
        highest = self.status.highest_epoch(instance)
        return (state is None or state is InstanceState.FAILED
                or (highest is not None and session.instance_epoch is not None and highest > session.instance_epoch))

    def needs_migration(self, session: PlacedSession) -> bool:
        if session.state is SessionState.MIGRATING:
            return True
        return session.state is SessionState.RUNNING and self._instance_failed(session)

    def begin_migration(self, session: PlacedSession) -> None:
        """*session*'s instance failed: increment the epoch (fencing the old instance); it is placed again, on the
        next instance by the policy, with its latest checkpoint (or afresh when there is none yet)."""
        if session.state is SessionState.RUNNING:
            log.warning("session %s: instance %s failed; epoch %d -> %d", session.id, session.instance,
                        session.epoch, session.epoch + 1)
            session.failed_at = self.clock()
            session.epoch += 1
            session.instance = session.instance_epoch = None
            session.apply(SessionEvent.INSTANCE_FAILED)

    def take_over_placement(self, session: PlacedSession) -> None:
        """*session* is still being placed, but the replica that admitted it stopped holding its placement lease (it
        died mid-placement, maybe after it started the session on an instance): this replica places it instead, as
        a migration -- the epoch is incremented, so a run the dead replica started is fenced."""
        if session.state is SessionState.PLACING:
            log.warning("session %s: its placement was abandoned by another replica; epoch %d -> %d", session.id,
                        session.epoch, session.epoch + 1)
            session.failed_at = self.clock()
            session.epoch += 1
            session.instance = session.instance_epoch = None
            session.apply(SessionEvent.PLACEMENT_ABANDONED)

    def migrated(self, session: PlacedSession) -> None:
        """*session* was placed again after its instance failed: it runs (or is done, as in :meth:`placed`)."""
        session.apply(SessionEvent.MIGRATED)
        session.migrations += 1
        self.kvsp.migrations.labels(component="controller").inc()
        if session.failed_at is not None:
            self.m_migration_seconds.observe(max(0.0, self.clock() - session.failed_at))
        session.failed_at = None
        log.info("session %s resumed on %s at epoch %d, output_offset %d", session.id, session.instance,
                 session.epoch, session.output_offset)

    # -- suspect reports (extension: docs/wire.md, "Suspect reports") -------------------------------------------

    def suspect(self, principal: Principal, session_id: uuid.UUID, report: SuspectReport) -> SuspectStep:
        """``POST sessions/{id}/suspect`` by the session's creator (404 for anyone else, as ``GET``): what verifying
        the report calls for. The client's word alone never moves a session: a run the PC does not already hold
        failed is probed first (:meth:`probe_outcome`)."""
        info = self.session_info(principal, session_id)
        session = self.sessions[session_id]
        if report.epoch > session.epoch:
            raise BadRequest(f"epoch: session {session_id} is at epoch {session.epoch}; {report.epoch} was never "
                             f"assigned")
        self.m_suspects.labels(reason=report.reason if report.reason in ("stall", "broken") else "other").inc()
        if info.epoch > report.epoch or session.state is SessionState.DONE:
            return SuspectStep.ANSWER
        if session.state is not SessionState.RUNNING or session.instance is None:
            return SuspectStep.WAIT
        return SuspectStep.MIGRATE if self._instance_failed(session) else SuspectStep.PROBE

    def probe_outcome(self, session: PlacedSession, error: Problem | OSError | None, *, last: bool = True
                      ) -> RunHealth:
        """Judge the probe of a suspected run (:func:`~kvsp_quic.roles.controller_sessions.judge_probe`; *last*:
        no other probe follows); a dead run is held failed from now on, as if its status had expired
        (:func:`fail_run`: every session it serves migrates; a later report of the run brings it back, as after an
        expiry)."""
        health = judge_probe(error, last=last)
        self.m_probes.labels(outcome=health.value).inc()
        log.log(logging.INFO if health is RunHealth.ALIVE else logging.WARNING, "suspect report of session %s: "
                "instance %s %s (%s)", session.id, session.instance, health.value,
                "answered" if error is None else f"{type(error).__name__}: {error}")
        if health is RunHealth.DEAD and session.instance is not None and session.instance_epoch is not None:
            fail_run(self.status, session.instance, session.instance_epoch)
        return health

    def lost(self, session: PlacedSession, epoch: int | None) -> bool:
        """Whether a verified suspect report of *epoch* moves *session*: it still runs in that epoch."""
        return epoch is not None and session.state is SessionState.RUNNING and session.epoch == epoch

    def next_due(self) -> float | None:
        """When the failure check (the adapter's tick) next has something to find, on the clock (None: no instance
        has a live status): the earliest expiry of a live instance status -- an instance that stops reporting fails
        then, and the sessions it serves migrate. A report moves its instance's expiry later, except for a new run
        (:attr:`StatusReport.expires_at` says); a failure reported or probed is an event of its own."""
        return min((e.expires_at for e in self.status.live()), default=None)

    def forget_expired(self) -> None:
        """Drop from :attr:`sessions` those the control store has let expire: done for ``done_ttl_ms``, or without a
        checkpoint for ``session_ttl_ms`` (a session being placed is kept)."""
        now = self.clock()
        for session in list(self.sessions.values()):
            ttl_ms = self.config.done_ttl_ms if session.state is SessionState.DONE else self.config.session_ttl_ms
            if now - session.touched > ttl_ms / 1000 and session.state is not SessionState.PLACING:
                del self.sessions[session.id]

    # -- resharding -----------------------------------------------------------------------------------------------

    def shard_map(self, map_id: str) -> ShardMap:
        found = self.maps.get(map_id)
        if found is None:
            raise NotFound(f"no shard map {map_id!r}")
        return found

    def register_map(self, shard_map: ShardMap) -> ReshardOutcome:
        """Make *shard_map* the authoritative version of a map the PC does not hold yet (a new parallel group)."""
        if shard_map.map in self.maps:
            raise PlanConflict(f"map {shard_map.map!r} exists at version {self.maps[shard_map.map].version}")
        self.maps[shard_map.map] = shard_map
        return ReshardOutcome(shard_map.map, shard_map.version, ReshardResult.REGISTERED)

    def begin_reshard(self, new: ShardMap, deadline_ms: int | None = None) -> ReshardRound:
        """Start moving a map from version v to v+1 = ``new.version`` (spec, "Sequence-Sharded Caches and
        Resharding"): every member's plan, to be acknowledged within *deadline_ms*. One reshard per map at a time;
        :meth:`end_reshard` ends it."""
        old = self.shard_map(new.map)
        if new.map in self._resharding:
            raise PlanConflict(f"a reshard of map {new.map!r} is in progress")
        deadline_ms = deadline_ms or self.config.reshard_deadline_ms
        round_ = ReshardRound(old, new, deadline_ms, plan_reshard(old, new, deadline_ms))
        self._resharding.add(new.map)
        return round_

    def decide_reshard(self, round_: ReshardRound, failed: Mapping[str, str]) -> ReshardCommit | ReshardAbort:
        """Every member answered or the deadline passed (*failed*: the members that did not acknowledge, and why):
        commit -- v+1 is authoritative from now on -- or abort."""
        message = round_.decision(failed)
        if isinstance(message, ReshardCommit):
            self.maps[round_.new.map] = round_.new
        return message

    def end_reshard(self, round_: ReshardRound) -> None:
        self._resharding.discard(round_.new.map)

    def reshard_outcome(self, round_: ReshardRound, acknowledged: Iterable[str], failed: Mapping[str, str],
                        undelivered: Mapping[str, str]) -> ReshardOutcome:
        """What the reshard came to, once its decision was sent (*undelivered*: the members it did not reach)."""
        committed = not failed
        result = ReshardResult.COMMITTED if committed else ReshardResult.ABORTED
        everyone = round_.members
        outcome = ReshardOutcome(round_.new.map, round_.new.version if committed else round_.old.version, result,
                                 tuple(sorted(acknowledged, key=everyone.index)), dict(failed), dict(undelivered))
        self.m_reshards.labels(outcome=result.value).inc()
        log.info("reshard of map %s to version %d %s", round_.new.map, round_.new.version,
                 result.value if committed else f"aborted ({dict(failed)})")
        return outcome


__all__ = [
    "Choice", "ControllerConfig", "PlacedSession", "PlacementController", "ReshardMessage", "ReshardOutcome", "rank",
]
