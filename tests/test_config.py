from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from kvsp_quic.app.config import ConfigError, ServerSection, TlsSection, build, host_port, load


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
