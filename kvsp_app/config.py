"""Configuration: one frozen dataclass per section, loaded from TOML, unknown keys rejected.

A role's section *is* that role's settings: its class extends the role's options dataclass (``[controller]`` is
:class:`~kvsp_quic.roles.controller.ControllerConfig` itself; ``[holder]`` is a
:class:`~kvsp_quic.roles.holder.HolderOptions`, ``[holder.leases]`` a :class:`~kvsp_quic.roles.leases.LeaseLimits`,
``[index]`` an :class:`~kvsp_quic.roles.index.IndexOptions`, ``[instance]`` an
:class:`~kvsp_quic.roles.instance.InstanceOptions` and a :class:`~kvsp_quic.roles.instance.ServiceOptions`,
``[frontend]`` a :class:`~kvsp_quic.frontend.FrontendOptions`) with only the keys the composition root resolves
itself (descriptor and key files, the index store, the URIs of other roles, the model). The role validates its
fields once, in ``__post_init__``, raising ``ValueError("field: ...")``; the loader names the file and the key
path (``config 'holder.toml': holder.replica_ttl_ms: must be positive``), as it does for a missing required key,
an unknown key or a value of the wrong type. :func:`options_of` hands a section's options to the role's
settings, which add what only exists at run time (base URI, descriptor objects, key octets); :func:`replace`
applies command-line overrides with the same checks. One unit per quantity: durations are milliseconds (``*_ms``),
sizes octets; :data:`RENAMED` keys are refused with their new name. Relative paths are resolved against the
file's directory.

    [server]                      # every server role
    listen = "127.0.0.1:8443"     # HOST:PORT; the TCP and UDP ports have the same number
    base_uri = "https://127.0.0.1:8443/kvsp/"   # as in the role's certificate (default https://HOST:PORT/)
    policy = "policy.toml"        # who may do what (kvsp_quic.auth)

    [tls]
    ca = "pki/ca.pem"
    cert = "pki/holder1.pem"
    key = "pki/holder1.key"
    crl = "pki/ca.crl"            # optional: the CA's CRL (PEM or DER); SIGHUP re-reads it and the policy

    [transport]                   # optional: fields of quic.tls.TransportSettings
    stream_window = 16777216
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, TypeVar

from kvsp_app import event_loop
from kvsp_quic.fields import BASE_URIS, RecordError, base_uri, base_uris
from kvsp_quic.frontend import FrontendOptions
from kvsp_quic.records import Link
from kvsp_quic.roles.controller import ControllerConfig
from kvsp_quic.roles.holder import HolderOptions
from kvsp_quic.roles.index import IndexOptions
from kvsp_quic.roles.instance import InstanceOptions, ServiceOptions
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_quic.storage.tiers import LocalStorageOptions
from kvsp_quic.tomlfile import read_toml
from moqt.relay.interfaces import RelayOptions
from moqt.types import PREFERRED_ALPNS, alpn_order

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration that cannot be used; the message is one line for the user."""


# -- sections every server shares --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TlsSection:
    ca: Path
    cert: Path
    key: Path
    crl: Path | None = None  # revoked peer certificates (quic.crl); re-read on SIGHUP


@dataclass(frozen=True)
class ServerSection:
    listen: str = "127.0.0.1:0"
    base_uri: str | None = None
    policy: Path | None = None
    event_loop: str = "auto"  # kvsp_app.event_loop: auto (uvloop where installed), uvloop, asyncio

    def __post_init__(self) -> None:
        host_port(self.listen)  # validates
        if self.event_loop not in event_loop.CHOICES:
            raise ConfigError(f"server.event_loop {self.event_loop!r}: expected one of {', '.join(event_loop.CHOICES)}")
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


@dataclass(frozen=True)
class ServerFile:
    """What every server role's file has; each role's file adds its section(s)."""

    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None  # required unless --dev
    transport: dict[str, float] = field(default_factory=dict)  # fields of quic.tls.TransportSettings


# -- the roles ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexSection(IndexOptions):
    """``[index]``: the Index Service's options, its store, and the descriptor files whose geometry lets lookups
    estimate costs."""

    store: typing.Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    redis_prefix: str = "kvsp:"
    descriptors: list[Path] = field(default_factory=list)
    # memory store: records a lookup keeps decoded (and rendered) for the next lookups, per generation of two
    # (kvsp_quic/storage/memory_index.py; ~7 KB each with 32 layer digests); 0: none
    lookup_cache_records: int = 8192

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.lookup_cache_records <= 1 << 24:
            raise ValueError("lookup_cache_records: must be 0 to 16777216")


@dataclass(frozen=True)
class IndexFile(ServerFile):
    index: IndexSection = field(default_factory=IndexSection)
    controller: ControllerConfig = field(default_factory=ControllerConfig)


