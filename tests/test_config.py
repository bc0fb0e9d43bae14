from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from kvsp_app.config import (
    ConfigError,
    FrontendFile,
    HolderFile,
    IndexFile,
    InstanceFile,
    RelayFile,
    ServerSection,
    TlsSection,
    build,
    host_port,
    load,
    options_of,
    replace,
)
from kvsp_quic.frontend import FrontendOptions
from kvsp_quic.roles.controller import ControllerConfig
from kvsp_quic.roles.holder import HolderOptions, HolderSettings
from kvsp_quic.roles.instance import InstanceOptions, ServiceOptions
from kvsp_quic.roles.leases import LeaseLimits
from kvsp_quic.samples import example_descriptor
from kvsp_quic.storage.tiers import LocalStorageConfig, LocalStorageOptions


@dataclass(frozen=True)
class Inner:
    size: int = 1
    ratio: float = 0.5


@dataclass(frozen=True)
class Sample:
    server: ServerSection
    tls: TlsSection
    mode: Literal["memory", "redis"] = "memory"
    names: list[str] = field(default_factory=list)
    inner: Inner = field(default_factory=Inner)
    knobs: dict[str, int] = field(default_factory=dict)
    flag: bool = False


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


BASE = '[server]\nlisten = "127.0.0.1:8443"\n[tls]\nca = "pki/ca.pem"\ncert = "/abs/c.pem"\nkey = "k.key"\n'


def test_a_full_file(tmp_path: Path) -> None:
    cfg = load(Sample, write(tmp_path, 'mode = "redis"\nnames = ["a"]\n'
                             'flag = true\n' + BASE + "[inner]\nsize = 4\nratio = 2\n[knobs]\nstream_window = 7\n"))
    assert cfg.mode == "redis" and cfg.names == ["a"] and cfg.flag is True
    assert cfg.inner == Inner(4, 2.0) and cfg.knobs == {"stream_window": 7}
    assert cfg.tls.ca == tmp_path / "pki" / "ca.pem" and cfg.tls.cert == Path("/abs/c.pem")  # relative to the file
    assert cfg.server.address() == ("127.0.0.1", 8443) and cfg.server.uri_for(8443) == "https://127.0.0.1:8443/"


