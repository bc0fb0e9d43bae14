"""Configuration: one frozen dataclass per component, loaded from TOML, unknown keys rejected.

A server's file has the sections its dataclass names; a missing key takes the field's default, a missing
required key, an unknown key, or a value of the wrong type is a :class:`ConfigError` whose one-line message
names the file and the key (``config 'holder.toml': holder.replica_ttl_ms: must be an integer``). Relative
paths are resolved against the file's directory.

    [server]                      # every server role
    listen = "127.0.0.1:8443"     # HOST:PORT; the TCP and UDP ports have the same number
    base_uri = "https://127.0.0.1:8443/kvsp/"   # as in the role's certificate (default https://HOST:PORT/)
    policy = "policy.toml"        # who may do what (kvsp_quic.auth)

    [tls]
    ca = "pki/ca.pem"
    cert = "pki/holder1.pem"
    key = "pki/holder1.key"

    [transport]                   # optional: fields of quic.tls.TransportSettings
    stream_window = 16777216
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvsp_quic.fields import RecordError, base_uri

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration that cannot be used; the message is one line for the user."""


# -- sections every server shares --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsSection:
    ca: Path
    cert: Path
    key: Path


@dataclass(frozen=True)
class ServerSection:
    listen: str = "127.0.0.1:0"
    base_uri: str | None = None
    policy: Path | None = None

    def __post_init__(self) -> None:
        host_port(self.listen)  # validates
        if self.base_uri is not None:
            try:
                base_uri(self.base_uri, "server.base_uri")
            except RecordError as exc:
                raise ConfigError(exc.detail) from None

    def address(self) -> tuple[str, int]:
        return host_port(self.listen)

    def uri_for(self, port: int) -> str:
        """The role's base URI once it listens on *port* (listen may say port 0)."""
        if self.base_uri is not None:
            return self.base_uri
        host, _ = self.address()
        return f"https://{'[' + host + ']' if ':' in host else host}:{port}/"


def host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r}: expected HOST:PORT (port 0 picks a free one)")
    return host, int(port)


# -- the roles ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexSection:
    store: typing.Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    redis_prefix: str = "kvsp:"
    max_ttl_ms: int = 600_000  # replica TTLs are capped at this
    max_lookup_keys: int = 8192
    max_lookup_targets: int = 256
    max_status_ttl_ms: int = 60_000
    descriptors: list[Path] = field(default_factory=list)  # their geometry makes lookups estimate costs


@dataclass(frozen=True)
class ControllerSection:
    """The Placement Controller, which runs in the Index Service's process (``kvsp-quic index``)."""

    start_hook: list[str] = field(default_factory=list)  # argv of a command that starts an instance; [] = none
    start_timeout_ms: int = 60_000  # how long a request waits for an instance the hook starts
    start_interval_ms: int = 10_000  # at most one hook run per interval
    max_cost_us: float | None = None  # a placement costlier than this looks for capacity (wake, start hook)
    prefetch_deadline_ms: int = 1000
    prefetch_lease_ms: int = 5000
    request_timeout_ms: int = 10_000  # of each request to an instance (reshard plans: their deadline_ms)
    tick_ms: int = 100  # failure checks
    session_ttl_ms: int = 3_600_000
    done_ttl_ms: int = 600_000
    max_sessions: int = 100_000
    reshard_deadline_ms: int = 5000
    sleep: typing.Literal["load", "always", "never"] = "load"  # the policy for requested_state: sleeping
    sleep_min_active: int = 1  # other active instances that must remain
    sleep_min_spare: int = 1  # spare batch slots the others must have beyond the requester's load
    sleep_max_kv_utilization: float = 0.9  # others fuller than this have no spare capacity

    def __post_init__(self) -> None:
        for name in ("start_timeout_ms", "start_interval_ms", "prefetch_deadline_ms", "prefetch_lease_ms",
                     "request_timeout_ms", "tick_ms", "session_ttl_ms", "done_ttl_ms", "max_sessions",
                     "reshard_deadline_ms"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"controller.{name}: must be positive")
        if self.max_cost_us is not None and self.max_cost_us <= 0:
            raise ConfigError("controller.max_cost_us: must be positive")
        if self.sleep_min_active < 0 or self.sleep_min_spare < 0:
            raise ConfigError("controller.sleep_min_active and sleep_min_spare: must not be negative")
        if not 0.0 <= self.sleep_max_kv_utilization <= 1.0:
            raise ConfigError("controller.sleep_max_kv_utilization: must be in [0, 1]")


@dataclass(frozen=True)
class IndexFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None  # required unless --dev
    transport: dict[str, float] = field(default_factory=dict)  # fields of quic.tls.TransportSettings
    index: IndexSection = field(default_factory=IndexSection)
    controller: ControllerSection = field(default_factory=ControllerSection)


