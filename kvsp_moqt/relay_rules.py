"""The MOQT relay's authorization rules, sans I/O: who may publish which namespace to the relay, and who may read
(FETCH, SUBSCRIBE) or discover (SUBSCRIBE_NAMESPACE) what. The generic asyncio relay is :mod:`moqt.relay`; these
rules are its :class:`~moqt.relay.interfaces.AccessRules` (:func:`kvsp_moqt.relay_policy.kvsp_relay`).
docs/moqt.md ("Relay") records the decisions.

Two kinds of namespace pass through a relay:

* **KVSP namespaces** (``"kvsp-1"``, compat_id hex, scope_id hex, holder-id, codec; DESIGN.md section 3). The
  fourth field names the publishing holder, so a PUBLISH_NAMESPACE is accepted only from an identity with the
  holder role that *is* that holder (``holder_id(identity) == field``) or may publish for it (a ``publish_for`` URI
  whose holder-id is the field, or ``"*"``), and that is authorized for the scope in the third field. A KVSP
  namespace published to a relay has its first four fields at least (a shorter prefix names no holder and is
  refused). Readers need a reader role (client, instance, holder: the GET rule of the holder's block resource)
  and the scope of the third field.
* **Open namespaces**: those under a prefix listed in the relay's ``open_prefixes`` (for generic MOQT traffic,
  e.g. the interop runner's ``moq-test``). Any identity in the policy may publish and read them. Empty by
  default: a relay then carries KVSP tracks only.

Anything else is refused: publishing with UNAUTHORIZED, reading with DOES_NOT_EXIST (the relay carries nothing
there, and says no more). An identity that is not in the policy gets UNAUTHORIZED for everything. Mutual TLS has
already happened: every identity here is a verified certificate's SAN URI.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsp_quic.auth import ALL, Policy, Principal, Role
from kvsp_quic.keys import holder_id
from kvsp_quic.records import NAMESPACE_TAG, KvspNamespace
from moqt.relay.interfaces import ALLOWED, Decision, Verdict, under
from moqt.types import Namespace

READERS = (Role.CLIENT, Role.INSTANCE, Role.HOLDER)


_OK = ALLOWED


def parse_prefix(text: str) -> Namespace:
    """``"moq-test"`` or ``"a/b"`` -> namespace fields (``/`` separates them; empty fields are not allowed)."""
    fields = tuple(part.encode("utf-8") for part in text.split("/"))
    if not fields or any(not f for f in fields):
        raise ValueError(f"namespace prefix {text!r}: fields separated by '/', none empty")
    return fields


def is_kvsp(namespace: Namespace) -> bool:
    return namespace[:1] == (NAMESPACE_TAG,)


def kvsp_fields_ok(namespace: Namespace) -> bool:
    """The fields a KVSP namespace has are well formed (it may stop after any of them)."""
    return KvspNamespace.parse(namespace) is not None


@dataclass(frozen=True)
class RelayRules:
    policy: Policy
    open_prefixes: tuple[Namespace, ...] = ()
    readers: tuple[Role, ...] = READERS

    @classmethod
    def of(cls, policy: Policy, open_prefixes: Sequence[str] = ()) -> RelayRules:
        return cls(policy, tuple(parse_prefix(p) for p in open_prefixes))

    def is_open(self, namespace: Namespace) -> bool:
        return any(under(namespace, p) for p in self.open_prefixes)

    def publish(self, identity: str | None, namespace: Namespace) -> Decision:
        """May *identity* publish *namespace* (PUBLISH_NAMESPACE) to the relay?"""
        principal = self.policy.principal(identity)
        if principal is None:
            return Decision(Verdict.UNAUTHORIZED, f"identity {identity!r} is not in the relay's policy")
        if is_kvsp(namespace):
            return self._publish_kvsp(principal, namespace)
        if self.is_open(namespace):
            return _OK
        return Decision(Verdict.UNAUTHORIZED, "the relay carries KVSP namespaces and its open prefixes only")

    def _publish_kvsp(self, principal: Principal, namespace: Namespace) -> Decision:
        fields = KvspNamespace.parse(namespace)
        if fields is None or fields.scope_id is None or fields.holder_id is None:
            return Decision(Verdict.UNAUTHORIZED, "a KVSP namespace published to a relay has its compat_id, scope_id "
                                                  "and holder-id fields (and at most the codec after them)")
        if Role.HOLDER not in principal.roles:
            return Decision(Verdict.UNAUTHORIZED, f"identity {principal.identity!r} is not a holder")
        publisher = fields.holder_id
        if not (holder_id(principal.identity) == publisher or principal.publish_for is ALL
                or any(holder_id(uri) == publisher for uri in principal.publish_for)):
            return Decision(Verdict.UNAUTHORIZED, f"identity {principal.identity!r} may not publish for holder-id "
                                                  f"{publisher}")
        if not principal.has_scope(fields.scope_id):
            return Decision(Verdict.UNAUTHORIZED, f"identity {principal.identity!r} is not authorized for scope "
                                                  f"{fields.scope_id.hex()}")
        return _OK

    def read(self, identity: str | None, namespace: Namespace) -> Decision:
        """May *identity* FETCH / SUBSCRIBE a track of *namespace*?"""
        principal = self.policy.principal(identity)
        if principal is None:
            return Decision(Verdict.UNAUTHORIZED, f"identity {identity!r} is not in the relay's policy")
        if is_kvsp(namespace):
            fields = KvspNamespace.parse(namespace)
            if fields is None or not fields.complete or fields.scope_id is None:
                return Decision(Verdict.DOES_NOT_EXIST, "not a KVSP track namespace")
            if not principal.has_role(*self.readers):
                return Decision(Verdict.UNAUTHORIZED, f"identity {principal.identity!r} may not read blocks")
            if not principal.has_scope(fields.scope_id):
                return Decision(Verdict.UNAUTHORIZED, f"identity {principal.identity!r} is not authorized for "
                                                      f"scope {fields.scope_id.hex()}")
            return _OK
        if self.is_open(namespace):
            return _OK
        return Decision(Verdict.DOES_NOT_EXIST, "no such track at this relay")

    def discover(self, identity: str | None, prefix: Namespace) -> Decision:
        """May *identity* SUBSCRIBE_NAMESPACE *prefix*? (What it then hears is filtered by :meth:`visible`.)"""
        if self.policy.principal(identity) is None:
            return Decision(Verdict.UNAUTHORIZED, f"identity {identity!r} is not in the relay's policy")
        return _OK

    def visible(self, identity: str | None, namespace: Namespace) -> bool:
        """Is a published *namespace* announced to a namespace subscriber with *identity*? Only when it could
        read tracks of it (a KVSP namespace without the codec field: when it could read its scope)."""
        principal = self.policy.principal(identity)
        if principal is None:
            return False
        if is_kvsp(namespace):
            fields = KvspNamespace.parse(namespace)
            return (fields is not None and fields.scope_id is not None and principal.has_role(*self.readers)
                    and principal.has_scope(fields.scope_id))
        return self.is_open(namespace)


__all__ = ["READERS", "Decision", "RelayRules", "Verdict", "is_kvsp", "kvsp_fields_ok", "parse_prefix", "under"]
