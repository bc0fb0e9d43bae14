"""Issue 13, "instance session resources bound to the session's owner" (docs/security.md): the PC names the
session's owner in every start and resume it sends (docs/wire.md, "Session owner"), and the instance serves the
session's token stream and ``GET sessions/{id}`` only to that owner and to the PC.

* Over the wire: the real Placement Controller (tests/support/pc_app.py's cluster: controller_app behind a
  RoleServer, recording instances behind their own) sends ``owner`` = the identity that created the session.
* Against a real instance (tests/support/instance.py's cluster: build_instance around a tiny model, on
  127.0.0.1): alice and bob are clients of the same scope; the PC starts alice's session; bob can neither read its
  tokens nor its state (404, as at the PC) nor cancel it (403), while alice and the PC can read it.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.support import pc_app

pytest.importorskip("torch", reason="the gpu extra (torch) is not installed")

from gpu.engine import Engine
from gpu.model import LlamaModel
from http3.client import KvspClient
from http3.server import RoleServer, bind_pair
from kvsp_app.instance import InstanceNode, build_instance
from kvsp_quic.auth import Policy
from kvsp_quic.roles.instance import InstanceOptions
from kvsp_runtime.instance_service import ServiceOptions
from tests.pki import TestPki, make_pki
from tests.support import instance as ia
from tests.support.instance import Cluster

post, read_stream, start_body, tokens_of = ia.post, ia.read_stream, ia.start_body, ia.tokens_of

PC_IDENTITY = "https://127.0.0.1/pc/"
ALICE, BOB = "urn:kvsp:client:alice", "urn:kvsp:client:bob"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> TestPki:
    """The instance's certificate, a PC's, and the clients alice and bob (overrides tests/conftest.py's: the PC
    needs a certificate of its own)."""
    return make_pki(tmp_path_factory.mktemp("pki"), roles={"server": ia.SERVER_IDENTITY, "pc": PC_IDENTITY})


def owner_policy() -> Policy:
    """alice and bob: clients of the same scope; the PC a controller; the instance itself."""
    return Policy.from_dict({"principal": [
        {"identity": PC_IDENTITY, "roles": ["controller"], "scopes": "*"},
        {"identity": ALICE, "roles": ["client"], "scopes": [ia.SCOPE.hex()]},
        {"identity": BOB, "roles": ["client"], "scopes": [ia.SCOPE.hex()]},
        {"identity": ia.SERVER_IDENTITY, "roles": ["instance", "holder"], "scopes": "*"},
    ]})


async def owned_instance(cl: Cluster) -> InstanceNode:
    """A real instance (as ``Cluster.instance``) under :func:`owner_policy`, without a PC to checkpoint to."""
    engine = Engine.load(str(cl.model_dir), block_tokens=ia.B, device_pages=256)
    tcp, udp = bind_pair("127.0.0.1", 0, 1 << 20)
    base = f"https://127.0.0.1:{tcp.getsockname()[1]}/"
    node = build_instance(engine, base_uri=base, files=cl.certs.files("server"), policy=owner_policy(),
                          scope_keys=[ia.SCOPE_KEY], index=cl.uri("is"), options=InstanceOptions(),
                          service=ServiceOptions(request_timeout_ms=5000), moqt=False)
    server = RoleServer(node.app, cl.certs.files("server"), quic_handlers=node.quic_handlers)
    await server.start(sockets=(tcp, udp))
    await node.start()
    cl.nodes.append((node, server, engine))
    return node


async def test_the_pc_names_the_session_owner_in_the_start_it_sends(tmp_path: Path) -> None:
    async with pc_app.cluster(tmp_path) as c:
        assert (await c.report("ia")).json() == {"state": "active"}
        body = pc_app.session_body()
        r = await c.call("alice", "POST", "sessions", body)
        assert r.status == 201, r.content
        (start,) = c.instances["ia"].of("start")
        assert start.owner == ALICE  # as received over HTTP/3 by the instance


async def test_a_client_of_the_same_scope_cannot_read_or_cancel_another_clients_session(
        instance_cluster: Cluster, reference: LlamaModel) -> None:
    cl = instance_cluster
    d = reference.descriptor(ia.B)
    node = await owned_instance(cl)
    base = node.role.settings.base_uri
    async with KvspClient(cl.certs.files("pc"), timeout=10.0) as pc:
        sid = uuid.uuid4()
        body = {**json.loads(start_body(sid, ia.PROMPT, max_tokens=3, d=d)), "owner": ALICE}
        r = await post(pc, f"{base}sessions/{sid}/start", body)
        assert r.status == 201, r.content

        # bob holds the session's scope but is not its owner: the session does not exist for him
        r = await cl.bob.request("GET", f"{base}sessions/{sid}/tokens")
        assert r.status == 404 and r.json()["status"] == 404, r.content
        r = await cl.bob.request("GET", f"{base}sessions/{sid}")
        assert r.status == 404, r.content
        r = await cl.bob.request("DELETE", f"{base}sessions/{sid}")
        assert r.status == 403, r.content  # cancelling at the instance is the PC's alone

        # the owner reads its tokens and state; the PC reads the state
        assert len(tokens_of(await read_stream(cl.alice, f"{base}sessions/{sid}/tokens"))) == 3
        r = await cl.alice.request("GET", f"{base}sessions/{sid}")
        assert r.status == 200 and r.json()["session"] == str(sid)
        r = await pc.request("GET", f"{base}sessions/{sid}")
        assert r.status == 200, r.content

        # a resume names the owner too: a run resumed for bob is bob's, not alice's
        cp = {"session": str(sid), "epoch": 1, "compat_id": d.compat_id.hex(), "scope_id": ia.SCOPE.hex(),
              "prompt_blocks": [k.hex() for k in ia.keys_of(ia.PROMPT, d)],
              "prompt_tail": ia.PROMPT[len(ia.PROMPT) // ia.B * ia.B:], "generated": [], "output_offset": 0,
              "sampler": {"method": "greedy", "seed": 0, "step": 0, "deterministic": True}}
        r = await post(pc, f"{base}sessions/{sid}/resume", {"epoch": 2, "checkpoint": cp, "max_tokens": 3,
                                                             "owner": BOB})
        assert r.status == 200, r.content
        r = await cl.alice.request("GET", f"{base}sessions/{sid}/tokens")
        assert r.status == 404, r.content
        assert len(tokens_of(await read_stream(cl.bob, f"{base}sessions/{sid}/tokens"))) == 3
