"""Suspect reports (docs/wire.md, "Suspect reports"; issue 12 point 4) at the Placement Controller's role and adapter,
and the front end's stall bound. The instances are the recording link of tests/support/controller.py with a probe
whose outcome each test sets; tests/test_fast_migration.py runs the same with real processes."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsp_frontend.session import StallWatch
from kvsp_quic.compat import InstanceState
from kvsp_quic.problems import BadRequest, NotFound, StaleEpoch
from kvsp_quic.records import InstanceStatusRecord
from kvsp_quic.roles.controller_records import SessionState, SuspectAnswer, SuspectReport, Verdict
from kvsp_quic.roles.controller_sessions import RunHealth, judge_probe
from kvsp_quic.storage.control_store import StoredStatus
from tests.peers import missing_peer
from tests.redis_server import REDIS_SERVER, SKIP_REASON, RedisServer
from tests.support.controller import FRONT, IA, IB, OTHER, Env, FakeLink, checkpoint, request, who


@dataclass
class ProbingLink(FakeLink):
    """:class:`FakeLink` with the suspect report's probe: ``probe_error`` is raised (None: the instance answered)."""

    probe_error: BaseException | None = None

    async def probe(self, instance: str, session: uuid.UUID, timeout: float) -> None:
        self.calls.append(("probe", instance, timeout))
        if self.probe_error is not None:
            raise self.probe_error

    async def cancel(self, instance: str, session: uuid.UUID) -> None:
        self.calls.append(("cancel", instance, session))


async def placed(probe_error: BaseException | None) -> tuple[Env, uuid.UUID]:
    env = Env()
    env.link = ProbingLink(probe_error=probe_error)
    env.svc.link = env.link
    await env.report(IA)
    req = request(keys=0)
    info, _ = await env.svc.create_session(who(FRONT), req)
    assert info.instance == IA
    await env.report(IB)
    return env, req.session


def test_the_probe_is_judged() -> None:
    assert judge_probe(None) is RunHealth.ALIVE
    assert judge_probe(BadRequest("x")) is RunHealth.ALIVE  # it answered
    assert judge_probe(NotFound("no session")) is RunHealth.GONE
    assert judge_probe(TimeoutError()) is RunHealth.DEAD
    assert judge_probe(TimeoutError(), last=False) is RunHealth.SILENT  # asked again, longer
    assert judge_probe(ConnectionResetError(), last=False) is RunHealth.DEAD
    assert judge_probe(ConnectionRefusedError()) is RunHealth.DEAD


async def test_a_false_alarm_moves_nothing() -> None:
    env, sid = await placed(None)
    answer = await env.svc.suspect(who(FRONT), sid, SuspectReport(1, "stall"))
    assert (answer.verdict, answer.epoch, answer.instance) == (Verdict.HEALTHY, 1, IA)
    assert env.link.of("probe") == [(IA, 0.3)] and not env.link.of("resume")
    assert env.pc.status.state(IA) is InstanceState.ACTIVE
    assert env.samples("kvsp_suspect_probes_total")[(("outcome", "alive"),)] == 1
    assert SuspectAnswer.loads(str(answer.to_json()).replace("'", '"')) == answer  # the wire shape round-trips


async def test_a_silent_instance_is_held_failed_and_the_session_moves_at_once() -> None:
    env, sid = await placed(TimeoutError())
    answer = await env.svc.suspect(who(FRONT), sid, SuspectReport(1, "broken"))
    assert (answer.verdict, answer.epoch, answer.instance, answer.state) == (Verdict.MOVED, 2, IB,
                                                                             SessionState.RUNNING)
    assert [i for i, _ in env.link.of("start")] == [IA, IB]  # no checkpoint yet: started afresh in epoch 2
    assert env.pc.status.state(IA) is InstanceState.FAILED  # as if its status had expired: the run is fenced
    req = request(keys=0)
    with pytest.raises(StaleEpoch):
        await env.svc.checkpoint(who(IA), sid, checkpoint(req, 1, [1]))
    await env.report(IA)  # the same run reports again: back, as after an expiry
    assert env.pc.status.state(IA) is InstanceState.ACTIVE
    # a second report of the old epoch (another replica, a retry) is answered at once: no probe, no migration
    again = await env.svc.suspect(who(FRONT), sid, SuspectReport(1, "broken"))
    assert (again.verdict, again.epoch, again.instance) == (Verdict.MOVED, 2, IB)
    assert len(env.link.of("probe")) == 2 and len(env.link.of("start")) == 2
    assert [t for _, t in env.link.of("probe")] == [0.3, 0.6]  # silent twice: the second probe waited longer
    assert env.samples("kvsp_suspect_probes_total")[(("outcome", "dead"),)] == 1


