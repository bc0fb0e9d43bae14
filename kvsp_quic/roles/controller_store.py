"""The Placement Controller's state as a shared :class:`~kvsp_quic.storage.control_store.ControlStore` keeps it.

The role (:class:`~kvsp_quic.roles.controller.PlacementController`) decides on its own objects; with a shared store
its asyncio adapter reads them from the store before a decision and writes them back after it (a compare-and-set on
the session's version). These are the conversions, without I/O:

* :func:`stored_session` / :func:`placed_session` -- a :class:`PlacedSession` and its stored form (the encoding,
  the version, the instance run that serves it, whether it waits for a migration);
* :func:`stored_status` / :func:`load_statuses` -- the role's view of an instance (the status table's entry, the
  state the PC decided for the run, the reporter's scopes) and a snapshot of every instance's, loaded into the
  role's :class:`~kvsp_quic.roles.status.StatusTable`.
"""

from __future__ import annotations

import orjson

from kvsp_quic.records import SessionCheckpoint
from kvsp_quic.roles.controller import PlacementController
from kvsp_quic.roles.controller_records import SessionRequest, SessionState
from kvsp_quic.roles.controller_sessions import PlacedSession
from kvsp_quic.roles.status import InstanceStatus, LifecyclePolicy
from kvsp_quic.storage.control_store import StatusSnapshot, StoredSession, StoredStatus, run_key


def stored_session(session: PlacedSession) -> StoredSession:
    """*session* as stored (clock values are not: they are on each process's monotonic clock)."""
    cp = session.checkpoint
    data = orjson.dumps({
        "request": session.request.to_json(), "owner": session.owner, "epoch": session.epoch,
        "served": session.served, "state": session.state.value, "instance": session.instance,
        "instance_epoch": session.instance_epoch, "checkpoint": cp.to_json() if cp is not None else None,
        "migrations": session.migrations,
    })
    run = ""
    if session.instance is not None and session.instance_epoch is not None and session.state is not SessionState.DONE:
        run = run_key(session.instance, session.instance_epoch)
    return StoredSession(data, session.version, run, session.state is SessionState.MIGRATING)


def placed_session(stored: StoredSession, now: float) -> PlacedSession:
    """The session :func:`stored_session` wrote; its clock values are *now* (a migrating session's ``failed_at``
    too: the migration time measured is this replica's share of it)."""
    obj = orjson.loads(stored.data)
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


__all__ = ["load_statuses", "placed_session", "stored_session", "stored_status"]
