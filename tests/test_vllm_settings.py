"""The vLLM connector's configuration (kvsp_vllm.settings, issue 27 point 1): both forms of
``kv_connector_extra_config``, and one line naming the setting for every bad or missing one. Needs no vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsp_dev import pki
from kvsp_vllm.settings import SettingError, settings_from_extra

KEY_HEX = "ab" * 32
INDEX = "https://127.0.0.1:4433/"
HOLDER = "https://127.0.0.1:4434/"


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dev")
    pki.init(root, [pki.client("dev")])
    (root / "scope.key").write_text(KEY_HEX + "\n")
    return root


def dev_form(root: Path, **changes: object) -> dict[str, object]:
    form: dict[str, object] = {"dev": str(root), "index": [INDEX], "holders": [HOLDER],
                               "scope_key_file": str(root / "scope.key")}
    form.update(changes)
    return {k: v for k, v in form.items() if v is not None}


def test_dev_form(dev: Path) -> None:
    s = settings_from_extra(dev_form(dev))
    assert (s.index, s.holders, s.scope_key) == ((INDEX,), (HOLDER,), bytes.fromhex(KEY_HEX))
    assert (s.tls.ca, s.tls.cert, s.tls.key) == (dev / "ca.pem", dev / "dev.pem", dev / "dev.key")
    assert (s.transport, s.lease_ttl_ms, s.publish) == ("h3", 30_000, True)
    assert KEY_HEX not in repr(s)


def test_config_file_form(dev: Path, tmp_path: Path) -> None:
    (tmp_path / "key").write_bytes(bytes(range(40)))  # raw octets
    config = tmp_path / "kvsp.toml"
    config.write_text(f'[tls]\nca = "{dev / "ca.pem"}"\ncert = "{dev / "dev.pem"}"\nkey = "{dev / "dev.key"}"\n'
                      f'[vllm]\nindex = ["{INDEX}"]\nholders = ["{HOLDER}"]\nscope_key_file = "key"\n'
                      f'transport = "tcp"\nlease_ttl_ms = 5000\npublish = false\n')
    s = settings_from_extra({"config": str(config)})
    assert (s.scope_key, s.transport, s.lease_ttl_ms, s.publish) == (bytes(range(40)), "tcp", 5000, False)


@pytest.mark.parametrize(("change", "named"), [
    ({"index": None}, "missing index"),
    ({"extra": 1}, "unknown extra"),
    ({"index": ["http://x/"]}, "index[0]"),
    ({"index": []}, "index: at least one"),
    ({"holders": "https://a/,https://b/"}, "holders"),
    ({"scope_key_file": "/no/such/key"}, "scope_key_file: cannot read '/no/such/key'"),
    ({"dev": "/no/such/dir"}, "dev: '/no/such/dir' is not a directory"),
])
def test_a_bad_dev_setting_is_one_line_naming_it(dev: Path, change: dict[str, object], named: str) -> None:
    with pytest.raises(SettingError) as caught:
        settings_from_extra(dev_form(dev, **change))
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_a_short_scope_key_and_a_bad_file(dev: Path, tmp_path: Path) -> None:
    (tmp_path / "short").write_text("abcd")
    with pytest.raises(SettingError, match=r"scope_key_file .*short.*at least 32 octets"):
        settings_from_extra(dev_form(dev, scope_key_file=str(tmp_path / "short")))
    config = tmp_path / "bad.toml"
    config.write_text(f'[tls]\nca = "{dev / "ca.pem"}"\ncert = "{dev / "dev.pem"}"\nkey = "{dev / "dev.key"}"\n'
                      f'[vllm]\nindex = ["{INDEX}"]\nholders = ["{HOLDER}"]\nscope_key_file = "{dev / "scope.key"}"\n'
                      'transport = "udp"\n')
    with pytest.raises(SettingError, match=r"bad.toml'.*vllm\.transport 'udp'"):
        settings_from_extra({"config": str(config)})
    config.write_text(f'[vllm]\nindex = ["{INDEX}"]\n')
    with pytest.raises(SettingError, match=r"\[tls\] with ca, cert and key is required"):
        settings_from_extra({"config": str(config)})
    with pytest.raises(SettingError, match="empty"):
        settings_from_extra({})
