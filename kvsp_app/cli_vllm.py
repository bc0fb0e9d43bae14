"""``kvsp-quic vllm``: what the vLLM connector (kvsp_vllm, loaded by vLLM in its own environment) will use.

``kvsp-quic vllm descriptor --model DIR --block-tokens B [--dtype fp32|bf16|fp16]`` prints the Compatibility
Descriptor of a model served by vLLM with ``block_size=B`` and ``dtype=...`` (``kv_cache_dtype="auto"``): it is
:func:`gpu.modelfiles.derive_descriptor` of the same files, the function the connector
(:mod:`kvsp_vllm.descriptor`), the reference engine and the transformers engine call, so all four agree on the
Compatibility ID. The command needs numpy only, not vLLM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvsp_app.cli_args import positive_int, usage

DTYPES = ("fp32", "bf16", "fp16")
VLLM_BLOCK_MULTIPLE = 16  # vLLM's block sizes; its CPU attention takes multiples of 32


def add_commands(sub: Any) -> None:
    """Add ``vllm descriptor`` to the subparsers action *sub* of the ``kvsp-quic`` parser."""
    vllm = sub.add_parser("vllm", help="the vLLM KV connector (kvsp_vllm): the descriptor it uses")
    vsub = vllm.add_subparsers(title="vllm commands", metavar="COMMAND")
    vllm.set_defaults(handler=lambda _a: usage(vllm))
    desc = vsub.add_parser(
        "descriptor", help="print the Compatibility Descriptor the vLLM connector uses for a model",
        description="The descriptor of vLLM serving --model DIR with block_size B and dtype TYPE "
                    "(kv_cache_dtype auto): the same the reference and transformers engines derive for the files.")
    desc.add_argument("--model", required=True, metavar="DIR", help="the model directory vLLM serves")
    desc.add_argument("--block-tokens", required=True, type=positive_int, metavar="B",
                      help="vLLM's block_size (a multiple of 16; of 32 on the CPU backend)")
    desc.add_argument("--dtype", choices=DTYPES, help="vLLM's dtype (default: the model's)")
    desc.set_defaults(handler=cmd_vllm_descriptor)


def cmd_vllm_descriptor(args: argparse.Namespace) -> int:
    from gpu.modelfiles import ModelError, derive_descriptor
    from kvsp_quic.compat import dumps_descriptor

    if args.block_tokens % VLLM_BLOCK_MULTIPLE:
        raise ModelError(f"--block-tokens {args.block_tokens}: vLLM's block sizes are multiples of "
                       f"{VLLM_BLOCK_MULTIPLE}")
    sys.stdout.write(dumps_descriptor(derive_descriptor(args.model, args.block_tokens, kv_dtype=args.dtype)))
    return 0