@dataclass(frozen=True)
class LocalStorageSection(LocalStorageOptions):
    """``[holder.local_storage]``: the tier's options, and the file of its key: with *encryption_key_file* files
    are AES-256-GCM sealed; otherwise each carries an HMAC-SHA-256 under the key in *mac_key_file* (created 0600
    when missing; default: ``<path>.mac-key`` beside the directory), and a file not sealed under it is never
    adopted or served (``kvsp_quic.storage.file_seal``)."""

    encryption_key_file: Path | None = None  # 32 raw octets, or 64 hex characters: AES-256-GCM at rest
    mac_key_file: Path | None = None  # 32 raw octets, or 64 hex characters: HMAC-SHA-256 of unencrypted files

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mac_key_file is not None:
            if self.encryption_key_file is not None:
                raise ValueError("mac_key_file: not with encryption_key_file (AES-GCM authenticates the files)")
            key, directory = Path(os.path.abspath(self.mac_key_file)), Path(os.path.abspath(self.path))
            if key == directory or directory in key.parents:
                raise ValueError("mac_key_file: must lie outside the storage directory (whoever can drop files "
                                 "there must not reach the key)")


@dataclass(frozen=True, kw_only=True)
class HolderSection(HolderOptions):
    """``[holder]``: the holder's options, and what the composition root resolves into its settings."""

    # The Index Service's base URIs (replicas, failing over between them); none: replicas are not published
    index: Annotated[list[str], BASE_URIS] = field(default_factory=list)
    descriptors: list[Path] = field(default_factory=list)  # the caches it serves (at least one)
    local_storage: LocalStorageSection | None = None
    workers: int | None = None  # processes serving the one port and store (None: one per core)
    moqt_alpns: list[str] = field(default_factory=lambda: list(PREFERRED_ALPNS))  # MOQT drafts, preferred first

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "index", base_uris(self.index, "index"))
        if self.workers is not None and not 1 <= self.workers <= 256:
            raise ValueError("workers: 1 to 256 processes")
        _check_alpns(self.moqt_alpns)


def _check_alpns(alpns: list[str]) -> None:
    try:
        alpn_order(alpns)
    except ValueError as exc:
        raise ValueError(f"moqt_alpns: {exc}") from None


@dataclass(frozen=True)
class HolderFile(ServerFile):
    holder: HolderSection = field(default_factory=HolderSection)


@dataclass(frozen=True, kw_only=True)
class RelaySection(RelayOptions):
    """``[relay]``: the relay's options (:class:`moqt.relay.RelayOptions`), and what the composition root wires
    around it: the Index Service link, the access rules' open prefixes, the sessions' data streams."""

    # The Index Service (its base URIs): upstreams for unpublished KVSP tracks, records of cached blocks
    index: Annotated[list[str], BASE_URIS] = field(default_factory=list)
    open_prefixes: list[str] = field(default_factory=list)  # non-KVSP namespaces relayed ("a/b"); none by default
    publish_records: bool = True  # with an index: advertise complete cached blocks with the relay's moqt:// URI
    record_ttl_ms: int = 60_000
    data_streams: int = 16  # upstream data streams a publisher's session may have open at once
    workers: int | None = None  # processes serving the one port, each with its own cache (None: one per core)
    moqt_alpns: list[str] = field(default_factory=lambda: list(PREFERRED_ALPNS))  # MOQT drafts, preferred first

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "index", base_uris(self.index, "index"))
        if self.workers is not None and not 1 <= self.workers <= 256:
            raise ValueError("workers: 1 to 256 processes")
        _check_alpns(self.moqt_alpns)
        for name in ("record_ttl_ms", "data_streams"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive")
        for i, prefix in enumerate(self.open_prefixes):
            fields_ = prefix.split("/")
            if not prefix or any(not part for part in fields_) or fields_[0] == "kvsp-1":
                raise ValueError(f"open_prefixes[{i}]: {prefix!r} is not a namespace prefix ('a/b', not kvsp-1)")


@dataclass(frozen=True)
class RelayFile(ServerFile):
    relay: RelaySection = field(default_factory=RelaySection)


@dataclass(frozen=True)
class LinkSection:
    """``[[instance.links]]``: a configured link (a :class:`~kvsp_quic.records.Link` whose ``rtt_us`` may be left
    out)."""

    holder: str  # a holder's base URI (https or moqt)
    mbit_per_s: float
    rtt_us: float = 0.0

    def link(self) -> Link:
        return Link(holder=self.holder, mbit_per_s=self.mbit_per_s, rtt_us=self.rtt_us)


@dataclass(frozen=True, kw_only=True)
class InstanceSection(InstanceOptions, ServiceOptions):
    """``[instance]`` of ``kvsp-quic instance``: the role's options, the service's, and the model, its cache and
    the roles it talks to, which the composition root resolves (docs/inference.md)."""

    model: Path | None = None  # a model directory (Hugging Face Llama layout); required
    device: str = "cpu"  # "cpu" or "cuda:N" (--gpu N)
    dtype: str | None = None  # compute dtype fp32 | bf16 | fp16 (default: the model's)
    kv_dtype: str | None = None  # KV element type (default: the compute dtype)
    block_tokens: int = 16
    model_name: str | None = None  # the descriptor's "model" (default: config.json's name, or the directory's)
    # The Index Service's base URIs: lookups, and where the instance publishes its replicas
    index: Annotated[list[str], BASE_URIS] = field(default_factory=list)
    scope_keys: list[Path] = field(default_factory=list)  # files of the scopes it serves (hex or raw octets)
    device_pages: int = 1024  # pages (blocks) of the device tier
    host_pages: int = 0  # pages of the host tier (pinned memory under CUDA)
    replica_ttl_ms: int = 60_000  # of the records of the blocks it holds
    moqt: bool = True  # fetch moqt:// replicas first
    warmup_tokens: int = 64
    links: list[LinkSection] = field(default_factory=list)  # configured links (others are measured)
    leases: LeaseLimits = field(default_factory=LeaseLimits)

    def __post_init__(self) -> None:
        InstanceOptions.__post_init__(self)
        ServiceOptions.__post_init__(self)
        object.__setattr__(self, "index", base_uris(self.index, "index"))
        for name in ("block_tokens", "device_pages", "replica_ttl_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")
        for name in ("host_pages", "warmup_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must not be negative")


@dataclass(frozen=True)
class InstanceFile(ServerFile):
    instance: InstanceSection = field(default_factory=InstanceSection)


@dataclass(frozen=True)
class FrontendSection(FrontendOptions):
    """``[frontend]``: the front end's options, and what the composition root resolves (docs/inference.md)."""

    controller: Annotated[list[str], BASE_URIS] = field(default_factory=list)  # the PC's base URIs (required)
    model: Path | None = None  # the model directory: its tokenizer and descriptor (required)
    model_name: str | None = None  # the "model" of the OpenAI API and of the descriptor
    block_tokens: int = 16  # must match the instances' --block-tokens
    scope_key: Path | None = None  # the scope the front end's sessions belong to (hex or raw octets)
    placement_timeout_ms: int = 30_000  # POST sessions at the PC; beyond: 503 with Retry-After
    max_choices: int = 16  # prompts x n of one request

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "controller", base_uris(self.controller, "controller"))
        for name in ("block_tokens", "placement_timeout_ms", "max_choices"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive")


@dataclass(frozen=True)
class FrontendFile(ServerFile):
    frontend: FrontendSection = field(default_factory=FrontendSection)


def options_of(section: Any, options: type[T]) -> dict[str, Any]:
    """The fields of the dataclass *options* (a base of *section*'s class) as keyword arguments: a file's section
    passed on to the role's settings, which extend the same options with what the composition root resolved."""
    if not isinstance(section, options):
        raise TypeError(f"{type(section).__name__} is not a {options.__name__}")
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(options)}  # type: ignore[arg-type]


