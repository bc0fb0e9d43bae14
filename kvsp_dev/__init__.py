"""Development tools of the composition root, the interop matrix, the tests and the benchmarks: the development PKI
(``pki``: ``kvsp-quic certs init``, ``--dev DIR``) and ``kvsp-quic`` role processes started and stopped as real
processes (``processes``). Nothing the servers run in production imports it (an import-linter contract says so).
"""
