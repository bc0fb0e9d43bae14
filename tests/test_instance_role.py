"""kvsp_quic/roles/instance.py (with instance_sessions.py and instance_reshard.py): the instance's lifecycle,
directives, sessions, the checks of session starts and resumes, status and resharding as plain objects on a fake
clock (no sockets, no torch)."""

from __future__ import annotations

import dataclasses
import uuid

import pytest

from kvsp_quic.auth import ALL, Principal, Role
from kvsp_quic.compat import InstanceState
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.problems import (
    BadRequest,
    Incompatible,
    InvalidState,
    NotFound,
    PlanConflict,
    Problem,
    ScopeDenied,
    StaleEpoch,
    TooManyRequests,
)
from kvsp_quic.records import (
    Link,
    PrefetchBlock,
    PrefetchDirective,
    PrefetchState,
    ReshardAbort,
    ReshardCommit,
    ReshardFetch,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
)
from kvsp_quic.roles.controller_records import SessionResume, SessionStart
from kvsp_quic.roles.instance import (
    EngineFigures,
    InstanceRole,
    InstanceSettings,
    Lifecycle,
    LinkMeter,
    Phase,
    ReshardBook,
    ReshardContext,
)

COMPAT = bytes(range(32))
SCOPE = bytes(16)
BASE = "https://ii.example/kvsp/"
A, B_, C = (bytes([i]) * 32 for i in (1, 2, 3))
GREEDY = Sampler(method="greedy", seed=0, step=0, deterministic=True)
TOP_P = Sampler(method="top-p", seed=7, step=0, deterministic=False, params={"p": 0.9})


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def role(clock: Clock, **kw: object) -> InstanceRole:
    settings = InstanceSettings(base_uri=BASE, compat_id=COMPAT, block_tokens=4, **kw)  # type: ignore[arg-type]
    return InstanceRole(settings, epoch=1_700_000_000_000, clock=clock)


def directive(*keys: bytes, deadline_ms: int = 50, compat: bytes = COMPAT, did: uuid.UUID | None = None
              ) -> PrefetchDirective:
    return PrefetchDirective(directive=did or uuid.uuid4(), scope_id=SCOPE, compat_id=compat,  # type: ignore[arg-type]
                             blocks=tuple(PrefetchBlock(k, ("https://h1.example/",)) for k in keys),  # type: ignore[arg-type]
                             deadline_ms=deadline_ms, lease_ms=2000)


# -- lifecycle ----------------------------------------------------------------------------------------------------


def test_draining_waits_for_in_flight_sessions_then_sleeps_and_only_the_pc_wakes_it() -> None:
    clock = Clock()
    life = Lifecycle(clock)
    life.admit()
    life.sessions_changed(2)
    assert life.set_by_controller(InstanceState.DRAINING) is InstanceState.DRAINING
    with pytest.raises(InvalidState):
        life.admit()
    life.sessions_changed(1)
    assert life.state is InstanceState.DRAINING
    life.changed = False
    life.sessions_changed(0)
    assert life.state is InstanceState.SLEEPING and life.changed  # reported at once
    with pytest.raises(InvalidState):
        life.admit()
    life.answer(InstanceState.ACTIVE, None)  # a status answer is no state change
    assert life.state is InstanceState.SLEEPING
    assert life.set_by_controller(InstanceState.ACTIVE) is InstanceState.ACTIVE
    life.admit()
    assert life.set_by_controller(InstanceState.SLEEPING) is InstanceState.SLEEPING  # nothing in flight: at once
    with pytest.raises(InvalidState):
        life.set_by_controller(InstanceState.FAILED)
    assert [s.value for s in life.history] == ["active", "draining", "sleeping", "active", "draining", "sleeping"]