# -- loading -----------------------------------------------------------------------------------------------------


RENAMED = {  # keys of earlier releases -> what to write now (durations are milliseconds everywhere)
    "frontend.failover_timeout_s": "frontend.failover_timeout_ms (milliseconds)",
}


def load(cls: type[T], path: str | os.PathLike[str]) -> T:
    """The dataclass *cls* from the TOML file at *path*."""
    where = f"config {os.fspath(path)!r}"
    obj = read_toml(path, where, ConfigError)
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
    hints = typing.get_type_hints(cls, include_extras=True)
    known = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(obj) - set(known))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        if where in RENAMED:
            raise ConfigError(f"{where}: renamed: write {RENAMED[where]}")
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
    except RecordError as exc:
        raise ConfigError(_located(exc.detail or str(exc), path, known)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(_located(str(exc), path, known)) from None


def replace(section: T, where: str, **changes: Any) -> T:
    """*section* with *changes* (command-line overrides), validated as the file is: a bad value is a
    :class:`ConfigError` naming ``where.field``."""
    known = {f.name: f for f in dataclasses.fields(section)}  # type: ignore[arg-type]
    try:
        return dataclasses.replace(section, **changes)  # type: ignore[type-var]
    except ConfigError:
        raise
    except RecordError as exc:
        raise ConfigError(_located(exc.detail or str(exc), where, known)) from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(_located(str(exc), where, known)) from None


def _located(message: str, path: str, known: Mapping[str, Any]) -> str:
    """A settings dataclass's error, located: ``"tick_ms: must be positive"`` from ``[controller]`` is
    ``controller.tick_ms: must be positive``."""
    m = re.match(r"(\w+)[:.\[]", message)
    if m is not None and m.group(1) in known:
        return f"{path}.{message}" if path else message
    return f"{path or 'config'}: {message}"


def _value(hint: Any, value: Any, where: str, root: Path) -> Any:
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        base, *marks = typing.get_args(hint)
        if BASE_URIS in marks and isinstance(value, str):
            return value  # one URI, as earlier releases wrote it: the section makes it a list of one
        return _value(base, value, where, root)
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
    "FrontendFile",
    "FrontendSection",
    "HolderFile",
    "HolderSection",
    "IndexFile",
    "IndexSection",
    "InstanceFile",
    "InstanceSection",
    "LinkSection",
    "LocalStorageSection",
    "RelayFile",
    "RelaySection",
    "ServerSection",
    "TlsSection",
    "build",
    "host_port",
    "load",
    "options_of",
    "replace",
]
