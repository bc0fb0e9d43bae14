"""Deterministic samplers across engines: the ``"engine"`` status extension (kvsp_quic.records.EngineStatus) and the
Placement Controller's decision (spec, "Records": "sampler.deterministic" is true only if every instance eligible
to resume the session produces bit-identical output tokens from the same state).

The PC keeps a session's ``deterministic`` only when every live instance of the session's scope reports the
session's compat_id with one and the same (engine name, build fingerprint); it clears it at a start or a resume
otherwise. Driven through the role's asyncio adapter (tests.support.controller's Env), and once over real sockets
(tests.support.pc_app's cluster: the real controller app, recording instances)."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvsp_quic import keys as k
from kvsp_quic.compat import InstanceState
from kvsp_quic.fields import CompatId, RecordError
from kvsp_quic.records import EngineStatus, InstanceStatusRecord, Sampler
from kvsp_quic.roles.controller_records import SessionStart
from kvsp_quic.roles.controller_sessions import engines_agree
from kvsp_quic.roles.instance import InstanceRole, InstanceSettings
from kvsp_quic.roles.status import InstanceStatus
from tests.helpers import Clock
from tests.support.controller import FRONT, IA, IB, IC, Env, checkpoint, request, who
from tests.support.index import C1, C2
from tests.support.pc_app import Cluster, cluster, session_body

REF = EngineStatus("reference", "kvsp-quic/0.1 torch/2.4 cpu float32", CompatId(C1))
REF_CUDA = dataclasses.replace(REF, build="kvsp-quic/0.1 torch/2.4 cuda float32")
HF = EngineStatus("transformers", "transformers/4.46 kvsp-quic/0.1 torch/2.4 cpu float32", CompatId(C1))


def entry(instance: str, engine: EngineStatus | None, state: InstanceState = InstanceState.ACTIVE
          ) -> InstanceStatus:
    return InstanceStatus(InstanceStatusRecord(instance, 1, state, 3000, engine=engine), state, 0.0, 10.0)


# -- the record ---------------------------------------------------------------------------------------------------


def test_the_engine_extension_round_trips_and_is_optional() -> None:
    record = InstanceStatusRecord(IA, 3, InstanceState.ACTIVE, 3000, engine=HF)
    wire = record.to_json()
    assert wire["engine"] == {"name": "transformers", "build": HF.build, "compat_id": C1.hex()}
    assert InstanceStatusRecord.from_json(wire) == record
    bare = InstanceStatusRecord(IA, 3, InstanceState.ACTIVE, 3000)
    assert "engine" not in bare.to_json() and InstanceStatusRecord.from_json(bare.to_json()).engine is None
    # unknown members of the extension are ignored, as in every record; a malformed one is refused
    assert InstanceStatusRecord.from_json({**wire, "engine": {**wire["engine"], "kernels": "x"}}).engine == HF
    with pytest.raises(RecordError, match=r"engine\.compat_id"):
        InstanceStatusRecord.from_json({**wire, "engine": {"name": "reference", "build": "b", "compat_id": "00"}})


def test_the_instance_reports_its_engine_with_its_compat_id() -> None:
    r = InstanceRole(InstanceSettings(base_uri=IA, compat_id=C2, block_tokens=4), epoch=1, clock=Clock())
    assert r.status_record().engine is None
    record = r.status_record(engine=("transformers", HF.build))
    assert record.engine == EngineStatus("transformers", HF.build, CompatId(C2))


# -- the decision -------------------------------------------------------------------------------------------------


def test_engines_agree() -> None:
    assert engines_agree([entry(IA, REF), entry(IB, REF)], C1)
    assert not engines_agree([entry(IA, REF), entry(IB, HF)], C1)  # another engine
    assert not engines_agree([entry(IA, REF), entry(IB, REF_CUDA)], C1)  # same engine, another build
    assert not engines_agree([entry(IA, REF), entry(IB, None)], C1)  # an instance that does not say
    assert not engines_agree([], C1)  # nobody to vouch for it
    # an instance of another compat_id cannot resume the session: it does not count
    assert engines_agree([entry(IA, REF), entry(IB, dataclasses.replace(HF, compat_id=CompatId(C2)))], C1)
    assert not engines_agree([entry(IA, REF)], C2)


async def report(env: Env, instance: str, engine: EngineStatus | None, **kw: Any) -> None:
    await env.report(instance, engine=engine, **kw)


def started(env: Env) -> SessionStart:
    start = env.link.of("start")[-1][1]
    assert isinstance(start, SessionStart)
    return start


async def test_the_pc_keeps_deterministic_only_when_every_instance_runs_the_same_build() -> None:
    env = Env()
    await report(env, IA, REF)
    await report(env, IB, REF, queued=3)
    await env.svc.create_session(who(FRONT), request(session=1))
    assert started(env).sampler == Sampler("greedy", 0, 0, True)

    await report(env, IB, HF, queued=3)  # IB now computes with transformers: IA's greedy output is not IB's
    await env.svc.create_session(who(FRONT), request(session=2))
    start = started(env)
    assert start.sampler == Sampler("greedy", 0, 0, False)  # cleared, nothing else changed
    assert start.prompt == request(session=2).prompt and start.epoch == 1

    await report(env, IB, dataclasses.replace(HF, compat_id=CompatId(C2)), queued=3)  # IB serves another model
    await env.svc.create_session(who(FRONT), request(session=3))
    assert started(env).sampler.deterministic

    await report(env, IC, None, queued=3)  # IC reports no engine: it could compute anything
    await env.svc.create_session(who(FRONT), request(session=4))
    assert not started(env).sampler.deterministic

    await env.report(IC, state=InstanceState.SLEEPING, engine=HF)  # a sleeping instance can be woken to resume
    await env.svc.create_session(who(FRONT), request(session=5))
    assert not started(env).sampler.deterministic

    # a non-deterministic request stays so whatever the instances report
    await report(env, IC, REF)
    req = dataclasses.replace(request(session=6), sampler=Sampler("top-p", 7, 0, False, {"p": 0.9}))
    await env.svc.create_session(who(FRONT), req)
    assert started(env).sampler == req.sampler


async def test_a_resume_is_deterministic_only_if_the_instances_still_agree() -> None:
    env = Env()
    await report(env, IA, REF)
    await report(env, IB, REF, queued=2)
    req = request()
    await env.svc.create_session(who(FRONT), req)
    assert started(env).sampler.deterministic
    await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6, 7]))
    env.advance(2)
    await report(env, IB, REF, queued=2)
    await report(env, IC, HF, queued=2)  # a transformers instance joins the scope
    env.advance(1.5)  # IA falls silent: failed; its record no longer counts
    tasks = await env.svc.tick()
    assert len(tasks) == 1 and await tasks[0]
    (instance, resume), = env.link.of("resume")
    assert instance == IB and resume.epoch == 2
    assert resume.checkpoint.sampler == Sampler("greedy", 0, 3, False)  # IC could be next: gate the tokens
    assert resume.checkpoint.generated == (5, 6, 7) and resume.checkpoint.output_offset == 3
    # the held checkpoint is the instance's own: only the message to the new instance was changed
    assert env.pc.sessions[req.session].checkpoint == checkpoint(req, 1, [5, 6, 7])


async def test_a_resume_keeps_deterministic_when_the_instances_agree() -> None:
    env = Env()
    await report(env, IA, HF)
    await report(env, IB, HF, queued=2)
    req = request()
    await env.svc.create_session(who(FRONT), req)
    await env.svc.checkpoint(who(IA), req.session, checkpoint(req, 1, [5, 6]))
    env.advance(2)
    await report(env, IB, HF, queued=2)
    env.advance(1.5)
    tasks = await env.svc.tick()
    assert len(tasks) == 1 and await tasks[0]
    (_, resume), = env.link.of("resume")
    assert resume.checkpoint.sampler == Sampler("greedy", 0, 2, True)


# -- over real sockets: the controller app and recording instances ------------------------------------------------


def greedy_body(n: int) -> dict[str, Any]:
    return {**session_body(n), "sampler": Sampler("greedy", 0, 0, True).to_json()}


async def test_the_controller_app_reads_the_extension_from_status_reports(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        await deterministic_over_http(c)


async def deterministic_over_http(c: Cluster) -> None:
    ref = {"name": REF.name, "build": REF.build, "compat_id": C1.hex()}
    for name in ("ia", "ib"):  # the status PUT as an instance sends it, JSON and all
        body = {"instance": c.uri(name), "epoch": 1, "state": "active", "ttl_ms": 60_000, "batch_size": 8,
                "prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 100.0, "engine": ref}
        put = await c.call(name, "PUT", f"instances/{k.uri_id(c.uri(name))}/status", body)
        assert put.status == 200, put.content
    created = await c.call("alice", "POST", "sessions", greedy_body(1))
    assert created.status == 201, created.content
    starts = [s for inst in c.instances.values() for s in inst.of("start")]
    assert len(starts) == 1 and starts[0].sampler.deterministic

    await c.report("ib", engine=HF)  # ib switches to the transformers engine
    created = await c.call("alice", "POST", "sessions", greedy_body(2))
    assert created.status == 201, created.content
    starts = [s for inst in c.instances.values() for s in inst.of("start") if s.session == uuid.UUID(int=2)]
    assert len(starts) == 1 and starts[0].sampler == Sampler("greedy", 0, 0, False)
