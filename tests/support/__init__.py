"""What several test modules share, so that no test module imports another (tests/test_layering.py checks it).

One module per area, each with the constants, builders and small worlds its tests have in common; the fixtures
built on them are tests/conftest.py's, found by name. The older shared modules -- tests/helpers.py (a manual clock,
``kvsp-quic`` in-process and as a process), tests/pki.py, tests/asgi.py, tests/peers.py, tests/redis_server.py and
tests/vectors.py -- stay where they were.

* the protocol core: ``descriptors`` (small_descriptor), ``records`` (the draft's example records), ``tiers``
  (storage tier blocks), ``metrics`` (the Prometheus text format, checked)
* the Index Service: ``index`` (records and principals, Env), ``index_app`` (its app over real sockets)
* holders: ``holder`` (the role in process), ``holder_app`` (over real sockets), ``cluster`` (blocks for real
  ``kvsp-quic index`` and ``holder`` processes), ``resource_limits`` (the attack tests' legitimate client)
* the Placement Controller: ``controller`` (Env, FakeLink), ``pc_app`` (the controller app with recording
  instances), ``replicated_pc`` (two replicas on one Redis)
* instances: ``instance`` (the in-process instance cluster), ``instance_processes`` (CPU instances as processes),
  ``reshard`` (maps between them), ``hf_model`` (transformers-written models)
* retrieval and MOQT: ``retrieval`` (the retrieval client's servers), ``moqt_relay`` (relay worlds),
  ``moqt_examples`` (every control message, fetch streams, datagrams)
* transports and security: ``transport`` (QUIC helpers), ``tls`` (``--dev`` role identities), ``crl`` (revocation)
* the front end: ``frontend`` (a byte tokenizer, a one-instance PC)
* vLLM (issue 27): ``vllm_runs`` (the model vLLM's CPU kernels take, running ``vllm_driver`` in .venv-vllm),
  ``vllm_driver`` (a script for .venv-vllm's interpreter, not imported here)
* waiting: ``waits`` (``until``: a bounded poll for an event, the seconds it took)
"""
