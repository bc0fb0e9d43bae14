"""The composition root: the ``kvsp-quic`` CLI (``cli``, ``cli_model``, ``cli_serve``, ``cli_args``), the TOML
configuration (``config``), server start-up (``serve``, ``instance``), the demo (``demo``) and the chaos suite
(``chaos``). The only package that imports every layer and wires roles to servers and engines; nothing imports it
(``python -m kvsp_app`` runs the CLI).
"""
