"""Run in .venv-vllm by tests/support/vllm.py (``python vllm_driver.py COMMAND JSON``): prints one JSON line.

* ``layouts {"model": DIR, "block": B}``: transformers computes the KV of a prompt on the model; vLLM's own CPU
  kernel (``cpu_attn_reshape_and_cache``) writes it into a paged cache of each layout; kvsp_vllm.layouts reads every
  block back and writes it into a fresh cache. Reports, per layout, whether the sections read equal the
  kvsp-layout-1 sections of transformers' cache (gpu.hf_engine.blocks_from_dynamic_cache) octet for octet, and
  whether the cache written equals the one vLLM's kernel wrote.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def layouts(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import transformers
    from vllm import _custom_ops as ops

    from gpu.hf_engine import blocks_from_dynamic_cache
    from gpu.kvcache import KV_DTYPES
    from gpu.modelfiles import derive_descriptor
    from kvsp_vllm.layouts import PagedLayout

    b = int(args["block"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32).eval()
    prompt = torch.tensor([[(7 * i + 3) % 290 + 5 for i in range(3 * b + 5)]])
    with torch.no_grad():
        cache = hf(prompt, use_cache=True).past_key_values
    out: dict[str, Any] = {}
    for kv, isa in (("fp32", "vec"), ("bf16", "vec"), ("bf16", "amx"), ("fp16", "vec")):
        dtype = KV_DTYPES[kv]
        descriptor = derive_descriptor(args["model"], b, kv_dtype=kv)
        want = blocks_from_dynamic_cache(cache, descriptor)  # 3 complete blocks, kvsp-layout-1 octets
        layout = PagedLayout("cpu-amx" if isa == "amx" else "cpu", b, descriptor.kv_heads, descriptor.head_dim)
        placement = [4, 1, 6]  # vLLM block ids of the prompt's blocks, in order
        read_ok = written_ok = True
        for layer_index, layer_kv in enumerate(cache.layers):
            keys = layer_kv.keys[0].transpose(0, 1).to(dtype).contiguous()  # (tokens, heads, dim)
            values = layer_kv.values[0].transpose(0, 1).to(dtype).contiguous()
            n = len(placement) * b
            paged = torch.zeros(8, descriptor.kv_heads, b, 2 * descriptor.head_dim, dtype=dtype)
            halves = paged.view(8, descriptor.kv_heads, 2 * b, -1).chunk(2, dim=2)
            slots = torch.tensor([placement[t // b] * b + t % b for t in range(n)], dtype=torch.int64)
            ops.cpu_attn_reshape_and_cache(keys[:n], values[:n], halves[0], halves[1], slots, isa)
            ours = torch.zeros_like(paged)
            for i, block_id in enumerate(placement):
                k, v = layout.read(paged, block_id)
                wk, wv = want[i][layer_index]
                read_ok &= k.view(torch.uint8).numpy().tobytes() == wk and v.view(torch.uint8).numpy().tobytes() == wv
                layout.write_octets(ours, block_id, [wk], [wv])
            written_ok &= torch.equal(ours.view(torch.uint8), paged.view(torch.uint8))
        out[f"{kv}-{isa}"] = {"read": bool(read_ok), "written": bool(written_ok)}
    return out


def generate(args: dict[str, Any]) -> dict[str, Any]:
    """``{"model": DIR, "block": B, "prompts": [[ids]], "max_tokens": N, "extra": {...}}``: greedy fp32 generation
    by one vLLM engine with the KVSP connector (``extra``: its kv_connector_extra_config; none: no connector)."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if args.get("extra") is not None:
        transfer = KVTransferConfig(kv_connector="KvspConnector", kv_connector_module_path="kvsp_vllm.connector",
                                    kv_role="kv_both", kv_connector_extra_config=args["extra"])
    llm = LLM(model=args["model"], dtype="float32", enforce_eager=True, max_model_len=2048,
              block_size=int(args["block"]), kv_transfer_config=transfer, skip_tokenizer_init=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=int(args["max_tokens"]), detokenize=False)
    outputs = []
    for prompt in args["prompts"]:  # one at a time: the second may load what the first stored
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        outputs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0})
    return {"outputs": outputs}


if __name__ == "__main__":
    del sys.path[0]  # this directory: its modules must not shadow vllm's or the project's
    command, raw = sys.argv[1], sys.argv[2]
    result = {"layouts": layouts, "generate": generate}[command](json.loads(raw))
    print(json.dumps(result), flush=True)