def test_an_idle_instance_asks_to_sleep_and_follows_the_answer() -> None:
    clock = Clock()
    life = Lifecycle(clock, sleep_after_idle_s=10)
    assert life.requested_state() is None
    clock.t += 9
    life.sessions_changed(1)  # busy: the idle time starts again when it ends
    clock.t += 5
    life.sessions_changed(0)
    clock.t += 9
    assert life.requested_state() is None
    clock.t += 1
    assert life.requested_state() is InstanceState.SLEEPING
    life.answer(InstanceState.ACTIVE, InstanceState.SLEEPING)  # refused: ask again after another idle period
    assert life.state is InstanceState.ACTIVE and life.requested_state() is None
    clock.t += 10
    assert life.requested_state() is InstanceState.SLEEPING
    life.answer(InstanceState.DRAINING, InstanceState.SLEEPING)  # accepted: nothing in flight, so asleep
    assert life.state is InstanceState.SLEEPING and life.requested_state() is None


# -- prefetch directives -------------------------------------------------------------------------------------------


def test_directives_complete_fail_and_turn_partial_at_their_deadline() -> None:
    clock = Clock()
    r = role(clock, max_directives=2)
    d, new = r.admit_directive(directive(A, B_, C), held=lambda k: k == A)
    assert new and d.state is PrefetchState.PENDING and d.pending == [B_, C]
    assert d.status().loaded == (A,)
    r.directives.block_loaded(d, C)
    r.directives.block_loaded(d, B_)
    assert d.state is PrefetchState.COMPLETE and d.status().loaded == (A, B_, C)  # in the directive's order
    again, new = r.admit_directive(d.record, held=lambda k: False)  # re-sent: the same directive
    assert again is d and not new
    with pytest.raises(Problem) as conflict:
        r.admit_directive(directive(A, did=d.id), held=lambda k: False)
    assert conflict.value.status == 409
    # all held: complete at once
    done, _ = r.admit_directive(directive(A), held=lambda k: True)
    assert done.state is PrefetchState.COMPLETE
    # a failed block: partial with what loaded, failed with nothing
    p, _ = r.admit_directive(directive(A, B_), held=lambda k: False)
    f, _ = r.admit_directive(directive(C), held=lambda k: False)
    with pytest.raises(TooManyRequests):  # two pending: the quota
        r.admit_directive(directive(C), held=lambda k: False)
    r.directives.block_loaded(p, A)
    r.directives.block_failed(p, B_)
    r.directives.block_failed(f, C)
    assert p.state is PrefetchState.PARTIAL and p.status().loaded == (A,)
    assert f.state is PrefetchState.FAILED
    # the deadline
    late, _ = r.admit_directive(directive(A, B_, deadline_ms=50), held=lambda k: False)
    r.directives.block_loaded(late, A)
    clock.t += 0.049
    assert r.directives.expire() == []
    clock.t += 0.002
    assert r.directives.expire() == [late] and late.state is PrefetchState.PARTIAL
    r.directives.block_loaded(late, B_)  # too late: it stays partial
    assert r.directives.status(late.id).loaded == (A,)
    with pytest.raises(Incompatible):
        r.admit_directive(directive(A, compat=bytes(32)), held=lambda k: False)
    clock.t += 601  # finished directives are forgotten after the retention time
    r.sweep()
    with pytest.raises(NotFound):
        r.directives.status(late.id)
    r.lifecycle.set_by_controller(InstanceState.DRAINING)
    with pytest.raises(InvalidState):  # never to an instance that is not active
        r.admit_directive(directive(A), held=lambda k: False)


# -- sessions ------------------------------------------------------------------------------------------------------


def new_session(r: InstanceRole, sid: uuid.UUID, epoch: int = 1, *, sampler: Sampler = GREEDY,
                prompt_len: int = 7, output: tuple[int, ...] = (), max_tokens: int = 40):  # type: ignore[no-untyped-def]
    return r.new_session(session=sid, epoch=epoch, compat_id=COMPAT, scope_id=SCOPE, prompt_len=prompt_len,
                         prompt_blocks=[A], prompt_tail=[1, 2, 3][:prompt_len - 4], max_tokens=max_tokens,
                         sampler=sampler, output=output)


