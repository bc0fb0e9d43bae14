"""Authorization: authenticated identities -> roles, scopes and the holders a principal may publish for.

The identity of a request is the single SAN URI of the verified client certificate (``quic.tls.scope_identity``
extracts it); this module works on that string only and does no I/O beyond reading the policy file. A policy
file (TOML) lists the principals::

    [defaults]                      # optional; a principal that omits a key takes it from here
    roles = ["client"]
    scopes = []

    [[principal]]
    identity = "https://h1.example/kvsp/"         # the certificate's SAN URI, exactly
    roles = ["holder"]                             # index, holder, controller, instance, client
    scopes = ["*"]                                 # "*" (every scope) or scope_ids in lowercase hex
    publish_for = ["moqt://relay.example:4443/"]   # more holders it may publish replicas for ("*": any)

    [[principal]]                                  # a user of the OpenAI-compatible front end
    identity = "urn:kvsp:user:alice"               # any absolute URI names a principal that has no certificate
    roles = ["client"]
    scopes = ["*"]
    api_keys = ["sha256:2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae"]
    max_concurrent = 4                             # requests in flight at the front end (429 beyond)
    tokens_per_minute = 20000                      # prompt + completion tokens per sliding minute (429 beyond)

``api_keys`` lists the SHA-256 of each key (``sha256:`` and 64 lowercase hex characters: ``printf %s "$KEY" |
sha256sum``), never a key: the front end hashes the ``Authorization: Bearer`` key of a request and looks the hash
up (:meth:`Policy.by_api_key`). A hash may belong to one principal only. ``max_concurrent`` and
``tokens_per_minute`` bound what the front end admits for the principal; absent: no limit.
Only the front end reads keys and limits; every KVSP role authenticates by certificate alone.

Every key is checked; unknown keys, unknown roles, malformed scope ids and URIs, duplicate identities and
duplicate list entries raise :class:`PolicyError` with one line naming the file and the key. docs/wire.md
("Authorization") records the decisions.

The checks raise the protocol's problem types: a missing role is :class:`~kvsp_quic.problems.Forbidden` (403,
``about:blank``), a missing scope :class:`~kvsp_quic.problems.ScopeDenied` (403 ``kvsp-scope-denied``).
"""

from __future__ import annotations

import enum
import hashlib
import os
import re
import secrets
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, TypeAlias
from urllib.parse import urlsplit

from kvsp_quic import fields as f
from kvsp_quic.fields import ScopeId
from kvsp_quic.problems import Forbidden, ScopeDenied
from kvsp_quic.tomlfile import read_toml


class Role(enum.StrEnum):
    INDEX = "index"
    HOLDER = "holder"
    CONTROLLER = "controller"  # the Placement Controller
    INSTANCE = "instance"
    CLIENT = "client"


class _All(enum.Enum):
    """The wildcard ``"*"``: every scope, or (in ``publish_for``) every holder."""

    ALL = "*"

    def __repr__(self) -> str:
        return "ALL"


ALL: Final = _All.ALL
Scopes: TypeAlias = frozenset[ScopeId] | Literal[_All.ALL]
Holders: TypeAlias = frozenset[str] | Literal[_All.ALL]

SCOPE_ID_SIZE = 16
_LIMIT_KEYS = ("max_concurrent", "tokens_per_minute")
_PRINCIPAL_KEYS = ("identity", "roles", "scopes", "publish_for", "api_keys", *_LIMIT_KEYS)
_DEFAULT_KEYS = ("roles", "scopes")
API_KEY_HASH_PREFIX = "sha256:"
_API_KEY_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")


def api_key_hash(key: str) -> str:
    """How a policy file records an API key: ``sha256:`` and the SHA-256 of its UTF-8 octets in lowercase hex."""
    return API_KEY_HASH_PREFIX + hashlib.sha256(key.encode("utf-8")).hexdigest()


def new_api_key() -> str:
    """A fresh API key: ``kvsp-`` and 256 random bits (base64url)."""
    return "kvsp-" + secrets.token_urlsafe(32)
_TOP_KEYS = ("defaults", "principal")


class PolicyError(ValueError):
    """The policy file or object is invalid; the message is one line naming the file and the key."""


