"""The connector's settings: vLLM's ``kv_connector_extra_config``, read strictly, once, at start-up.

Two forms (docs/vllm.md, "Configuration"):

* ``{"config": FILE}``: a kvsp-quic TOML file with ``[tls]`` (``ca``, ``cert``, ``key``: the engine's client
  certificate) and ``[vllm]``::

      [vllm]
      index = ["https://is.example:4433/"]         # the Index Service (several URIs: replicas, tried in turn)
      holders = ["https://holder.example:4434/"]   # where new blocks are stored (PUT), the first that answers
      scope_key_file = "scope.key"                 # hex text or >= 32 raw octets; relative to FILE's directory
      transport = "h3"                             # h3 (HTTP/3 first, TCP fallback) or tcp (HTTP/1.1 over TLS)
      lease_ttl_ms = 30000                         # leases taken on the replicas a request will load
      publish = true                               # store and publish the engine's new complete prompt blocks
      timeout_ms = 10000                           # every request to a KVSP service

* ``{"dev": DIR, "index": [URI, ...], "holders": [URI, ...], "scope_key_file": FILE}``, exactly these keys: the
  development PKI that ``kvsp-quic index --dev DIR`` and ``kvsp-quic holder --dev DIR`` made (DIR/ca.pem and the
  ``dev`` client, DIR/dev.pem and DIR/dev.key), the other settings at their defaults.

A setting that is missing, unknown or wrong raises :class:`SettingError`, whose message is one line naming it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsp_quic.fields import RecordError, base_uris
from kvsp_quic.keys import KeyInputError, scope_key_of_file
from kvsp_quic.tomlfile import read_toml
from quic.tls import TlsConfigError, TlsFiles

WHERE = "kv_connector_extra_config"
DEV_CLIENT = "dev"  # the client certificate `--dev DIR` writes (kvsp_app.serve.DEV_CLIENT)
TRANSPORTS = ("h3", "tcp")
DEV_KEYS = frozenset({"dev", "index", "holders", "scope_key_file"})
VLLM_KEYS = frozenset({"index", "holders", "scope_key_file", "transport", "lease_ttl_ms", "publish", "timeout_ms"})
TLS_KEYS = frozenset({"ca", "cert", "key"})


class SettingError(ValueError):
    """A bad or missing connector setting; the message is one line that names it."""


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector needs of the KVSP deployment."""

    tls: TlsFiles
    index: tuple[str, ...]
    holders: tuple[str, ...]
    scope_key: bytes
    transport: str = "h3"
    lease_ttl_ms: int = 30_000
    publish: bool = True
    timeout_ms: int = 10_000

    def __post_init__(self) -> None:
        if not self.index:
            raise SettingError(f"{WHERE}: index: at least one Index Service URI")
        if self.publish and not self.holders:
            raise SettingError(f"{WHERE}: holders: at least one holder URI (or publish = false)")
        if self.transport not in TRANSPORTS:
            raise SettingError(f"{WHERE}: transport {self.transport!r}: expected one of {', '.join(TRANSPORTS)}")
        for name in ("lease_ttl_ms", "timeout_ms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SettingError(f"{WHERE}: {name}: a positive number of milliseconds, not {value!r}")

    def __repr__(self) -> str:  # the scope key is a secret: never in a log line
        return (f"ConnectorSettings(index={list(self.index)!r}, holders={list(self.holders)!r}, "
                f"transport={self.transport!r}, lease_ttl_ms={self.lease_ttl_ms}, publish={self.publish}, "
                f"timeout_ms={self.timeout_ms})")


def settings_from_extra(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The settings *extra* (vLLM's ``kv_connector_extra_config``) names: one of the two forms of the module."""
    if not extra:
        raise SettingError(f"{WHERE}: empty; give {{\"config\": FILE}} or {{\"dev\": DIR, \"index\": [...], "
                           f"\"holders\": [...], \"scope_key_file\": FILE}}")
    keys = set(extra)
    if "config" in keys:
        if keys != {"config"}:
            raise SettingError(f"{WHERE}: with \"config\", nothing else (got {', '.join(sorted(keys - {'config'}))})")
        return settings_from_file(_text(extra["config"], "config"))
    if "dev" in keys:
        if keys != DEV_KEYS:
            missing, unknown = DEV_KEYS - keys, keys - DEV_KEYS
            what = f"missing {', '.join(sorted(missing))}" if missing else f"unknown {', '.join(sorted(unknown))}"
            raise SettingError(f"{WHERE}: the dev form takes exactly dev, index, holders, scope_key_file ({what})")
        dev = Path(_text(extra["dev"], "dev"))
        if not dev.is_dir():
            raise SettingError(f"{WHERE}: dev: {os.fspath(dev)!r} is not a directory (kvsp-quic index --dev DIR "
                               f"makes one)")
        return ConnectorSettings(tls=_tls(lambda: TlsFiles.in_dir(dev, DEV_CLIENT), "dev"),
                                 index=_uris(extra["index"], "index"), holders=_uris(extra["holders"], "holders"),
                                 scope_key=_scope_key(Path(_text(extra["scope_key_file"], "scope_key_file")),
                                                      "scope_key_file"))
    raise SettingError(f"{WHERE}: unknown {', '.join(sorted(keys))}; expected \"config\" or \"dev\"")


def settings_from_file(path: str | os.PathLike[str]) -> ConnectorSettings:
    """``[tls]`` and ``[vllm]`` of the kvsp-quic TOML file at *path* (relative paths: from its directory)."""
    where = f"{WHERE}: config {os.fspath(path)!r}"
    doc = read_toml(path, where, SettingError)
    root = Path(path).resolve().parent
    tls, section = doc.get("tls"), doc.get("vllm")
    if not isinstance(tls, dict):
        raise SettingError(f"{where}: [tls] with ca, cert and key is required")
    if not isinstance(section, dict):
        raise SettingError(f"{where}: [vllm] is required (index, holders, scope_key_file)")
    for name, table, known in (("tls", tls, TLS_KEYS), ("vllm", section, VLLM_KEYS)):
        unknown = set(table) - known
        if unknown:
            raise SettingError(f"{where}: {name}.{sorted(unknown)[0]}: unknown key (known: {', '.join(sorted(known))})")
    missing = sorted(TLS_KEYS - set(tls))
    if missing:
        raise SettingError(f"{where}: tls.{missing[0]} is required")
    for name in ("index", "scope_key_file"):
        if name not in section:
            raise SettingError(f"{where}: vllm.{name} is required")

    def path_of(value: Any, name: str) -> Path:
        p = Path(_text(value, name, where))
        return p if p.is_absolute() else root / p

    files = _tls(lambda: TlsFiles.of(*(path_of(tls[k], f"tls.{k}") for k in ("ca", "cert", "key"))), "tls", where)
    options: dict[str, Any] = {}
    for name in ("transport", "lease_ttl_ms", "publish", "timeout_ms"):
        if name in section:
            options[name] = section[name]
    if "publish" in options and not isinstance(options["publish"], bool):
        raise SettingError(f"{where}: vllm.publish: true or false")
    try:
        return ConnectorSettings(tls=files, index=_uris(section["index"], "vllm.index", where),
                                 holders=_uris(section.get("holders", []), "vllm.holders", where),
                                 scope_key=_scope_key(path_of(section["scope_key_file"], "vllm.scope_key_file"),
                                                      "vllm.scope_key_file", where), **options)
    except SettingError as exc:
        raise SettingError(str(exc).replace(f"{WHERE}: ", f"{where}: vllm.", 1)) from None


def _text(value: Any, name: str, where: str = WHERE) -> str:
    if not isinstance(value, str) or not value:
        raise SettingError(f"{where}: {name}: a non-empty string, not {value!r}")
    return value


def _uris(value: Any, name: str, where: str = WHERE) -> tuple[str, ...]:
    try:
        return tuple(base_uris(value, name))
    except RecordError as exc:
        raise SettingError(f"{where}: {exc.detail}") from None


def _tls(make: Any, name: str, where: str = WHERE) -> TlsFiles:
    try:
        files: TlsFiles = make()
    except TlsConfigError as exc:
        raise SettingError(f"{where}: {name}: {exc}") from None
    return files


def _scope_key(path: Path, name: str, where: str = WHERE) -> bytes:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise SettingError(f"{where}: {name}: cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    try:
        return scope_key_of_file(raw)
    except KeyInputError as exc:
        raise SettingError(f"{where}: {name} {os.fspath(path)!r}: {exc.detail}") from None


__all__ = ["ConnectorSettings", "SettingError", "settings_from_extra", "settings_from_file"]
