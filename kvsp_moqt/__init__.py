"""KVSP over MOQT, in one place (DESIGN.md section 3): the pure namespace/track mapping (``tracks``), a holder's
replicas served as tracks (``holder_tracks``), the relay's access rules (``relay_rules``) and its KVSP
implementations of the generic relay's interfaces (``relay_policy``), the relay's Index Service link
(``index_link``), and the ``moqt://`` retrieval source with HTTP fallback (``source``). The generic MOQT library is
:mod:`moqt`; this package sits above it and above :mod:`http3` (whose typed client it uses).
"""
