"""The ``kvsp-quic`` command: parse arguments, call the library, print JSON. The composition root.

Every failure the user can cause ends in one line on stderr and a non-zero exit status, never a traceback:
exit 1 for a protocol or input error, 2 for a usage error (argparse).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvsp_app.cli_args import nonneg_int, positive_int, usage
from kvsp_quic import __version__
from kvsp_quic.compat import Codec, CompatDescriptor
from kvsp_quic.container import (
    ANY_TOKEN_COUNT,
    ContainerDecoder,
    ContainerError,
    DecodedLayer,
    encode,
    replica_digest,
)
from kvsp_quic.fields import format_digest
from kvsp_quic.keys import BlockKeyer, KeyInputError, parse_scope_key, scope_id, scope_key_of_file
from kvsp_quic.problems import Problem

PROG = "kvsp-quic"


class CliError(Exception):
    """A one-line error for the user."""


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["interop"]:  # its own argument parser: python -m interop
        from interop.runner import main as interop_main

        return interop_main(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return handler(args)
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps interpreter shutdown from flushing into the pipe
        return 141
    except OSError as exc:
        where = f" {exc.filename!r}" if exc.filename else ""
        print(f"{PROG}: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if not _is_user_error(exc):
            raise
        message = exc.detail if isinstance(exc, Problem) and exc.detail else str(exc)
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _is_user_error(exc: Exception) -> bool:
    """Errors that are the user's to fix (bad input, configuration, files): one line, no traceback."""
    from kvsp_app.config import ConfigError
    from kvsp_dev.pki import PkiError
    from kvsp_quic.auth import PolicyError
    from quic.tls import TlsConfigError

    return isinstance(exc, CliError | Problem | ConfigError | PolicyError | PkiError | TlsConfigError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="KV Cache Storage Protocol (KVSP) over QUIC")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")

    keys = sub.add_parser("keys", help="compute compat_id, scope_id and the Block Keys of a token sequence",
                          description="Print {compat_id, scope_id, block_keys} as JSON. Only complete blocks "
                                      "have keys.")
    keys.add_argument("--descriptor", required=True, metavar="FILE", help="Compatibility Descriptor (JSON)")
    secret = keys.add_mutually_exclusive_group(required=True)
    secret.add_argument("--scope-key-file", metavar="FILE",
                        help="the scope key: a file of hex text (whitespace ignored) or of >= 32 raw octets "
                             "('-' for stdin)")
    secret.add_argument("--scope-key", metavar="HEX",
                        help="the scope key in hex (discouraged: visible to other users in ps and in shell "
                             "history; use --scope-key-file)")
    src = keys.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", metavar="T1,T2,...", help="comma-separated token ids")
    src.add_argument("--tokens-file", metavar="FILE",
                     help="token ids as a JSON array or separated by commas / whitespace ('-' for stdin)")
    keys.set_defaults(handler=cmd_keys)

    container = sub.add_parser("container", help="inspect or build KV Block Containers")
    csub = container.add_subparsers(title="container commands", metavar="COMMAND")
    container.set_defaults(handler=lambda _a: usage(container))

    inspect = csub.add_parser("inspect", help="validate a container and print its header and digests",
                              description="Print the header, per-layer lengths and SHA-256 digests as JSON. "
                                          "With --descriptor the geometry is checked too, and the replica "
                                          "digest is printed when the container holds every layer.")
    inspect.add_argument("file", metavar="FILE")
    inspect.add_argument("--descriptor", metavar="FILE")
    inspect.set_defaults(handler=cmd_container_inspect)

    pack = csub.add_parser("pack", help="build a container from random data or a .npy file",
                           description="Write a codec-raw container of layers A-B with N tokens. The data come "
                                       "from a seeded generator (--random) or from a .npy array of shape "
                                       "(layers, 2, tokens, kv_heads, head_dim) (--npy).")
    pack.add_argument("--descriptor", required=True, metavar="FILE")
    pack.add_argument("--tokens", required=True, type=positive_int, metavar="N")
    pack.add_argument("--layers", required=True, type=_layer_range, metavar="A-B")
    data = pack.add_mutually_exclusive_group(required=True)
    data.add_argument("--random", type=nonneg_int, metavar="SEED")
    data.add_argument("--npy", metavar="FILE")
    pack.add_argument("-o", "--output", required=True, metavar="FILE")
    pack.set_defaults(handler=cmd_container_pack)

    certs = sub.add_parser("certs", help="a development PKI: a CA and a certificate per role and client")
    ksub = certs.add_subparsers(title="certs commands", metavar="COMMAND")
    certs.set_defaults(handler=lambda _a: usage(certs))
    cinit = ksub.add_parser(
        "init", help="create or reuse a CA in DIR and issue the missing or outdated certificates",
        description="Write DIR/ca.pem + ca.key and NAME.pem + NAME.key per principal, and print "
                    '{"ca", "principals": [{"name", "uri", "cert", "key", "created"}]} as JSON. A role\'s '
                    "certificate carries its base URI as SAN URI, the URI's host (and every --host) as SAN IP or "
                    "DNS name, and EKU serverAuth + clientAuth; a client's carries urn:kvsp:client:NAME and EKU "
                    "clientAuth. Idempotent: an existing CA is reused, and a certificate is reissued only when it "
                    "is missing, expires within a day, or names another URI or other hosts.")
    cinit.add_argument("dir", metavar="DIR")
    cinit.add_argument("--role", action="append", default=[], metavar="NAME=BASE_URI",
                       help="a role principal, e.g. holder1=https://127.0.0.1:4433/kvsp/ (repeatable)")
    cinit.add_argument("--client", action="append", default=[], metavar="NAME",
                       help="a client-only principal, SAN URI urn:kvsp:client:NAME (repeatable)")
    cinit.add_argument("--host", action="append", default=[], metavar="H",
                       help="an extra SAN IP address or DNS name for every role certificate (repeatable)")
    cinit.set_defaults(handler=cmd_certs_init)

    from kvsp_app import cli_model, cli_serve, cli_vllm

    cli_model.add_commands(sub)
    cli_serve.add_commands(sub)
    cli_vllm.add_commands(sub)
    return parser


