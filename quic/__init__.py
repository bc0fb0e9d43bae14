"""The transport floor that HTTP/3 and MOQT share: TLS files and settings (``tls``), the development PKI (``pki``),
batched UDP (``udp``), our QUIC connection with mutual TLS, sliding receive windows and the other aioquic patches
(``connection``), the asyncio connection protocol and ``connect_quic`` (``protocol``), and the UDP listener that hands
each connection to a handler by ALPN (``listener``). It imports nothing above it (import-linter, pyproject.toml).
"""
