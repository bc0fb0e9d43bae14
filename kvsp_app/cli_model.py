"""``kvsp-quic model``: write a small random-weights model, print a model directory's Compatibility Descriptor,
generate text with the reference model.

Hooked into the ``kvsp-quic`` parser by ``add_commands(sub)``. ``model init`` and ``model descriptor`` need
numpy only; ``model generate`` imports torch (the ``gpu`` extra) when it runs, so the CLI works without torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvsp_app.cli_args import nonneg_int, positive_int, usage

SUPPORTED_DTYPES = ("fp32", "bf16", "fp16")
# The chat template ``model init`` writes into tokenizer_config.json (the front end's /v1/chat/completions renders
# it: http3/frontend_text.load_chat_template): each message as <|role|>content and a newline, then <|assistant|>.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")



def add_commands(sub: Any) -> None:
    """Add ``model init | descriptor | generate`` to the subparsers action *sub* of the ``kvsp-quic`` parser."""
    model = sub.add_parser("model", help="reference model files: init a random model, descriptor, generate")
    msub = model.add_subparsers(title="model commands", metavar="COMMAND")
    model.set_defaults(handler=lambda _a: usage(model))

    init = msub.add_parser(
        "init", help="write a small random-weights Llama model (config.json, model.safetensors, tokenizer.json, "
                     "tokenizer_config.json with a chat template)",
        description="Write a Hugging Face Llama layout model with seeded random weights and a byte-level "
                    "tokenizer (token id = UTF-8 octet), for tests and demos. The same arguments always give the "
                    "same files, hence the same model_digest. Prints a JSON summary.")
    init.add_argument("directory", metavar="DIR")
    init.add_argument("--layers", required=True, type=positive_int, metavar="N")
    init.add_argument("--kv-heads", required=True, type=positive_int, metavar="H")
    init.add_argument("--head-dim", required=True, type=_even_int, metavar="D")
    init.add_argument("--heads", type=positive_int, metavar="Q",
                      help="query heads, a multiple of --kv-heads (default: 2 x kv heads)")
    init.add_argument("--hidden", type=positive_int, metavar="N", help="hidden size (default: heads x head dim)")
    init.add_argument("--intermediate", type=positive_int, metavar="N", help="MLP size (default: 2 x hidden)")
    init.add_argument("--vocab", type=positive_int, default=256, metavar="N", help="vocabulary, >= 256 (256)")
    init.add_argument("--dtype", choices=SUPPORTED_DTYPES, default="fp32", help="weight dtype (fp32)")
    init.add_argument("--seed", type=nonneg_int, default=0, metavar="S")
    init.add_argument("--rope-theta", type=positive_int, default=10000, metavar="T")
    init.add_argument("--rope-scaling", metavar="JSON",
                      help='config.json rope_scaling, e.g. \'{"rope_type": "linear", "factor": 2.0}\'')
    init.add_argument("--max-positions", type=positive_int, default=8192, metavar="N")
    init.add_argument("--tied", action="store_true", help="tie the output layer to the embeddings")
    init.add_argument("--name", metavar="NAME", help="_name_or_path in config.json (the descriptor's model)")
    init.add_argument("--force", action="store_true", help="overwrite an existing model in DIR")
    init.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                      help="write no tokenizer_config.json (by default it holds a simple chat template: "
                           "<|role|>content lines, then <|assistant|>)")
    init.set_defaults(handler=cmd_model_init)

    desc = msub.add_parser(
        "descriptor", help="print the Compatibility Descriptor of a model directory",
        description="Derive the descriptor: model digest over *.safetensors, tokenizer digest of tokenizer.json, "
                    "geometry and positional encoding from config.json, the given block size.")
    desc.add_argument("directory", metavar="DIR")
    desc.add_argument("--block-tokens", required=True, type=positive_int, metavar="B")
    desc.add_argument("--name", metavar="NAME", help="the model name (default: config.json's, or DIR's name)")
    desc.add_argument("--kv-dtype", metavar="TYPE", help="KV element type (default: the model's dtype)")
    desc.add_argument("-o", "--output", metavar="FILE", help="write the descriptor here (default: stdout)")
    desc.set_defaults(handler=cmd_model_descriptor)

    gen = msub.add_parser("generate", help="generate text with the reference model (needs torch)",
                          description="Tokenize a prompt, prefill it, and sample tokens. Prints JSON.")
    gen.add_argument("directory", metavar="DIR")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=positive_int, default=16, metavar="N")
    gen.add_argument("--method", choices=("greedy", "top-p"), default="greedy")
    gen.add_argument("--p", type=float, default=0.9, help="top-p mass (0.9)")
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--seed", type=nonneg_int, default=0)
    gen.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    gen.add_argument("--block-tokens", type=positive_int, default=16, metavar="B")
    gen.set_defaults(handler=cmd_model_generate)


def _even_int(text: str) -> int:
    value = positive_int(text)
    if value % 2:
        raise argparse.ArgumentTypeError(f"{text!r} is not even (rotary embeddings pair dimensions)")
    return value


def cmd_model_init(args: argparse.Namespace) -> int:
    from gpu.modelfiles import CONFIG_FILE, KV_TO_DTYPE, ModelConfig, ModelError, write_random_model
    from kvsp_quic.compat import model_digest

    directory = Path(args.directory)
    if (directory / CONFIG_FILE).exists() and not args.force:
        raise ModelError(f"{args.directory!r} already holds a model (--force overwrites it)")
    heads = args.heads or 2 * args.kv_heads
    if heads % args.kv_heads:
        raise ModelError(f"--heads {heads} is not a multiple of --kv-heads {args.kv_heads}")
    hidden = args.hidden or heads * args.head_dim
    scaling = None
    if args.rope_scaling:
        try:
            scaling = json.loads(args.rope_scaling)
        except ValueError as exc:
            raise ModelError(f"--rope-scaling is not JSON: {exc}") from None
    config = ModelConfig(hidden_size=hidden, intermediate_size=args.intermediate or 2 * hidden,
                         num_hidden_layers=args.layers, num_attention_heads=heads,
                         num_key_value_heads=args.kv_heads, vocab_size=args.vocab, head_dim=args.head_dim,
                         rope_theta=float(args.rope_theta), rope_scaling=scaling,
                         max_position_embeddings=args.max_positions, tie_word_embeddings=args.tied,
                         dtype=KV_TO_DTYPE[args.dtype], name=args.name)
    write_random_model(directory, config, seed=args.seed)
    if args.chat_template:  # not part of the tokenizer digest (tokenizer.json): the Compatibility ID is unchanged
        (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2) + "\n",
                                                         encoding="utf-8")
    h, q = config.hidden_size, config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = 2 * h + h * (q + 2 * kv) + q * h + 3 * h * config.intermediate_size
    parameters = config.vocab_size * h * (1 if config.tie_word_embeddings else 2) + h + per_layer * args.layers
    print(json.dumps({"directory": str(directory), "files": sorted(p.name for p in directory.iterdir()),
                      "parameters": parameters, "model_digest": model_digest(directory),
                      "positional": config.positional(), "config": config.to_json()}, indent=2))
    return 0


def cmd_model_descriptor(args: argparse.Namespace) -> int:
    from gpu.modelfiles import derive_descriptor
    from kvsp_quic.compat import dumps_descriptor

    descriptor = derive_descriptor(args.directory, args.block_tokens, name=args.name, kv_dtype=args.kv_dtype)
    text = dumps_descriptor(descriptor)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(json.dumps({"compat_id": descriptor.compat_id.hex(), "output": args.output}))
    else:
        sys.stdout.write(text)
    return 0


def cmd_model_generate(args: argparse.Namespace) -> int:
    from gpu.modelfiles import ModelError

    try:
        import torch  # noqa: F401
    except ImportError:
        raise ModelError("'model generate' needs torch: pip install 'kvsp-quic[gpu]'") from None
    import asyncio

    from gpu.generate import generate_tokens
    from gpu.kvcache import PagedKVCache
    from gpu.model import LlamaModel
    from gpu.prefill import prefill
    from gpu.sampling import TokenSampler

    try:
        model = LlamaModel.load(args.directory, device=args.device)
    except RuntimeError as exc:  # a device that is not there
        raise ModelError(str(exc)) from None
    tokenizer = model.tokenizer
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ModelError("the prompt has no tokens")
    params = {"p": args.p, "temperature": args.temperature} if args.method == "top-p" else {}
    try:
        sampler = TokenSampler(args.method, params=params, seed=args.seed)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
    b = args.block_tokens
    pages = -(-(len(prompt) + args.max_tokens) // b) + 1
    cache = PagedKVCache(layers=model.num_layers, kv_heads=model.kv_heads, head_dim=model.head_dim,
                         block_tokens=b, kv_dtype=model.kv_dtype_name, device=model.device, device_pages=pages)
    result = asyncio.run(prefill(model, cache, prompt))
    eos = model.config.eos_token_id
    stop = set(eos) if isinstance(eos, tuple) else ({eos} if eos is not None else set())
    out = generate_tokens(model, result, sampler, max_new_tokens=args.max_tokens, stop_tokens=stop)
    result.sequence.release()
    print(json.dumps({"prompt_tokens": len(prompt), "tokens": out.tokens, "text": tokenizer.decode(out.tokens),
                      "sampler": sampler.record().to_json()}, ensure_ascii=False))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvsp_app.cli_model model ...``: the same commands outside ``kvsp-quic``."""
    parser = argparse.ArgumentParser(prog="kvsp-quic")
    add_commands(parser.add_subparsers(title="commands", metavar="COMMAND"))
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    from kvsp_quic.problems import Problem

    try:
        return int(handler(args))
    except Problem as exc:
        print(f"kvsp-quic: error: {exc.detail or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