def test_checkpoints_at_block_boundaries_every_n_tokens_and_at_the_end() -> None:
    clock = Clock()
    r = role(clock, checkpoint_tokens=6)
    s, old, new = new_session(r, uuid.uuid4())
    assert new and old is None and s.deterministic and not s.gated
    made = [i + 1 for i in range(20) if s.append(100 + i, clock())]
    # the prompt has 7 tokens: a block of 4 completes at lengths 8, 12, 16, 20, 24 (offsets 1, 5, 9, 13, 17)
    assert made == [1, 5, 9, 13, 17]
    cp = s.take_checkpoint()
    assert cp is not None and cp.output_offset == 17 and cp.generated == tuple(range(100, 117))
    assert cp.sampler.step == 17 and cp.prompt_blocks == (A,) and cp.prompt_tail == (1, 2, 3)
    assert s.take_checkpoint() is None  # one in flight at a time
    s.checkpoint_done(17, False)  # failed: made again, covering what came since
    r.finish_session(s, Phase.DONE, "length")
    cp = s.take_checkpoint()
    assert cp is not None and cp.output_offset == 20
    s.checkpoint_done(20, True)
    assert s.checkpoints_settled and s.stream_done(20) and not s.stream_done(19)
    # every N tokens when blocks are long
    r2 = role(clock, checkpoint_tokens=3, max_tokens=100)
    s2, _, _ = new_session(r2, uuid.uuid4(), prompt_len=4)
    assert [i + 1 for i in range(8) if s2.append(i, clock())] == [3, 4, 7, 8]


def test_a_non_deterministic_session_releases_only_acknowledged_tokens() -> None:
    clock = Clock()
    r = role(clock, checkpoint_tokens=2)
    s, _, _ = new_session(r, uuid.uuid4(), sampler=TOP_P)
    assert s.gated and not s.deterministic
    for t in range(3):
        s.append(t, clock())
    assert s.releasable() == 0
    cp = s.take_checkpoint()
    assert cp is not None and cp.sampler.deterministic is False and cp.sampler.params == {"p": 0.9}
    s.checkpoint_done(cp.output_offset, True)
    assert s.releasable() == cp.output_offset == 3  # the latest checkpoint replaced the one at offset 1
    # greedy without a PC: released at once
    r3 = role(clock, controller=False)
    s3, _, _ = new_session(r3, uuid.uuid4(), sampler=TOP_P)
    s3.append(5, clock())
    assert not s3.gated and s3.releasable() == 1


def test_epochs_fence_older_runs() -> None:
    clock = Clock()
    r = role(clock)
    sid = uuid.uuid4()
    s1, _, _ = new_session(r, sid, 1)
    again, _, new = new_session(r, sid, 1)
    assert again is s1 and not new  # a re-sent start
    s2, old, new = new_session(r, sid, 2, output=(9, 9))
    assert new and old is s1 and s1.phase is Phase.SUPERSEDED and s2.base_offset == 2 and s2.acked == 2
    with pytest.raises(StaleEpoch):
        new_session(r, sid, 1)
    r.sessions.fence(s2, "the PC holds a newer epoch")
    assert s2.phase is Phase.SUPERSEDED and s2.stream_done(0)
    with pytest.raises(StaleEpoch):
        new_session(r, sid, 2)  # the PC said a newer epoch exists
    s3, _, new = new_session(r, sid, 3)
    assert new and s3.epoch == 3


def test_admission_limits_and_state() -> None:
    clock = Clock()
    r = role(clock, max_running=1, max_queued=1)
    new_session(r, uuid.uuid4())
    new_session(r, uuid.uuid4())
    with pytest.raises(TooManyRequests):
        new_session(r, uuid.uuid4())
    with pytest.raises(Incompatible):
        r.new_session(session=uuid.uuid4(), epoch=1, compat_id=bytes(32), scope_id=SCOPE, prompt_len=4,
                      prompt_blocks=[], prompt_tail=[], max_tokens=1, sampler=GREEDY)
    r2 = role(clock)
    r2.lifecycle.set_by_controller(InstanceState.DRAINING)
    with pytest.raises(InvalidState):
        new_session(r2, uuid.uuid4())


# -- the status record ---------------------------------------------------------------------------------------------


