"""The inference side of KVSP in torch: the reference Llama-family model, a paged KV cache with device and host
tiers, conversion to and from kvsp-layout-1, layer-streamed prefill and sampling (docs/gpu.md).

Modules: ``modelfiles`` (config.json, safetensors writer, tokenizer, descriptor; no torch), ``model``,
``rope``, ``kvcache``, ``prefill``, ``generate``, ``sampling``, ``engine``, and ``hf_engine`` (the transformers
engine). Importing this package imports nothing else, so ``gpu.modelfiles`` works where torch is not installed.
"""
