"""Holder liveness and failure reports at the Index Service (kvsp_quic.roles.liveness; issue 12, point 5): a lookup
leaves out the replicas of a holder whose liveness record lapsed (https records and their moqt:// twins at the
same port), keeps those of holders that never reported, and tries a holder that a client of the scope reported
failed last -- without dropping its records."""

from __future__ import annotations

import pytest

from kvsp_quic.problems import BadRequest, Forbidden, ScopeDenied
from kvsp_quic.records import LookupRequest, moqt_record
from kvsp_quic.roles.index import IndexService
from kvsp_quic.roles.liveness import FailureReports, LivenessTable, demote
from kvsp_quic.storage.memory_index import MemoryIndexStore
from tests.helpers import Clock
from tests.support.index import C1, H1, H2, H3, PC, S1, S2, bk, hid, make_config, replica, who

TWIN = "moqt://h1.example:443/"  # h1's MOQT twin: the same host and port as https://h1.example/


async def lookup(service: IndexService, n: int = 1, *, scope: bytes = S1) -> list[list[str]]:
    response = await service.lookup(who(PC), LookupRequest(scope, C1, tuple(bk(i) for i in range(n))))  # type: ignore[arg-type]
    return [[r.holder for r in m.replicas] for m in response.blocks]


async def rendered(service: IndexService, n: int = 1) -> int:
    matched, _body = await service.lookup_json(who(PC), LookupRequest(S1, C1, tuple(bk(i) for i in range(n))))  # type: ignore[arg-type]
    return matched


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def service(clock: Clock) -> IndexService:
    svc = IndexService(MemoryIndexStore(), clock=clock, config=make_config())
    for holder in (H1, H2):
        for i in range(2):
            await svc.publish(who(holder), hid(holder), bk(i), replica(i, holder))
    return svc


async def test_a_lapsed_holder_drops_out_of_lookups_until_it_reports_again(service: IndexService,
                                                                           clock: Clock) -> None:
    assert service.report_liveness(who(H1), hid(H1), H1, 3000) == 3000
    assert await lookup(service, 2) == [[H1, H2], [H1, H2]]
    clock.now += 2.9
    assert await lookup(service, 2) == [[H1, H2], [H1, H2]]
    clock.now += 0.2  # lapsed: its replicas are left out, H2's stay (H2 never reported: never left out)
    assert await lookup(service, 2) == [[H2], [H2]]
    assert await rendered(service, 2) == 2  # the rendered fast path agrees
    service.report_liveness(who(H1), hid(H1), H1, 3000)  # back (e.g. restarted on the same port)
    assert await lookup(service, 2) == [[H1, H2], [H1, H2]]


async def test_the_moqt_twin_goes_with_its_holder(service: IndexService, clock: Clock) -> None:
    twin = moqt_record(replica(0, H1), TWIN)
    service.liveness.report(H1, 1000)
    await service.store.put(twin, clock())
    assert set((await lookup(service))[0]) == {H1, H2, TWIN}
    clock.now += 1.5
    assert await lookup(service) == [[H2]]


async def test_a_prefix_ends_where_only_lapsed_replicas_remain(clock: Clock) -> None:
    svc = IndexService(MemoryIndexStore(), clock=clock, config=make_config())
    for i in range(3):
        await svc.publish(who(H1), hid(H1), bk(i), replica(i, H1))
    await svc.publish(who(H2), hid(H2), bk(0), replica(0, H2))
    svc.report_liveness(who(H1), hid(H1), H1, 1000)
    clock.now += 2
    assert await lookup(svc, 3) == [[H2]]
    assert await rendered(svc, 3) == 1


async def test_liveness_is_the_holders_own(service: IndexService) -> None:
    with pytest.raises(Forbidden):
        service.report_liveness(who(H3), hid(H1), H1, 1000)  # H3 does not publish for H1
    service.report_liveness(who(H2), hid(H1), H1, 1000)  # H2 publishes for H1
    with pytest.raises(BadRequest):
        service.report_liveness(who(H1), hid(H2), H1, 1000)  # the path names another holder
    with pytest.raises(BadRequest):
        service.report_liveness(who(H1), hid(H1), H1, 0)
    assert service.report_liveness(who(H1), hid(H1), H1, 10**9) == service.liveness.max_ttl_ms


async def test_a_failure_report_demotes_for_a_while_and_drops_nothing(service: IndexService, clock: Clock) -> None:
    service.report_failure(who(PC), hid(H1), H1, S1)
    assert await lookup(service, 2) == [[H2, H1], [H2, H1]]  # still listed, tried last
    assert await lookup(service, 2, scope=S2) == []  # (no S2 records; another scope is not affected anyway)
    assert service.failures.demoted(S2) == frozenset()
    clock.now += service.failures.demote_ms / 1000 + 0.1
    assert await lookup(service, 2) == [[H1, H2], [H1, H2]]


async def test_only_a_principal_of_the_scope_reports(service: IndexService) -> None:
    with pytest.raises(ScopeDenied):
        service.report_failure(who("urn:kvsp:client:bob"), hid(H1), H1, S1)  # bob has S2 only
    with pytest.raises(BadRequest):
        service.report_failure(who(PC), hid(H2), H1, S1)


def test_the_tables_on_their_own() -> None:
    clock = Clock()
    table = LivenessTable(clock, max_ttl_ms=5000)
    assert table.alive(H1) is None
    table.report(H1, 1000)
    assert table.alive(H1) is True and table.lapsed_endpoints() == frozenset()
    clock.now += 1.0
    assert table.alive(H1) is False and table.lapsed_endpoints() == {("h1.example", 443)}
    table.report(TWIN, 1000)  # alive at the same endpoint: not lapsed
    assert table.lapsed_endpoints() == frozenset()
    reports = FailureReports(clock, demote_ms=0)
    reports.report(S1, H1)
    assert reports.demoted(S1) == frozenset() and reports.reports == 1
    r1, r2 = replica(0, H1), replica(0, H2)
    assert demote([r1, r2], frozenset({("h1.example", 443)})) == (r2, r1)
    assert demote([r1, r2], frozenset()) == (r1, r2)