def test_status_records_every_third_of_the_ttl() -> None:
    clock = Clock()
    r = role(clock, status_ttl_ms=3000, sleep_after_idle_ms=5000)
    assert r.report_due() == 0  # the first at once
    record = r.status_record(EngineFigures(kv_utilization=0.25, prefill_tokens_per_s=1234.56,
                                           decode_tokens_per_s=88.0))
    assert record.instance == BASE and record.epoch == 1_700_000_000_000 and record.ttl_ms == 3000
    assert record.state is InstanceState.ACTIVE and record.requested_state is None and record.batch_size == 4
    assert (record.kv_utilization, record.prefill_tokens_per_s, record.decode_tokens_per_s) == (0.25, 1234.6, 88.0)
    r.reported(InstanceState.ACTIVE)
    assert r.report_due() == pytest.approx(1.0)
    clock.t += 1.0
    assert r.report_due() == 0
    new_session(r, uuid.uuid4())
    record = r.status_record()
    assert record.queued == 1 and record.running == 0
    r.lifecycle.set_by_controller(InstanceState.DRAINING)
    assert r.report_due() == 0  # a state change is reported at once
    r.reported(None)
    assert r.report_due() > 0


def test_links_configured_and_measured() -> None:
    links = LinkMeter([Link(holder="https://h1.example/", mbit_per_s=1000, rtt_us=50)])
    links.observe("https://h1.example/", 10**6, 0.1, 0.001)  # configured wins
    links.observe("moqt://h2.example:443/", 1_000_000, 0.01, 0.0005)
    out = {link.holder: link for link in links.links()}
    assert out["https://h1.example/"].mbit_per_s == 1000
    assert out["moqt://h2.example:443/"].mbit_per_s == pytest.approx(800.0)
    assert out["moqt://h2.example:443/"].rtt_us == pytest.approx(500)


# -- resharding ----------------------------------------------------------------------------------------------------


def plan(frm: int, to: int, *, retain=(), fetch=(), release=()) -> ReshardPlan:  # type: ignore[no-untyped-def]
    return ReshardPlan(map="m", from_version=frm, to_version=to, deadline_ms=100, retain=tuple(retain),
                       fetch=tuple(ReshardFetch(t, "https://ii2.example/") for t in fetch), release=tuple(release))


def test_reshard_plans_commit_and_abort_in_the_spec_order() -> None:
    book = ReshardBook(block_tokens=4)
    ctx = ReshardContext(compat_id=COMPAT, scope_id=SCOPE, block_keys=(A, B_, C))  # type: ignore[arg-type]
    steps = book.plan(plan(0, 1, fetch=[(0, 12)]), ctx)
    assert steps.new and steps.retain == () and [i for i, _ in steps.fetch] == [0, 1, 2]
    assert not book.plan(plan(0, 1, fetch=[(0, 12)]), None).new  # the same plan again
    with pytest.raises(PlanConflict):
        book.plan(plan(0, 1, retain=[(0, 4)]), None)  # another plan while one is in progress
    with pytest.raises(PlanConflict):
        book.commit(ReshardCommit("m", 1))  # not acknowledged yet
    book.fetched(steps.state, [0, 1, 2])
    book.acknowledge(steps.state)
    state, drop = book.commit(ReshardCommit("m", 1))
    assert state.version == 1 and drop == set() and state.held == {0, 1, 2}
    assert book.commit(ReshardCommit("m", 1))[1] == set()  # committed already
    with pytest.raises(PlanConflict):
        book.plan(plan(0, 1), None)  # version 1 holds now
    steps = book.plan(plan(1, 2, retain=[(0, 8)], release=[(8, 12)]), None)
    assert steps.retain == (0, 1) and steps.fetch == ()
    book.acknowledge(steps.state)
    state, drop = book.commit(ReshardCommit("m", 2))
    assert drop == {2} and state.held == {0, 1}
    steps = book.plan(plan(2, 3, fetch=[(8, 12)]), None)
    book.fetched(steps.state, [2])
    state2, discard = book.abort(ReshardAbort("m", 3))
    assert state2 is not None and state2.version == 2 and discard == {2} and state2.held == {0, 1}
    with pytest.raises(PlanConflict):
        book.abort(ReshardAbort("m", 2))  # committed: cannot be aborted
    with pytest.raises(BadRequest):
        book.plan(plan(2, 3, retain=[(2, 8)]), None)  # not on a block boundary
    book2 = ReshardBook(block_tokens=4)
    with pytest.raises(BadRequest):
        book2.plan(plan(0, 1, fetch=[(0, 4)]), None)  # fetching needs the context's block keys
    assert book2.abort(ReshardAbort("other", 1)) == (None, set())


