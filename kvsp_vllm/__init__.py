"""KVSP inside vLLM: a KV connector (``kvsp_vllm.connector.KvspConnector``, a ``KVConnectorBase_V1``) that loads
prompt blocks from KVSP holders and stores the engine's new blocks at one, layer by layer (docs/vllm.md).

vLLM loads it by name::

    KVTransferConfig(kv_connector="KvspConnector", kv_connector_module_path="kvsp_vllm.connector",
                     kv_role="kv_both", kv_connector_extra_config={"config": "kvsp.toml"})

Modules: :mod:`~kvsp_vllm.settings` (``kv_connector_extra_config``), :mod:`~kvsp_vllm.layouts` (vLLM's paged
layouts <-> kvsp-layout-1, exactly), :mod:`~kvsp_vllm.descriptor` (the Compatibility Descriptor of a vLLM
configuration), :mod:`~kvsp_vllm.services` (the KVSP client on its own event loop thread) and
:mod:`~kvsp_vllm.connector` (vLLM's class, the only module that imports vLLM; a first version without a CI test yet,
issue 27). Nothing of the rest of kvsp-quic imports this package (pyproject.toml's import-linter contracts).
"""
