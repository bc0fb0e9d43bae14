"""Starting a server role: configuration -> role objects -> an HTTP endpoint, until SIGINT / SIGTERM.

Every server subcommand (``kvsp-quic index``, ``kvsp-quic holder``, ``kvsp-quic relay``) goes through :func:`prepare`:

* normally the TLS files and the policy come from the configuration and are required;
* with ``--dev DIR`` (in the spirit of ``vault server -dev``) the sockets are bound first (127.0.0.1, a free
  port unless ``--listen`` says otherwise), then DIR gets a dev CA (reused when present), the role's certificate
  for its base URI and a ``dev`` client certificate (``kvsp-quic certs``), and the policy is
  :meth:`~kvsp_quic.auth.Policy.dev_ca`: every certificate of that CA has every right, so roles started with the
  same DIR trust each other and the ``dev`` client can do anything (``--policy FILE`` with ``--dev``: that policy
  instead, with the dev certificates).

Once the role serves, exactly one JSON line goes to standard output: ``{"ready": ROLE, "base_uri": ..., "ca": ...,
"client_cert": ..., "client_key": ...}``; logs go to standard error. This module is part of the composition root
(with :mod:`kvsp_app.cli`): it is the place that imports the HTTP edge and wires it to the roles.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsp_app.config import (
    ConfigError,
    FrontendFile,
    HolderFile,
    IndexFile,
    InstanceFile,
    ServerSection,
    TlsSection,
    options_of,
)
from kvsp_app.holder_workers import make_host_directory
from kvsp_quic.compat import CompatDescriptor
from kvsp_quic.samples import example_descriptor

log = logging.getLogger("kvsp.serve")

DEV_CLIENT = "dev"


@dataclass
class Prepared:
    """What every server role needs before its app exists."""

    role: str
    files: Any  # quic.tls.TlsFiles
    policy: Any  # kvsp_quic.auth.Policy
    base_uri: str
    sockets: tuple[socket.socket, socket.socket | None]
    settings: Any  # quic.tls.TransportSettings
    ready: dict[str, Any] = field(default_factory=dict)
    policy_file: Path | None = None  # where the policy came from (None: the dev policy), for worker processes
    policy_derive: Any = None  # Policy -> Policy applied to a policy re-read on SIGHUP (the front end's --dev key)


def transport_settings(values: dict[str, float]) -> Any:
    from quic.tls import TransportSettings

    known = {f.name for f in dataclasses.fields(TransportSettings)} - {"extra_alpn"}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"transport.{key}: unknown key (known: {', '.join(sorted(known))})")
        if value <= 0:
            raise ConfigError(f"transport.{key}: must be positive")
    kwargs: dict[str, Any] = {k: (int(v) if float(v).is_integer() else v) for k, v in values.items()}
    return TransportSettings(**kwargs)


def prepare(role: str, server: ServerSection, tls: TlsSection | None, transport: dict[str, float], *,
            dev_dir: Path | None, policy_path: Path | None = None, reuse_port: bool = False) -> Prepared:
    """Bind the sockets (*reuse_port*: shareable with worker processes), and find (or, with *dev_dir*, make) the
    certificates and the policy."""
    from http3.server import bind_pair
    from kvsp_dev import pki
    from kvsp_quic.auth import Policy
    from quic.tls import TlsFiles

    settings = transport_settings(transport)
    host, port = server.address()
    tcp, udp = bind_pair(host, port, settings.socket_buffer, reuse_port=reuse_port)
    bound = tcp.getsockname()[1]
    try:
        base = server.uri_for(bound)
        if dev_dir is not None:
            name = f"{role}-{bound}"
            ca, _ = pki.init(dev_dir, [pki.role(name, base), pki.client(DEV_CLIENT)],
                             extra_hosts=["127.0.0.1", "localhost"] if host in ("127.0.0.1", "localhost") else [])
            files = TlsFiles.in_dir(dev_dir, name)
            # --policy with --dev: the dev certificates, a real policy (the interop matrix tests refusals so)
            policy = Policy.load(policy_path) if policy_path is not None else Policy.dev_ca()
            policy_file = policy_path
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
            if tls.crl is not None:  # [tls] crl: revoked peers are refused; SIGHUP re-reads it (quic.crl)
                files = dataclasses.replace(files, crl=_revocation(tls.crl, files.ca_pem))
            policy = Policy.load(path)
            policy_file = path
            ready = {"ca": os.fspath(tls.ca), "client_cert": None, "client_key": None}
    except BaseException:
        tcp.close()
        if udp is not None:
            udp.close()
        raise
    return Prepared(role, files, policy, base, (tcp, udp), settings, ready, policy_file)


def _revocation(path: Path, ca_pem: bytes) -> Any:
    from quic.crl import CrlError, Revocation

    try:
        return Revocation(path, ca_pem)
    except CrlError as exc:
        raise ConfigError(f"tls.crl: {exc}") from None


async def serve_app(prepared: Prepared, app: Any, *, quic_handlers: dict[str, Any] | None = None) -> Any:
    from http3.server import RoleServer
    from kvsp_app.reload import reload_on_sighup

    on_refused = None
    if quic_handlers:  # a role serving MOQT counts refused handshakes with its sessions' ends (moqt.aio.audit)
        from moqt.aio.audit import AUDIT, reason_label

        def on_refused(refusal: Any) -> None:
            AUDIT.handshake_refused(side="server", reason=reason_label(refusal.error_code), peer=refusal.peer,
                                    alpn=refusal.alpn, detail=refusal.reason)

    server = RoleServer(app, prepared.files, settings=prepared.settings, quic_handlers=quic_handlers,
                        on_refused=on_refused)
    await server.start(sockets=prepared.sockets)
    reload_on_sighup(prepared.policy, prepared.policy_file, prepared.files, prepared.policy_derive)
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
    """The Index Service with the Placement Controller: one process, one base URI (docs/wire.md)."""
    from http3.client import KvspClient
    from kvsp_http.controller_app import controller_app
    from kvsp_quic.metrics import Registry
    from kvsp_quic.roles.controller import PlacementController
    from kvsp_quic.roles.index import NO_GEOMETRY, IndexConfig, IndexOptions, IndexService
    from kvsp_quic.roles.status import LifecyclePolicy, StatusTable
    from kvsp_runtime.controller_link import CommandStarter, HttpInstanceLink
    from kvsp_runtime.controller_service import ControllerService

    section, pc = cfg.index, cfg.controller
    descriptors = load_descriptors(section.descriptors)
    unconfigured = not descriptors  # docs/wire.md, "Index Service": the geometry comes from the descriptors only
    if dev_dir is not None and not descriptors:
        descriptors = [example_descriptor()]
    store = _index_store(section)
    shared = liveness = None
    if section.store == "redis":
        from kvsp_quic.storage.redis_control import RedisControlStore
        from kvsp_quic.storage.redis_liveness import RedisLivenessStore

        # holders' liveness and failure reports beside the replicas, on the index store's connections
        liveness = RedisLivenessStore(store.client, prefix=section.redis_prefix)

        shared = RedisControlStore.from_url(section.redis_url, cluster=section.redis_cluster,
                                            prefix=section.redis_prefix)
        try:
            await _check_redis(section, shared)
        except BaseException:
            await shared.aclose()
            await store.aclose()
            raise
    prepared = prepare("index", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path)
    client = starter = None
    try:
        config = IndexConfig.with_descriptors(descriptors, **options_of(section, IndexOptions))
        status = StatusTable(clock, policy=LifecyclePolicy(pc.sleep_policy), max_ttl_ms=section.max_status_ttl_ms)
        service = IndexService(store, clock=clock, config=config, status=status, shared_liveness=liveness)
        # The PC's requests to instances carry the index's certificate: the instances' policy gives it the
        # controller role.
        client = KvspClient(prepared.files, settings=prepared.settings, timeout=pc.request_timeout_s)
        starter = CommandStarter(pc.start_hook, pc_uri=prepared.base_uri) if pc.start_hook else None
        role = PlacementController(service, clock=clock, metrics=Registry(), identity=prepared.base_uri, config=pc)
        controller = ControllerService(role, HttpInstanceLink(client), starter=starter, store=shared)
        base_path = _path_of(prepared.base_uri)
        app = controller_app(service, controller, prepared.policy, base_path=base_path, tick_interval=pc.tick_s)
        server = await serve_app(prepared, app)
    except BaseException:
        if client is not None:
            await client.aclose()
        await store.aclose()
        if shared is not None:
            await shared.aclose()
        raise
    if unconfigured:  # once it serves: a start-up that fails says only why
        log.warning("no Compatibility Descriptor configured%s: %s", " (--dev: only the example descriptor)"
                    if dev_dir is not None else "", NO_GEOMETRY)
    log.info("Index Service and Placement Controller at %s (store: %s, start hook: %s)", prepared.base_uri,
             section.store, " ".join(pc.start_hook) or "none")
    announce(prepared, store=section.store, controller=True, metrics=prepared.base_uri + "metrics")
    try:
        await _wait(stop)
    finally:
        await server.close()
        await client.aclose()
        if starter is not None:
            await starter.aclose()
        await store.aclose()
        if shared is not None:
            await shared.aclose()


async def _check_redis(section: Any, shared: Any) -> None:
    """Before ``ready``: Redis answers, in the mode configured (``--redis-cluster`` or not); else one line
    (ConfigError) and exit 1, never a ready Index Service that answers 500."""
    from kvsp_app.config import ConfigError

    url, cluster = section.redis_url, section.redis_cluster
    try:
        async with asyncio.timeout(5):
            await shared.ping()
            info = await shared.client.info("cluster")
    except Exception as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if not cluster and "MOVED" in detail:
            detail = "it is a Redis Cluster: add --redis-cluster (index.redis_cluster)"
        elif cluster and "not enabled" in detail:
            detail = "it is not a Redis Cluster: drop --redis-cluster (index.redis_cluster)"
        raise ConfigError(f"index.redis_url: Redis at {url} does not answer: {detail}") from None
    enabled = bool(int(info.get("cluster_enabled", 0))) if isinstance(info, dict) and "cluster_enabled" in info \
        else cluster
    if enabled != cluster:
        raise ConfigError(f"index.redis_url: Redis at {url} is {'a cluster' if enabled else 'not a cluster'}: "
                          f"{'add' if enabled else 'drop'} --redis-cluster (index.redis_cluster)")


def _index_store(section: Any) -> Any:
    if section.store == "redis":
        from kvsp_quic.storage.redis_index import RedisIndexStore

        return RedisIndexStore.from_url(section.redis_url, cluster=section.redis_cluster, prefix=section.redis_prefix)
    from kvsp_quic.storage.memory_index import MemoryIndexStore

    return MemoryIndexStore(recent=section.lookup_cache_records)


# -- the Holder --------------------------------------------------------------------------------------------------


async def run_holder(cfg: HolderFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                     stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    from http3.client import KvspClient
    from kvsp_http.holder_app import holder_app
    from kvsp_moqt.holder_tracks import holder_moqt_handlers
    from kvsp_moqt.tracks import moqt_uri_for
    from kvsp_quic.metrics import Registry
    from kvsp_quic.roles.holder import Holder, HolderOptions, HolderSettings
    from kvsp_quic.storage.tiers import LocalStorageConfig, LocalStorageOptions
    from kvsp_runtime.publisher import ReplicaPublisher

    section = cfg.holder
    descriptors = load_descriptors(section.descriptors)
    if dev_dir is not None and not descriptors:
        descriptors = [example_descriptor()]
    if not descriptors:
        raise ConfigError("holder.descriptors: the holder needs at least one Compatibility Descriptor (--descriptor)")
    local = None
    if section.local_storage is not None:
        ls = section.local_storage
        encryption_key = _read_key(ls.encryption_key_file)
        local = LocalStorageConfig(**options_of(ls, LocalStorageOptions), encryption_key=encryption_key,
                                   mac_key=_mac_key(ls) if encryption_key is None else None)
    workers = section.workers or os.cpu_count() or 1
    prepared = prepare("holder", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path,
                       reuse_port=workers > 1)
    client = host_directory = None
    try:
        settings = HolderSettings(prepared.base_uri, tuple(descriptors), local_storage=local,
                                  **options_of(section, HolderOptions))
        store = None
        if workers > 1:
            host_directory = make_host_directory(prepared.sockets[0].getsockname()[1])
            store = shared_store(settings, host_directory)
        holder = Holder(settings, clock=clock, store=store)
        recovered = holder.recover()
        if recovered:
            log.info("recovered %d block(s) from local storage", recovered)
        moqt_uri = moqt_uri_for(prepared.base_uri)  # the same UDP port serves MOQT (moq-00, moqt-18) next to h3
        server = await serve_app(prepared, holder_app(holder, prepared.policy, metrics=Registry()),
                                 quic_handlers=holder_moqt_handlers(holder, prepared.policy,
                                                                    alpns=section.moqt_alpns))
    except ValueError as exc:
        for sock in prepared.sockets:
            if sock is not None:
                sock.close()
        if host_directory is not None:
            shutil.rmtree(host_directory, ignore_errors=True)
        raise ConfigError(str(exc)) from None
    pool = None
    if host_directory is not None:
        pool = await start_workers(holder, prepared, host_directory, workers, server, section.moqt_alpns,
                                   cfg.server.event_loop)
    publisher = None
    if section.index:
        client = KvspClient(prepared.files, settings=prepared.settings)
        publisher = ReplicaPublisher(holder, client, section.index, moqt_uri=moqt_uri)
        publisher.start()
    else:
        log.warning("no Index Service configured (holder.index / --index): replicas are not published")
    log.info("Holder at %s (%d descriptor(s), host tier %d octets%s, %d worker process(es))", prepared.base_uri,
             len(descriptors), section.host_capacity, f", local-storage {local.path}" if local else "", workers)
    announce(prepared, **_uris("index", section.index), moqt=moqt_uri, workers=workers,
             worker_pids=pool[0].pids() if pool is not None else [])
    try:
        await _wait(stop)
    finally:
        if publisher is not None:
            await publisher.stop(withdraw=True)
        if pool is not None:
            await pool[0].stop()
        await server.close()
        if pool is not None:
            await pool[1].close()
        if client is not None:
            await client.aclose()
        if host_directory is not None:
            shutil.rmtree(host_directory, ignore_errors=True)


def shared_store(settings: Any, host_directory: Path) -> Any:
    """The tiers of a holder with worker processes: the host tier in shared memory, local storage as usual."""
    from kvsp_quic.storage.shared_host import SharedHostTier
    from kvsp_quic.storage.tiers import LocalStorageTier, TieredStore, eviction_policy

    tiers: list[Any] = [SharedHostTier(host_directory, settings.host_capacity, eviction_policy(settings.eviction))]
    if settings.local_storage is not None:
        tiers.append(LocalStorageTier(settings.local_storage, eviction_policy(settings.eviction)))
    return TieredStore(tiers)


async def start_workers(holder: Any, prepared: Prepared, host_directory: Path, count: int, server: Any,
                        moqt_alpns: list[str], loop: str = "auto") -> tuple[Any, Any]:
    """The control socket and workers 1..count-1 of a holder (``kvsp_app.holder_workers``), serving."""
    from kvsp_app.holder_workers import ControlServer, WorkerSpec, worker_main
    from kvsp_app.workers import Workers

    control = ControlServer(holder, prepared.policy, host_directory / "control.sock")
    await control.start()
    host, port = prepared.sockets[0].getsockname()[:2]
    level = logging.getLogger().getEffectiveLevel()

    def spec_for(index: int) -> WorkerSpec:
        return WorkerSpec(index, holder.settings, prepared.files, prepared.policy_file, prepared.settings, host, port,
                          host_directory, level, tuple(moqt_alpns), loop)

    pool = Workers("holder", worker_main, spec_for, count)
    try:
        await pool.start()
    except BaseException as exc:
        await pool.stop()
        await server.close()
        await control.close()
        shutil.rmtree(host_directory, ignore_errors=True)
        raise ConfigError(f"holder workers: {exc}") from None
    return pool, control


# -- the Inference Instance ---------------------------------------------------------------------------------------


DEV_SCOPE_KEY = "scope.key"  # --dev without --scope-key: the dev scope's key, made once in DIR (hex)


def read_scope_key(path: Path) -> bytes:
    """A scope key file: hex text (64 or more hex digits, whitespace ignored), or 32 or more raw octets."""
    from kvsp_quic.keys import check_scope_key

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the scope key {os.fspath(path)!r}: {exc.strerror}") from None
    text = b"".join(raw.split())
    if len(text) >= 64 and len(text) % 2 == 0:
        with contextlib.suppress(ValueError):
            return check_scope_key(bytes.fromhex(text.decode("ascii")))
    if len(raw) >= 32:
        return raw
    raise ConfigError(f"scope key {os.fspath(path)!r}: expected at least 32 octets (raw) or 64 hex characters")


def dev_scope_key(dev_dir: Path) -> Path:
    """The dev scope key file, created once: 0600 from its first octet (``os.open`` with the mode and
    ``O_EXCL``, never written before a chmod), in a directory made 0700; a racing creator's file is kept."""
    path = dev_dir / DEV_SCOPE_KEY
    if not path.exists():
        dev_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.write(fd, (os.urandom(32).hex() + "\n").encode("ascii"))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # never replaces a key another process made meanwhile
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return path


