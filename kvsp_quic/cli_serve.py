"""The server subcommands of ``kvsp-quic``: ``index`` and ``holder`` (later: ``controller``, ``relay``, ...).

Each takes ``--config FILE`` (TOML, :mod:`kvsp_quic.config`) and flags for the usual overrides, or ``--dev DIR``
for a quick start (:mod:`kvsp_quic.serve`). Flags win over the file; the file wins over the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

from .config import ConfigError, HolderFile, IndexFile, LocalStorageSection, ServerSection, TlsSection, load

T = TypeVar("T")

_SIZE_RE = re.compile(r"(\d+)\s*([KMGT]i?B?|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "M": 10**6, "MB": 10**6, "G": 10**9, "GB": 10**9, "T": 10**12,
          "TB": 10**12, "KI": 1 << 10, "KIB": 1 << 10, "MI": 1 << 20, "MIB": 1 << 20, "GI": 1 << 30, "GIB": 1 << 30,
          "TI": 1 << 40, "TIB": 1 << 40}


def size(text: str) -> int:
    """``"64MiB"`` -> 67108864 (also KB, MB, GB with powers of ten, and plain octets)."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1073741824, 512MiB, 4GiB)")
    return int(m.group(1)) * _UNITS[(m.group(2) or "").upper()]


def add_commands(sub: Any) -> None:
    index = sub.add_parser("index", help="run the Index Service (replicas, lookup, instance status)",
                           description="Serve the Index Service over HTTP/3, HTTP/2 and HTTP/1.1 on one port. "
                                       "Needs --config FILE with [tls] and a policy, or --dev DIR.")
    _common(index)
    index.add_argument("--store", choices=["memory", "redis"], help="where replicas are kept (default memory)")
    index.add_argument("--redis", metavar="URL",
                       help="redis://HOST:PORT/DB of the shared store (implies --store redis)")
    index.add_argument("--redis-cluster", action="store_true", default=None, help="the URL names a Redis Cluster")
    index.add_argument("--descriptor", action="append", metavar="FILE",
                       help="a Compatibility Descriptor whose geometry lets lookups estimate costs (repeatable)")
    index.add_argument("--max-ttl-ms", type=int, metavar="MS", help="cap on replica TTLs (default 600000)")
    index.set_defaults(handler=cmd_index)

    holder = sub.add_parser("holder", help="run a Holder (block storage in tiers, leases)",
                            description="Serve a Holder over HTTP/3, HTTP/2 and HTTP/1.1 on one port, publishing its "
                                        "replicas to the Index Service. Needs --config FILE with [tls] and a policy, "
                                        "or --dev DIR.")
    _common(holder)
    holder.add_argument("--index", metavar="URI", help="the Index Service's base URI, to publish replicas to")
    holder.add_argument("--descriptor", action="append", metavar="FILE",
                        help="a Compatibility Descriptor of the caches it serves (repeatable; --dev defaults to the "
                             "spec's example)")
    holder.add_argument("--host-capacity", type=size, metavar="SIZE", help="memory tier capacity (default 1GiB)")
    holder.add_argument("--local-storage", type=Path, metavar="DIR", help="a directory for the local-storage tier")
    holder.add_argument("--local-capacity", type=size, metavar="SIZE", help="local-storage capacity (default 10GiB)")
    holder.add_argument("--encryption-key-file", type=Path, metavar="FILE",
                        help="AES-256-GCM at rest for local storage: 32 raw octets or 64 hex characters")
    holder.add_argument("--replica-ttl-ms", type=int, metavar="MS", help="TTL of published replicas (default 300000)")
    holder.add_argument("--eviction", metavar="NAME", help="eviction policy: lru (default), fifo, lfu")
    holder.set_defaults(handler=cmd_holder)


    # Parsed by interop.runner itself (kvsp_quic.cli.main hands it the arguments); listed here for --help.
    sub.add_parser("interop", help="run the interop matrix (python -m interop; see kvsp-quic interop --help)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help="TOML configuration (docs in README)")
    p.add_argument("--dev", type=Path, metavar="DIR",
                   help="quick start: a dev CA and certificates in DIR, 127.0.0.1 on a free port, full rights for "
                        "DIR's certificates; never for production")
    p.add_argument("--listen", metavar="HOST:PORT", help="where to listen (TCP and UDP, same port; 0: a free one)")
    p.add_argument("--base-uri", metavar="URI", help="the base URI in the certificate (default https://HOST:PORT/)")
    p.add_argument("--policy", type=Path, metavar="FILE", help="the authorization policy (TOML)")
    p.add_argument("--tls-dir", type=Path, metavar="DIR", help="take ca.pem, NAME.pem, NAME.key from DIR")
    p.add_argument("--name", metavar="NAME", help="the principal name in --tls-dir")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def _file(cls: type[T], args: argparse.Namespace) -> T:
    return load(cls, args.config) if args.config is not None else cls()


def _server_overrides(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    server = cfg.server
    changes: dict[str, Any] = {}
    if args.listen is not None or args.base_uri is not None:
        server = ServerSection(listen=args.listen or server.listen, base_uri=args.base_uri or server.base_uri,
                               policy=server.policy)
    elif args.dev is not None and args.config is None:
        server = ServerSection(listen="127.0.0.1:0")
    changes["server"] = server
    if args.tls_dir is not None:
        if not args.name:
            raise ConfigError("--tls-dir needs --name (the principal whose NAME.pem and NAME.key to use)")
        changes["tls"] = TlsSection(args.tls_dir / "ca.pem", args.tls_dir / f"{args.name}.pem",
                                    args.tls_dir / f"{args.name}.key")
    return changes


def _logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("quic").setLevel(logging.ERROR)  # aioquic logs every refused handshake as a warning


def cmd_index(args: argparse.Namespace) -> int:
    from .serve import run_index

    cfg = _file(IndexFile, args)
    section = cfg.index
    overrides: dict[str, Any] = {}
    if args.store is not None:
        overrides["store"] = args.store
    if args.redis is not None:
        overrides.update(store="redis", redis_url=args.redis)
    if args.redis_cluster:
        overrides["redis_cluster"] = True
    if args.descriptor:
        overrides["descriptors"] = [Path(d) for d in args.descriptor]
    if args.max_ttl_ms is not None:
        overrides["max_ttl_ms"] = args.max_ttl_ms
    cfg = dataclasses.replace(cfg, index=dataclasses.replace(section, **overrides), **_server_overrides(cfg, args))
    _logging(args.log_level)
    asyncio.run(run_index(cfg, dev_dir=args.dev, policy_path=args.policy))
    return 0


def cmd_holder(args: argparse.Namespace) -> int:
    from .serve import run_holder

    cfg = _file(HolderFile, args)
    section = cfg.holder
    overrides: dict[str, Any] = {}
    if args.index is not None:
        overrides["index"] = args.index
    if args.descriptor:
        overrides["descriptors"] = [Path(d) for d in args.descriptor]
    for name in ("host_capacity", "replica_ttl_ms", "eviction"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.local_storage is not None:
        overrides["local_storage"] = LocalStorageSection(
            path=args.local_storage, capacity=args.local_capacity or 10 << 30,
            encryption_key_file=args.encryption_key_file)
    elif args.local_capacity is not None or args.encryption_key_file is not None:
        raise ConfigError("--local-capacity and --encryption-key-file need --local-storage DIR")
    cfg = dataclasses.replace(cfg, holder=dataclasses.replace(section, **overrides), **_server_overrides(cfg, args))
    _logging(args.log_level)
    asyncio.run(run_holder(cfg, dev_dir=args.dev, policy_path=args.policy))
    return 0
