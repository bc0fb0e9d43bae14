"""Starting a server role: configuration -> role objects -> an HTTP endpoint, until SIGINT / SIGTERM.

Every server subcommand (``kvsp-quic index``, ``kvsp-quic holder``, ...) goes through :func:`prepare`:

* normally the TLS files and the policy come from the configuration and are required;
* with ``--dev DIR`` (in the spirit of ``vault server -dev``) the sockets are bound first (127.0.0.1, a free
  port unless ``--listen`` says otherwise), then DIR gets a dev CA (reused when present), the role's certificate
  for its base URI and a ``dev`` client certificate (``kvsp-quic certs``), and the policy is
  :meth:`~kvsp_quic.auth.Policy.dev_ca`: every certificate of that CA has every right, so roles started with the
  same DIR trust each other and the ``dev`` client can do anything.

Once the role serves, exactly one JSON line goes to standard output: ``{"ready": ROLE, "base_uri": ..., "ca": ...,
"client_cert": ..., "client_key": ...}``; logs go to standard error. This module is part of the composition root
(with :mod:`kvsp_quic.cli`): it is the place that imports the HTTP edge and wires it to the roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from .compat import CompatDescriptor
from .config import ConfigError, HolderFile, IndexFile, ServerSection, TlsSection

log = logging.getLogger("kvsp.serve")

DEV_CLIENT = "dev"


def example_descriptor() -> CompatDescriptor:
    """The Compatibility Descriptor of the spec's test vectors, the default of ``--dev`` holders."""
    text = resources.files("kvsp_quic").joinpath("data/example-descriptor.json").read_text()
    return CompatDescriptor.loads(text)


@dataclass
class Prepared:
    """What every server role needs before its app exists."""

    role: str
    files: Any  # http3.tls.TlsFiles
    policy: Any  # kvsp_quic.auth.Policy
    base_uri: str
    sockets: tuple[socket.socket, socket.socket | None]
    settings: Any  # http3.tls.TransportSettings
    ready: dict[str, Any] = field(default_factory=dict)


def transport_settings(values: dict[str, float]) -> Any:
    from http3.tls import TransportSettings

    known = {f.name for f in dataclasses.fields(TransportSettings)} - {"extra_alpn"}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"transport.{key}: unknown key (known: {', '.join(sorted(known))})")
        if value <= 0:
            raise ConfigError(f"transport.{key}: must be positive")
    kwargs: dict[str, Any] = {k: (int(v) if float(v).is_integer() else v) for k, v in values.items()}
    return TransportSettings(**kwargs)


def prepare(role: str, server: ServerSection, tls: TlsSection | None, transport: dict[str, float], *,
            dev_dir: Path | None, policy_path: Path | None = None) -> Prepared:
    """Bind the sockets, and find (or, with *dev_dir*, make) the certificates and the policy."""
    from http3 import pki
    from http3.server import bind_pair
    from http3.tls import TlsFiles

    from .auth import Policy

    settings = transport_settings(transport)
    host, port = server.address()
    tcp, udp = bind_pair(host, port, settings.socket_buffer)
    bound = tcp.getsockname()[1]
    try:
        base = server.uri_for(bound)
        if dev_dir is not None:
            name = f"{role}-{bound}"
            ca, _ = pki.init(dev_dir, [pki.role(name, base), pki.client(DEV_CLIENT)],
                             extra_hosts=["127.0.0.1", "localhost"] if host in ("127.0.0.1", "localhost") else [])
            files = TlsFiles.in_dir(dev_dir, name)
            policy = Policy.dev_ca()
            ready: dict[str, str | None] = {"ca": os.fspath(ca),
                                            "client_cert": os.fspath(dev_dir / f"{DEV_CLIENT}.pem"),
                                            "client_key": os.fspath(dev_dir / f"{DEV_CLIENT}.key")}
        else:
            if tls is None:
                raise ConfigError("[tls] ca, cert and key are required (or use --dev DIR for a development setup)")
            path = policy_path or server.policy
            if path is None:
                raise ConfigError("a policy file is required: [server] policy or --policy (or use --dev DIR)")
            files = TlsFiles.of(tls.ca, tls.cert, tls.key)
            policy = Policy.load(path)
            ready = {"ca": os.fspath(tls.ca), "client_cert": None, "client_key": None}
    except BaseException:
        tcp.close()
        if udp is not None:
            udp.close()
        raise
    return Prepared(role, files, policy, base, (tcp, udp), settings, ready)


async def serve_app(prepared: Prepared, app: Any, *, quic_handlers: dict[str, Any] | None = None) -> Any:
    from http3.server import RoleServer

    server = RoleServer(app, prepared.files, settings=prepared.settings, quic_handlers=quic_handlers)
    await server.start(sockets=prepared.sockets)
    return server


def announce(prepared: Prepared, **extra: Any) -> None:
    """The one JSON line on standard output that says the role serves."""
    line = {"ready": prepared.role, "base_uri": prepared.base_uri, **prepared.ready, **extra}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