@pytest.mark.parametrize(("text", "message"), [
    ("colour = 1\n" + BASE, "colour: unknown key"),
    (BASE + "[inner]\nsize = 4\nshape = 1\n", "inner.shape: unknown key"),
    (BASE + "[inner]\nsize = true\n", "inner.size: must be an integer"),
    (BASE + "[inner]\nratio = 'x'\n", "inner.ratio: must be a number"),
    ('mode = "disk"\n' + BASE, "mode: must be one of 'memory', 'redis'"),
    ("names = 'a'\n" + BASE, "names: must be an array"),
    ("names = [1]\n" + BASE, "names[0]: must be a string"),
    ("flag = 1\n" + BASE, "flag: must be true or false"),
    (BASE + "colour = 1\n", "tls.colour: unknown key"),
    ('[server]\nlisten = "x"\n[tls]\nca = "a"\ncert = "b"\nkey = "c"\n', "expected HOST:PORT"),
    ('[server]\nbase_uri = "http://x/"\n[tls]\nca = "a"\ncert = "b"\nkey = "c"\n', "scheme must be https"),
    ('[server]\n[tls]\nca = "a"\ncert = "b"\n', "tls.key: required key is missing"),
    ("[server\n", "not valid TOML"),
])
def test_errors_name_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(Sample, path)
    assert message in str(info.value) and str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_and_build(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(Sample, tmp_path / "nope.toml")
    assert build(ServerSection, {"listen": "[::1]:0"}).address() == ("::1", 0)
    assert host_port("localhost:1") == ("localhost", 1)
    assert ServerSection(listen="[::1]:9").uri_for(9) == "https://[::1]:9/"


# -- the role sections: each is its role's settings, validated by the role ------------------------------------------


@pytest.mark.parametrize(("cls", "obj", "message"), [
    (IndexFile, {"controller": {"tick_ms": 0}}, "controller.tick_ms: must be positive"),
    (IndexFile, {"controller": {"sleep_max_kv_utilization": 2}}, "controller.sleep_max_kv_utilization: must be in"),
    (IndexFile, {"index": {"max_lookup_keys": 0}}, "index.max_lookup_keys: must be positive"),
    (IndexFile, {"index": {"lookup_cache_records": -1}}, "index.lookup_cache_records: must be 0 to 16777216"),
    (HolderFile, {"holder": {"replica_ttl_ms": 0}}, "holder.replica_ttl_ms: must be positive"),
    (HolderFile, {"holder": {"eviction": "mru"}}, "holder.eviction: unknown eviction policy 'mru'"),
    (HolderFile, {"holder": {"index": "http://is.example/"}}, "holder.index: "),
    (HolderFile, {"holder": {"leases": {"max_ttl_ms": 0}}}, "holder.leases.max_ttl_ms: must be positive"),
    (HolderFile, {"holder": {"local_storage": {"path": "d", "capacity": 0}}},
     "holder.local_storage.capacity: must be positive"),
    (InstanceFile, {"instance": {"load_timeout_ms": 0}}, "instance.load_timeout_ms: must be positive"),
    (InstanceFile, {"instance": {"max_queued": -1}}, "instance.max_queued: must not be negative"),
    (InstanceFile, {"instance": {"prefer_transport": "udp"}}, "instance.prefer_transport: 'h3' or 'tcp'"),
    (RelayFile, {"relay": {"upstream_timeout_ms": 0}}, "relay.upstream_timeout_ms: must be positive"),
    (RelayFile, {"relay": {"cache_bytes": -1}}, "relay.cache_bytes: must not be negative"),
    (RelayFile, {"relay": {"open_prefixes": ["kvsp-1/x"]}}, "relay.open_prefixes[0]: 'kvsp-1/x' is not a namespace"),
    (FrontendFile, {"frontend": {"failover_timeout_ms": 0}}, "frontend.failover_timeout_ms: must be positive"),
    (FrontendFile, {"frontend": {"failover_timeout_s": 30}},
     "frontend.failover_timeout_s: renamed: write frontend.failover_timeout_ms"),
])
def test_the_roles_check_their_sections(cls: type[Any], obj: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(cls, obj, source="config 'x.toml'")
    assert str(info.value).startswith(f"config 'x.toml': {message}")


def test_sections_are_the_roles_settings(tmp_path: Path) -> None:
    cfg = build(HolderFile, {"holder": {"replica_ttl_ms": 9000, "publish_backoff_ms": [10, 20],
                                        "leases": {"max_keys_per_lease": 7},
                                        "local_storage": {"path": "blocks", "capacity": 1 << 20}}}, root=tmp_path)
    assert isinstance(cfg.holder, HolderOptions) and cfg.holder.leases == LeaseLimits(max_keys_per_lease=7)
    assert cfg.holder.publish_backoff_s == (0.01, 0.02)
    local = cfg.holder.local_storage
    assert local is not None and local.path == tmp_path / "blocks"
    storage = LocalStorageConfig(**options_of(local, LocalStorageOptions), encryption_key=bytes(32))
    settings = HolderSettings("https://h.example/", (example_descriptor(),), local_storage=storage,
                              **options_of(cfg.holder, HolderOptions))
    assert settings.replica_ttl_ms == 9000 and settings.leases.max_keys_per_lease == 7
    assert build(IndexFile, {}).controller == ControllerConfig()
    instance = build(InstanceFile, {"instance": {"sleep_after_idle_ms": 1500, "request_timeout_ms": 250}}).instance
    assert isinstance(instance, InstanceOptions) and isinstance(instance, ServiceOptions)
    assert instance.sleep_after_idle_s == 1.5 and instance.request_timeout_s == 0.25
    frontend = build(FrontendFile, {"frontend": {"failover_timeout_ms": 2500}}).frontend
    assert isinstance(frontend, FrontendOptions) and frontend.failover_timeout_s == 2.5
    with pytest.raises(TypeError):
        options_of(frontend, HolderOptions)


def test_overrides_are_checked_like_the_file() -> None:
    section = build(HolderFile, {}).holder
    assert replace(section, "holder", replica_ttl_ms=5).replica_ttl_ms == 5
    with pytest.raises(ConfigError, match=r"^holder\.replica_ttl_ms: must be positive$"):
        replace(section, "holder", replica_ttl_ms=0)
    with pytest.raises(ConfigError, match=r"^holder\.index: "):
        replace(section, "holder", index="ftp://x/")


_DURATION = re.compile(r"(ttl|timeout|interval|retention|deadline|backoff|idle|retry|tick|grace|poll|stall)")


def _keys(cls: type[Any], path: str) -> list[str]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        out.append(f"{path}.{f.name}")
        for arg in (hints[f.name], *typing.get_args(hints[f.name])):
            if dataclasses.is_dataclass(arg):
                out.extend(_keys(arg, f"{path}.{f.name}"))  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("cls", [IndexFile, HolderFile, RelayFile, InstanceFile, FrontendFile])
def test_one_unit_per_quantity(cls: type[Any]) -> None:
    """Every duration a file can say is in milliseconds, and its key says so."""
    for where in _keys(cls, cls.__name__):
        name = where.rpartition(".")[2]
        if _DURATION.search(name):
            assert name.endswith("_ms"), f"{where}: a duration in milliseconds is named *_ms"
        assert name.endswith("_per_s") or not name.endswith("_s"), f"{where}: durations are milliseconds"