@dataclass(frozen=True)
class Principal:
    """What one authenticated identity may do."""

    identity: str
    roles: frozenset[Role]
    scopes: Scopes = frozenset()
    publish_for: Holders = frozenset()
    api_keys: frozenset[str] = frozenset()  # hashes (api_key_hash), never keys
    max_concurrent: int | None = None  # front end: requests in flight (None: no limit)
    tokens_per_minute: int | None = None  # front end: prompt + completion tokens per sliding minute

    def __post_init__(self) -> None:
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError("Principal.identity must be a non-empty string")
        if not all(isinstance(r, Role) for r in self.roles):
            raise ValueError(f"Principal.roles must be Role values, got {sorted(map(str, self.roles))}")
        if self.scopes is not ALL and any(len(s) != SCOPE_ID_SIZE for s in self.scopes):
            raise ValueError("Principal.scopes must be 16-octet scope ids or ALL")
        if any(not _API_KEY_HASH_RE.fullmatch(h) for h in self.api_keys):
            raise ValueError("Principal.api_keys must be hashes ('sha256:' and 64 lowercase hex characters)")
        for name in _LIMIT_KEYS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Principal.{name} must be a positive integer or None")

    def has_role(self, *roles: Role | str) -> bool:
        """True when the principal has at least one of *roles*."""
        return not self.roles.isdisjoint(parse_roles(roles))

    def has_scope(self, scope_id: bytes) -> bool:
        if len(scope_id) != SCOPE_ID_SIZE:
            raise ValueError(f"a scope id has {SCOPE_ID_SIZE} octets, got {len(scope_id)}")
        return self.scopes is ALL or ScopeId(bytes(scope_id)) in self.scopes


@dataclass(frozen=True)
class Policy:
    """The principals of a deployment, by identity. Build one with :meth:`load`, :meth:`from_dict` or
    :meth:`dev`. Immutable except for :meth:`replace_with` (SIGHUP reload): apps keep the object and ask it for
    each request, so a reloaded policy applies to the next request, on new and existing connections alike."""

    principals: Mapping[str, Principal] = field(default_factory=lambda: MappingProxyType({}))
    source: str = "policy"  # where it came from, for messages
    anyone: bool = False  # --dev only: every verified identity not listed gets every right (see dev_ca)
    api_keys: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # key hash -> identity

    def principal(self, identity: str | None) -> Principal | None:
        """The principal of *identity*, or None when the identity is absent or not in the policy."""
        if identity is None:
            return None
        found = self.principals.get(identity)
        if found is None and self.anyone:
            return Principal(identity, frozenset(Role), ALL, ALL)
        return found

    def __len__(self) -> int:
        return len(self.principals)

    def by_api_key(self, key: str) -> Principal | None:
        """The principal whose ``api_keys`` list the hash of *key*, or None."""
        identity = self.api_keys.get(api_key_hash(key))
        return self.principals.get(identity) if identity is not None else None

    def replace_with(self, other: Policy) -> None:
        """Take *other*'s principals, source and keys in place (the reload of a running server's policy file).
        One attribute assignment each; a request reads :meth:`principal` once, so it sees one policy or the
        other for its identity (the event loop runs no request while this runs)."""
        for name in ("principals", "api_keys", "source", "anyone"):
            object.__setattr__(self, name, getattr(other, name))

    def with_principal(self, principal: Principal) -> Policy:
        """This policy and *principal* (its identity and key hashes must be new): ``--dev`` adds its API key so."""
        if principal.identity in self.principals:
            raise ValueError(f"{principal.identity!r} is already in the policy")
        taken = [h for h in principal.api_keys if h in self.api_keys]
        if taken:
            raise ValueError(f"the API key hash {taken[0]} is already in the policy")
        keys = {**self.api_keys, **{h: principal.identity for h in principal.api_keys}}
        return Policy(MappingProxyType({**self.principals, principal.identity: principal}), self.source,
                      self.anyone, MappingProxyType(keys))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        where = f"policy {os.fspath(path)!r}"
        obj = read_toml(path, where, PolicyError)
        return cls.from_dict(obj, source=where)

    @classmethod
    def loads(cls, text: str, *, source: str = "policy") -> Policy:
        try:
            obj = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"{source}: not valid TOML ({exc})") from None
        return cls.from_dict(obj, source=source)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], *, source: str = "policy") -> Policy:
        """A policy from the parsed TOML document (or an equivalent dict)."""
        principals = _Parser(source).policy(obj)
        keys = {h: p.identity for p in principals.values() for h in p.api_keys}
        return cls(MappingProxyType(principals), source, api_keys=MappingProxyType(keys))

    @classmethod
    def dev_ca(cls) -> Policy:
        """The policy of ``--dev`` servers: whoever holds a certificate of the dev CA -- the handshake has already
        checked that -- gets every role, every scope and may publish for any holder. Roles started with the same
        dev directory thus trust each other. Never use it outside a development setup."""
        return cls(MappingProxyType({}), "dev policy (every certificate of the dev CA)", anyone=True)

    @classmethod
    def dev(cls, identities_with_full_rights: Iterable[str]) -> Policy:
        """The quick-start policy of ``--dev`` servers: every role, every scope, publishing for any holder."""
        identities = list(dict.fromkeys(identities_with_full_rights))
        if not identities:
            raise ValueError("Policy.dev needs at least one identity")
        every_role = [r.value for r in Role]
        return cls.from_dict(
            {"principal": [{"identity": i, "roles": every_role, "scopes": "*", "publish_for": "*"}
                           for i in identities]},
            source="dev policy")