@dataclass(frozen=True)
class LocalStorageSection:
    path: Path
    capacity: int
    read_mbit_per_s: int | None = None
    encryption_key_file: Path | None = None  # 32 raw octets, or 64 hex characters: AES-256-GCM at rest
    fsync: bool = True


@dataclass(frozen=True)
class LeaseSection:
    max_ttl_ms: int = 60_000
    max_octets_per_client: int = 16 << 30
    max_leases_per_client: int = 1024
    max_keys_per_lease: int = 1024


@dataclass(frozen=True)
class HolderSection:
    index: str | None = None  # the Index Service's base URI; without one, replicas are not published
    descriptors: list[Path] = field(default_factory=list)  # the caches it serves (at least one)
    host_capacity: int = 1 << 30
    host_read_mbit_per_s: int | None = None
    eviction: str = "lru"
    replica_ttl_ms: int = 300_000
    retention_ms: int | None = None
    max_block_bytes: int = 1 << 30
    local_storage: LocalStorageSection | None = None
    leases: LeaseSection = field(default_factory=LeaseSection)

    def __post_init__(self) -> None:
        if self.index is not None:
            try:
                base_uri(self.index, "holder.index")
            except RecordError as exc:
                raise ConfigError(exc.detail) from None


@dataclass(frozen=True)
class HolderFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None
    transport: dict[str, float] = field(default_factory=dict)
    holder: HolderSection = field(default_factory=HolderSection)


@dataclass(frozen=True)
class RelaySection:
    index: str | None = None  # the Index Service: upstreams for unpublished KVSP tracks, records of cached blocks
    cache_bytes: int = 1 << 30  # payload octets of completed fetches kept (LRU)
    open_prefixes: list[str] = field(default_factory=list)  # non-KVSP namespaces relayed ("a/b"); none by default
    publish_records: bool = True  # with an index: advertise complete cached blocks with the relay's moqt:// URI
    record_ttl_ms: int = 60_000
    upstream_timeout_ms: int = 10_000  # for the upstream's FETCH_OK, next piece, SUBSCRIBE_OK
    data_streams: int = 16  # upstream data streams a publisher's session may have open at once

    def __post_init__(self) -> None:
        if self.index is not None:
            try:
                base_uri(self.index, "relay.index")
            except RecordError as exc:
                raise ConfigError(exc.detail) from None
        for name in ("cache_bytes",):
            if getattr(self, name) < 0:
                raise ConfigError(f"relay.{name}: must not be negative")
        for name in ("record_ttl_ms", "upstream_timeout_ms", "data_streams"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"relay.{name}: must be positive")
        for i, prefix in enumerate(self.open_prefixes):
            fields_ = prefix.split("/")
            if not prefix or any(not part for part in fields_) or fields_[0] == "kvsp-1":
                raise ConfigError(f"relay.open_prefixes[{i}]: {prefix!r} is not a namespace prefix ('a/b', not "
                                  f"kvsp-1)")


@dataclass(frozen=True)
class RelayFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None
    transport: dict[str, float] = field(default_factory=dict)
    relay: RelaySection = field(default_factory=RelaySection)



@dataclass(frozen=True)
class LinkSection:
    holder: str  # a holder's base URI (https or moqt)
    mbit_per_s: float
    rtt_us: float = 0.0


@dataclass(frozen=True)
class InstanceSection:
    """``kvsp-quic instance``: the model, its cache, the roles it talks to (docs/inference.md)."""

    model: Path | None = None  # a model directory (Hugging Face Llama layout); required
    device: str = "cpu"  # "cpu" or "cuda:N" (--gpu N)
    dtype: str | None = None  # compute dtype fp32 | bf16 | fp16 (default: the model's)
    kv_dtype: str | None = None  # KV element type (default: the compute dtype)
    block_tokens: int = 16
    model_name: str | None = None  # the descriptor's "model" (default: config.json's name, or the directory's)
    index: str | None = None  # the Index Service: lookups, and where the instance publishes its replicas
    controller: str | None = None  # the Placement Controller: status reports and checkpoints
    scope_keys: list[Path] = field(default_factory=list)  # files of the scopes it serves (hex or raw octets)
    device_pages: int = 1024  # pages (blocks) of the device tier
    host_pages: int = 0  # pages of the host tier (pinned memory under CUDA)
    status_ttl_ms: int = 3000
    max_running: int = 4
    max_queued: int = 64
    max_directives: int = 64
    max_tokens: int = 4096
    checkpoint_tokens: int = 16
    sleep_after_idle_ms: int | None = None
    deterministic_greedy: bool = True
    replica_ttl_ms: int = 60_000
    session_lease_ms: int | None = None
    moqt: bool = True  # fetch moqt:// replicas first
    warmup_tokens: int = 64
    links: list[LinkSection] = field(default_factory=list)  # configured links (others are measured)
    leases: LeaseSection = field(default_factory=LeaseSection)

    def __post_init__(self) -> None:
        for name in ("index", "controller"):
            value = getattr(self, name)
            if value is not None:
                try:
                    base_uri(value, f"instance.{name}")
                except RecordError as exc:
                    raise ConfigError(exc.detail) from None
        for name in ("block_tokens", "device_pages", "status_ttl_ms", "max_running", "max_directives", "max_tokens",
                     "checkpoint_tokens", "replica_ttl_ms"):
            if getattr(self, name) < 1:
                raise ConfigError(f"instance.{name}: must be positive")
        if self.checkpoint_tokens > 64:
            raise ConfigError("instance.checkpoint_tokens: at most 64 (spec: a checkpoint at least every 64 tokens)")
        if self.host_pages < 0 or self.warmup_tokens < 0 or self.max_queued < 0:
            raise ConfigError("instance.host_pages, warmup_tokens and max_queued must not be negative")