def _layer_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    if not sep:
        lo = hi = text
    first, last = nonneg_int(lo), nonneg_int(hi)
    if first > last:
        raise argparse.ArgumentTypeError(f"empty layer range {text!r} (A-B with A <= B)")
    return first, last


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2)
    sys.stdout.write("\n")


# -- keys -----------------------------------------------------------------------------------------------------


def parse_token_text(text: str, source: str) -> list[int]:
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            values = json.loads(stripped)
        except ValueError as exc:
            raise CliError(f"{source}: not a JSON array of integers ({exc})") from None
        if not isinstance(values, list) or not all(type(v) is int for v in values):
            raise CliError(f"{source}: not a JSON array of integers")
        return values
    tokens = []
    for item in stripped.replace(",", " ").split():
        try:
            tokens.append(int(item, 10))
        except ValueError:
            raise CliError(f"{source}: {item!r} is not a token id") from None
    return tokens


def read_key_file(raw: bytes, source: str) -> bytes:
    """A scope key file's content (:func:`kvsp_quic.keys.scope_key_of_file`: hex text or >= 32 raw octets, the
    format of the instance's ``--scope-key FILE``); a bad one is a CliError naming *source*."""
    try:
        return scope_key_of_file(raw)
    except KeyInputError as exc:
        raise CliError(f"{source}: {exc.detail}") from None


def scope_key_of(args: argparse.Namespace) -> bytes:
    """``--scope-key-file FILE`` (``-``: stdin), or ``--scope-key HEX`` with a warning: a secret in argv is
    visible to every local user (``ps``, ``/proc/PID/cmdline``) and lands in shell history (issue 13)."""
    if args.scope_key is not None:
        print(f"{PROG} keys: warning: --scope-key puts the secret scope key on the command line, where other "
              f"users can read it (ps) and shell history keeps it; use --scope-key-file FILE or - (stdin)",
              file=sys.stderr)
        return parse_scope_key(args.scope_key)
    if args.scope_key_file == "-":
        if args.tokens_file == "-":
            raise CliError("--scope-key-file - and --tokens-file -: only one of them can read stdin")
        return read_key_file(sys.stdin.buffer.read(), "--scope-key-file -")
    return read_key_file(Path(args.scope_key_file).read_bytes(), args.scope_key_file)