# -- the checks of a session start and resume ---------------------------------------------------------------------

SCOPE_KEY = bytes(range(32))
KEYER = BlockKeyer(SCOPE_KEY, COMPAT, 4)
ALICE = Principal("urn:kvsp:client:alice", frozenset({Role.CONTROLLER}), frozenset({KEYER.scope_id}))
PROMPT = tuple(range(10, 21))  # two blocks of 4 and a tail of 3


def samplers_of_this_engine(sampler: Sampler) -> None:
    if sampler.method not in ("greedy", "top-p"):
        raise ValueError(f"sampling method {sampler.method!r} is not one of greedy, top-p")


def checked_role(clock: Clock, **kw: object) -> InstanceRole:
    settings = InstanceSettings(base_uri=BASE, compat_id=COMPAT, block_tokens=4, vocab_size=256, max_tokens=50,
                                **kw)  # type: ignore[arg-type]
    return InstanceRole(settings, epoch=1, clock=clock, keyers=[KEYER], check_sampler=samplers_of_this_engine)


def start(sid: uuid.UUID, *, epoch: int = 1, prompt: tuple[int, ...] = PROMPT, block_keys: tuple[bytes, ...] = (),
          sampler: Sampler = GREEDY, max_tokens: int = 8, scope: bytes = KEYER.scope_id, compat: bytes = COMPAT,
          session: uuid.UUID | None = None) -> SessionStart:
    return SessionStart(session or sid, epoch, scope, compat, prompt, max_tokens, sampler,  # type: ignore[arg-type]
                        block_keys)  # type: ignore[arg-type]


def test_a_start_is_checked_against_the_scope_key_the_cache_the_vocabulary_the_keys_and_the_sampler() -> None:
    r = checked_role(Clock())
    sid = uuid.uuid4()
    keys = KEYER.keys(PROMPT)
    admitted = r.start_session(ALICE, sid, start(sid, block_keys=tuple(keys[:1])))
    s = admitted.session
    assert admitted.new and admitted.superseded is None and admitted.keyer is KEYER
    assert s.prompt_blocks == tuple(keys) and len(keys) == 2 and s.prompt_tail == PROMPT[8:] and s.prompt_len == 11
    assert s.max_tokens == 8 and s.sampler() == GREEDY
    again = r.start_session(ALICE, sid, start(sid))
    assert again.session is s and not again.new  # a re-sent start
    other = uuid.uuid4()
    with pytest.raises(BadRequest, match="session"):
        r.start_session(ALICE, other, start(other, session=sid))
    with pytest.raises(ScopeDenied, match="not authorized"):
        r.start_session(ALICE, other, start(other, scope=bytes(16)))
    everyone = Principal("urn:kvsp:client:pc", frozenset({Role.CONTROLLER}), ALL)
    with pytest.raises(ScopeDenied, match="no scope key"):
        r.start_session(everyone, other, start(other, scope=bytes(16)))
    with pytest.raises(Incompatible):
        r.start_session(ALICE, other, start(other, compat=bytes(32)))
    with pytest.raises(BadRequest, match="vocabulary size 256"):
        r.start_session(ALICE, other, start(other, prompt=(1, 2, 256)))
    with pytest.raises(BadRequest, match="block_keys"):
        r.start_session(ALICE, other, start(other, block_keys=(keys[1],)))
    with pytest.raises(BadRequest, match="sampler: sampling method 'beam'"):
        r.start_session(ALICE, other, start(other, sampler=Sampler(method="beam", seed=0, step=0,
                                                                   deterministic=False)))
    with pytest.raises(BadRequest, match="max_tokens: at most 50"):
        r.start_session(ALICE, other, start(other, max_tokens=51))
    assert set(r.sessions.sessions) == {sid}  # nothing refused was admitted


