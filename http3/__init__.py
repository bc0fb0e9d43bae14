"""The HTTP stack, free of KVSP: HTTP/3, HTTP/2 and HTTP/1.1 <-> ASGI on one port number (``server``; ``h3_server``,
``tcp_server`` with ``tcp_h1`` / ``tcp_h2``, ``asgi_bridge``) and the HTTP client (``client`` over ``h3_client`` and
``h1_client``). It imports ``quic`` and nothing of KVSP (an import-linter contract says so); the KVSP resources are
served by ``kvsp_http`` and requested through ``kvsp_client``.
"""