@dataclass(frozen=True)
class InstanceFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None
    transport: dict[str, float] = field(default_factory=dict)
    instance: InstanceSection = field(default_factory=InstanceSection)

@dataclass(frozen=True)
class FrontendSection:
    """``kvsp-quic frontend``: the OpenAI-compatible edge (docs/inference.md)."""

    controller: str | None = None  # the Placement Controller's base URI (required)
    model: Path | None = None  # the model directory: its tokenizer and descriptor (required)
    model_name: str | None = None  # the "model" of the OpenAI API and of the descriptor
    block_tokens: int = 16  # must match the instances' --block-tokens
    scope_key: Path | None = None  # the scope the front end's sessions belong to (hex or raw octets)
    max_tokens: int = 4096
    failover_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.controller is not None:
            try:
                base_uri(self.controller, "frontend.controller")
            except RecordError as exc:
                raise ConfigError(exc.detail) from None
        if self.block_tokens < 1 or self.max_tokens < 1 or self.failover_timeout_s <= 0:
            raise ConfigError("frontend.block_tokens, max_tokens and failover_timeout_s must be positive")


@dataclass(frozen=True)
class FrontendFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None
    transport: dict[str, float] = field(default_factory=dict)
    frontend: FrontendSection = field(default_factory=FrontendSection)


# -- loading -----------------------------------------------------------------------------------------------------


def load(cls: type[T], path: str | os.PathLike[str]) -> T:
    """The dataclass *cls* from the TOML file at *path*."""
    where = f"config {os.fspath(path)!r}"
    try:
        with open(path, "rb") as fh:
            obj = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read {where}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: not valid TOML ({exc})") from None
    return build(cls, obj, source=where, root=Path(path).resolve().parent)


def build(cls: type[T], obj: Mapping[str, Any], *, source: str = "config", root: Path | None = None) -> T:
    """The dataclass *cls* from a mapping, strictly: unknown keys and wrong types are errors."""
    try:
        return _build(cls, obj, "", root or Path.cwd())
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _build(cls: type[T], obj: Any, path: str, root: Path) -> T:
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{path or 'the file'}: must be a table")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(obj) - set(known))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise ConfigError(f"{where}: unknown key (known: {', '.join(known) or 'none'})")
    kwargs: dict[str, Any] = {}
    for name, fld in known.items():
        where = f"{path}.{name}" if path else name
        if name in obj:
            kwargs[name] = _value(hints[name], obj[name], where, root)
        elif fld.default is dataclasses.MISSING and fld.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{where}: required key is missing")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None


def _value(hint: Any, value: Any, where: str, root: Path) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) == 1:
            return _value(options[0], value, where, root)
        raise ConfigError(f"{where}: unsupported type {hint}")  # pragma: no cover - a programming error
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{where}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: must be a table")
        return {_value(key_type, k, where, root): _value(value_type, v, f"{where}.{k}", root)
                for k, v in value.items()}
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: must be an array")
        items = [_value(args[0], v, f"{where}[{i}]", root) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where, root)  # type: ignore[arg-type]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: must be an integer")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}: must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string")
        return value
    if hint is Path:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}: must be a path")
        path = Path(os.path.expanduser(value))
        return path if path.is_absolute() else root / path
    raise ConfigError(f"{where}: unsupported type {hint}")  # pragma: no cover - a programming error


__all__ = [
    "ConfigError",
    "ControllerSection",
    "FrontendFile",
    "FrontendSection",
    "HolderFile",
    "HolderSection",
    "IndexFile",
    "IndexSection",
    "InstanceFile",
    "InstanceSection",
    "LeaseSection",
    "LinkSection",
    "LocalStorageSection",
    "RelayFile",
    "RelaySection",
    "ServerSection",
    "TlsSection",
    "build",
    "host_port",
    "load",
]
