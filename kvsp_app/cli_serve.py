"""The server subcommands of ``kvsp-quic``: ``index``, ``holder`` and ``relay`` (later: ``controller``, ...).

Each takes ``--config FILE`` (TOML, :mod:`kvsp_app.config`) and flags for the usual overrides, or ``--dev DIR``
for a quick start (:mod:`kvsp_app.serve`). Flags win over the file; the file wins over the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import re
import shlex
import sys
from pathlib import Path
from typing import Any, TypeVar

from kvsp_app import event_loop

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
    index = sub.add_parser("index", help="run the Index Service with the Placement Controller (replicas, lookup, "
                                         "instance status, sessions, migration, resharding)",
                           description="Serve the Index Service and the Placement Controller (one process, one base "
                                       "URI) over HTTP/3, HTTP/2 and HTTP/1.1 on one port, with /metrics. Needs "
                                       "--config FILE with [tls] and a policy, or --dev DIR.")
    _common(index)
    index.add_argument("--store", choices=["memory", "redis"], help="where replicas are kept (default memory)")
    index.add_argument("--redis", metavar="URL",
                       help="redis://HOST:PORT/DB of the shared store (implies --store redis)")
    index.add_argument("--redis-cluster", action="store_true", default=None, help="the URL names a Redis Cluster")
    index.add_argument("--descriptor", action="append", metavar="FILE",
                       help="a Compatibility Descriptor whose geometry lets lookups estimate costs (repeatable)")
    index.add_argument("--max-ttl-ms", type=int, metavar="MS", help="cap on replica TTLs (default 600000)")
    index.add_argument("--start-hook", metavar="CMD",
                       help="a command (split like a shell would, run without one) that starts an inference instance "
                            "when none has capacity; it gets KVSP_PC_URI and KVSP_START_REASON in its environment")
    index.add_argument("--sleep-policy", choices=["load", "always", "never"],
                       help="answer to instances asking to sleep (default load: when the others have spare slots)")
    index.set_defaults(handler=cmd_index)

    holder = sub.add_parser("holder", help="run a Holder (block storage in tiers, leases)",
                            description="Serve a Holder over HTTP/3, HTTP/2 and HTTP/1.1 on one port, publishing its "
                                        "replicas to the Index Service. Needs --config FILE with [tls] and a policy, "
                                        "or --dev DIR.")
    _common(holder)
    holder.add_argument("--index", action="append", metavar="URI",
                        help="the Index Service's base URI, to publish replicas to (repeatable: replicas of the "
                             "service, tried in turn)")
    holder.add_argument("--descriptor", action="append", metavar="FILE",
                        help="a Compatibility Descriptor of the caches it serves (repeatable; --dev defaults to the "
                             "spec's example)")
    holder.add_argument("--host-capacity", type=size, metavar="SIZE", help="memory tier capacity (default 1GiB)")
    holder.add_argument("--local-storage", type=Path, metavar="DIR", help="a directory for the local-storage tier")
    holder.add_argument("--local-capacity", type=size, metavar="SIZE", help="local-storage capacity (default 10GiB)")
    holder.add_argument("--encryption-key-file", type=Path, metavar="FILE",
                        help="AES-256-GCM at rest for local storage: 32 raw octets or 64 hex characters")
    holder.add_argument("--mac-key-file", type=Path, metavar="FILE",
                        help="the key authenticating unencrypted local-storage files (HMAC-SHA-256), outside DIR; "
                             "created 0600 when missing (default: DIR.mac-key)")
    holder.add_argument("--replica-ttl-ms", type=int, metavar="MS", help="TTL of published replicas (default 300000)")
    holder.add_argument("--eviction", metavar="NAME",
                        help="eviction policy: prefix (default: the deepest blocks of the coldest chains first), lru, "
                             "fifo, lfu")
    holder.add_argument("--workers", type=int, metavar="N",
                        help="processes serving the port and the one block store (default: one per core)")
    holder.set_defaults(handler=cmd_holder)

    relay = sub.add_parser("relay", help="run a MOQT relay (KVSP tracks: cache, coalescing, Replica Records)",
                           description="Serve a MOQT relay (drafts 14 and 18, mutual TLS) on one UDP port, with "
                                       "GET status over HTTP/3, HTTP/2 and HTTP/1.1 on the same port. Holders "
                                       "PUBLISH_NAMESPACE their tracks to it; subscribers FETCH and SUBSCRIBE. "
                                       "Needs --config FILE with [tls] and a policy, or --dev DIR.")
    _common(relay)
    relay.add_argument("--index", action="append", metavar="URI",
                       help="the Index Service: upstreams for KVSP tracks nobody published here, and Replica "
                            "Records for the blocks the relay caches (repeatable: replicas of the service)")
    relay.add_argument("--cache-size", type=size, metavar="SIZE", dest="cache_bytes",
                       help="memory for cached objects (default 1GiB; 0: no cache)")
    relay.add_argument("--open-prefix", action="append", metavar="A/B", dest="open_prefixes",
                       help="also relay non-KVSP namespaces under this prefix (repeatable; e.g. moq-test for the "
                            "MOQT interop runner's cases)")
    relay.add_argument("--no-records", action="store_false", default=None, dest="publish_records",
                       help="with --index: do not advertise cached blocks")
    relay.add_argument("--record-ttl-ms", type=int, metavar="MS", help="TTL of the relay's records (default 60000)")
    relay.add_argument("--workers", type=int, metavar="N",
                       help="processes serving the port, each with its own cache (default: one per core)")
    relay.set_defaults(handler=cmd_relay)

    inst = sub.add_parser("instance", help="run an inference instance (reference model, paged KV cache, prefetch, "
                                           "sessions, checkpoints, status)",
                          description="Serve an Inference Instance (docs/inference.md) over HTTP/3, HTTP/2 and "
                                      "HTTP/1.1 on one port, with its own replicas over MOQT on the same UDP port: "
                                      "prefetch directives, sessions (start, resume, token stream), reshard, state. "
                                      "Needs --model DIR and --config FILE with [tls] and a policy, or --dev DIR.")
    _common(inst)
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--gpu", type=int, metavar="N", help="run on CUDA device N")
    where.add_argument("--device", metavar="DEVICE", help="cpu (default) or cuda:N")
    inst.add_argument("--model", type=Path, metavar="DIR", help="the model directory (kvsp-quic model init DIR ...)")
    inst.add_argument("--engine", choices=["reference", "transformers"],
                      help="what computes: reference (default) or transformers (the model's Hugging Face modules)")
    inst.add_argument("--model-name", metavar="NAME", help="the descriptor's model name (default: config.json's)")
    inst.add_argument("--block-tokens", type=int, metavar="B", help="tokens per block (default 16)")
    inst.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="compute dtype (default: the model's)")
    inst.add_argument("--kv-dtype", metavar="TYPE", help="KV element type, e.g. fp8-e4m3 (default: the compute dtype)")
    inst.add_argument("--index", action="append", metavar="URI",
                      help="the Index Service: lookups, and where replicas are published (repeatable: replicas)")
    inst.add_argument("--controller", action="append", metavar="URI",
                      help="the Placement Controller: status reports, checkpoints (repeatable: replicas)")
    inst.add_argument("--scope-key", action="append", type=Path, metavar="FILE", dest="scope_keys",
                      help="a scope key this instance serves (hex or raw octets; repeatable; --dev: DIR/scope.key)")
    inst.add_argument("--device-pages", type=int, metavar="N", help="blocks in the device tier (default 1024)")
    inst.add_argument("--host-pages", type=int, metavar="N", help="blocks in the host tier (default 0)")
    inst.add_argument("--status-ttl-ms", type=int, metavar="MS", help="TTL of status records (default 3000)")
    inst.add_argument("--max-running", type=int, metavar="N", help="sessions computed at once (default 4)")
    inst.add_argument("--max-tokens", type=int, metavar="N", help="output tokens per session at most (default 4096)")
    inst.add_argument("--checkpoint-tokens", type=int, metavar="N", help="checkpoint every N tokens (default 16)")
    inst.add_argument("--sleep-after-idle-ms", type=int, metavar="MS", help="ask the PC to sleep after this idle time")
    inst.add_argument("--replica-ttl-ms", type=int, metavar="MS", help="TTL of published replicas (default 60000)")
    inst.add_argument("--warmup-tokens", type=int, metavar="N", help="tokens of the start-up prefill (default 64)")
    inst.add_argument("--no-moqt", action="store_false", default=None, dest="moqt",
                      help="fetch blocks over HTTP only (default: moqt:// replicas first)")
    inst.add_argument("--prefer-transport", choices=["h3", "tcp"], default=None, dest="prefer_transport",
                      help="https requests try this first: h3 (default) or tcp (HTTP/1.1 over TLS, faster for bulk "
                           "blocks here); the other is the fallback")
    inst.set_defaults(handler=cmd_instance)

    add_frontend(sub)
    demo = sub.add_parser("demo", help="start a whole cluster on this machine, run a workload with a failure, report",
                          description="Write a small random model; start the Index Service with the Placement "
                                      "Controller, a holder, a relay, two inference instances and the front end on "
                                      "127.0.0.1 with fresh dev certificates; send requests with shared prefixes; "
                                      "kill one instance mid-generation; print a report; stop everything.")
    demo.add_argument("--json", action="store_true", help="print the report as JSON")
    demo.add_argument("--workdir", type=Path, metavar="DIR", help="keep the model, certificates and logs in DIR")
    demo.add_argument("--requests", type=int, default=4, metavar="N", help="requests sharing the prefix (4)")
    demo.add_argument("--prefix-tokens", type=int, default=1536, metavar="N", help="shared prefix length (1536)")
    demo.add_argument("--layers", type=int, default=8, metavar="N", help="model layers (8)")
    demo.add_argument("--hidden", type=int, default=512, metavar="N", help="model hidden size (512)")
    demo.add_argument("--tenants", type=int, metavar="N",
                      help="N tenants (>= 2), each with its own scope key, front end and instance, sharing the index, "
                           "PC, holder and relay: per-tenant cache hits and a cross-tenant leak check (exit 1 on a "
                           "leak); --requests, --prefix-tokens, --layers and --hidden then default to 3, 512, 4, 256")
    demo.set_defaults(handler=cmd_demo)
    add_chaos(sub)
    # Parsed by interop.runner itself (kvsp_app.cli.main hands it the arguments); listed here for --help.
    sub.add_parser("interop", help="run the interop matrix (python -m interop; see kvsp-quic interop --help)")


def _demo_tenants(args: argparse.Namespace) -> int:
    from kvsp_app.config import ConfigError
    from kvsp_app.demo_tenants import TenantsOptions, render_tenants, run_tenants

    if args.tenants < 2:
        raise ConfigError("--tenants: at least 2")
    given = {"requests": 4, "prefix_tokens": 1536, "layers": 8, "hidden": 512}  # the single-tenant defaults
    overrides = {k: getattr(args, k) for k, default in given.items() if getattr(args, k) != default}
    options = TenantsOptions(tenants=args.tenants, workdir=args.workdir, **overrides)
    if options.requests < 1 or options.prefix_tokens < 64 or options.layers < 1 or options.hidden < 64 \
            or options.hidden % 64:
        raise ConfigError("--requests >= 1, --prefix-tokens >= 64, --layers >= 1, --hidden a multiple of 64")
    report = asyncio.run(run_tenants(options, lambda line: print(line, file=sys.stderr, flush=True)))
    print(json.dumps(report, indent=2) if args.json else render_tenants(report))
    return 0 if report["leaks"] == 0 else 1


def add_frontend(sub: Any) -> None:
    fe = sub.add_parser("frontend", help="run the OpenAI-compatible front end (/v1/completions, /v1/chat/completions)",
                        description="Serve OpenAI's API (/v1/completions, /v1/chat/completions, /v1/models, "
                                    "/tokenize, /detokenize, /health, /version), routing every request through the "
                                    "Placement Controller and relaying each output token exactly once across "
                                    "instance failures (docs/inference.md). Users authenticate with a client "
                                    "certificate or 'Authorization: Bearer KEY' (--dev: DIR/api.key; README).")
    _common(fe)
    fe.add_argument("--controller", action="append", metavar="URI",
                    help="the Placement Controller's base URI (kvsp-quic index; repeatable: replicas)")
    fe.add_argument("--model", type=Path, metavar="DIR", help="the model directory (tokenizer, descriptor)")
    fe.add_argument("--model-name", metavar="NAME", help="the model's name (default: from the model directory)")
    fe.add_argument("--block-tokens", type=int, metavar="B", help="block size, as the instances use (default 16)")
    fe.add_argument("--scope-key", type=Path, metavar="FILE",
                    help="the scope key of the sessions (--dev default: DIR/scope.key, shared with instances)")
    fe.add_argument("--max-tokens", type=int, metavar="N", help="the largest max_tokens accepted (default 4096)")
    fe.set_defaults(handler=cmd_frontend)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvsp_app.config import ConfigError
    from kvsp_app.demo import DemoOptions, demo_ok, render, run

    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError("the demo runs inference instances, which need torch: pip install 'kvsp-quic[gpu]'") \
            from None
    if args.tenants is not None:
        return _demo_tenants(args)
    if args.requests < 1 or args.prefix_tokens < 64 or args.layers < 1 or args.hidden < 64 or args.hidden % 64:
        raise ConfigError("--requests >= 1, --prefix-tokens >= 64, --layers >= 1, --hidden a multiple of 64")
    options = DemoOptions(workdir=args.workdir, requests=args.requests, prefix_tokens=args.prefix_tokens,
                          layers=args.layers, hidden=args.hidden)
    report = asyncio.run(run(options, lambda line: print(line, file=sys.stderr, flush=True)))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if demo_ok(report) else 1  # the instance kill, and the PC replica kill where Redis runs


def add_chaos(sub: Any) -> None:
    from kvsp_app.chaos import FAULTS

    chaos = sub.add_parser("chaos", help="start a replicated cluster on this machine and inject faults into a workload",
                           description="Start a redis-server (--redis-cluster: a 3-node Redis Cluster), two IS+PC "
                                       "replicas, two holders, a relay, three CPU "
                                       "instances and the front end on 127.0.0.1; run greedy and seeded top-p "
                                       "streams sharing a prefix without a fault (the reference), then once per "
                                       "fault; report requests completed, tokens lost/duplicated/altered, time to "
                                       "recover and TTFT penalty per fault. Exit 1 on any loss, 2 without "
                                       "redis-server (docs/chaos.md).")
    chaos.add_argument("--json", action="store_true", help="print the report as JSON")
    chaos.add_argument("--fault", action="append", choices=FAULTS, metavar="NAME",
                       help=f"a fault to inject (repeatable; default all: {', '.join(FAULTS)})")
    chaos.add_argument("--rounds", type=int, default=1, metavar="N", help="rounds of every fault (1)")
    chaos.add_argument("--streams", type=int, default=4, metavar="N", help="concurrent streams per run (4)")
    chaos.add_argument("--max-tokens", type=int, default=96, metavar="N", help="tokens per stream (96)")
    chaos.add_argument("--workdir", type=Path, metavar="DIR", help="keep the model, certificates and logs in DIR")
    chaos.add_argument("--redis-cluster", action="store_true",
                       help="the IS+PC replicas on a 3-node Redis Cluster (primaries only), not one redis-server")
    chaos.set_defaults(handler=cmd_chaos)


def cmd_chaos(args: argparse.Namespace) -> int:
    import shutil

    from kvsp_app.config import ConfigError

    if shutil.which("redis-server") is None:
        from kvsp_app.chaos_cluster import REDIS_MISSING

        print(REDIS_MISSING, file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError("the chaos suite runs inference instances, which need torch: pip install 'kvsp-quic[gpu]'") \
            from None
    from kvsp_app.chaos import ChaosOptions, render, run

    if args.rounds < 1 or args.streams < 1 or args.max_tokens < 24:
        raise ConfigError("--rounds >= 1, --streams >= 1, --max-tokens >= 24")
    options = ChaosOptions(faults=tuple(dict.fromkeys(args.fault or ())) or ChaosOptions().faults,
                           rounds=args.rounds, workdir=args.workdir, streams=args.streams,
                           max_tokens=args.max_tokens, redis_cluster=args.redis_cluster)
    report = asyncio.run(run(options, lambda line: print(line, file=sys.stderr, flush=True)))
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["ok"] else 1



def _given(args: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The flags among *names* given on the command line (those left out keep the configuration's values)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def _serve(run_role: Any, cfg: Any, args: argparse.Namespace) -> int:
    """Log at ``--log-level`` and run the role *run_role* with *cfg* on its configured event loop until stopped."""
    _logging(args.log_level)
    event_loop.run(run_role(cfg, dev_dir=args.dev, policy_path=args.policy), cfg.server.event_loop)
    return 0

def cmd_frontend(args: argparse.Namespace) -> int:
    from kvsp_app.config import FrontendFile, replace
    from kvsp_app.serve import run_frontend

    cfg = _file(FrontendFile, args)
    overrides = _given(args, "controller", "model", "model_name", "block_tokens", "scope_key", "max_tokens")
    cfg = dataclasses.replace(cfg, frontend=replace(cfg.frontend, "frontend", **overrides),
                              **_server_overrides(cfg, args))
    return _serve(run_frontend, cfg, args)


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
    p.add_argument("--crl", type=Path, metavar="FILE",
                   help="the CA's CRL (PEM or DER): revoked peer certificates are refused; SIGHUP re-reads it")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--event-loop", choices=event_loop.CHOICES,
                   help="the event loop (default auto: uvloop where installed, else asyncio's)")


def _file(cls: type[T], args: argparse.Namespace) -> T:
    from kvsp_app.config import load
    return load(cls, args.config) if args.config is not None else cls()


def _server_overrides(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    from kvsp_app.config import ConfigError, ServerSection, TlsSection
    server = cfg.server
    changes: dict[str, Any] = {}
    if args.listen is not None or args.base_uri is not None:
        server = ServerSection(listen=args.listen or server.listen, base_uri=args.base_uri or server.base_uri,
                               policy=server.policy, event_loop=server.event_loop)
    elif args.dev is not None and args.config is None:
        server = ServerSection(listen="127.0.0.1:0")
    if args.event_loop is not None:
        server = dataclasses.replace(server, event_loop=args.event_loop)
    changes["server"] = server
    if args.tls_dir is not None:
        if not args.name:
            raise ConfigError("--tls-dir needs --name (the principal whose NAME.pem and NAME.key to use)")
        changes["tls"] = TlsSection(args.tls_dir / "ca.pem", args.tls_dir / f"{args.name}.pem",
                                    args.tls_dir / f"{args.name}.key", cfg.tls.crl if cfg.tls else None)
    if args.crl is not None:
        tls = changes.get("tls", cfg.tls)
        if tls is None or args.dev is not None:
            raise ConfigError("--crl needs [tls] or --tls-dir (the CRL of the CA that issues the peers' certificates)")
        changes["tls"] = dataclasses.replace(tls, crl=args.crl)
    return changes


def _logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("quic").setLevel(logging.ERROR)  # aioquic logs every refused handshake as a warning


def cmd_index(args: argparse.Namespace) -> int:
    from kvsp_app.config import IndexFile, replace
    from kvsp_app.serve import run_index

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
    pc: dict[str, Any] = {}
    if args.start_hook is not None:
        pc["start_hook"] = shlex.split(args.start_hook)
    if args.sleep_policy is not None:
        pc["sleep"] = args.sleep_policy
    cfg = dataclasses.replace(cfg, index=replace(section, "index", **overrides),
                              controller=replace(cfg.controller, "controller", **pc), **_server_overrides(cfg, args))
    return _serve(run_index, cfg, args)


def cmd_holder(args: argparse.Namespace) -> int:
    from kvsp_app.config import ConfigError, HolderFile, LocalStorageSection, replace
    from kvsp_app.serve import run_holder

    cfg = _file(HolderFile, args)
    section = cfg.holder
    overrides = _given(args, "index", "host_capacity", "replica_ttl_ms", "eviction", "workers")
    if args.descriptor:
        overrides["descriptors"] = [Path(d) for d in args.descriptor]
    if args.local_storage is not None:
        try:
            overrides["local_storage"] = LocalStorageSection(
                path=args.local_storage, capacity=args.local_capacity or 10 << 30,
                encryption_key_file=args.encryption_key_file, mac_key_file=args.mac_key_file)
        except ValueError as exc:
            raise ConfigError(f"--local-storage: {exc}") from None
    elif args.local_capacity is not None or args.encryption_key_file is not None or args.mac_key_file is not None:
        raise ConfigError("--local-capacity, --encryption-key-file and --mac-key-file need --local-storage DIR")
    cfg = dataclasses.replace(cfg, holder=replace(section, "holder", **overrides), **_server_overrides(cfg, args))
    return _serve(run_holder, cfg, args)


def cmd_relay(args: argparse.Namespace) -> int:
    from kvsp_app.config import RelayFile, replace
    from kvsp_app.serve_relay import run_relay

    cfg = _file(RelayFile, args)
    section = cfg.relay
    overrides = _given(args, "index", "cache_bytes", "open_prefixes", "publish_records", "record_ttl_ms", "workers")
    cfg = dataclasses.replace(cfg, relay=replace(section, "relay", **overrides), **_server_overrides(cfg, args))
    return _serve(run_relay, cfg, args)


def cmd_instance(args: argparse.Namespace) -> int:
    from kvsp_app.config import ConfigError, InstanceFile, replace
    from kvsp_app.serve import check_device, run_instance

    cfg = _file(InstanceFile, args)
    overrides = _given(args, "model", "model_name", "block_tokens", "dtype", "kv_dtype", "index", "controller",
                       "scope_keys", "device_pages", "host_pages", "status_ttl_ms", "max_running", "max_tokens",
                       "checkpoint_tokens", "sleep_after_idle_ms", "replica_ttl_ms", "warmup_tokens", "moqt", "device",
                       "prefer_transport", "engine")
    if args.gpu is not None:
        overrides["device"] = f"cuda:{args.gpu}"
    section = replace(cfg.instance, "instance", **overrides)
    check_device(section.device)  # before anything else: --gpu 0 without CUDA is one line
    if section.model is None:
        raise ConfigError("--model DIR (or instance.model in --config) is required")
    cfg = dataclasses.replace(cfg, instance=section, **_server_overrides(cfg, args))
    return _serve(run_instance, cfg, args)
