"""The Index Service's geometry (issue 12, point 8): without a Compatibility Descriptor for the compat_id an
instance serves, lookups cannot estimate fetch cost and placement ignores where blocks are (docs/wire.md, "Index
Service"). Instances report the compat_id they serve (status extension ``"engine"``) but not its block size, so
the index cannot learn the geometry; it says so loudly instead: a WARNING at start-up when no descriptor is
configured, and one per compat_id an instance reports that has none. With ``--descriptor FILE`` of the instances'
descriptor neither appears and lookups with ``targets`` estimate. Real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from http3.client import KvspClient
from kvsp_client.api import KvspApi
from kvsp_quic.records import LookupRequest
from kvsp_quic.roles.index import NO_GEOMETRY
from tests.helpers import Process
from tests.support.instance_processes import active, files_of, keyer_of, start_instances, tiny_model

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")


async def test_an_index_without_the_instances_descriptor_warns_and_one_with_it_estimates(
        tmp_path: Path, procs: list[Process]) -> None:
    model = tiny_model(tmp_path)
    dev = str(tmp_path / "dev")
    bare = Process("index", "--dev", dev)
    procs.append(bare)
    uri = bare.ready["base_uri"]
    [instance] = await start_instances(1, dev, model, [uri], procs)
    compat = instance.ready["compat_id"]
    async with KvspClient(files_of(bare.ready), timeout=20) as client:
        await active(client, uri, [instance])
    instance_err = instance.stop()
    err = bare.stop()
    assert "Traceback" not in err and "Traceback" not in instance_err, err
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert any("no Compatibility Descriptor configured" in w and NO_GEOMETRY in w for w in warnings), err
    assert any(compat in w and instance.ready["base_uri"] in w and NO_GEOMETRY in w for w in warnings), err
    assert sum(compat in w for w in warnings) == 1, "warned once per compat_id"

    descriptor = tmp_path / "tiny.json"
    descriptor.write_text(json.dumps(instance.ready["descriptor"]))
    known = Process("index", "--dev", dev, "--descriptor", str(descriptor))
    procs.append(known)
    uri = known.ready["base_uri"]
    [instance] = await start_instances(1, dev, model, [uri], procs)
    keyer = keyer_of(instance)
    target = instance.ready["base_uri"]
    async with KvspClient(files_of(known.ready), timeout=20) as client:
        await active(client, uri, [instance])
        api = KvspApi(client)
        request = LookupRequest(keyer.scope_id, keyer.compat_id, tuple(keyer.keys(list(range(16)))), (target,))
        deadline = time.monotonic() + 30
        while True:  # the instance states its prefill rate once it has measured one (warm-up)
            found = await api.lookup(uri, request)
            if found.targets:
                break
            assert time.monotonic() < deadline, f"no estimate for {target}: {found}"
            await asyncio.sleep(0.2)
        assert [t.instance for t in found.targets] == [target]
    instance.stop()
    err = known.stop()
    assert not [line for line in err.splitlines() if "WARNING" in line and NO_GEOMETRY in line], err
