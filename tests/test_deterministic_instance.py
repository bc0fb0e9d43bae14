"""A real instance (gpu.engine behind kvsp_runtime.instance_service, over sockets) reports its engine: the ``"engine"``
status extension in its ``PUT instances/{id}/status`` to the PC and in ``GET status`` (docs/wire.md, "Placement
Controller": deterministic samplers across engines). The PC side is tests/test_deterministic.py."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from kvsp_quic.records import EngineStatus, InstanceStatusRecord
from tests.support.instance import Cluster
from tests.support.waits import until


async def test_a_real_instance_reports_its_engine_and_build(instance_cluster: Cluster) -> None:
    cl = instance_cluster
    node = await cl.instance(status_ttl_ms=300)
    base = node.role.settings.base_uri
    engine = node.service.engine
    expected = EngineStatus(engine.name, engine.build, engine.descriptor.compat_id)
    assert expected.name == "reference" and "torch/" in expected.build
    await until(lambda: any(s["instance"] == base for s in cl.pc.statuses))
    reported = InstanceStatusRecord.from_json(next(s for s in cl.pc.statuses if s["instance"] == base))
    assert reported.engine == expected
    r = await cl.alice.request("GET", f"{base}status")
    assert r.status == 200 and InstanceStatusRecord.from_json(r.json()).engine == expected
