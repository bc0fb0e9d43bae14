"""Assembling an Inference Instance (composition root): the role, the engine's cache as a holder, the clients, the
fetch sources (MOQT first, with HTTP leases), the publisher, the asyncio service, its ASGI app and MOQT handlers.

    engine = Engine.load("models/tiny", block_tokens=16)
    node = build_instance(engine, base_uri=..., files=..., policy=..., scope_keys=[key], index=...,
                          service=ServiceOptions(controller=...))
    server = RoleServer(node.app, files, quic_handlers=node.quic_handlers)
    await node.start()

This is the one place where the instance's layers meet: ``gpu`` (the engine and its :class:`gpu.engine.CacheHolder`),
``http3`` (the service and routes, which see the engine only through :mod:`kvsp_quic.engine`), ``moqt`` and
``kvsp_moqt`` (the MOQT pool, source and holder tracks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu.engine import CacheHolder, Engine
from gpu.kvcache import Page
from http3.asgi_types import ASGIApp
from http3.client import KvspClient
from kvsp_app.config import ConfigError, options_of
from kvsp_client.api import ServiceEndpoints
from kvsp_client.retrieval import BlockSource, HttpSource
from kvsp_http.instance_app import instance_app
from kvsp_moqt.holder_tracks import holder_moqt_handlers
from kvsp_moqt.source import LeasingMoqtSource, PreferMoqt
from kvsp_moqt.tracks import moqt_uri_for
from kvsp_quic.auth import Policy
from kvsp_quic.keys import BlockKeyer
from kvsp_quic.records import Link
from kvsp_quic.roles.holder import HolderSettings
from kvsp_quic.roles.instance import InstanceOptions, InstanceRole, InstanceSettings, next_instance_epoch
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_runtime.instance_blocks import BlockFinder
from kvsp_runtime.instance_service import InstanceService, ServiceOptions
from kvsp_runtime.publisher import ReplicaPublisher
from moqt.aio import MoqtPool
from quic.rtt import PEER_RTTS
from quic.tls import TlsFiles, TransportSettings

log = logging.getLogger("kvsp.instance")

DEV_EPOCH_FILE = "instance.epoch"  # in the --dev directory: the epochs of the instances started there


def persisted_epoch(path: Path, now: Callable[[], float] = time.time) -> int:
    """The epoch of an instance starting now, persisted in *path* (:func:`~kvsp_quic.roles.instance.
    next_instance_epoch`: one more than the last one there, and never below the start time in ms; *now*: the
    wall clock, in seconds since the Unix epoch). The file is created 0600 (in a directory made 0700 if missing)
    and replaced atomically -- written to a temporary file of its own, fsync'd, renamed over it, the directory
    fsync'd -- so a crash leaves the old epoch or the new one, never neither. A file that is not one decimal
    number is refused (ConfigError, one line): guessing could hand out an epoch already used."""
    previous: int | None = None
    try:
        text = path.read_text(encoding="ascii")
    except FileNotFoundError:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"epoch file {os.fspath(path)!r}: cannot read it: {exc}") from None
    else:
        try:
            previous = int(text.strip())
            if previous < 0:
                raise ValueError
        except ValueError:
            raise ConfigError(f"epoch file {os.fspath(path)!r}: not a decimal number; remove it only if this "
                              f"instance's clock never moved backward") from None
    epoch = next_instance_epoch(previous, int(now() * 1000))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover of a crashed start may have had another mode
            os.write(fd, f"{epoch}\n".encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise ConfigError(f"epoch file {os.fspath(path)!r}: cannot write it: {exc.strerror or exc}") from None
    return epoch


@dataclass
class InstanceNode:
    """An assembled instance: its service, its ASGI app and MOQT handlers (for one RoleServer), its clients."""

    service: InstanceService[Page]
    app: ASGIApp
    quic_handlers: dict[str, Any]
    moqt_uri: str
    client: KvspClient
    pool: MoqtPool | None  # when MOQT sources are used

    @property
    def role(self) -> InstanceRole:
        return self.service.role

    async def start(self) -> None:
        await self.service.start()

    async def aclose(self) -> None:
        await self.service.aclose()
        if self.pool is not None:
            await self.pool.aclose()
        await self.client.aclose()


def build_instance(engine: Engine, *, base_uri: str, files: TlsFiles, policy: Policy,
                   scope_keys: Iterable[bytes] = (), index: str | Sequence[str] | None = None, epoch: int | None = None,
                   clock: Callable[[], float] = time.monotonic, options: InstanceOptions | None = None,
                   service: ServiceOptions | None = None, links: Iterable[Link] = (),
                   replica_ttl_ms: int = 60_000, lease_limits: LeaseLimits | None = None, moqt: bool = True,
                   transport: TransportSettings | None = None) -> InstanceNode:
    """Wire an instance around *engine*: the role (its *options*; the engine's Compatibility ID, block size and
    vocabulary, and whether *service* names a Placement Controller, are the rest of its settings), its holder of
    its own cache, the client (with *files*, the instance's certificate) for the Index Service, the PC and other
    holders, the publisher, the fetch sources (MOQT first when *moqt*), the asyncio service, the app.
    *epoch*: default the time now in ms since the Unix epoch."""
    transport = transport if transport is not None else TransportSettings()
    options = options if options is not None else InstanceOptions(engine=engine.name)
    if engine.name != options.engine:  # never serve under the wrong engine's name (status, docs/inference.md)
        raise ValueError(f"the instance is configured for engine {options.engine!r}, but its engine is "
                         f"{engine.name!r} (Engine.load(..., engine={options.engine!r}))")
    service = service if service is not None else ServiceOptions()
    d = engine.descriptor
    role_settings = InstanceSettings(base_uri=base_uri, compat_id=bytes(d.compat_id), block_tokens=d.block_tokens,
                                     vocab_size=engine.vocab_size, controller=bool(service.controller),
                                     **options_of(options, InstanceOptions))
    keyers = [BlockKeyer(key, d.compat_id, d.block_tokens) for key in scope_keys]
    role = InstanceRole(role_settings, epoch=epoch if epoch is not None else int(time.time() * 1000), clock=clock,
                        links=links, keyers=keyers, check_sampler=engine.check_sampler)
    holder = CacheHolder(HolderSettings(base_uri, (d,), replica_ttl_ms=replica_ttl_ms,
                                        leases=lease_limits if lease_limits is not None else LeaseLimits()),
                         engine.cache, clock=clock)
    # Block loads run concurrently (a prefill consumes every block's stream at once; a directive starts every
    # load at once): over HTTP/3 they are spread over up to block_connections connections per holder.
    client = KvspClient(files, settings=transport, timeout=service.request_timeout_s,
                        prefer=service.prefer_transport, connections_per_origin=service.block_connections,
                        rtts=PEER_RTTS)  # connect timeouts scaled with the RTT (issue 12, point 5)
    moqt_uri = moqt_uri_for(base_uri)
    http = HttpSource(client, timeout=service.request_timeout_s)
    pool = None
    sources: list[BlockSource] = [http]
    if moqt:
        pool = MoqtPool(files, settings=transport, connections_per_origin=service.block_connections, rtts=PEER_RTTS)
        sources.insert(0, LeasingMoqtSource(pool, [d], http))
    publisher = finder = None
    if index:  # one URI or several: one view of the Index Service's replicas for the publisher and the lookups
        endpoints = ServiceEndpoints.of(index, "index")
        publisher = ReplicaPublisher(holder, client, endpoints, moqt_uri=moqt_uri)
        finder = BlockFinder(client, endpoints, descriptor=d, own=[base_uri, moqt_uri], sources=sources,
                             ranking=PreferMoqt() if moqt else None,
                             timeout=service.request_timeout_s)
    node = InstanceService(role, engine, holder, client, finder=finder, options=service, publisher=publisher)
    return InstanceNode(node, instance_app(node, policy), holder_moqt_handlers(holder, policy), moqt_uri, client,
                        pool)


__all__ = ["InstanceNode", "build_instance"]
