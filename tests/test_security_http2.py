"""Issue 13: the optional HTTP/2 path of the client (``KvspClient(fallback_http2=True)``, httpx) checks the server's
role identity like the HTTP/1.1 and HTTP/3 paths (docs/security.md): the server certificate's SAN URI must cover
the URL called (:func:`quic.tls.serves`) before any request is sent. Real servers on 127.0.0.1 with ``--dev``-style
certificates (tests/support/tls.py's dev_roles): the index's certificate answering on the holder's port is refused and
the server sees no request; the index at its own port is reached over HTTP/2."""

from __future__ import annotations

from pathlib import Path

import pytest

from http3.client import KvspClient, TransportError
from http3.server import RoleServer
from tests.support.tls import Counting, dev_roles


async def test_the_http2_path_refuses_a_co_located_role_answering_for_another(tmp_path: Path) -> None:
    async with dev_roles(tmp_path) as (roles, client_files):
        (holder_pair, holder_base, _), (index_pair, index_base, index_files) = roles["holder"], roles["index"]
        app = Counting()
        impostor = RoleServer(app, index_files)  # the index's certificate on the holder's port
        await impostor.start(sockets=holder_pair)
        genuine = RoleServer(app, index_files)
        await genuine.start(sockets=index_pair)
        try:
            async with KvspClient(client_files, prefer="tcp", fallback_http2=True, fallback=False,
                                  retries=0) as client:
                for _ in range(2):  # and again: no connection was kept for the origin
                    with pytest.raises(TransportError, match="not the role at port"):
                        await client.request("GET", f"{holder_base}blocks/x")
                    assert app.requests == 0  # nothing was sent to the wrong role
                response = await client.request("GET", f"{index_base}lookup")
                assert response.status == 200 and response.http_version == "HTTP/2"
                assert (await client.request("GET", f"{index_base}lookup")).status == 200  # the pooled connection
                assert app.requests == 2
        finally:
            await impostor.close()
            await genuine.close()
