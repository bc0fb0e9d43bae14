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

    [transport]                   # optional: fields of http3.tls.TransportSettings
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

from .fields import RecordError, base_uri

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
class IndexFile:
    server: ServerSection = field(default_factory=ServerSection)
    tls: TlsSection | None = None  # required unless --dev
    transport: dict[str, float] = field(default_factory=dict)  # fields of http3.tls.TransportSettings
    index: IndexSection = field(default_factory=IndexSection)


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


__all__ = ["ConfigError", "HolderFile", "HolderSection", "IndexFile", "IndexSection", "LeaseSection",
           "LocalStorageSection", "ServerSection", "TlsSection", "build", "host_port", "load"]