@contextlib.asynccontextmanager
async def until_signalled() -> AsyncIterator[asyncio.Event]:
    """An event set by SIGINT or SIGTERM (a second signal still interrupts)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def load_descriptors(paths: list[Path]) -> list[CompatDescriptor]:
    return [CompatDescriptor.load(p) for p in paths]


# -- the Index Service -------------------------------------------------------------------------------------------


async def run_index(cfg: IndexFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                    stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    from http3.index_app import index_app

    from .roles.index import IndexConfig, IndexService

    section = cfg.index
    descriptors = load_descriptors(section.descriptors)
    if dev_dir is not None and not descriptors:
        descriptors = [example_descriptor()]
    store = _index_store(section)
    prepared = prepare("index", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path)
    try:
        config = IndexConfig.with_descriptors(
            descriptors, max_ttl_ms=section.max_ttl_ms, max_lookup_keys=section.max_lookup_keys,
            max_lookup_targets=section.max_lookup_targets, max_status_ttl_ms=section.max_status_ttl_ms)
        service = IndexService(store, clock=clock, config=config)
        base_path = _path_of(prepared.base_uri)
        server = await serve_app(prepared, index_app(service, prepared.policy, base_path=base_path))
    except BaseException:
        await store.aclose()
        raise
    log.info("Index Service at %s (store: %s)", prepared.base_uri, section.store)
    announce(prepared, store=section.store)
    try:
        await _wait(stop)
    finally:
        await server.close()
        await store.aclose()


def _index_store(section: Any) -> Any:
    if section.store == "redis":
        from .storage.redis_index import RedisIndexStore

        return RedisIndexStore.from_url(section.redis_url, cluster=section.redis_cluster, prefix=section.redis_prefix)
    from .storage.memory_index import MemoryIndexStore

    return MemoryIndexStore()


# -- the Holder --------------------------------------------------------------------------------------------------


async def run_holder(cfg: HolderFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                     stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    from http3.client import KvspClient
    from http3.holder_app import holder_app
    from http3.publisher import ReplicaPublisher
    from moqt.aio_kvsp import holder_moqt_handlers
    from moqt.kvsp import moqt_uri_for

    from .roles.holder import Holder, HolderSettings
    from .roles.leases import LeaseLimits
    from .storage.tiers import LocalStorageConfig

    section = cfg.holder
    descriptors = load_descriptors(section.descriptors)
    if dev_dir is not None and not descriptors:
        descriptors = [example_descriptor()]
    if not descriptors:
        raise ConfigError("holder.descriptors: the holder needs at least one Compatibility Descriptor (--descriptor)")
    local = None
    if section.local_storage is not None:
        ls = section.local_storage
        local = LocalStorageConfig(path=ls.path, capacity=ls.capacity, read_mbit_per_s=ls.read_mbit_per_s,
                                   encryption_key=_read_key(ls.encryption_key_file), fsync=ls.fsync)
    prepared = prepare("holder", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path)
    client = None
    try:
        settings = HolderSettings(
            base_uri=prepared.base_uri, descriptors=tuple(descriptors), host_capacity=section.host_capacity,
            host_read_mbit_per_s=section.host_read_mbit_per_s, local_storage=local, eviction=section.eviction,
            replica_ttl_ms=section.replica_ttl_ms, retention_ms=section.retention_ms,
            max_block_bytes=section.max_block_bytes, leases=LeaseLimits(**vars(section.leases)))
        holder = Holder(settings, clock=clock)
        recovered = holder.recover()
        if recovered:
            log.info("recovered %d block(s) from local storage", recovered)
        moqt_uri = moqt_uri_for(prepared.base_uri)  # the same UDP port serves MOQT (moq-00, moqt-18) next to h3
        server = await serve_app(prepared, holder_app(holder, prepared.policy),
                                 quic_handlers=holder_moqt_handlers(holder, prepared.policy))
    except ValueError as exc:
        for sock in prepared.sockets:
            if sock is not None:
                sock.close()
        raise ConfigError(str(exc)) from None
    publisher = None
    if section.index is not None:
        client = KvspClient(prepared.files, settings=prepared.settings)
        publisher = ReplicaPublisher(holder, client, section.index, moqt_uri=moqt_uri)
        publisher.start()
    else:
        log.warning("no Index Service configured (holder.index / --index): replicas are not published")
    log.info("Holder at %s (%d descriptor(s), host tier %d octets%s)", prepared.base_uri, len(descriptors),
             section.host_capacity, f", local-storage {local.path}" if local else "")
    announce(prepared, index=section.index, moqt=moqt_uri)
    try:
        await _wait(stop)
    finally:
        if publisher is not None:
            await publisher.stop(withdraw=True)
        await server.close()
        if client is not None:
            await client.aclose()


def _read_key(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the encryption key {os.fspath(path)!r}: {exc.strerror}") from None
    text = raw.strip()
    if len(text) == 64:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(text.decode("ascii"))
    if len(raw) == 32:
        return raw
    raise ConfigError(f"encryption key {os.fspath(path)!r}: expected 32 raw octets or 64 hex characters")


# -- helpers -----------------------------------------------------------------------------------------------------


def _path_of(uri: str) -> str:
    from urllib.parse import urlsplit

    return urlsplit(uri).path or "/"


async def _wait(stop: asyncio.Event | None) -> None:
    if stop is not None:
        await stop.wait()
        return
    async with until_signalled() as signalled:
        await signalled.wait()
    log.info("shutting down")
