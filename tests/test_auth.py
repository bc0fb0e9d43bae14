from __future__ import annotations

from pathlib import Path

import pytest

from kvsp_quic import auth
from kvsp_quic.auth import ALL, Policy, PolicyError, Principal, Role
from kvsp_quic.problems import Forbidden, ScopeDenied

H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example:8443/kvsp/"
RELAY = "moqt://relay.example:4443/"
PC = "https://pc.example/"
ALICE = "urn:kvsp:client:alice"
S1 = "00112233445566778899aabbccddeeff"
S2 = "ffeeddccbbaa99887766554433221100"

EXAMPLE = f"""
# the README's example
[defaults]
roles = ["client"]
scopes = ["{S1}"]

[[principal]]
identity = "{H1}"
roles = ["holder"]
scopes = ["*"]
publish_for = ["{RELAY}"]

[[principal]]
identity = "{H2}"
roles = ["holder", "instance"]
scopes = ["{S1}", "{S2}"]

[[principal]]
identity = "{PC}"
roles = ["controller"]
scopes = "*"

[[principal]]
identity = "{ALICE}"
"""


def _policy(text: str) -> Policy:
    return Policy.loads(text, source="policy 'p.toml'")


def _one(extra: str = "", identity: str = ALICE, roles: str = '["client"]') -> str:
    return f'[[principal]]\nidentity = "{identity}"\nroles = {roles}\n{extra}\n'


def test_load_the_example(tmp_path: Path) -> None:
    path = tmp_path / "policy.toml"
    path.write_text(EXAMPLE)
    policy = Policy.load(path)
    assert len(policy) == 4 and policy.source == f"policy {str(path)!r}"
    h1 = policy.principal(H1)
    assert h1 == Principal(H1, frozenset({Role.HOLDER}), ALL, frozenset({RELAY}))
    h2 = policy.principal(H2)
    assert h2 is not None and h2.roles == {Role.HOLDER, Role.INSTANCE}
    assert h2.scopes == {bytes.fromhex(S1), bytes.fromhex(S2)} and h2.publish_for == frozenset()
    pc = policy.principal(PC)
    assert pc is not None and pc.scopes is ALL
    alice = policy.principal(ALICE)  # everything from [defaults]
    assert alice == Principal(ALICE, frozenset({Role.CLIENT}), frozenset({bytes.fromhex(S1)}))
    assert policy.principal("urn:kvsp:client:eve") is None and policy.principal(None) is None
    with pytest.raises(TypeError):
        policy.principals[ALICE] = alice  # type: ignore[index]


def test_from_dict_and_defaults_are_optional() -> None:
    policy = Policy.from_dict({"principal": [{"identity": ALICE, "roles": ["client"]}]})
    alice = policy.principal(ALICE)
    assert alice is not None and alice.scopes == frozenset() and alice.publish_for == frozenset()
    assert Policy.from_dict({"principal": [{"identity": H1, "roles": ["holder"], "publish_for": "*"}]}) \
        .principals[H1].publish_for is ALL
    assert Policy.from_dict({"principal": [{"identity": H1, "roles": ["holder"], "scopes": ["*"]}]}) \
        .principals[H1].scopes is ALL


def test_dev_policy() -> None:
    policy = Policy.dev([H1, ALICE, H1])
    assert len(policy) == 2
    for identity in (H1, ALICE):
        p = policy.principal(identity)
        assert p is not None and p.roles == set(Role) and p.scopes is ALL and p.publish_for is ALL
        auth.require_scope(p, bytes(16))
        auth.require_role(p, Role.INDEX)
    with pytest.raises(ValueError, match="at least one identity"):
        Policy.dev([])
    with pytest.raises(PolicyError, match=r"dev policy: principal\[0\]\.identity"):
        Policy.dev(["not a uri"])