async def test_a_session_the_instance_lost_moves_alone() -> None:
    env, sid = await placed(NotFound("no session"))
    answer = await env.svc.suspect(who(FRONT), sid, SuspectReport(1, "broken"))
    assert answer.verdict is Verdict.MOVED and answer.epoch == 2
    assert env.pc.status.state(IA) is InstanceState.ACTIVE  # the instance answered: it is not held failed


async def test_only_the_creator_reports_and_only_epochs_that_were_assigned() -> None:
    env, sid = await placed(TimeoutError())
    with pytest.raises(NotFound):
        await env.svc.suspect(who(OTHER), sid, SuspectReport(1, "stall"))
    with pytest.raises(BadRequest):
        await env.svc.suspect(who(FRONT), sid, SuspectReport(2, "stall"))
    assert not env.link.of("probe")
    assert (await env.svc.session_info(who(FRONT), sid)).epoch == 1


def test_the_stall_bound_follows_the_gaps() -> None:
    now = [0.0]
    watch = StallWatch(_clock=lambda: now[0])
    watch.new_stream()
    assert not bool(watch.flowing) and watch.bound(1.0) == 1.0
    for gap in [0.01] * 8 + [0.1]:
        watch.token()
        now[0] += gap
    watch.token()
    assert bool(watch.flowing)
    assert watch.bound(1.0) == pytest.approx(0.2)  # twice the 99th percentile (the 0.1 s gap)
    watch.false_alarm()
    assert watch.bound(1.0) == pytest.approx(0.4)
    watch.token()
    assert watch.bound(1.0) == pytest.approx(0.2)
    watch.new_stream()  # a resumed run computes before its first token: the caller's bound until then
    assert watch.bound(1.0) == 1.0
    quick = StallWatch(_clock=lambda: now[0], min_gaps=1)
    quick.token()
    now[0] += 0.001
    quick.token()
    assert quick.bound(1.0) == quick.floor_s


async def test_the_shared_store_holds_a_probed_run_failed(tmp_path: Path) -> None:
    """``fail_status`` of :class:`RedisControlStore` (a real redis-server): the stored status of that run is dropped
    (every replica then holds it failed), its highest epoch kept; a status of another run is left alone."""
    if REDIS_SERVER is None:
        missing_peer(SKIP_REASON)
    from kvsp_quic.storage.redis_control import RedisControlStore

    with RedisServer.start(tmp_path / "redis") as server:
        store = RedisControlStore.from_url(server.url)
        try:
            for instance, epoch in ((IA, 3), (IB, 1)):
                record = InstanceStatusRecord(instance, epoch, InstanceState.ACTIVE, 60_000)
                assert (await store.put_status(StoredStatus(record, InstanceState.ACTIVE, 60_000))).higher is None
            assert not await store.fail_status(IA, 2)  # not the stored run
            assert not await store.fail_status("https://nobody.example/", 1)
            assert await store.fail_status(IA, 3)
            snapshot = await store.statuses()
            assert snapshot is not None
            assert [s.record.instance for s in snapshot.entries] == [IB]
            assert snapshot.epochs == {IA: 3, IB: 1}
            assert not await store.fail_status(IA, 3)  # once
        finally:
            await store.aclose()