def cmd_keys(args: argparse.Namespace) -> int:
    descriptor = CompatDescriptor.load(args.descriptor)
    scope_key = scope_key_of(args)
    if args.tokens is not None:
        tokens = parse_token_text(args.tokens, "--tokens")
    else:
        text = sys.stdin.read() if args.tokens_file == "-" else Path(args.tokens_file).read_text()
        tokens = parse_token_text(text, args.tokens_file)
    keyer = BlockKeyer(scope_key, descriptor.compat_id, descriptor.block_tokens)
    _print_json({
        "compat_id": descriptor.compat_id.hex(),
        "scope_id": scope_id(scope_key).hex(),
        "block_keys": [k.hex() for k in keyer.keys(tokens)],
    })
    return 0


# -- container ------------------------------------------------------------------------------------------------


def cmd_container_inspect(args: argparse.Namespace) -> int:
    descriptor = CompatDescriptor.load(args.descriptor) if args.descriptor else None
    # With a descriptor the geometry is checked for the container's own token count: a container need not
    # hold a complete block to be inspected, and "complete_block" says whether it does.
    decoder = ContainerDecoder(descriptor, token_count=ANY_TOKEN_COUNT, repr_digest=True)
    layers: list[DecodedLayer] = []
    with open(args.file, "rb", buffering=0) as fh:
        while n := fh.readinto(decoder.get_buffer()):
            layers += decoder.buffer_updated(n)
    header = decoder.finish()
    assert decoder.repr_digest is not None
    report: dict[str, Any] = {
        "version": header.version,
        "flags": header.flags,
        "codec": header.codec,
        "first_layer": header.first_layer,
        "layer_count": header.layer_count,
        "token_count": header.token_count,
        "size": header.total_length,
        "repr_digest": format_digest(decoder.repr_digest),
        "layers": [{"layer": layer.index, "k_length": len(layer.k), "v_length": len(layer.v),
                    "digest": layer.digest.hex() if layer.digest else None} for layer in layers],
    }
    if descriptor is not None:
        report["compat_id"] = descriptor.compat_id.hex()
        report["complete_block"] = header.token_count == descriptor.block_tokens
        if header.first_layer == 0 and header.layer_count == descriptor.layers:
            report["replica_digest"] = format_digest(replica_digest([layer.digest or b"" for layer in layers]))
    _print_json(report)
    return 0


def cmd_container_pack(args: argparse.Namespace) -> int:
    from kvsp_quic.samples import random_sections, sections_from_npy

    descriptor = CompatDescriptor.load(args.descriptor)
    first, last = args.layers
    if last >= descriptor.layers:
        raise CliError(f"--layers {first}-{last}: the descriptor has layers 0-{descriptor.layers - 1}")
    if args.random is not None:
        sections = random_sections(descriptor, args.tokens, first, last, args.random)
    else:
        sections = sections_from_npy(args.npy, descriptor, args.tokens)
        if len(sections) != last - first + 1:
            raise CliError(f"{args.npy!r} holds {len(sections)} layers; --layers {first}-{last} needs "
                           f"{last - first + 1}")
    try:
        container = encode(sections, first_layer=first, token_count=args.tokens, codec=Codec.RAW,
                           descriptor=descriptor, digests=False)
    except ContainerError as exc:
        raise CliError(exc.detail) from None
    _write_atomically(Path(args.output), container.chunks())
    return 0


# -- certs ----------------------------------------------------------------------------------------------------


def cmd_certs_init(args: argparse.Namespace) -> int:
    from kvsp_dev import pki  # imported here: the other commands need no X.509

    try:
        principals = []
        for spec in args.role:
            name, sep, uri = spec.partition("=")
            if not sep or not name or not uri:
                raise CliError(f"--role {spec!r}: expected NAME=BASE_URI")
            principals.append(pki.role(name, uri))
        principals += [pki.client(name) for name in args.client]
        ca, issued = pki.init(args.dir, principals, extra_hosts=args.host)
    except pki.PkiError as exc:
        raise CliError(str(exc)) from None
    _print_json({
        "ca": os.fspath(ca),
        "principals": [{"name": i.name, "uri": i.uri, "cert": os.fspath(i.cert), "key": os.fspath(i.key),
                        "created": i.created} for i in issued],
    })
    return 0


def _write_atomically(path: Path, chunks: Any) -> None:
    """Write to a temporary file beside *path*, then rename: a failed write never leaves a partial file."""
    directory = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.writelines(chunks)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