# -- checks ------------------------------------------------------------------------------------------------------


def require_role(principal: Principal, *roles: Role | str) -> None:
    """Pass when *principal* has at least one of *roles*, else raise :class:`Forbidden` (403)."""
    given = set(parse_roles(roles))
    wanted = [r for r in Role if r in given]  # in a stable order for the message
    if principal.roles.isdisjoint(wanted):
        need = f"the role {wanted[0]}" if len(wanted) == 1 else "one of the roles " + ", ".join(wanted)
        has = ", ".join(r for r in Role if r in principal.roles) or "none"
        raise Forbidden(f"identity {principal.identity!r} needs {need} (it has: {has})")


def require_scope(principal: Principal, scope_id: bytes) -> None:
    """Pass when *principal* is authorized for *scope_id* (16 octets), else raise :class:`ScopeDenied`."""
    if not principal.has_scope(scope_id):
        raise ScopeDenied(f"identity {principal.identity!r} is not authorized for scope {bytes(scope_id).hex()}")


def may_publish_for(principal: Principal, holder_uri: str) -> bool:
    """Whether *principal* may publish Replica Records naming *holder_uri* as the holder.

    Only holders publish: a holder always for its own identity, and for the holders its ``publish_for`` lists.
    URIs compare exactly, as configured (like holder-ids).
    """
    if Role.HOLDER not in principal.roles:
        return False
    return (holder_uri == principal.identity or principal.publish_for is ALL
            or holder_uri in principal.publish_for)


def require_publish_for(principal: Principal, holder_uri: str) -> None:
    if not may_publish_for(principal, holder_uri):
        if Role.HOLDER not in principal.roles:
            raise Forbidden(f"identity {principal.identity!r} is not a holder and may not publish replicas")
        raise Forbidden(f"identity {principal.identity!r} may not publish replicas for holder {holder_uri!r}")


def parse_roles(roles: Iterable[Role | str]) -> list[Role]:
    """Role names -> roles; ValueError for an unknown name or none at all (API misuse, not a policy error)."""
    out = []
    for r in roles:
        try:
            out.append(Role(r))
        except ValueError:
            raise ValueError(f"unknown role {r!r}") from None
    if not out:
        raise ValueError("at least one role is required")
    return out


# -- parsing -------------------------------------------------------------------------------------------------------