def check_device(device: str) -> None:
    """Fail early, in one line, when torch is missing or the device does not exist (``--gpu 0`` without CUDA)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError("the instance needs torch: pip install 'kvsp-quic[gpu]'") from None
    from gpu.kvcache import resolve_device

    try:
        resolve_device(device)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None


async def run_instance(cfg: InstanceFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                       stop: asyncio.Event | None = None, clock: Callable[[], float] = time.monotonic) -> None:
    from gpu.engine import Engine
    from gpu.modelfiles import ModelError
    from kvsp_app.instance import DEV_EPOCH_FILE, build_instance, persisted_epoch

    section = cfg.instance
    if section.model is None:
        raise ConfigError("instance.model: the model directory is required (--model DIR)")
    check_device(section.device)
    key_files = list(section.scope_keys)
    if not key_files and dev_dir is not None:
        key_files = [dev_scope_key(dev_dir)]
    scope_keys = [read_scope_key(p) for p in key_files]
    if not scope_keys:
        log.warning("no scope key (--scope-key FILE): this instance cannot start or resume sessions")
    # the instance epoch, higher at every start: persisted (spec, "Instance Status and Lifecycle"), else the start time
    epoch_file = section.epoch_file or (dev_dir / DEV_EPOCH_FILE if dev_dir is not None else None)
    epoch = persisted_epoch(epoch_file) if epoch_file is not None else int(time.time() * 1000)
    try:
        engine = Engine.load(os.fspath(section.model), device=section.device, dtype=section.dtype,
                             kv_dtype=section.kv_dtype, block_tokens=section.block_tokens,
                             device_pages=section.device_pages, host_pages=section.host_pages,
                             name=section.model_name, engine=section.engine)
    except (ModelError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    try:
        await engine.warmup(section.warmup_tokens)
        prepared = prepare("instance", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path)
    except BaseException:
        engine.close()
        raise
    try:
        node = build_instance(
            engine, base_uri=prepared.base_uri, files=prepared.files, policy=prepared.policy, scope_keys=scope_keys,
            index=section.index, epoch=epoch, clock=clock, options=section, service=section,
            links=[x.link() for x in section.links], replica_ttl_ms=section.replica_ttl_ms,
            lease_limits=section.leases, moqt=section.moqt, transport=prepared.settings)
        server = await serve_app(prepared, node.app, quic_handlers=node.quic_handlers)
    except BaseException:
        for sock in prepared.sockets:
            if sock is not None:
                sock.close()
        engine.close()
        raise
    await node.start()
    d = engine.descriptor
    log.info("Inference Instance at %s (model %s on %s, %d device pages of %d tokens, epoch %d)", prepared.base_uri,
             d.model, engine.model.device, section.device_pages, d.block_tokens, node.role.epoch)
    announce(prepared, instance_id=node.service.instance_id, epoch=node.role.epoch, compat_id=d.compat_id.hex(),
             descriptor=d.to_json(), device=str(engine.model.device), **_uris("index", section.index),
             engine=engine.name, engine_build=engine.build, layer_streamed=True,
             **_uris("controller", section.controller), moqt=node.moqt_uri,
             scope_ids=[k.hex() for k in node.role.keyers],
             scope_key=os.fspath(key_files[0]) if dev_dir is not None and key_files else None)
    try:
        await _wait(stop)
    finally:
        await node.aclose()
        await server.close()
        engine.close()

# -- the front end -------------------------------------------------------------------------------------------------


async def run_frontend(cfg: FrontendFile, *, dev_dir: Path | None, policy_path: Path | None = None,
                       stop: asyncio.Event | None = None) -> None:
    from gpu.modelfiles import DESCRIBED_FAMILIES, ModelConfig, derive_descriptor, load_tokenizer
    from http3.client import KvspClient
    from kvsp_client.api import ServiceEndpoints
    from kvsp_frontend.app import Frontend, frontend_app
    from kvsp_frontend.auth import dev_api_key, with_dev_key
    from kvsp_frontend.text import ChatTemplateError, load_chat_template
    from kvsp_quic.keys import BlockKeyer

    section = cfg.frontend
    if not section.controller:
        raise ConfigError("--controller URI (or frontend.controller) is required: the Placement Controller")
    if section.model is None:
        raise ConfigError("--model DIR (or frontend.model) is required: the model's tokenizer and descriptor")
    key_path = section.scope_key
    if key_path is None and dev_dir is not None:
        key_path = dev_scope_key(dev_dir)
    if key_path is None:
        raise ConfigError("--scope-key FILE (or frontend.scope_key) is required: the scope of the sessions")
    scope_key = read_scope_key(key_path)
    descriptor = derive_descriptor(section.model, section.block_tokens, name=section.model_name)
    tokenizer = load_tokenizer(section.model)
    model_config = ModelConfig.load(section.model, families=DESCRIBED_FAMILIES)  # whichever engine serves it
    try:
        chat_template = load_chat_template(section.model)
    except ChatTemplateError as exc:
        raise ConfigError(str(exc)) from None
    prepared = prepare("frontend", cfg.server, cfg.tls, cfg.transport, dev_dir=dev_dir, policy_path=policy_path)
    client = KvspClient(prepared.files, settings=prepared.settings)
    # Users authenticate with a client certificate or an API key: the front end's listener alone accepts clients
    # without a certificate (its client towards the PC and the instances keeps mutual TLS).
    prepared = dataclasses.replace(prepared, settings=dataclasses.replace(prepared.settings,
                                                                          client_cert_optional=True))
    ready_extra: dict[str, Any] = {"openai_base_url": f"{prepared.base_uri}v1"}
    if dev_dir is not None:
        api_key = dev_api_key(dev_dir)
        prepared = dataclasses.replace(prepared, policy=with_dev_key(prepared.policy, api_key),
                                       policy_derive=lambda policy: with_dev_key(policy, api_key))
        ready_extra.update(api_key=api_key, api_key_file=os.fspath(dev_dir / "api.key"))
    frontend = Frontend(client, ServiceEndpoints(section.controller, "controller"),
                        BlockKeyer(scope_key, descriptor.compat_id, descriptor.block_tokens),
                        tokenizer, descriptor.model, options=section,
                        context=model_config.max_position_embeddings, vocab_size=model_config.vocab_size,
                        chat_template=chat_template, placement_timeout_s=section.placement_timeout_ms / 1000,
                        max_choices=section.max_choices)
    try:
        server = await serve_app(prepared, frontend_app(frontend, prepared.policy,
                                                         base_path=_path_of(prepared.base_uri)))
    except BaseException:
        await client.aclose()
        raise
    log.info("front end at %s (model %s, controller %s)", prepared.base_uri, descriptor.model,
             ", ".join(section.controller))
    announce(prepared, **_uris("controller", section.controller), completions=f"{prepared.base_uri}v1/completions",
             **ready_extra)
    try:
        await _wait(stop)
    finally:
        await server.close()
        await client.aclose()


def _uris(key: str, uris: list[str]) -> dict[str, Any]:
    """The ready line's members for a service's URIs: *key* the first (or null; as earlier releases announced it)
    and *key* + ``es``/``s`` all of them (``"indexes"``, ``"controllers"``)."""
    return {key: uris[0] if uris else None, ("indexes" if key == "index" else key + "s"): list(uris)}


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


def _mac_key(ls: Any) -> bytes:
    """The key sealing a holder's unencrypted local-storage files: ``mac_key_file``, by default beside the
    directory; created 0600 with a random key when missing (``kvsp_quic.storage.file_seal``)."""
    from kvsp_quic.storage.file_seal import KeyFileError, default_key_file, load_or_create_key

    try:
        path = ls.mac_key_file or default_key_file(ls.path)
        key, created = load_or_create_key(path, fsync=ls.fsync)
    except KeyFileError as exc:
        raise ConfigError(f"holder.local_storage.mac_key_file: {exc}") from None
    if created:
        log.warning(
            "local-storage: created the MAC key %s%s; block files not sealed under it are refused", path,
            "" if ls.mac_key_file else " (no mac_key_file configured: beside the directory)")
    return key


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