@pytest.mark.parametrize(("text", "message"), [
    ("version = 1\n" + _one(), "policy 'p.toml': version: unknown key (allowed: defaults, principal)"),
    ("[defaults]\nroles = ['client']\npublish_for = []\n" + _one(),
     "policy 'p.toml': defaults.publish_for: unknown key (allowed: roles, scopes)"),
    ("defaults = 3\n" + _one(), "policy 'p.toml': defaults: must be a table, not a number"),
    (_one("colour = 'red'"), "principal[0].colour: unknown key (allowed: identity, roles, scopes, publish_for, "
     "api_keys, max_concurrent, tokens_per_minute)"),
    ("", "principal: no [[principal]] tables"),
    ("principal = []", "principal: no [[principal]] tables"),
    ("[principal]\nidentity = 'x:y'", "principal: must be an array of tables ([[principal]]), not a table"),
    ("principal = [1]", "principal[0]: must be a table, not a number"),
    ("[[principal]]\nroles = ['client']", "principal[0].identity: required key is missing"),
    ("[[principal]]\nidentity = 'x:y'", "principal[0].roles: required key is missing (and [defaults] has no roles)"),
    (_one(roles='["holdr"]'), "principal[0].roles[0]: unknown role 'holdr' (one of: index, holder, controller,"),
    (_one(roles='[]'), "principal[0].roles: must list at least one role"),
    (_one(roles='"client"'), "principal[0].roles: must be an array of strings, not a string"),
    (_one(roles='["client", 1]'), "principal[0].roles[1]: must be a string, not a number"),
    (_one(roles='["client", "client"]'), "principal[0].roles[1]: 'client' is listed twice"),
    ("[defaults]\nroles = ['nobody']\n" + _one(), "defaults.roles[0]: unknown role 'nobody'"),
    ("[defaults]\nscopes = ['xx']\n" + _one(), "defaults.scopes[0]: 'xx' is not a scope_id"),
    (_one(f'scopes = ["{S1.upper()}"]'), "principal[0].scopes[0]: '00112233445566778899AABBCCDDEEFF' is not a"),
    (_one(f'scopes = ["{S1}00"]'), "principal[0].scopes[0]: '00112233445566778899aabbccddeeff00' is not a "
                                   "scope_id (32 lowercase hex characters)"),
    (_one(f'scopes = ["*", "{S1}"]'), 'principal[0].scopes: "*" means all and cannot be combined'),
    (_one(f'scopes = ["{S1}", "{S1}"]'), "principal[0].scopes[1]: '00112233445566778899aabbccddeeff' is listed"),
    (_one("scopes = 7"), "principal[0].scopes: must be an array of strings, not a number"),
    (_one(identity="", roles='["client"]'), "principal[0].identity: must not be empty"),
    ("[[principal]]\nidentity = 3\nroles = ['client']", "principal[0].identity: must be a string, not a number"),
    (_one(identity="alice"), "principal[0].identity: 'alice' is not an absolute URI"),
    (_one(identity="urn:kvsp:client:a b"), "principal[0].identity: 'urn:kvsp:client:a b' contains whitespace"),
    (_one(identity="https://h1.example/kvsp", roles='["holder"]'),
     "policy 'p.toml': principal[0].identity: a base URI must end with '/'"),
    (_one(identity="https://h1.example/kvsp/?x=1", roles='["holder"]'), "principal[0].identity: a base URI has no"),
    (_one(identity=ALICE) + _one(identity=H1, roles='["holder"]') + _one(identity=ALICE),
     f"principal[2].identity: {ALICE!r} is already listed at principal[0]"),
    (_one(f'publish_for = ["{H2}"]'), "principal[0].publish_for: only a principal with the holder role publishes"),
    (_one('publish_for = "*"'), "principal[0].publish_for: only a principal with the holder role publishes"),
    (_one('publish_for = ["ftp://x/"]', identity=H1, roles='["holder"]'),
     "principal[0].publish_for[0]: scheme must be https or moqt, got 'ftp'"),
    (_one('publish_for = ["https://h2.example"]', identity=H1, roles='["holder"]'),
     "principal[0].publish_for[0]: a base URI must end with '/'"),
    (_one(f'publish_for = ["{H2}", "*"]', identity=H1, roles='["holder"]'),
     'principal[0].publish_for: "*" means all and cannot be combined'),
    ("[[principal]\n", "policy 'p.toml': not valid TOML ("),
    (_one() + "roles = ['client']", "policy 'p.toml': not valid TOML (Cannot overwrite a value"),
])
def test_every_error_is_one_line_naming_the_file_and_key(text: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        _policy(text)
    text_of = str(info.value)
    assert message in text_of and "\n" not in text_of
    assert text_of.startswith("policy 'p.toml': ")


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    with pytest.raises(PolicyError, match=r"cannot read policy '.*missing\.toml': No such file"):
        Policy.load(missing)
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe = 1")
    with pytest.raises(PolicyError, match=r"policy '.*bad\.toml': not valid TOML"):
        Policy.load(bad)
    bad.write_text(_one(roles='["root"]'))
    with pytest.raises(PolicyError, match=r"policy '.*bad\.toml': principal\[0\]\.roles\[0\]: unknown role 'root'"):
        Policy.load(bad)


def test_principal_constructor_rejects_misuse() -> None:
    with pytest.raises(ValueError, match="identity"):
        Principal("", frozenset({Role.CLIENT}))
    with pytest.raises(ValueError, match="Role values"):
        Principal(ALICE, frozenset({"client"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="16-octet"):
        Principal(ALICE, frozenset({Role.CLIENT}), frozenset({b"short"}))  # type: ignore[arg-type]


# -- checks ------------------------------------------------------------------------------------------------------


@pytest.fixture
def policy() -> Policy:
    return _policy(EXAMPLE)


def _get(policy: Policy, identity: str) -> Principal:
    p = policy.principal(identity)
    assert p is not None
    return p


def test_require_role(policy: Policy) -> None:
    h2 = _get(policy, H2)
    auth.require_role(h2, Role.HOLDER)
    auth.require_role(h2, "instance")
    auth.require_role(h2, Role.INDEX, Role.INSTANCE)  # any one of them is enough
    assert h2.has_role("holder") and not h2.has_role(Role.CONTROLLER)
    with pytest.raises(Forbidden) as info:
        auth.require_role(h2, Role.CONTROLLER)
    exc = info.value
    assert exc.status == 403 and exc.type_uri == "about:blank"
    assert exc.detail == f"identity {H2!r} needs the role controller (it has: holder, instance)"
    with pytest.raises(Forbidden, match="needs one of the roles index, controller"):
        auth.require_role(_get(policy, ALICE), Role.INDEX, "controller")
    with pytest.raises(ValueError, match="at least one role"):
        auth.require_role(h2)
    with pytest.raises(ValueError, match="unknown role 'root'"):
        auth.require_role(h2, "root")


def test_require_scope(policy: Policy) -> None:
    s1, s2 = bytes.fromhex(S1), bytes.fromhex(S2)
    alice = _get(policy, ALICE)
    auth.require_scope(alice, s1)
    auth.require_scope(alice, bytearray(s1))
    with pytest.raises(ScopeDenied) as info:
        auth.require_scope(alice, s2)
    exc = info.value
    assert exc.status == 403 and exc.type_uri == "https://iana.org/assignments/kvsp#kvsp-scope-denied"
    assert exc.detail == f"identity {ALICE!r} is not authorized for scope {S2}"
    auth.require_scope(_get(policy, H1), s2)  # "*"
    auth.require_scope(_get(policy, H2), s2)
    with pytest.raises(ValueError, match="16 octets"):
        auth.require_scope(_get(policy, H1), b"\x00" * 32)


def test_publish_for(policy: Policy) -> None:
    h1, h2, alice, pc = (_get(policy, i) for i in (H1, H2, ALICE, PC))
    assert auth.may_publish_for(h1, H1) and auth.may_publish_for(h1, RELAY)  # itself, and what it lists
    assert not auth.may_publish_for(h1, H2)
    assert not auth.may_publish_for(h1, H1.rstrip("/"))  # URIs compare exactly
    assert auth.may_publish_for(h2, H2) and not auth.may_publish_for(h2, H1)
    assert not auth.may_publish_for(alice, ALICE) and not auth.may_publish_for(pc, PC)  # only holders publish
    auth.require_publish_for(h1, RELAY)
    with pytest.raises(Forbidden, match=f"identity {H1!r} may not publish replicas for holder {H2!r}") as info:
        auth.require_publish_for(h1, H2)
    assert info.value.status == 403 and info.value.type_uri == "about:blank"
    with pytest.raises(Forbidden, match="is not a holder and may not publish replicas"):
        auth.require_publish_for(pc, PC)
    anyone = Policy.from_dict({"principal": [{"identity": H1, "roles": ["holder"], "publish_for": ["*"]}]})
    assert auth.may_publish_for(_get(anyone, H1), "https://elsewhere.example/")


def test_the_readme_example_is_valid() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("### The policy file", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    policy = Policy.loads(block, source="README")
    alice = policy.principal(ALICE)
    assert len(policy) == 5 and alice is not None and alice.roles == {Role.CLIENT} and alice.scopes == frozenset()
    holder = _get(policy, "https://127.0.0.1:8444/kvsp/")
    assert auth.may_publish_for(holder, "moqt://127.0.0.1:8444/")
    auth.require_scope(holder, bytes.fromhex("6d1c6481cd428737da312c089db3832a"))


def test_dev_ca_policy_gives_every_verified_identity_every_right() -> None:
    from kvsp_quic.auth import ALL, Policy, Role

    policy = Policy.dev_ca()
    who = policy.principal("https://127.0.0.1:4433/")
    assert who is not None and who.roles == frozenset(Role) and who.scopes is ALL and who.publish_for is ALL
    assert policy.principal(None) is None  # still nobody without a verified identity
    assert not Policy.from_dict({"principal": [{"identity": "urn:kvsp:client:a", "roles": ["client"]}]}).principal(
        "urn:kvsp:client:b")
