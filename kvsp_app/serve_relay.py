"""``kvsp-quic relay``: the MOQT relay's process and its worker processes (independent relays on one port).

Split from :mod:`kvsp_app.serve`, whose helpers (prepare, serve_app, announce) it uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_app import event_loop
from kvsp_app.config import ConfigError, RelayFile, options_of
from kvsp_app.serve import Prepared, _path_of, _uris, _wait, announce, prepare, serve_app

log = logging.getLogger("kvsp.serve")

# A relay's per-stream receive window (unless [transport] stream_window says otherwise): it credits an upstream
# FETCH back only as its fastest downstream forwards it, so this bounds how far ingest runs ahead of forwarding.
RELAY_STREAM_WINDOW = 2 << 20


async def run_relay(cfg: RelayFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                    stop: asyncio.Event | None = None) -> None:
    section = cfg.relay
    # Workers are independent relays (each its own cache and sessions): a block FETCH scales over them because each
    # finds its upstream through the Index Service; a namespace published to one process is unknown to the others.
    if (section.workers or 1) > 1 and (section.open_prefixes or not section.index):
        why = "open prefixes relay live tracks" if section.open_prefixes else "without --index, upstreams are"
        raise ConfigError(f"relay.workers: {why} published to one process, which the others do not see: use "
                          f"--workers 1 (KVSP block fetches with --index scale over workers)")
    workers = section.workers or (os.cpu_count() or 1 if section.index and not section.open_prefixes else 1)
    transport = {"stream_window": RELAY_STREAM_WINDOW, **cfg.transport}
    prepared = prepare("relay", cfg.server, cfg.tls, transport, dev_dir=dev_dir, policy_path=policy_path,
                       reuse_port=workers > 1)
    pool = None
    if workers > 1:  # cache_bytes is the relay's memory: each process caches its share
        cfg = dataclasses.replace(cfg, relay=dataclasses.replace(section, cache_bytes=section.cache_bytes // workers))
        pool = await _start_relay_workers(cfg, prepared, workers)
    try:
        await serve_relay(cfg, prepared, stop, announce_extra={
            "cache_bytes": section.cache_bytes, "workers": workers,
            "worker_pids": pool.pids() if pool is not None else []})
    finally:
        if pool is not None:
            await pool.stop()


async def serve_relay(cfg: RelayFile, prepared: Prepared, stop: asyncio.Event | None, *,
                      announce_extra: dict[str, Any] | None = None, serving: Callable[[], None] | None = None) -> None:
    """One relay process on *prepared*'s sockets until *stop*; announced when *announce_extra* is given (the
    primary), silent otherwise (a worker, whose *serving* is called once it serves)."""
    from http3.client import KvspClient
    from kvsp_http.relay_app import relay_app
    from kvsp_moqt.index_link import IndexLink
    from kvsp_moqt.relay_policy import kvsp_relay
    from kvsp_moqt.relay_rules import RelayRules
    from moqt.aio import MoqtPool, moqt_handlers
    from moqt.relay import RelayConfig, RelayOptions

    section = cfg.relay
    client = pool = link = None
    try:
        moqt_uri = _relay_moqt_uri(prepared)  # the relay's UDP port serves MOQT (moq-00, moqt-18) and h3
        rules = RelayRules.of(prepared.policy, section.open_prefixes)
        if section.index:
            client = KvspClient(prepared.files, settings=prepared.settings)
            pool = MoqtPool(prepared.files, settings=prepared.settings, alpn=section.moqt_alpns)
            link = IndexLink(client, section.index, pool, moqt_uri=moqt_uri, publish=section.publish_records,
                             ttl_ms=section.record_ttl_ms, timeout=section.upstream_timeout_s)
        relay = kvsp_relay(rules, RelayConfig(moqt_uri=moqt_uri, **options_of(section, RelayOptions)), link=link)
        server = await serve_app(prepared, relay_app(relay, prepared.policy, base_path=_path_of(prepared.base_uri)),
                                 quic_handlers=moqt_handlers(relay, data_streams=section.data_streams,
                                                             alpns=section.moqt_alpns))
    except BaseException:
        for sock in prepared.sockets:
            if sock is not None:
                sock.close()
        if client is not None:
            await client.aclose()
        raise
    if serving is not None:
        serving()
    if announce_extra is not None:
        log.info("MOQT relay at %s (cache %d octets, open prefixes: %s, index: %s, %d process(es))", moqt_uri,
                 section.cache_bytes, ", ".join(section.open_prefixes) or "none",
                 ", ".join(section.index) or "none",
                 announce_extra.get("workers", 1))
        announce(prepared, **{"moqt": moqt_uri, **_uris("index", section.index), "cache_bytes": section.cache_bytes,
                              "open_prefixes": section.open_prefixes, **announce_extra})
    try:
        await _wait(stop)
    finally:
        await relay.aclose()
        if link is not None:
            await link.aclose(withdraw=True)
        await server.close()
        if pool is not None:
            await pool.aclose()
        if client is not None:
            await client.aclose()


@dataclass(frozen=True)
class RelayWorkerSpec:
    """What a relay worker process needs (pickled to it): the configuration and what the primary prepared."""

    index: int
    cfg: RelayFile
    files: Any
    policy_file: Path | None  # None: the --dev policy
    settings: Any
    base_uri: str
    host: str
    port: int
    log_level: int


def relay_worker_main(spec: RelayWorkerSpec, ready: Any) -> None:
    """A relay worker: an independent relay (its own cache and upstream sessions) on the primary's port."""
    from kvsp_app.workers import worker_process

    worker_process(spec.index, spec.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        event_loop.run(_relay_worker(spec, ready), spec.cfg.server.event_loop)


async def _relay_worker(spec: RelayWorkerSpec, ready: Any) -> None:
    from http3.server import bind_pair
    from kvsp_quic.auth import Policy

    sockets = bind_pair(spec.host, spec.port, spec.settings.socket_buffer, reuse_port=True)
    policy = Policy.load(spec.policy_file) if spec.policy_file is not None else Policy.dev_ca()
    prepared = Prepared("relay", spec.files, policy, spec.base_uri, sockets, spec.settings, {}, spec.policy_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    parent = os.getppid()

    async def orphaned() -> None:  # a worker whose primary is gone stops
        while os.getppid() == parent:
            await asyncio.sleep(0.5)
        stop.set()

    watcher = asyncio.create_task(orphaned())
    try:
        await serve_relay(spec.cfg, prepared, stop, serving=ready.set)
    finally:
        watcher.cancel()


async def _start_relay_workers(cfg: RelayFile, prepared: Prepared, count: int) -> Any:
    from kvsp_app.workers import Workers

    host, port = prepared.sockets[0].getsockname()[:2]
    level = logging.getLogger().getEffectiveLevel()

    def spec_for(index: int) -> RelayWorkerSpec:
        return RelayWorkerSpec(index, cfg, prepared.files, prepared.policy_file, prepared.settings,
                               prepared.base_uri, host, port, level)

    pool = Workers("relay", relay_worker_main, spec_for, count)
    try:
        await pool.start()
    except BaseException as exc:
        await pool.stop()
        for sock in prepared.sockets:
            if sock is not None:
                sock.close()
        raise ConfigError(f"relay workers: {exc}") from None
    return pool


def _relay_moqt_uri(prepared: Prepared) -> str:
    """``moqt://host:port/`` of the relay: the base URI's host, and its port -- or, when the base URI names none
    (its scheme's default), the port the relay listens on: MOQT has no default port."""
    from urllib.parse import urlsplit

    parts = urlsplit(prepared.base_uri)
    port = parts.port or prepared.sockets[0].getsockname()[1]
    host = parts.hostname or "127.0.0.1"
    return f"moqt://{'[' + host + ']' if ':' in host else host}:{port}/"
