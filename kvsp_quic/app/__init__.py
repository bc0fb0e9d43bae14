"""The composition root: the ``kvsp-quic`` CLI (``cli``, ``cli_model``, ``cli_serve``, ``cli_args``), the TOML
configuration (``config``), server start-up (``serve``, ``instance``) and the demo (``demo``). The only package that
imports every layer and wires roles to servers and engines; nothing imports it but ``python -m kvsp_quic``.
"""