class _Parser:
    def __init__(self, source: str) -> None:
        self.source = source

    def error(self, path: str, message: str) -> PolicyError:
        return PolicyError(f"{self.source}: {path}: {message}" if path else f"{self.source}: {message}")

    def table(self, value: Any, path: str, allowed: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.error(path, f"must be a table, not {_kind(value)}")
        for key in value:
            if key not in allowed:
                where = f"{path}.{key}" if path else str(key)
                raise self.error(where, f"unknown key (allowed: {', '.join(allowed)})")
        return value

    def policy(self, obj: Mapping[str, Any]) -> dict[str, Principal]:
        top = self.table(obj, "", _TOP_KEYS)
        defaults = self.table(top.get("defaults", {}), "defaults", _DEFAULT_KEYS)
        default_roles = self.roles(defaults["roles"], "defaults.roles") if "roles" in defaults else None
        default_scopes: Scopes = (self.scopes(defaults["scopes"], "defaults.scopes") if "scopes" in defaults
                                  else frozenset())
        key_at: dict[str, int] = {}
        entries = top.get("principal")
        if entries is None:
            raise self.error("principal", "no [[principal]] tables: the policy would deny every request")
        if not isinstance(entries, list):
            raise self.error("principal", f"must be an array of tables ([[principal]]), not {_kind(entries)}")
        if not entries:
            raise self.error("principal", "no [[principal]] tables: the policy would deny every request")
        out: dict[str, Principal] = {}
        first_at: dict[str, int] = {}
        for i, entry in enumerate(entries):
            path = f"principal[{i}]"
            t = self.table(entry, path, _PRINCIPAL_KEYS)
            if "identity" not in t:
                raise self.error(f"{path}.identity", "required key is missing")
            identity = self.identity(t["identity"], f"{path}.identity")
            if identity in first_at:
                raise self.error(f"{path}.identity",
                                 f"{identity!r} is already listed at principal[{first_at[identity]}]")
            first_at[identity] = i
            if "roles" in t:
                roles = self.roles(t["roles"], f"{path}.roles")
            elif default_roles is not None:
                roles = default_roles
            else:
                raise self.error(f"{path}.roles", "required key is missing (and [defaults] has no roles)")
            scopes = self.scopes(t["scopes"], f"{path}.scopes") if "scopes" in t else default_scopes
            publish_for = self.publish_for(t.get("publish_for", []), f"{path}.publish_for")
            if (publish_for is ALL or publish_for) and Role.HOLDER not in roles:
                raise self.error(f"{path}.publish_for", "only a principal with the holder role publishes replicas")
            api_keys = self.api_keys(t.get("api_keys", []), f"{path}.api_keys")
            for h in api_keys:
                if h in key_at:
                    raise self.error(f"{path}.api_keys", f"the hash {h} is already listed at principal[{key_at[h]}]")
                key_at[h] = i
            limits = {name: self.limit(t[name], f"{path}.{name}") for name in _LIMIT_KEYS if name in t}
            out[identity] = Principal(identity, roles, scopes, publish_for, api_keys, **limits)
        return out

    def api_keys(self, value: Any, path: str) -> frozenset[str]:
        items = self.strings(value, path)
        for i, text in enumerate(items):
            if not _API_KEY_HASH_RE.fullmatch(text):
                raise self.error(f"{path}[{i}]", "must be the SHA-256 of a key ('sha256:' and 64 lowercase hex "
                                                 "characters), never the key itself")
        return frozenset(items)

    def limit(self, value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(path, f"must be an integer, not {_kind(value)}")
        if value < 1:
            raise self.error(path, "must be positive")
        return value

    def strings(self, value: Any, path: str) -> list[str]:
        if not isinstance(value, list):
            raise self.error(path, f"must be an array of strings, not {_kind(value)}")
        seen: set[str] = set()
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.error(f"{path}[{i}]", f"must be a string, not {_kind(item)}")
            if item in seen:
                raise self.error(f"{path}[{i}]", f"{item!r} is listed twice")
            seen.add(item)
        return value

    def roles(self, value: Any, path: str) -> frozenset[Role]:
        items = self.strings(value, path)
        if not items:
            raise self.error(path, "must list at least one role")
        out = set()
        for i, name in enumerate(items):
            try:
                out.add(Role(name))
            except ValueError:
                raise self.error(f"{path}[{i}]", f"unknown role {name!r} (one of: {', '.join(Role)})") from None
        return frozenset(out)

    def wildcard_or_list(self, value: Any, path: str) -> list[str] | None:
        """``"*"`` or ``["*"]`` -> None (everything); otherwise the list, in which "*" must not appear."""
        if value == "*":
            return None
        items = self.strings(value, path)
        if "*" in items:
            if len(items) > 1:
                raise self.error(path, '"*" means all and cannot be combined with other entries')
            return None
        return items

    def scopes(self, value: Any, path: str) -> Scopes:
        items = self.wildcard_or_list(value, path)
        if items is None:
            return ALL
        out = set()
        for i, text in enumerate(items):
            where = f"{path}[{i}]"
            try:
                out.add(f.scope_id(text, where))
            except f.RecordError:
                raise self.error(where, f"{text!r} is not a scope_id (32 lowercase hex characters)") from None
        return frozenset(out)

    def publish_for(self, value: Any, path: str) -> Holders:
        items = self.wildcard_or_list(value, path)
        if items is None:
            return ALL
        for i, uri in enumerate(items):
            try:
                f.base_uri(uri, f"{path}[{i}]", schemes=("https", "moqt"))
            except f.RecordError as exc:
                raise PolicyError(f"{self.source}: {exc.detail}") from None
        return frozenset(items)

    def identity(self, value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise self.error(path, f"must be a string, not {_kind(value)}")
        if not value:
            raise self.error(path, "must not be empty")
        if any(ch.isspace() or ord(ch) < 0x20 or ord(ch) == 0x7F for ch in value):
            raise self.error(path, f"{value!r} contains whitespace or control characters")
        try:
            scheme = urlsplit(value).scheme
        except ValueError:
            scheme = ""
        if not scheme or not value.startswith(scheme + ":"):
            raise self.error(path, f"{value!r} is not an absolute URI (a certificate's SAN URI)")
        if scheme == "https":  # a role's identity is its base URI
            try:
                f.base_uri(value, path)
            except f.RecordError as exc:
                raise PolicyError(f"{self.source}: {exc.detail}") from None
        return value


def _kind(value: Any) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, int | float):
        return "a number"
    return type(value).__name__