def checkpoint(sid: uuid.UUID, *, generated: tuple[int, ...] = (5, 6, 7, 8, 9), offset: int = 3, step: int = 5,
               blocks: tuple[bytes, ...] | None = None, tail: tuple[int, ...] = PROMPT[8:]) -> SessionCheckpoint:
    return SessionCheckpoint(
        session=sid, epoch=1, compat_id=COMPAT, scope_id=KEYER.scope_id,  # type: ignore[arg-type]
        prompt_blocks=tuple(KEYER.keys(PROMPT)) if blocks is None else blocks, prompt_tail=tail,  # type: ignore[arg-type]
        generated=generated, output_offset=offset, sampler=dataclasses.replace(TOP_P, step=step))


def test_a_resume_continues_from_the_covered_output_with_the_sampler_moved_back() -> None:
    r = checked_role(Clock())
    sid = uuid.uuid4()
    admitted = r.resume_session(ALICE, sid, SessionResume(2, checkpoint(sid), prompt=PROMPT))
    s = admitted.session
    assert admitted.new and s.epoch == 2 and s.output == [5, 6, 7] and s.base_offset == s.acked == 3
    assert s.sampler().step == 3 and s.sampler().params == {"p": 0.9}  # the two uncovered tokens are drawn again
    assert s.prompt_len == 11 and s.max_tokens == 50  # no max_tokens: the instance's limit
    assert s.gated  # top-p: tokens wait for acknowledged checkpoints
    other = uuid.uuid4()
    with pytest.raises(BadRequest, match=r"checkpoint\.session"):
        r.resume_session(ALICE, other, SessionResume(2, checkpoint(sid)))
    with pytest.raises(BadRequest, match="a tail is shorter than a block"):
        r.resume_session(ALICE, other, SessionResume(2, checkpoint(other, tail=(1, 2, 3, 4))))
    with pytest.raises(BadRequest, match="not the prompt of the checkpoint"):
        r.resume_session(ALICE, other, SessionResume(2, checkpoint(other), prompt=(*PROMPT[:-1], 99)))
    with pytest.raises(BadRequest, match="vocabulary"):
        r.resume_session(ALICE, other, SessionResume(2, checkpoint(other, generated=(300,), offset=1, step=1)))
    at_boundary = checkpoint(other, generated=(), offset=0, step=0, tail=())
    with pytest.raises(BadRequest, match="without the prompt"):
        r.resume_session(ALICE, other, SessionResume(2, at_boundary))
    resumed = r.resume_session(ALICE, other, SessionResume(2, at_boundary, prompt=PROMPT[:8], max_tokens=4))
    assert resumed.new and resumed.session.output == [] and resumed.session.max_tokens == 4


def test_scope_keys_must_fit_the_cache() -> None:
    settings = InstanceSettings(base_uri=BASE, compat_id=COMPAT, block_tokens=8)
    with pytest.raises(ValueError, match="block size"):
        InstanceRole(settings, epoch=1, clock=Clock(), keyers=[KEYER])  # set up for blocks of 4


def test_a_reshard_context_must_be_of_the_principals_scope_and_this_cache() -> None:
    r = checked_role(Clock())
    ctx = ReshardContext(compat_id=COMPAT, scope_id=KEYER.scope_id, block_keys=(A, B_))  # type: ignore[arg-type]
    with pytest.raises(Incompatible):
        r.plan_reshard(ALICE, plan(0, 1, fetch=[(0, 8)]), dataclasses.replace(ctx, compat_id=bytes(32)))
    with pytest.raises(ScopeDenied):
        r.plan_reshard(ALICE, plan(0, 1, fetch=[(0, 8)]), dataclasses.replace(ctx, scope_id=bytes(16)))
    steps = r.plan_reshard(ALICE, plan(0, 1, fetch=[(0, 8)]), ctx)
    assert steps.new and [i for i, _ in steps.fetch] == [0, 1]
    with pytest.raises(PlanConflict, match="still loading"):
        r.plan_reshard(ALICE, plan(0, 1, fetch=[(0, 8)]), ctx)  # the same plan again, its fetches not in
    r.reshard.acknowledge(steps.state)
    assert not r.plan_reshard(ALICE, plan(0, 1, fetch=[(0, 8)]), ctx).new  # answered as acknowledged
