"""The Placement Controller's state as a :class:`~kvsp_quic.storage.control_store.ControlStore` keeps it.

The role (:class:`~kvsp_quic.roles.controller.PlacementController`) decides on its own objects; its asyncio adapter
reads them from the store before a decision and writes them back after it (a compare-and-set on the session's
version). These are the conversions, without I/O:

* :func:`stored_session` / :func:`placed_session` -- a :class:`PlacedSession` and its stored form (a
  :class:`SessionSnapshot`, which a store outside the process encodes; the version, the instance run that serves
  it, whether it waits for a migration);
* :func:`stored_status` / :func:`load_statuses` -- the role's view of an instance (the status table's entry, the
  state the PC decided for the run, the reporter's scopes) and a snapshot of every instance's, loaded into the
  role's :class:`~kvsp_quic.roles.status.StatusTable`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson

from kvsp_quic.records import SessionCheckpoint
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_records import SessionRequest, SessionState
from kvsp_quic.roles.controller_sessions import PlacedSession
from kvsp_quic.roles.status import InstanceStatus, LifecyclePolicy
from kvsp_quic.storage.control_store import StatusSnapshot, StoredSession, StoredStatus, run_key


@dataclass(frozen=True)
class SessionSnapshot:
    """A copy of a :class:`PlacedSession` as the role wrote it: the payload of a :class:`StoredSession`. A store in
    this process keeps it as is (read back, it is copied again, clock values included); a store outside the process
    keeps :meth:`encoded` (clock values are not encoded: they are on each process's monotonic clock)."""

    session: PlacedSession

    def encoded(self) -> bytes:
        session, cp = self.session, self.session.checkpoint
        return orjson.dumps({
            "request": session.request.to_json(), "owner": session.owner, "epoch": session.epoch,
            "served": session.served, "state": session.state.value, "instance": session.instance,
            "instance_epoch": session.instance_epoch, "checkpoint": cp.to_json() if cp is not None else None,
            "migrations": session.migrations,
        })


def stored_session(session: PlacedSession) -> StoredSession:
    """*session* as stored: a snapshot (a shallow copy: its fields are immutable values) and its index facts."""
    run = ""
    if session.instance is not None and session.instance_epoch is not None and session.state is not SessionState.DONE:
        run = run_key(session.instance, session.instance_epoch)
    return StoredSession(SessionSnapshot(replace(session)), session.version, run,
                         session.state is SessionState.MIGRATING)


def placed_session(stored: StoredSession, now: float) -> PlacedSession:
    """The session :func:`stored_session` wrote, as a new object with the stored version: a copy of its snapshot
    when the store kept one, else decoded, its clock values *now* (a migrating session's ``failed_at`` too: the
    migration time measured is this replica's share of it)."""
    if isinstance(stored.payload, SessionSnapshot):
        return replace(stored.payload.session, version=stored.version)
    obj = orjson.loads(stored.payload.encoded())
    cp = obj.get("checkpoint")
    state = SessionState(obj["state"])
    return PlacedSession(SessionRequest.from_json(obj["request"]), obj["owner"], now, now, epoch=obj["epoch"],
                         served=obj["served"], state=state, instance=obj.get("instance"),
                         instance_epoch=obj.get("instance_epoch"),
                         checkpoint=SessionCheckpoint.from_json(cp) if cp is not None else None,
                         failed_at=now if state is SessionState.MIGRATING else None,
                         migrations=obj.get("migrations", 0), version=stored.version)


def stored_status(role: PlacementController, instance: str) -> StoredStatus | None:
    """What the role holds about *instance* (None without a live status)."""
    entry = role.status.get(instance)
    if entry is None:
        return None
    policy = role.status.policy
    decided = policy.decided(instance, entry.record.epoch) if isinstance(policy, LifecyclePolicy) else None
    remaining = int((entry.expires_at - role.clock()) * 1000)
    return StoredStatus(entry.record, entry.state, remaining, decided, role.instance_scopes(instance))


def load_statuses(role: PlacementController, snapshot: StatusSnapshot) -> None:
    """Make *snapshot* (every replica's reports) the role's view of the instances."""
    now = role.clock()
    policy = role.status.policy
    entries = []
    for s in snapshot.entries:
        entries.append(InstanceStatus(s.record, s.state, now, now + s.remaining_ms / 1000.0))
        if s.scopes is not None:
            role.set_instance_scopes(s.record.instance, s.scopes)
        if isinstance(policy, LifecyclePolicy):
            if s.decided is not None:
                policy.hold(s.record.instance, s.record.epoch, s.decided)
            else:
                policy.forget(s.record.instance)
    role.status.replace(entries, snapshot.epochs)


__all__ = ["SessionSnapshot", "load_statuses", "placed_session", "stored_session", "stored_status"]
