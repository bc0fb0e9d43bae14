"""The MOQT part of the authorization matrix (:mod:`tests.authz_matrix`): SUBSCRIBE_NAMESPACE and FETCH against the
relay, FETCH against the holder's and the instance's MOQT endpoints, in scope and out of scope, for every kind of
principal but "none", over both MOQT drafts.

* **Expected** at the relay: the relay's own rules object, :class:`kvsp_moqt.relay_rules.RelayRules` built from the
  same policy file (``read`` for FETCH, ``discover`` for SUBSCRIBE_NAMESPACE); at a holder or an instance
  (:class:`kvsp_moqt.holder_tracks.HolderTracks`): the rule of the holder's ``GET blocks`` resource (the reader roles)
  and the namespace's scope. A foreign CA's certificate: refused by the QUIC handshake.
* **Actual**: ``tls`` (the handshake was refused), ``UNAUTHORIZED`` (the request's error code), or what else came
  back (``accepted``, ``DOES_NOT_EXIST``, another error code): only ``tls`` and ``UNAUTHORIZED`` are refusals.

"No certificate" is not a MOQT column: MOQT shares each role's QUIC listener with HTTP/3, whose matrix shows that
listener refusing a handshake without a certificate (``tls``); ``connect_moqt`` always presents one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsp_moqt.relay_rules import RelayRules, Verdict
from kvsp_moqt.tracks import does_not_exist, track_name, track_namespace, unauthorized
from kvsp_quic.fields import ScopeId
from kvsp_quic.samples import example_descriptor
from moqt.aio import MoqtConnectError, MoqtRequestError, MoqtSessionClosed, connect_moqt
from moqt.types import Draft, Location
from tests.authz_matrix import BLOCK_KEY, IDENTITIES, KINDS, OTHER_SCOPE, TLS, Principals, app_rules

MOQT_KINDS = tuple(k for k in KINDS if k != "none")
DRAFTS = ("moq-00", "moqt-18")
CODEC_RAW = 1


@dataclass(frozen=True)
class MoqtCell:
    server: str  # relay, holder, instance
    request: str  # SUBSCRIBE_NAMESPACE or FETCH
    variant: str  # in scope / out of scope
    kind: str
    alpn: str
    expected: bool
    actual: str

    @property
    def refused(self) -> bool:
        return self.actual in (TLS, "UNAUTHORIZED")

    @property
    def unauthorized_success(self) -> bool:
        return not self.expected and not self.refused

    @property
    def ok(self) -> bool:
        return self.expected != self.refused

    def describe(self) -> str:
        return (f"MOQT {self.server}: {self.request} ({self.variant}) as {self.kind} over {self.alpn}: expected "
                f"{'allowed' if self.expected else 'refused'}, got {self.actual}")


def _expected(server: str, request: str, kind: str, namespace: tuple[bytes, ...], scope: ScopeId,
              principals: Principals, identities: dict[str, str]) -> bool:
    if kind == "foreign":
        return False
    identity = identities[kind]
    if server == "relay":
        rules = RelayRules.of(principals.policy)
        decision = rules.discover(identity, namespace) if request == "SUBSCRIBE_NAMESPACE" else \
            rules.read(identity, namespace)
        return decision.verdict is Verdict.OK
    principal = principals.policy.principal(identity)
    get_blocks = next(r for r in app_rules("holder") if r.method == "GET" and r.path.startswith("blocks/"))
    return (principal is not None and get_blocks.allowed is not None
            and not principal.roles.isdisjoint(get_blocks.allowed) and principal.has_scope(scope))


def _name(code: int, draft: Draft) -> str:
    if code == unauthorized(draft):
        return "UNAUTHORIZED"
    return "DOES_NOT_EXIST" if code == does_not_exist(draft) else f"error 0x{code:x}"


async def _ask(conn: Any, request: str, namespace: tuple[bytes, ...], draft: Draft) -> str:
    try:
        if request == "SUBSCRIBE_NAMESPACE":
            await conn.subscribe_namespace(namespace[:3], timeout=10)
            return "accepted"
        async with conn.fetch(namespace, track_name(bytes(BLOCK_KEY)), Location(0, 0), Location(1, 0)) as fetch:
            await fetch.wait_accepted(10)
            return "accepted"
    except MoqtRequestError as exc:
        return _name(exc.error_code, draft)


async def moqt_cells(ready: dict[str, dict[str, Any]], principals: Principals,
                     alpns: Sequence[str] = DRAFTS) -> list[MoqtCell]:
    """Every MOQT cell against the servers of *ready* that serve MOQT (relay, holder, instance)."""
    targets = [(s, r) for s in ("relay", "holder", "instance") if s in ready
               for r in (("SUBSCRIBE_NAMESPACE", "FETCH") if s == "relay" else ("FETCH",))]

    async def one(kind: str, alpn: str) -> list[MoqtCell]:
        draft = Draft.from_alpn(alpn)
        files = principals.files[kind]
        assert files is not None
        cells = []
        for server, request in targets:
            info = ready[server]
            compat = bytes.fromhex(info["compat_id"]) if "compat_id" in info else example_descriptor().compat_id
            host, port = info["moqt"].removeprefix("moqt://").rstrip("/").rsplit(":", 1)
            conn = None
            with contextlib.suppress(MoqtConnectError, ConnectionError):  # the handshake refused: "tls"
                conn = await connect_moqt(host, int(port), files, alpn=alpn, timeout=10)
            try:
                for variant, scope in (("in scope", principals.scope), ("out of scope", OTHER_SCOPE)):
                    namespace = track_namespace(compat, scope, info["base_uri"], CODEC_RAW)
                    expected = _expected(server, request, kind, namespace, scope, principals, IDENTITIES)
                    if conn is None:
                        actual = TLS
                    else:
                        try:
                            actual = await asyncio.wait_for(_ask(conn, request, namespace, draft), 20)
                        except MoqtSessionClosed as exc:
                            actual = f"session closed ({exc})"
                    cells.append(MoqtCell(server, request, variant, kind, alpn, expected, actual))
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.aclose()
        return cells

    results = await asyncio.gather(*(one(k, a) for a in alpns for k in MOQT_KINDS))
    return [c for cells in results for c in cells]


def moqt_markdown(cells: list[MoqtCell]) -> str:
    rows: dict[tuple[str, str, str], dict[str, list[MoqtCell]]] = {}
    for c in cells:
        rows.setdefault((c.server, c.request, c.variant), {}).setdefault(c.kind, []).append(c)
    lines = ["| server | MOQT request | variant | " + " | ".join(MOQT_KINDS) + " |",
             "|---|---|---|" + "---|" * len(MOQT_KINDS)]
    for (server, request, variant), by_kind in rows.items():
        entries = []
        for kind in MOQT_KINDS:
            answers = [c.actual for c in by_kind.get(kind, [])]
            text = answers[0] if len(set(answers)) == 1 else " / ".join(answers)
            if any(c.unauthorized_success for c in by_kind.get(kind, [])):
                text = f"**{text} UNAUTHORIZED SUCCESS**"
            elif any(not c.ok for c in by_kind.get(kind, [])):
                text = f"**{text} (expected allowed)**"
            entries.append(text)
        lines.append(f"| {server} | {request} | {variant} | " + " | ".join(entries) + " |")
    bad = [c for c in cells if c.unauthorized_success]
    wrong = [c for c in cells if not c.ok and not c.unauthorized_success]
    lines.append("")
    lines.append(f"{len(cells)} MOQT cells ({len(rows)} requests and variants x {len(MOQT_KINDS)} principals x "
                 f"{len(DRAFTS)} drafts): {len(bad)} unauthorized successes, {len(wrong)} refusals of allowed "
                 f"requests.")
    return "\n".join(lines)


__all__ = ["DRAFTS", "MOQT_KINDS", "MoqtCell", "moqt_cells", "moqt_markdown"]
